"""Hit extension and coalesced plans over real gRPC, with KV payloads.

The "model" is a full prefill whose KV rows are a function of (token, position) only: V holds
the token id (exactly, in fp32) and the position it was computed at; K is a per-token random
vector rotated by RoPE to its position. So the KV an engine would get from a full prefill of
any prompt is known row by row, and what a Fetch serves for an extended hit can be compared
row by row: exact rows bit-exact, shifted rows equal to the stored rows rotated by the delta
(bit-exact against the server's rotation, and to the prompt's own prefill up to fp32 rounding).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sidecar.app import create_server
from sidecar.client import SidecarClient
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.payload import decode_payload, encode_payload
from sidecar.registry.lookup_plan import CARVE_OUT_TOKENS, FetchSpec, Fidelity, SegmentKind
from sidecar.rotation import RopeSpec, rotate_keys
from sidecar.tiers import StoreConfig
from tests.conftest import ANCHORS, make_config, message, text

LAYOUT = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32")


def _spec() -> RopeSpec:
    from transformers import LlamaConfig

    return RopeSpec.from_hf_config(LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=32))


SPEC = _spec()
IDENT = CacheIdentity(model_id="tiny-ext", kv_layout=LAYOUT.fingerprint(), rope_fingerprint=SPEC.fingerprint)
_BASE = torch.randn(1 << 12, LAYOUT.num_layers, 2, 32, generator=torch.Generator().manual_seed(7))


def prefill(tokens: np.ndarray) -> list[dict[str, torch.Tensor]]:
    """Per layer {"k", "v"}: ``[n, heads, 32]`` rows of a full prefill of ``tokens``."""
    tok = torch.from_numpy(tokens.astype(np.int64))
    n = len(tokens)
    pos = torch.arange(n, dtype=torch.int64)
    out = []
    for layer in range(LAYOUT.num_layers):
        base = _BASE[tok % _BASE.shape[0], layer].contiguous()  # [n, 2, 32]
        k = rotate_keys(base, pos[:, None], SPEC)
        v = torch.zeros(n, 2, 32)
        v[:, :, 0] = tok.float()[:, None]
        v[:, :, 1] = pos.float()[:, None]
        v[:, :, 2:] = base[:, :, 2:]
        out.append({"k": k, "v": v})
    return out


def payloads(kv, bounds) -> dict[int, torch.Tensor]:
    return {a: encode_payload([{p: t[a:b] for p, t in layer.items()} for layer in kv], LAYOUT)
            for a, b in zip(bounds[:-1], bounds[1:])}


async def store_prefilled(c: SidecarClient, tokens: np.ndarray):
    kv = prefill(tokens)
    meta = await c.store(tokens, identity=IDENT)
    res = await c.store(tokens, identity=IDENT, layout=LAYOUT, payloads=payloads(kv, meta.chunk_bounds))
    assert res.chunks_stored == len(meta.chunk_bounds) - 1
    return kv


async def served(c: SidecarClient, plan):
    """(segment, fetched KV rows per layer) for every CHUNK_HIT row of ``plan``."""
    hits = plan.hits()
    got = await c.fetch([(h.chunk_hash, h.start - h.chunk_offset) for h in hits], identity=IDENT,
                        layout=LAYOUT, rope=SPEC)
    out = []
    for h, kv in zip(hits, got):
        assert kv.ok and kv.num_tokens >= h.chunk_offset + len(h)
        assert kv.delta == h.delta and kv.source_pos == h.source_pos - h.chunk_offset
        view = decode_payload(bytearray(kv.data), LAYOUT, kv.num_tokens)
        rows = slice(h.chunk_offset, h.chunk_offset + len(h))
        out.append((h, [{p: view.part(layer, p)[rows] for p in ("k", "v")} for layer in range(LAYOUT.num_layers)]))
    return out


def check_against_prefill(tokens: np.ndarray, stored_kv, fetched) -> None:
    """Every served row is the stored prefill's row of the same token, at the right position."""
    want = prefill(tokens)
    for h, layers in fetched:
        src = slice(h.source_pos, h.source_pos + len(h))
        dst = slice(h.start, h.end)
        for layer, rows in enumerate(layers):
            # V: the same token; stored at the source position
            assert torch.equal(rows["v"][:, :, 0], want[layer]["v"][dst, :, 0]), f"wrong tokens in {h}"
            assert torch.equal(rows["v"], stored_kv[layer]["v"][src])
            if h.delta == 0:
                assert torch.equal(rows["k"], want[layer]["k"][dst])  # bit-exact
                assert torch.equal(rows["k"], stored_kv[layer]["k"][src])
            else:
                assert torch.equal(rows["k"], rotate_keys(stored_kv[layer]["k"][src], h.delta, SPEC))
                torch.testing.assert_close(rows["k"], want[layer]["k"][dst], rtol=1e-4, atol=1e-4)


