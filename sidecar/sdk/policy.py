"""Policy SDK: an agent's history rewrite -> span directives for ``Splice``.

An agent harness keeps its conversation as OpenAI-format messages and may rewrite its own
history between turns (drop a failed tool call, cut an old tool output to a stub). The engine
session holds the rendering of the previous list; ``Splice`` wants directives over those
tokens. This module closes the gap (docs/architecture.md, "The edit path", "Policy interface")::

    new_messages = policy.transform(messages, turn_idx)
    directives, old_ids, new_ids = diff_directives(messages, new_messages, renderer,
                                                   mode_for=policy.mode_for)
    plan = client.splice(session, version, directives)          # old_ids: the session's tokens

Rendering goes through a chat template: ``TokenizerRenderer`` wraps a transformers tokenizer
and its own template; any object with ``render(messages, tools=None, *,
add_generation_prompt=True) -> uint32 ids`` is a ``Renderer`` too (the benchmarks' offline
``workloads.chat_template.ChatTemplate`` and ``workloads.hf_chat.HFChatTemplate`` are).

The diff works on message blocks, never on raw tokens: both lists are rendered with the
token offset where each message starts, the blocks are matched by content (a longest-common-
subsequence diff, ``difflib``), and every run of changed, inserted or dropped messages becomes
one directive over the OLD tokens::

    old:  [sys][user][asst+call][tool: 9 KB][asst][tool][user] G      G = generation prompt
    new:  [sys][user][asst+call][tool: stub][asst][tool][user][user2] G
                                 ^^^^^^^^^^^ directive 0           ^^^^^^^ directive 1 (+ G)

* Leading tokens a changed block shares with its replacement (the role header, a kept head
  of the content) are trimmed off the directive (``trim=True``): same tokens at the same
  positions after the same prefix, so their KV is already right. Trailing ones are not: the
  rest of an edited message is recomputed against its new content.
* A directive that ends where the generation prompt starts takes the generation prompt with
  it (then trimmed like any other), so the spliced session ends in freshly computed tokens:
  the engine gets next-token logits from the splice itself instead of re-running the last
  token. Appending messages is therefore an insertion at (or just before) the old end.
* Templates that re-render earlier messages when one is appended (a system prompt that
  mentions the last message, date stamps) have no stable block boundaries:
  ``TemplateNotIncremental`` is raised, and the caller sends a full prompt (Lookup path).

This module must stay importable without the server, the engines or the benchmarks; it is
re-exported by ``sidecar.client``.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from sidecar.directives import Directive, EditMode, apply_edits, validate_directives

Message = Mapping[str, Any]
#: ``mode_for(old_message, new_message) -> EditMode``; ``None`` on the side where a message was
#: inserted or dropped (or for the generation prompt).
ModeFor = Callable[[Message | None, Message | None], EditMode]

__all__ = [
    "EditPolicy",
    "Message",
    "MessageDiff",
    "ModeFor",
    "Policy",
    "RenderedBlocks",
    "Renderer",
    "TemplateNotIncremental",
    "TokenizerRenderer",
    "TruncateOldToolOutputs",
    "diff_directives",
    "edit_turn",
    "render_blocks",
]


class TemplateNotIncremental(ValueError):
    """The chat template does not render a conversation as the concatenation of its message
    blocks, so edits cannot be cut at message boundaries; send the full prompt instead."""


# --------------------------------------------------------------------------------- policies


@runtime_checkable
class Policy(Protocol):
    """A history rewrite: ``transform(messages, turn_idx) -> messages`` (a new list; the input
    is not mutated). Stateless policies are easiest to reason about: the same list gives the
    same result at every turn. A policy may also define ``mode_for`` (see ``EditPolicy``)."""

    def transform(self, messages: Sequence[Message], turn_idx: int) -> list[Message]: ...


class EditPolicy:
    """Base class for policies: declares the directive mode of each edit it makes.

    ``mode`` (default ``amortize``) applies to every edit; override ``mode_for`` to choose per
    message, e.g. ``forget`` where removed content must leave the cache (PII). A tenant setting
    on the sidecar may force ``forget`` whatever the policy says.
    """

    mode: EditMode = EditMode.AMORTIZE

    def mode_for(self, old: Message | None, new: Message | None) -> EditMode:
        return self.mode

    def transform(self, messages: Sequence[Message], turn_idx: int) -> list[Message]:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class TruncateOldToolOutputs(EditPolicy):
    """Reference policy: tool outputs older than ``keep_turns`` assistant turns are cut to
    their first ``head`` and last ``tail`` characters around ``joiner``. A tool message's age
    is the number of assistant messages after it. Stateless and idempotent (the same rule as
    ``workloads.traces.TruncateOldToolOutputs``, so both produce the same histories)."""

    keep_turns: int = 2
    head: int = 100
    tail: int = 100
    joiner: str = " ... "
    mode: EditMode = EditMode.AMORTIZE

    def transform(self, messages: Sequence[Message], turn_idx: int) -> list[Message]:
        later = sum(1 for m in messages if m.get("role") == "assistant")
        out: list[Message] = []
        for m in messages:
            later -= m.get("role") == "assistant"
            text = m.get("content")
            if m.get("role") == "tool" and later >= self.keep_turns and isinstance(text, str) \
                    and len(text) > self.head + self.tail + len(self.joiner):
                m = {**m, "content": text[: self.head] + self.joiner + text[len(text) - self.tail :]}
            out.append(m)
        return out


# -------------------------------------------------------------------------------- rendering


@runtime_checkable
class Renderer(Protocol):
    """Anything that renders messages to token ids (``uint32 [n]``) with a chat template.

    ``add_generation_prompt`` is optional: a renderer without it is taken to render no
    generation prompt (its output for a list is the concatenation of the message blocks).
    """

    def render(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None) -> np.ndarray: ...


class RenderedBlocks(NamedTuple):
    """A rendering cut at message boundaries: message ``i`` is ``ids[starts[i]:starts[i+1]]``;
    ``ids[starts[-1]:]`` is what follows the last message (the generation prompt)."""

    ids: np.ndarray  # uint32 [n]
    starts: np.ndarray  # int64 [len(messages) + 1], starts[0] == 0


class TokenizerRenderer:
    """Renders with a transformers tokenizer's own chat template (``apply_chat_template``).

    Messages and tool schemas go to the template as they are (so templates that print only
    role and content drop tool calls, as they would in serving). ``render_blocks`` renders the
    template text once per message prefix (cheap string work) and tokenizes the full text once,
    mapping each message's first character to its first token; a token that straddles a
    message boundary, or a prefix that is not a prefix of the full text, raises
    ``TemplateNotIncremental``.
    """

    def __init__(self, hf_tokenizer: Any) -> None:
        if not getattr(hf_tokenizer, "chat_template", None):
            raise ValueError("tokenizer: has no chat template")
        self.hf = hf_tokenizer

    def _text(self, messages: Sequence[Message], tools: Any, add_generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(
            [dict(m) for m in messages], tools=list(tools) if tools else None, tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def _encode(self, text: str, offsets: bool = False) -> Any:
        return self.hf(text, add_special_tokens=False, return_offsets_mapping=offsets)

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> np.ndarray:
        text = self._text(messages, tools, add_generation_prompt)
        return np.asarray(self._encode(text)["input_ids"], dtype=np.uint32)

    def render_blocks(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> RenderedBlocks:
        full = self._text(messages, tools, add_generation_prompt)
        chars = [0]
        for k in range(1, len(messages) + 1):
            try:
                text = self._text(messages[:k], tools, False)
            except Exception as e:  # jinja templates raise on lists they refuse (role order, ...)
                raise TemplateNotIncremental(f"chat template refuses the first {k} messages: {e}") from e
            if not full.startswith(text) or len(text) < chars[-1]:
                raise TemplateNotIncremental(
                    f"chat template re-renders earlier messages: the rendering of messages[:{k}] is not a "
                    "prefix of the whole conversation's"
                )
            chars.append(len(text))
        enc = self._encode(full, offsets=True)
        ids = np.asarray(enc["input_ids"], dtype=np.uint32)
        spans = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        ends = spans[:, 1]
        # message k starts at the first token that ends after its first character
        starts = np.searchsorted(ends, np.asarray(chars, dtype=np.int64), side="right")
        for k, (c, t) in enumerate(zip(chars, starts.tolist())):
            if t < len(ids) and spans[t, 0] < c:
                raise TemplateNotIncremental(
                    f"token {t} ({spans[t, 0]}..{spans[t, 1]}) straddles the start of message {k} (character {c})"
                )
        starts[0] = 0
        return RenderedBlocks(ids, starts.astype(np.int64))


def _takes_generation_prompt(renderer: Any) -> bool:
    try:
        return "add_generation_prompt" in inspect.signature(renderer.render).parameters
    except (TypeError, ValueError):
        return False


def render_blocks(
    renderer: Renderer,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> RenderedBlocks:
    """``messages`` rendered and cut at message boundaries.

    Uses ``renderer.render_blocks`` when it has one; otherwise renders every prefix of the list
    (without a generation prompt) and checks that each is a prefix of the next, raising
    ``TemplateNotIncremental`` when not. Costs one render per message: fine for templates
    that cache per-message work (``ChatTemplate``); ``TokenizerRenderer`` avoids re-tokenizing.
    Whatever precedes the first message (a tool-schema block, a default system prompt) counts
    as part of message 0.
    """
    own = getattr(renderer, "render_blocks", None)
    if own is not None:
        return own(messages, tools, add_generation_prompt=add_generation_prompt)
    gen = _takes_generation_prompt(renderer)

    def run(msgs: Sequence[Message], with_prompt: bool) -> np.ndarray:
        kw = {"add_generation_prompt": with_prompt} if gen else {}
        return np.asarray(renderer.render(msgs, tools, **kw), dtype=np.uint32)

    full = run(messages, add_generation_prompt)
    starts = np.zeros(len(messages) + 1, dtype=np.int64)
    reuse_full = not (gen and add_generation_prompt)  # ``full`` is then the last prefix itself
    for k in range(1, len(messages) + 1):
        prefix = full if k == len(messages) and reuse_full else run(messages[:k], False)
        n = len(prefix)
        if n < starts[k - 1] or n > len(full) or not np.array_equal(full[:n], prefix):
            raise TemplateNotIncremental(
                f"chat template re-renders earlier messages: the rendering of messages[:{k}] is not a prefix "
                "of the whole conversation's"
            )
        starts[k] = n
    return RenderedBlocks(full, starts)


# ------------------------------------------------------------------------------------- diff


class MessageDiff(NamedTuple):
    """What ``diff_directives`` returns; unpacks as ``directives, old_ids, new_ids``.

    ``directives`` address ``old_ids`` (sorted, non-overlapping); applying them gives exactly
    ``new_ids``.
    """

    directives: tuple[Directive, ...]
    old_ids: np.ndarray  # uint32: the rendering of the old messages (what the session holds)
    new_ids: np.ndarray  # uint32: the rendering of the new messages


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def diff_directives(
    old_messages: Sequence[Message],
    new_messages: Sequence[Message],
    renderer: Renderer,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    new_tools: Sequence[Mapping[str, Any]] | None = None,
    mode_for: ModeFor | EditMode | None = None,
    add_generation_prompt: bool = True,
    trim: bool = True,
) -> MessageDiff:
    """Directives that turn the rendering of ``old_messages`` into that of ``new_messages``.

    Args:
      old_messages / new_messages: OpenAI-format message lists (the policy's input and output).
      renderer: a ``Renderer`` (see ``render_blocks`` for how boundaries are found).
      tools / new_tools: tool schemas rendered with the old / new list (``new_tools`` defaults
        to ``tools``).
      mode_for: a ``EditMode`` for every edit, or ``mode_for(old_msg, new_msg) -> EditMode`` per edit
        (a policy's bound ``mode_for``); a run of several changed messages is ``forget`` when
        any of its pairs says so. Default: ``amortize``.
      add_generation_prompt: render both with the generation prompt (the default, matching a
        session that holds a prompt) or without.
      trim: drop the leading tokens a changed run shares with its replacement from the
        directive (module docstring).
    Returns:
      ``MessageDiff(directives, old_ids, new_ids)``; no directives when the renderings are
      equal. Pure.
    Raises:
      TemplateNotIncremental: the template has no stable message boundaries.
    """
    fixed = mode_for is None or isinstance(mode_for, EditMode)
    pick = _constant_mode(EditMode(mode_for or EditMode.AMORTIZE)) if fixed else mode_for
    old = render_blocks(renderer, old_messages, tools, add_generation_prompt=add_generation_prompt)
    new = render_blocks(
        renderer, new_messages, tools if new_tools is None else new_tools, add_generation_prompt=add_generation_prompt
    )
    # One block per message plus the generation prompt as a last pseudo-block (message None).
    ob, nb = _blocks(old), _blocks(new)
    matcher = difflib.SequenceMatcher(None, [b.tobytes() for b in ob], [b.tobytes() for b in nb], autojunk=False)
    olds = list(old_messages) + [None]
    news = list(new_messages) + [None]
    os_, ns_ = old.starts, new.starts
    n_old, n_new = len(old.ids), len(new.ids)
    spans: list[list] = []  # [old start, old end, new start, new end, mode]
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        a, b = _bound(os_, i1, n_old), _bound(os_, i2, n_old)
        c, d = _bound(ns_, j1, n_new), _bound(ns_, j2, n_new)
        modes = [pick(o, n) for o, n in zip_longest(olds[i1:i2], news[j1:j2])]
        spans.append([a, b, c, d, EditMode.FORGET if EditMode.FORGET in modes else EditMode.AMORTIZE])
    if spans and spans[-1][1] == os_[-1] < n_old and spans[-1][3] == ns_[-1]:
        # The last edit ends where the generation prompt starts (which it left unchanged):
        # take the prompt along, so the spliced sequence ends in computed tokens and the
        # engine gets next-token logits from the splice itself.
        spans[-1][1], spans[-1][3] = n_old, n_new
    directives: list[Directive] = []
    for a, b, c, d, mode in spans:
        if trim:
            p = _common_prefix(old.ids[a:b], new.ids[c:d])
            a, c = a + p, c + p
        if a < b or c < d:
            directives.append(Directive(start=a, end=b, replacement=new.ids[c:d], mode=mode))
    result = MessageDiff(tuple(directives), old.ids, new.ids)
    _check(result)
    return result


def _constant_mode(mode: EditMode) -> ModeFor:
    def pick(old: Message | None, new: Message | None) -> EditMode:
        return mode

    return pick


def _blocks(r: RenderedBlocks) -> list[np.ndarray]:
    s = r.starts.tolist()
    return [r.ids[a:b] for a, b in zip(s, s[1:])] + [r.ids[s[-1] :]]


def _bound(starts: np.ndarray, i: int, n: int) -> int:
    """Token offset of block ``i`` (the generation-prompt pseudo-block ends at ``n``)."""
    return int(starts[i]) if i < len(starts) else n


_BUG = "this is a bug in sidecar/sdk/policy.py"


def _check(diff: MessageDiff) -> None:
    if not diff.directives:
        if not np.array_equal(diff.old_ids, diff.new_ids):
            raise AssertionError(f"diff_directives found no edit between different renderings; {_BUG}")
        return
    edits = validate_directives(diff.directives, len(diff.old_ids))
    if not np.array_equal(apply_edits(diff.old_ids, edits), diff.new_ids):
        raise AssertionError(f"diff_directives: the directives do not reproduce the new rendering; {_BUG}")


def edit_turn(
    policy: Policy,
    messages: Sequence[Message],
    turn_idx: int,
    renderer: Renderer,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    trim: bool = True,
) -> tuple[list[Message], MessageDiff]:
    """Apply ``policy`` to the history the session holds (``messages``) and diff the result.

    Returns the new message list (the next turn's history) and the ``MessageDiff``; modes come
    from ``policy.mode_for`` when the policy has one, else ``amortize``.
    """
    new = list(policy.transform(messages, turn_idx))
    diff = diff_directives(
        messages, new, renderer, tools=tools, mode_for=getattr(policy, "mode_for", None),
        add_generation_prompt=add_generation_prompt, trim=trim,
    )
    return new, diff
