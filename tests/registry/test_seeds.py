"""Seed hits: text moved without a chunk cut of its own is found through
16-token seed windows, extended to its edges, served from the right stored rows, and never
across a scope or an identity. The compiled planner and the reference agree on all of it
(``test_compiled_lookup.py`` runs them side by side with seeds on)."""

from __future__ import annotations

import numpy as np
import pytest

from sidecar.app import create_server
from sidecar.client import SidecarClient
from sidecar.identity import CacheIdentity
from sidecar.payload import decode_payload
from sidecar.registry.chunk_index import ChunkIndex, LookupQuery
from sidecar.registry.chunker import ChunkerConfig
from sidecar.registry.entry import EntryState
from sidecar.registry.entry_table import I_NTOK, I_POS
from sidecar.registry.lookup_plan import AdmissionPolicy, Fidelity
from sidecar.registry.registry import InMemoryRegistry, RegistryConfig
from sidecar.registry.seeds import interval_bits, unpack
from sidecar.tiers import StoreConfig
from tests.conftest import ANCHORS, make_config, message, text
from tests.registry.test_compiled_lookup import check_seed_map
from tests.registry.test_hit_extension import IDENT as KV_IDENT
from tests.registry.test_hit_extension import LAYOUT, SPEC, check_against_prefill, served, store_prefilled

#: long chunks: a 200-token document rarely holds a cut of its own
CHUNKER = ChunkerConfig(mask_bits=10, min_size=32, max_size=512, anchor_tokens=ANCHORS)
IDENT = CacheIdentity(model_id="seeds")


def index(**config) -> ChunkIndex:
    return ChunkIndex(CHUNKER, InMemoryRegistry(RegistryConfig(**config)))


def reordered(rng: np.random.Generator, sizes=(200, 180, 220, 160)) -> tuple[np.ndarray, np.ndarray, list]:
    """A stored prompt (header + documents inside one message) and the same documents in
    another order after a header long enough that every stored chunk they sit in can be named
    (a Fetch item names a chunk by the prompt position of its first row); the documents."""
    docs = [text(rng, n) for n in sizes]
    first = np.concatenate([message(rng, 40), *docs]).astype(np.uint32)
    order = [2, 0, 3, 1]
    second = np.concatenate([message(rng, 600), *[docs[i] for i in order], message(rng, 30, ANCHORS[1])])
    return first, second.astype(np.uint32), [docs[i] for i in order]


def lookup(ix: ChunkIndex, tokens: np.ndarray, identity: CacheIdentity = IDENT, scope: str = "a", reference=False,
           **kw):
    q = LookupQuery(tokens=tokens, data=tokens.tobytes(), identity=identity, scope=scope, **kw)
    return (ix.lookup_reference if reference else ix.lookup)(q)


def assert_rows_are_stored_tokens(ix: ChunkIndex, tokens: np.ndarray, plan) -> None:
    """Every hit row serves prompt tokens equal to the stored tokens at its row."""
    for h in plan.hits():
        e = ix.registry.peek(h.chunk_hash)
        stored = np.frombuffer(e.tokens, dtype="<u4")
        assert np.array_equal(tokens[h.start : h.end], stored[h.chunk_offset : h.chunk_offset + len(h)]), h


@pytest.mark.parametrize("reference", [False, True])
def test_moved_documents_without_cuts_are_found_by_seeds(rng, reference):
    first, second, docs = reordered(rng)
    on, off = index(), index(seed_interval=0)
    for ix in (on, off):
        ix.register(first, first.tobytes(), IDENT, "a", state=EntryState.RESIDENT)
    with_seeds = lookup(on, second, reference=reference, recompute_tokens=0)
    without = lookup(off, second, reference=reference, recompute_tokens=0)
    with_seeds.check_tiling(len(second))
    assert_rows_are_stored_tokens(on, second, with_seeds)
    assert all(h.fidelity is Fidelity.APPROXIMATE for h in with_seeds.hits())
    # the documents start after a 601-token header; without seeds little of them is found
    body = sum(len(d) for d in docs)
    assert without.summary.shifted_tokens < 0.5 * body
    # with seeds each document is recovered up to its edges (a document can extend one or two
    # tokens into its neighbour when their tokens happen to agree)
    assert with_seeds.summary.shifted_tokens >= 0.97 * body, (with_seeds.summary, without.summary)
    starts = {601 + sum(len(d) for d in docs[:i]) for i in range(len(docs))}
    assert starts & {a for a, _ in with_seeds.hit_segments().tolist()}