@pytest.fixture
async def sidecar_target():
    server, port = await create_server(make_config(store=StoreConfig(cpu_bytes=64 << 20)))
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0.1)


async def test_reordered_documents_inside_one_message_recovered_to_their_edges(rng, sidecar_target):
    """rerank_inline: documents re-ordered inside one message (no anchors between them)."""
    docs = [text(rng, 300) for _ in range(3)]
    head = message(rng, 600)  # past the largest chunk: every stored neighbour can be named
    first = np.concatenate([head, *docs, message(rng, 20, ANCHORS[1])]).astype(np.uint32)
    order = [2, 0, 1]
    second = np.concatenate([head, *[docs[i] for i in order], message(rng, 20, ANCHORS[1])]).astype(np.uint32)
    h = len(head)
    async with SidecarClient(sidecar_target, tenant="t") as c:
        stored = await store_prefilled(c, first)
        base = await c.lookup(second, identity=IDENT, engine_prefix_len=len(head), recompute_tokens=0)
        base.check_tiling(len(second))
        segs = base.hit_segments().tolist()
        # every moved run of documents is one hit segment, recovered exactly to its edges
        # (documents 0 and 1 stay adjacent: one segment)
        want = [[h, h + 300], [h + 300, h + 900]]
        assert segs == want, (segs, want)
        assert all(h.fidelity is Fidelity.APPROXIMATE for h in base.hits())
        # at least one row is a partial chunk reached by extension
        assert any(h.chunk_offset > 0 or len(h) < 32 for h in base.hits())
        check_against_prefill(second, stored, await served(c, base))
        # repair_scope "segment": boundary repair once per segment; the carve-out still holds
        k4 = await c.lookup(second, identity=IDENT, engine_prefix_len=len(head), recompute_tokens=4,
                            repair_scope="segment")
        assert k4.hit_segments().tolist() == [[a + 4, b] for a, b in want]
        check_against_prefill(second, stored, await served(c, k4))
        # the default, repair_scope "chunk": also a 4-token hole at every stored chunk's first row
        k4c = await c.lookup(second, identity=IDENT, engine_prefix_len=len(head), recompute_tokens=4)
        k4c.check_tiling(len(second))
        starts = [s.start for s in base.hits() if s.chunk_offset == 0 and s.start not in {a for a, _ in want}]
        assert starts, "the moved documents span several stored chunks"
        holes = sorted([a for a, _ in want] + starts)
        assert_holes(base, k4c, holes, 4)
        check_against_prefill(second, stored, await served(c, k4c))


def covered(plan) -> set[int]:
    return {t for s in plan.hits() for t in range(s.start, s.end)}


def assert_holes(base, repaired, holes: list[int], k: int, min_hit: int = 16) -> None:
    """``repaired`` serves what ``base`` serves except k tokens from each of ``holes`` and the
    parts between holes shorter than ``min_hit`` (folded), rows still taken from the same
    stored chunks at the same delta."""
    want: set[int] = set()
    for a, b in base.hit_segments().tolist():
        cuts = [h for h in holes if a <= h < b]
        for lo, hi in zip([c + k for c in cuts], cuts[1:] + [b]):
            if hi - lo >= min_hit:
                want.update(range(lo, hi))
    assert covered(repaired) == want
    rows = {t: (s.chunk_hash, s.delta) for s in base.hits() for t in range(s.start, s.end)}
    assert all(rows[t] == (s.chunk_hash, s.delta) for s in repaired.hits() for t in range(s.start, s.end))


