"""The reference engine applies Splice plans: tiny GQA and MLA models, batch-invariant attention.

Checked on every layer against the engine's own caches: ``amortize`` keeps downstream V / the
MLA latent bit for bit and rotates the rotary part once by the cumulative delta; ``forget``
(and REFRESH) equal a full re-prefill of the edited prompt bit for bit; two directives in one
turn equal the same edits one at a time up to one rounding of the tail keys. Most plans come
from the in-process planner; the last tests run the loop over gRPC against a real sidecar
(Splice -> apply -> CommitSplice, and AbortSplice + Lookup fallback).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clients.transformers import Engine, ReusePolicy
from clients.transformers.splice import PlanNotApplicable, SpliceSession, clone_cache
from sidecar.directives import Directive, EditMode, OpKind, SessionId, SessionMirror, plan_splice
from sidecar.errors import InvalidArgument, NotFound
from sidecar.rotation import rotate_keys

FULL = ReusePolicy(prefix_cache=False, sidecar=False, store=False)


@pytest.fixture
def engine(model) -> Engine:
    return Engine(model, reuse=FULL)


def conversation(p) -> np.ndarray:
    """Five message blocks, 166 tokens."""
    return p.join(p.msg(30), p.msg(40), p.msg(25), p.msg(35), p.msg(30))


def d(start: int, end: int, replacement, mode: EditMode = EditMode.AMORTIZE) -> Directive:
    return Directive(start=start, end=end, replacement=np.asarray(replacement, dtype=np.uint32), mode=mode)


def parts(engine: Engine, cache, layer: int, a: int, b: int) -> list[tuple[bool, torch.Tensor]]:
    """(rotary?, rows [a, b) as [n, ...]) for each KV part of one layer."""
    ad = engine.adapter
    return [(p.rotary, ad.part_view(cache, layer, j, a, b)) for j, p in enumerate(ad.layout.parts)]


def assert_rows_equal(engine: Engine, x, xa: int, y, ya: int, n: int, what: str) -> None:
    for layer in range(engine.layout.num_layers):
        for (_, gx), (_, gy) in zip(parts(engine, x, layer, xa, xa + n), parts(engine, y, layer, ya, ya + n)):
            assert torch.equal(gx, gy), f"{what}: layer {layer} differs"


def assert_cache_equal(x, y) -> None:
    assert x.length == y.length
    for i, (lx, ly) in enumerate(zip(x.layers, y.layers)):
        assert torch.equal(lx.keys, ly.keys), f"layer {i} keys differ"
        assert torch.equal(lx.values, ly.values), f"layer {i} values differ"


def test_amortize_keeps_downstream_kv_and_rotates_keys_once(engine, prompts):
    toks = conversation(prompts)
    sess = SpliceSession.open(engine, toks)
    orig = clone_cache(engine, sess.cache)
    s, e, r = 31, 50, np.arange(7, 19)  # replace 19 tokens of message 1 with 12: delta -7
    res = sess.splice([d(s, e, r)])
    delta = len(r) - (e - s)
    new = np.concatenate([toks[:s], r, toks[e:]]).astype(np.uint32)
    assert np.array_equal(sess.tokens, new) and np.array_equal(res.tokens, new)
    n2, tail = len(new), len(toks) - e
    assert (res.prefilled, res.rotated, res.moved, res.refreshed) == (len(r), tail, tail, 0)
    assert res.logits is None, "the last token was kept, not recomputed"
    assert sess.cache.length == n2

    # prefix untouched; replacement == the model's own KV for the edited prompt (same left context)
    full = engine.prefill(new, reuse=FULL)
    assert_rows_equal(engine, sess.cache, 0, orig, 0, s, "prefix")
    assert_rows_equal(engine, sess.cache, s, full.cache, s, len(r), "replacement")
    # downstream: V / c_kv bit for bit; rotary part == rotate_keys(original, delta) bit for bit
    spec = engine.rope
    for layer in range(engine.layout.num_layers):
        got = parts(engine, sess.cache, layer, s + len(r), n2)
        want = parts(engine, orig, layer, e, len(toks))
        for (rotary, g), (_, w) in zip(got, want):
            if rotary:
                assert torch.equal(g, rotate_keys(w, delta, spec)), f"layer {layer}: rotary part"
                assert not torch.equal(g, w)
            else:
                assert torch.equal(g, w), f"layer {layer}: non-rotary part changed"


def test_forget_equals_full_prefill(engine, prompts):
    toks = conversation(prompts)
    sess = SpliceSession.open(engine, toks)
    s, e, r = 72, 96, np.arange(100, 105)  # message 2 cut to 5 tokens
    res = sess.splice([d(s, e, r, EditMode.FORGET)])
    new = np.concatenate([toks[:s], r, toks[e:]]).astype(np.uint32)
    assert res.prefilled == len(new) - s and res.rotated == 0
    full = engine.prefill(new, reuse=FULL)
    assert_cache_equal(sess.cache, full.cache)
    assert torch.equal(res.logits, full.logits)


def test_refresh_equals_full_prefill(engine, prompts):
    """refresh_after=0: every kept downstream slot is REFRESHed instead of rotated, which makes
    the splice a re-prefill of everything after the edit."""
    toks = conversation(prompts)
    sess = SpliceSession.open(engine, toks)
    res = sess.splice([d(40, 40, np.arange(1, 9))], refresh_after=0)
    assert res.rotated == 0 and res.refreshed == len(toks) - 40
    full = engine.prefill(sess.tokens, reuse=FULL)
    assert_cache_equal(sess.cache, full.cache)
    assert torch.equal(res.logits, full.logits)


def runs(positions: np.ndarray) -> list[tuple[int, int]]:
    cuts = np.flatnonzero(np.diff(positions) != 1) + 1
    return [(int(r[0]), int(r[-1]) + 1) for r in np.split(positions, cuts)]


def test_partial_refresh_interleaved_with_rotation(engine, prompts):
    """refresh_after=1 after a two-edit splice: the next splice REFRESHes the once-rotated
    regions and ROTATEs the never-rotated replacement tokens between them (neither op is
    contiguous). Rotated rows follow the rotation rule; each refreshed run equals a forward
    pass of its tokens over the final cache truncated to its start."""
    toks = conversation(prompts)
    sess = SpliceSession.open(engine, toks)
    sess.splice([d(40, 40, [1, 2, 3]), d(90, 92, [4, 5, 6, 7])], refresh_after=1)
    before = clone_cache(engine, sess.cache)
    plan = plan_splice(sess.mirror, [d(10, 12, [8])], refresh_after=1)  # delta -1
    (rotate,), (refresh,) = plan.ops_of(OpKind.ROTATE), plan.ops_of(OpKind.REFRESH)
    assert len(runs(rotate.positions)) == 2 and len(runs(refresh.positions)) == 2
    res = sess.apply(plan)
    assert res.rotated == len(rotate) and res.refreshed == len(refresh) and res.logits is not None
    for a, b in runs(rotate.positions):  # new position p held old position p + 1
        for layer in range(engine.layout.num_layers):
            got, want = parts(engine, sess.cache, layer, a, b), parts(engine, before, layer, a + 1, b + 1)
            for (rotary, g), (_, w) in zip(got, want):
                assert torch.equal(g, rotate_keys(w, -1, engine.rope) if rotary else w)
    for a, b in runs(refresh.positions):
        ref = clone_cache(engine, sess.cache)
        ref.truncate(a)
        engine._forward(ref, sess.tokens[a:b], a, want_logits=False)
        assert_rows_equal(engine, sess.cache, a, ref, a, b - a, f"refreshed run [{a}, {b})")


def test_two_directives_equal_one_at_a_time(engine, prompts):
    toks = conversation(prompts)
    a = (20, 30, np.arange(1, 4))  # delta -7
    b = (100, 104, np.arange(11, 21))  # delta +6
    both = SpliceSession.open(engine, toks)
    both.splice([d(*a), d(*b)])
    seq = SpliceSession.open(engine, toks)
    seq.splice([d(*a)])
    shift = len(a[2]) - (a[1] - a[0])
    seq.splice([d(b[0] + shift, b[1] + shift, b[2])])
    assert np.array_equal(both.tokens, seq.tokens)
    n2 = len(both)
    tail = b[0] + shift + len(b[2])  # the region rotated by delta_a + delta_b in one turn, twice one at a time
    assert_rows_equal(engine, both.cache, 0, seq.cache, 0, tail, "up to the second replacement")
    for layer in range(engine.layout.num_layers):
        got, want = parts(engine, both.cache, layer, tail, n2), parts(engine, seq.cache, layer, tail, n2)
        for (rotary, g), (_, w) in zip(got, want):
            if not rotary:
                assert torch.equal(g, w)
                continue
            eps = torch.finfo(g.dtype).eps
            torch.testing.assert_close(g, w, rtol=2 * eps, atol=4 * eps * float(w.abs().max()))


def test_decode_after_amortize_then_forget(engine, prompts):
    """An amortize splice, decoding, a new turn and more decoding keep tokens, slots and cache
    in step: a final forget from the start reproduces a full prefill of the whole sequence."""
    toks = conversation(prompts)
    sess = SpliceSession.open(engine, toks, reserve=64)
    sess.splice([d(50, 80, np.arange(3, 8))])
    n2 = len(sess)
    out = sess.generate(4)
    assert len(out) == 4 and len(sess) == n2 + 3 and sess.cache.length == n2 + 3
    assert np.array_equal(sess.tokens[n2:], out[:-1])
    logits = sess.append(np.concatenate([[out[-1]], prompts.msg(12)]))
    assert logits.shape == (engine.config.vocab_size,) and torch.isfinite(logits).all()
    more = sess.generate(3)
    assert len(more) == 3 and sess.cache.length == len(sess)
    # drop the first generated turn (amortize), then forget everything from token 1 on
    sess.splice([d(n2, n2 + 3, [])])
    res = sess.splice([d(1, 2, sess.tokens[1:2], EditMode.FORGET)])
    full = engine.prefill(sess.tokens, reuse=FULL)
    assert_cache_equal(sess.cache, full.cache)
    assert torch.equal(res.logits, full.logits)


def test_plans_the_engine_cannot_apply_change_nothing(engine, prompts):
    toks = conversation(prompts)
    sess = SpliceSession.open(engine, toks)
    before = clone_cache(engine, sess.cache)
    # a paged plan (block size 16)
    paged = SessionMirror.open(session_id=SessionId("local"), tenant="", block_size=16, tokens=toks)
    with pytest.raises(PlanNotApplicable, match="block size 16"):
        sess.apply(plan_splice(paged, [d(5, 9, [1])]))
    # a plan for another token sequence (same session id and version)
    other = SessionMirror.open(session_id=SessionId("local"), tenant="", block_size=1, tokens=toks[::-1].copy())
    with pytest.raises(PlanNotApplicable, match="another token sequence"):
        sess.apply(plan_splice(other, [d(5, 9, [1])]))
    # a stale plan: built, then another one committed first
    stale = plan_splice(sess.mirror, [d(5, 9, [1])])
    sess.splice([d(100, 101, [2, 3])])
    snapshot = (sess.tokens.copy(), sess.version, clone_cache(engine, sess.cache))
    with pytest.raises(PlanNotApplicable, match="version 0"):
        sess.apply(stale)
    assert np.array_equal(sess.tokens, snapshot[0]) and sess.version == snapshot[1] == 1
    assert_cache_equal(sess.cache, snapshot[2])
    assert before.length == len(toks)


# ------------------------------------------------------------------ the loop over gRPC


def test_remote_splice_equals_in_process_and_commits(engine, prompts, client):
    """Splice -> apply -> CommitSplice against a real sidecar gives the in-process result, and
    the sidecar's mirror follows (version, length, appends)."""
    toks = conversation(prompts)
    local = SpliceSession.open(engine, toks)
    remote = SpliceSession.open(engine, toks, sidecar=client)
    try:
        assert remote.session_id != "local" and client.get_session(remote.session_id).length == len(toks)
        edits = [d(10, 40, [7, 8, 9]), d(120, 121, [])]
        want, got = local.splice(edits), remote.splice(edits)
        assert got.fell_back is None and got.plan_id
        assert np.array_equal(got.tokens, want.tokens)
        assert_cache_equal(remote.cache, local.cache)
        state = client.get_session(remote.session_id)
        assert (state.version, state.length, state.pending_plan_id) == (1, len(want.tokens), None)
        extra = prompts.msg(12)
        local.append(extra), remote.append(extra)
        assert client.get_session(remote.session_id).length == len(want.tokens) + len(extra)
        again = [d(0, 0, [5, 6])]
        assert np.array_equal(remote.splice(again).tokens, local.splice(again).tokens)
        assert_cache_equal(remote.cache, local.cache)
        assert client.get_session(remote.session_id).version == 2
    finally:
        remote.close()
    with pytest.raises(NotFound):
        client.get_session(remote.session_id)