def test_seeds_stay_in_their_scope_and_identity(rng):
    first, second, _ = reordered(rng)
    ix = index()
    ix.register(first, first.tobytes(), IDENT, "a", state=EntryState.RESIDENT)
    assert lookup(ix, second, recompute_tokens=0).summary.shifted_tokens > 0
    # another tenant: nothing
    assert lookup(ix, second, scope="b", recompute_tokens=0).summary.shifted_tokens == 0
    # another model in the same tenant (the same text, other KV): nothing, by either planner
    other = CacheIdentity(model_id="another-model")
    for reference in (False, True):
        assert lookup(ix, second, identity=other, reference=reference, recompute_tokens=0).summary.shifted_tokens == 0
    # the other model's own copy is served to it, and its chunks own the windows now
    ix.register(first, first.tobytes(), other, "a", state=EntryState.RESIDENT)
    assert lookup(ix, second, identity=other, recompute_tokens=0).summary.shifted_tokens > 0


def test_observed_chunks_are_seeded_for_dry_runs_only(rng):
    first, second, _ = reordered(rng)
    ix = index()
    ix.register(first, first.tobytes(), IDENT, "a")  # OBSERVED: no KV stored
    assert lookup(ix, second, recompute_tokens=0).summary.shifted_tokens == 0
    assert lookup(ix, second, recompute_tokens=0, dry_run=True).summary.shifted_tokens > 0


def test_exact_policy_and_seed_interval_zero_use_no_seeds(rng):
    first, second, _ = reordered(rng)
    ix = index()
    ix.register(first, first.tobytes(), IDENT, "a", state=EntryState.RESIDENT)
    assert lookup(ix, second, policy=AdmissionPolicy.EXACT).summary.shifted_tokens == 0
    assert index(seed_interval=0).registry.table.ctr[5] == 0


def test_deleting_a_chunk_forgets_the_windows_it_owns(rng):
    first, second, _ = reordered(rng)
    ix = index()
    ix.register(first, first.tobytes(), IDENT, "a", state=EntryState.RESIDENT)
    table = ix.registry.table
    table.sync()
    assert table.ctr[5] > 0
    check_seed_map(table)
    # a second copy of the same text (another model) takes the windows over; deleting the first
    # copy's chunks keeps them, deleting the second's empties the map
    other = CacheIdentity(model_id="another-model")
    res = ix.register(first, first.tobytes(), other, "a", state=EntryState.RESIDENT)
    for key in list(ix.registry.keys_lru()):
        if key not in res.keys:
            ix.registry.delete(key)
    table.sync()
    check_seed_map(table)
    assert table.ctr[5] > 0
    assert lookup(ix, second, identity=other, recompute_tokens=0).summary.shifted_tokens > 0
    for key in res.keys:
        ix.registry.delete(key)
    table.sync()
    assert table.ctr[5] == 0 and (table.sd_val < 0).all()


def test_seed_interval_is_validated():
    assert interval_bits(16) == 4 and interval_bits(1) == 0 and interval_bits(0) == -1
    for bad in (3, -16, 24):
        with pytest.raises(ValueError, match="registry.seed_interval"):
            RegistryConfig(seed_interval=bad)