async def test_exact_hit_extended_right_is_bit_exact(rng, sidecar_target):
    """A prompt that leaves a stored one mid-chunk: the exact hits extend up to the divergence,
    exact (same left context, same positions), bit-identical to the prompt's own prefill."""
    first = np.concatenate([message(rng, 40), text(rng, 600), message(rng, 50, ANCHORS[1])]).astype(np.uint32)
    cut = 377
    second = np.concatenate([first[:cut], text(rng, 200)]).astype(np.uint32)
    async with SidecarClient(sidecar_target, tenant="t") as c:
        stored = await store_prefilled(c, first)
        plan = await c.lookup(second, identity=IDENT, recompute_tokens=0)
        plan.check_tiling(len(second))
        assert plan.hit_segments().tolist() == [[0, cut]]
        assert plan.summary.exact_tokens == cut
        assert all(h.fidelity is Fidelity.EXACT for h in plan.hits())
        check_against_prefill(second, stored, await served(c, plan))
        # exact policy: the same (right extension of exact hits is exact)
        ex = await c.lookup(second, identity=IDENT, policy="exact")
        assert ex.summary.exact_tokens == cut


async def test_short_hits_fold_into_prefill_and_extension_needs_stored_kv(rng, sidecar_target):
    """A hit segment below registry.min_hit_tokens is prefilled; OBSERVED neighbours (no KV)
    are not used to extend a served hit."""
    doc = text(rng, 400)
    first = np.concatenate([message(rng, 60), doc]).astype(np.uint32)
    second = np.concatenate([message(rng, 590), text(rng, 7), doc[150:], message(rng, 10, ANCHORS[2])])
    second = second.astype(np.uint32)
    async with SidecarClient(sidecar_target, tenant="t") as c:
        meta = await c.store(first, identity=IDENT)  # metadata only: OBSERVED
        dry = await c.lookup(second, identity=IDENT, dry_run=True, recompute_tokens=0)
        real = await c.lookup(second, identity=IDENT, recompute_tokens=0)
        assert dry.summary.shifted_tokens > 0 and real.summary.shifted_tokens == 0
        kv = prefill(first)
        bounds = list(meta.chunk_bounds)
        # store the payload of every chunk but the one the left extension would enter
        seg = dry.hit_segments().tolist()[0]
        assert seg[0] == 591 + 7  # extended left to the doc's (shifted) edge
        start_src = 61 + 150
        keep = [a for a, b in zip(bounds, bounds[1:]) if not (a <= start_src < b)]
        pl = {a: p for a, p in payloads(kv, bounds).items() if a in keep}
        await c.store(first, identity=IDENT, layout=LAYOUT, payloads=pl)
        real = await c.lookup(second, identity=IDENT, recompute_tokens=0)
        assert real.summary.shifted_tokens > 0
        for h in real.hits():  # nothing served from the chunk without KV
            assert not (h.source_pos <= start_src < h.source_pos + len(h))
        check_against_prefill(second, kv, await served(c, real))
        assert all(b - a >= 16 for a, b in real.hit_segments().tolist())


def test_min_hit_tokens_folds_short_segments(rng, identity):
    from sidecar.registry.chunk_index import ChunkIndex, LookupQuery
    from sidecar.registry.chunker import ChunkerConfig
    from sidecar.registry.registry import InMemoryRegistry, RegistryConfig

    short = message(rng, 20, ANCHORS[2])  # a 21-token message: one chunk (anchors always cut)
    first = np.concatenate([message(rng, 100), short, message(rng, 100, ANCHORS[1])]).astype(np.uint32)
    second = np.concatenate([message(rng, 130), short, message(rng, 50, ANCHORS[3])]).astype(np.uint32)
    for min_hit, expect in ((0, 21), (16, 21), (21, 21), (22, 0)):
        index = ChunkIndex(ChunkerConfig(anchor_tokens=ANCHORS),
                           InMemoryRegistry(RegistryConfig(min_hit_tokens=min_hit)))
        index.register(first, first.tobytes(), identity, "t")
        plan = index.lookup(LookupQuery(tokens=second, data=second.tobytes(), identity=identity, scope="t",
                                        dry_run=True))
        plan.check_tiling(len(second))
        assert plan.summary.shifted_tokens == expect, (min_hit, plan.segments)
        assert all(s.start >= CARVE_OUT_TOKENS for s in plan.segments if s.kind is SegmentKind.CHUNK_HIT)


