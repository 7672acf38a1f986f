"""Lookup planning on the chunk index (domain level, no gRPC)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sidecar.identity import SHARED_SCOPE, CacheIdentity
from sidecar.registry.chunk_index import ChunkIndex, LookupQuery
from sidecar.registry.chunker import ChunkerConfig
from sidecar.registry.entry import EntryState
from sidecar.registry.lookup_plan import CARVE_OUT_TOKENS, AdmissionPolicy, Fidelity, RepairScope, SegmentKind
from sidecar.registry.registry import InMemoryRegistry, RegistryConfig
from tests.conftest import ANCHORS, message

HIT, PREFILL, PREFIX = SegmentKind.CHUNK_HIT, SegmentKind.PREFILL, SegmentKind.ENGINE_PREFIX


@pytest.fixture
def index() -> ChunkIndex:
    return ChunkIndex(ChunkerConfig(anchor_tokens=ANCHORS), InMemoryRegistry(RegistryConfig()))


def q(tokens, identity, scope="a", **kw) -> LookupQuery:
    tokens = np.asarray(tokens, dtype=np.uint32)
    return LookupQuery(tokens=tokens, data=tokens.tobytes(), identity=identity, scope=scope, **kw)


def reg(index, tokens, identity, scope="a", state=EntryState.RESIDENT, **kw):
    tokens = np.asarray(tokens, dtype=np.uint32)
    return index.register(tokens, tokens.tobytes(), identity, scope, state=state, **kw)


def conversation(rng, sizes=(400, 900, 300, 1200)):
    return np.concatenate([message(rng, n, ANCHORS[i % 2]) for i, n in enumerate(sizes)])


def test_empty_registry_is_all_prefill(index, identity, rng):
    toks = conversation(rng)
    plan = index.lookup(q(toks, identity))
    plan.check_tiling(len(toks))
    assert [s.kind for s in plan.segments] == [PREFILL]
    assert plan.summary.prefill_tokens == len(toks) and plan.summary.chunks_hit == 0


def test_identical_prompt_is_exact(index, identity, rng):
    toks = conversation(rng)
    reg(index, toks, identity)
    plan = index.lookup(q(toks, identity))
    plan.check_tiling(len(toks))
    assert all(s.kind is HIT and s.fidelity is Fidelity.EXACT and s.delta == 0 for s in plan.segments)
    assert plan.summary.exact_tokens == len(toks)


def test_shifted_body_is_approximate_with_delta(index, identity, rng):
    body = conversation(rng)
    old = np.concatenate([message(rng, 100), body])
    new = np.concatenate([message(rng, 350), body])
    reg(index, old, identity)
    plan = index.lookup(q(new, identity))
    plan.check_tiling(len(new))
    hits = plan.hits()
    assert sum(len(s) for s in hits) == len(body)
    assert all(s.delta == 250 and s.fidelity is Fidelity.APPROXIMATE for s in hits)
    assert all(s.source_pos == s.start - 250 for s in hits)
    assert plan.summary.shifted_tokens == len(body) and plan.summary.prefill_tokens == 351


def test_exact_policy_refuses_shifted_and_other_context(index, identity, rng):
    body = conversation(rng)
    reg(index, np.concatenate([message(rng, 100), body]), identity)
    new = np.concatenate([message(rng, 100), body])  # same positions, different left context
    pi = index.lookup(q(new, identity))
    assert pi.summary.shifted_tokens == len(body)  # same position but other context: approximate
    ex = index.lookup(q(new, identity, policy=AdmissionPolicy.EXACT))
    ex.check_tiling(len(new))
    assert ex.summary.prefill_tokens == len(new)


def test_engine_prefix_and_straddling_chunk(index, identity, rng):
    toks = conversation(rng)
    reg(index, toks, identity)
    epl = 416  # inside a chunk
    plan = index.lookup(q(toks, identity, engine_prefix_len=epl))
    plan.check_tiling(len(toks))
    segs = plan.segments
    assert segs[0].kind is PREFIX and segs[0].end == epl
    first = segs[1]
    assert first.kind is HIT and first.start == epl and first.chunk_offset > 0
    assert first.source_pos == epl and first.delta == 0
    assert plan.summary.prefix_tokens == epl and plan.summary.exact_tokens == len(toks) - epl


def test_engine_prefix_covers_everything(index, identity, rng):
    toks = conversation(rng)
    plan = index.lookup(q(toks, identity, engine_prefix_len=len(toks)))
    assert [s.kind for s in plan.segments] == [PREFIX] and plan.summary.chunks_total == 0


def test_first_chunk_carve_out(index, identity, rng):
    """Positions below 32 are never served from a shifted chunk."""
    body = message(rng, 500)
    reg(index, np.concatenate([message(rng, 200), body]), identity)
    new = np.concatenate([message(rng, 3), body])  # body now starts at position 4
    plan = index.lookup(q(new, identity))
    plan.check_tiling(len(new))
    hits = plan.hits()
    assert hits and min(s.start for s in hits) == CARVE_OUT_TOKENS
    assert hits[0].chunk_offset == CARVE_OUT_TOKENS - 4 and hits[0].delta == 4 - 201
    assert all(s.kind is PREFILL for s in plan.segments if s.start < CARVE_OUT_TOKENS)


def test_recompute_tokens(index, identity, rng):
    body = conversation(rng)
    reg(index, np.concatenate([message(rng, 100), body]), identity)
    new = np.concatenate([message(rng, 200), body])
    base = index.lookup(q(new, identity))
    # The body's chunks continue one stored sequence: one hit segment.
    assert len(base.hit_segments()) == 1
    # repair_scope "segment": repaired once, at the segment's start
    k8 = index.lookup(q(new, identity, recompute_tokens=8, repair_scope=RepairScope.SEGMENT))
    k8.check_tiling(len(new))
    assert k8.summary.chunks_hit == base.summary.chunks_hit
    assert len(k8.hit_segments()) == 1
    assert k8.summary.shifted_tokens == base.summary.shifted_tokens - 8
    assert k8.hits()[0].chunk_offset == 8 and all(s.chunk_offset == 0 for s in k8.hits()[1:])
    # repair_scope "chunk" (the default): re-prefilled at every stored chunk's start, each hit row
    # still the same chunk at the same delta, one hit segment per chunk
    k8c = index.lookup(q(new, identity, recompute_tokens=8))
    k8c.check_tiling(len(new))
    hits, base_hits = k8c.hits(), base.hits()
    assert len(hits) == len(base_hits) == len(k8c.hit_segments()) > 1
    for h, b in zip(hits, base_hits):
        assert (h.chunk_hash, h.delta, h.chunk_offset, h.start, h.end) == (b.chunk_hash, b.delta, 8, b.start + 8, b.end)
    assert k8c.summary.shifted_tokens == base.summary.shifted_tokens - 8 * len(hits)
    huge = index.lookup(q(new, identity, recompute_tokens=512, repair_scope=RepairScope.SEGMENT))
    assert huge.summary.prefill_tokens == base.summary.prefill_tokens + 512
    # chunk scope, k at least the largest chunk: only what the segment-start repair cut into is
    # left (its first rows were re-prefilled); every later chunk is re-prefilled whole
    assert index.lookup(q(new, identity, recompute_tokens=512)).hits() == huge.hits()[:1]


def test_left_context_window(index, identity, rng):
    shared_ctx = message(rng, 300)
    doc = message(rng, 400)
    reg(index, np.concatenate([message(rng, 100), shared_ctx, doc]), identity)
    same_ctx = np.concatenate([message(rng, 50), shared_ctx, doc])  # doc keeps its left neighbour
    other_ctx = np.concatenate([message(rng, 50), message(rng, 300), doc])
    w = 64
    a = index.lookup(q(same_ctx, identity, left_context_window=w))
    b = index.lookup(q(other_ctx, identity, left_context_window=w))
    a.check_tiling(len(same_ctx))
    b.check_tiling(len(other_ctx))
    doc_start = len(same_ctx) - len(doc)
    assert any(s.start == doc_start for s in a.hits())
    # The doc's first chunk has another left neighbour: refused. Later doc chunks whose W-token
    # window lies inside the doc itself still match.
    assert not any(s.start == doc_start for s in b.hits())
    assert any(s.start > doc_start for s in b.hits())
    # Without the guard the doc is a hit in both.
    assert any(s.start == doc_start for s in index.lookup(q(other_ctx, identity)).hits())


def test_dry_run_changes_nothing(index, identity, rng):
    toks = conversation(rng)
    reg(index, toks, identity)
    before = [(k, index.registry.peek(k).hits) for k in index.registry.keys_lru()]
    plan = index.lookup(q(toks, identity, dry_run=True))
    assert plan.dry_run and plan.summary.exact_tokens == len(toks)
    assert [(k, index.registry.peek(k).hits) for k in index.registry.keys_lru()] == before
    index.lookup(q(toks, identity))
    assert all(index.registry.peek(k).hits == 1 for k in index.registry.keys_lru())


def test_observed_entries_only_count_in_dry_run(index, identity, rng):
    toks = conversation(rng)
    reg(index, toks, identity, state=EntryState.OBSERVED)
    assert index.lookup(q(toks, identity, dry_run=True)).summary.exact_tokens == len(toks)
    assert index.lookup(q(toks, identity)).summary.prefill_tokens == len(toks)


def test_scopes_isolate_tenants_and_shared_is_visible(index, identity, rng):
    toks = conversation(rng)
    reg(index, toks, identity, scope="a")
    assert index.lookup(q(toks, identity, scope="b")).summary.chunks_hit == 0
    reg(index, toks, identity, scope=SHARED_SCOPE)
    plan = index.lookup(q(toks, identity, scope="b"))
    assert plan.summary.exact_tokens == len(toks)
    shared_keys = {k for k in index.registry.keys_lru() if index.registry.peek(k).scope == SHARED_SCOPE}
    assert {s.chunk_hash for s in plan.hits()} <= shared_keys


def test_identity_isolation(index, identity, rng):
    toks = conversation(rng)
    reg(index, toks, identity)
    other = CacheIdentity(model_id="test-model", kv_layout="gqa-2x4x64", rope_fingerprint="rope-yarn")
    assert index.lookup(q(toks, other)).summary.chunks_hit == 0


def test_register_from_skips_leading_chunks(index, identity, rng):
    toks = conversation(rng)
    res = reg(index, toks, identity, register_from=500)
    assert res.bounds[0] >= 500 and res.chunks_registered == res.chunks_total
    plan = index.lookup(q(toks, identity))
    assert all(s.start >= 500 for s in plan.hits())
    again = reg(index, toks, identity, register_from=500)
    assert again.chunks_registered == 0 and again.chunks_refreshed == res.chunks_total


def test_chunk_visible_to_next_lookup(index, identity, rng):
    """Within-batch discovery: a registration is visible to the very next lookup."""
    a = np.concatenate([message(rng, 60), message(rng, 700)])
    b = np.concatenate([message(rng, 90), a[61:]])
    reg(index, a, identity)
    assert index.lookup(q(b, identity)).summary.shifted_tokens == 701


def test_token_verification_on_hit(index, identity, rng):
    toks = conversation(rng)
    reg(index, toks, identity)
    # A 64-bit collision: other tokens registered under a prompt chunk's key. The key still
    # matches, the verification must refuse it.
    key = index.registry.keys_lru()[1]
    e = index.registry.peek(key)
    index.registry.delete(key)
    index.registry.insert(dataclasses.replace(e, tokens=bytes(len(e.tokens))))
    plan = index.lookup(q(toks, identity))
    plan.check_tiling(len(toks))
    assert key not in {s.chunk_hash for s in plan.hits()}
    assert index.registry.stats.verify_failures == 1