def test_remote_plan_not_applicable_aborts_and_falls_back_to_lookup(engine, prompts, client):
    """Mirrors out of step (tokens appended on the sidecar behind the engine's back): the plan
    is refused before the cache is touched, aborted, and the turn is a full prompt of the
    edited tokens on a re-opened session."""
    toks = conversation(prompts)
    sess = SpliceSession.open(engine, toks, sidecar=client)
    old_id = sess.session_id
    client.append_session(old_id, prompts.msg(5))
    edits = [d(10, 40, [7, 8, 9])]
    res = sess.splice(edits)
    try:
        assert res.fell_back and "mirrors out of step" in res.fell_back
        with pytest.raises(NotFound):
            client.get_session(old_id)  # aborted, then closed
        edited = np.concatenate([toks[:10], np.array([7, 8, 9], dtype=np.uint32), toks[40:]])
        assert np.array_equal(sess.tokens, edited) and res.prefilled == len(edited)
        state = client.get_session(sess.session_id)
        assert (state.version, state.length, state.pending_plan_id) == (0, len(edited), None)
        full = engine.prefill(edited)
        assert_cache_equal(sess.cache, full.cache)
        assert torch.equal(res.logits, full.logits)
        # the re-opened session splices normally
        assert sess.splice([d(0, 1, [])]).fell_back is None
    finally:
        sess.close()


def test_remote_invalid_directives_change_nothing(engine, prompts, client):
    toks = conversation(prompts)
    sess = SpliceSession.open(engine, toks, sidecar=client)
    before = clone_cache(engine, sess.cache)
    try:
        with pytest.raises(InvalidArgument, match=r"directives\[1\]\.start"):
            sess.splice([d(5, 20, [1]), d(10, 30, [2])])
        assert sess.version == 0 and np.array_equal(sess.tokens, toks)
        assert_cache_equal(sess.cache, before)
        state = client.get_session(sess.session_id)
        assert (state.version, state.length, state.pending_plan_id) == (0, len(toks), None)
    finally:
        sess.close()