def test_short_seed_hits_fold_into_the_prefill(rng):
    """A seed hit shorter than registry.seed_min_tokens (64) is prefilled; with the minimum at
    16 it is served, and after a 4-token repair one of 16 tokens still folds: a seed never
    produces a Fetch item below min_hit_tokens."""
    doc = text(rng, 400)
    first = np.concatenate([message(rng, 40), doc]).astype(np.uint32)
    probe = index()
    probe.register(first, first.tobytes(), IDENT, "a", state=EntryState.RESIDENT)
    table = probe.registry.table
    table.sync()
    # 40 tokens around a seed window (12 before it, inside its stored chunk), and 18 around another
    seeds = [unpack(int(v)) for v in table.sd_val[table.sd_val >= 0]]
    at = sorted(int(table.si[s, I_POS]) + r for s, r in seeds if 12 <= r <= table.si[s, I_NTOK] - 28)
    moved = first[at[0] - 12 : at[0] + 28]
    short = np.concatenate([message(rng, 300), text(rng, 50), first[at[-1] - 1 : at[-1] + 17], text(rng, 50)])
    second = np.concatenate([message(rng, 300), text(rng, 50), moved, text(rng, 50)]).astype(np.uint32)
    default, low = index(), index(seed_min_tokens=16)
    for ix in (default, low):
        ix.register(first, first.tobytes(), IDENT, "a", state=EntryState.RESIDENT)
    assert lookup(default, second, recompute_tokens=0).summary.shifted_tokens == 0
    got = lookup(low, second, recompute_tokens=0)
    assert got.summary.shifted_tokens == len(moved) == got.seed_tokens
    assert_rows_are_stored_tokens(low, second, got)
    k4 = lookup(low, short.astype(np.uint32), recompute_tokens=4)
    assert k4.summary.shifted_tokens == 0  # 18 tokens found, 14 left after repair: folded
    with pytest.raises(ValueError, match="registry.seed_min_tokens"):
        RegistryConfig(seed_min_tokens=-1)


@pytest.fixture
async def seeded_server():
    server, port = await create_server(make_config(chunker=CHUNKER, store=StoreConfig(cpu_bytes=64 << 20)))
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        await server.stop(0.1)


async def test_seed_hits_serve_the_stored_rows_over_grpc(rng, seeded_server):
    """Over a real sidecar: every row a seed hit serves is the stored prefill's row of the same
    token, rotated by the hit's delta (``check_against_prefill``), with and without repair; the
    seed metrics count it."""
    server, target = seeded_server
    first, second, docs = reordered(rng)

    def metric(name: str, labels: dict | None = None) -> float:
        return server.metrics.registry.get_sample_value(name, labels or {}) or 0.0

    async with SidecarClient(target, tenant="t") as c:
        stored = await store_prefilled(c, first)
        for k in (0, 4):
            plan = await c.lookup(second, identity=KV_IDENT, engine_prefix_len=601, recompute_tokens=k)
            plan.check_tiling(len(second))
            # k = 4 repairs every stored chunk's first row: parts shorter than seed_min_tokens fold
            assert plan.summary.shifted_tokens >= (0.97 if k == 0 else 0.8) * sum(len(d) for d in docs), plan.summary
            assert any(h.chunk_offset > 0 for h in plan.hits())  # entered mid-chunk
            check_against_prefill(second, stored, await served(c, plan))
            # one span Fetch item per hit segment serves the segment's tokens, in order
            segs = plan.hit_segments().tolist()
            spans = await c.fetch(plan.fetch_spans(), identity=KV_IDENT, layout=LAYOUT, rope=SPEC)
            assert [kv.num_tokens for kv in spans] == [b - a for a, b in segs] and all(kv.ok for kv in spans)
            for (a, b), kv in zip(segs, spans):
                view = decode_payload(bytearray(kv.data), LAYOUT, kv.num_tokens)
                for layer in range(LAYOUT.num_layers):
                    assert np.array_equal(view.part(layer, "v")[:, 0, 0].numpy(), second[a:b].astype(np.float32))
        assert metric("kv_sidecar_registry_seeds") == server.index.registry.seed_windows() > 0
        seeded = metric("kv_sidecar_lookup_seed_tokens_total", {"dry_run": "false"})
        shifted = metric("kv_sidecar_lookup_tokens_total", {"kind": "shifted", "dry_run": "false"})
        assert 0.5 * shifted < seeded <= shifted