async def test_one_fetch_item_per_hit_segment(rng, sidecar_target):
    """``plan.fetch_spans()``: one span item per hit segment; its answer is the segment's rows,
    equal row for row to the per-chunk Fetch of the same plan; spans that cannot be served
    (a chunk unknown, not following on) are misses; old-style items still work alongside."""
    docs = [text(rng, 300) for _ in range(3)]
    head = message(rng, 600)
    first = np.concatenate([head, *docs, message(rng, 20, ANCHORS[1])]).astype(np.uint32)
    second = np.concatenate([head, docs[2], docs[0], docs[1], message(rng, 20, ANCHORS[1])]).astype(np.uint32)
    async with SidecarClient(sidecar_target, tenant="t") as c:
        stored = await store_prefilled(c, first)
        plan = await c.lookup(second, identity=IDENT, engine_prefix_len=len(head), repair_scope="segment")
        spans = plan.fetch_spans()
        segs = plan.hit_segments().tolist()
        assert len(spans) == len(segs) == 2 and len(plan.hits()) > len(spans)
        assert [(s.target_pos, s.target_pos + s.num_tokens) for s in spans] == [tuple(x) for x in segs]
        got = await c.fetch(spans, identity=IDENT, layout=LAYOUT, rope=SPEC)
        per_chunk = await served(c, plan)
        want = prefill(second)
        for span, kv, (a, b) in zip(spans, got, segs):
            assert kv.ok and kv.num_tokens == b - a and kv.chunk_hash == span.chunk_hash
            view = decode_payload(bytearray(kv.data), LAYOUT, kv.num_tokens)
            rows = [(h, layers) for h, layers in per_chunk if a <= h.start < b]
            for layer in range(LAYOUT.num_layers):
                for p in ("k", "v"):
                    assert torch.equal(view.part(layer, p), torch.cat([ls[layer][p] for _, ls in rows]))
                assert torch.equal(view.part(layer, "v")[:, :, 0], want[layer]["v"][a:b, :, 0])
        check_against_prefill(second, stored, per_chunk)
        # a broken span is a miss; a plain item next to it is served
        s0 = spans[1]
        bad = FetchSpec(s0.chunk_hash, s0.target_pos, s0.num_tokens, s0.row_offset, tuple(reversed(s0.next_hashes)))
        h0 = plan.hits()[0]
        mixed = await c.fetch([bad, (h0.chunk_hash, h0.start - h0.chunk_offset), spans[0]], identity=IDENT,
                              layout=LAYOUT, rope=SPEC)
        assert [m.ok for m in mixed] == [len(s0.next_hashes) < 2, True, True]
        too_long = FetchSpec(s0.chunk_hash, s0.target_pos, s0.num_tokens + 10_000, s0.row_offset, s0.next_hashes)
        assert not (await c.fetch([too_long], identity=IDENT, layout=LAYOUT, rope=SPEC))[0].ok


def test_a_hit_covering_the_whole_request_is_never_folded(rng, identity):
    """An 8-token request stored whole (SGLang HiCache names its pages with 8 tokens) is a hit
    even though 8 < registry.min_hit_tokens: folding it would prefill the whole request."""
    from sidecar.registry.chunk_index import ChunkIndex, LookupQuery
    from sidecar.registry.chunker import ChunkerConfig
    from sidecar.registry.registry import InMemoryRegistry, RegistryConfig

    page = (np.arange(8, dtype=np.uint32) * 7919 + 3) | np.uint32(0x80000000)
    index = ChunkIndex(ChunkerConfig(anchor_tokens=ANCHORS), InMemoryRegistry(RegistryConfig(min_hit_tokens=16)))
    index.register(page, page.tobytes(), identity, "t")
    plan = index.lookup(LookupQuery(tokens=page, data=page.tobytes(), identity=identity, scope="t", dry_run=True))
    plan.check_tiling(len(page))
    assert [(s.kind, s.start, s.end) for s in plan.segments] == [(SegmentKind.CHUNK_HIT, 0, 8)]
