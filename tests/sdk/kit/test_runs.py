"""``sidecar.sdk.kit.runs``: from a LookupPlan to the run an engine loads and the chunks it stores
(pure: no RPC, no engine)."""

from __future__ import annotations

import numpy as np

from sidecar.registry.lookup_plan import Fidelity, LookupPlan, SegmentKind
from sidecar.sdk.kit import LoadItem, LoadRun, load_item, load_run, served_ranges, store_chunks

H, P, E = SegmentKind.CHUNK_HIT, SegmentKind.PREFILL, SegmentKind.ENGINE_PREFIX
X, A, N = Fidelity.EXACT, Fidelity.APPROXIMATE, Fidelity.NONE


def plan(rows, bounds=()) -> LookupPlan:
    """A plan from ``(kind, start, end, hash, chunk_offset, source_pos, fidelity)`` rows."""
    flat = []
    for k, s, e, h, o, p, f in rows:
        flat += [int(k), s, e, h, o, p, int(f)]
    return LookupPlan.from_flat(flat, chunk_bounds=np.asarray(bounds, dtype=np.uint32))


# engine prefix 64, exact hit to 200, recompute gap [200, 204) then a shifted chunk to 400, a real gap, a hit
GUARDED = plan([(E, 0, 64, 0, 0, 0, N), (H, 64, 200, 11, 64, 0, X), (P, 200, 204, 0, 0, 0, N),
                (H, 204, 400, 22, 4, 150, A), (P, 400, 500, 0, 0, 0, N), (H, 500, 700, 33, 0, 300, A)],
               bounds=(0, 200, 400, 500, 700))


def test_load_run_rules():
    """What the vLLM connector loads from a plan: contiguous with the engine's hit, recompute gaps
    bridged, block-aligned, at most n - 1, nothing at or after a forget edit."""
    p = GUARDED
    c = load_run(p, local=64, n=700, block_size=32)
    assert (c.local, c.end, c.bridged) == (64, 384, 4)
    assert [(i.chunk_hash, i.row, i.start, i.end) for i in c.items] == [(11, 64, 64, 200), (22, 0, 200, 384)]
    assert c.items[1].target_pos == 200 and (c.gap_start, c.gap_end) == (400, 500)
    c = load_run(p, local=64, n=700, block_size=32, bridge_recompute=False)
    assert c.end == 192 and c.bridged == 0
    c = load_run(p, local=64, n=700, block_size=32, limit=300)
    assert c.end == 288 and c.gap_end == 700
    assert load_run(p, local=0, n=700, block_size=32).tokens == 0  # a plan ENGINE_PREFIX the engine does not hold
    assert load_run(p, local=416, n=700, block_size=32).tokens == 0  # inside a gap
    tail = plan([(E, 0, 64, 0, 0, 0, N), (H, 64, 130, 5, 0, 64, X)], bounds=(64, 130))
    assert load_run(tail, local=64, n=130, block_size=32).end == 128  # n - 1 = 129, cut to the block
    # Store: not the chunks with loaded shifted rows, not the chunks the sidecar serves whole
    c = load_run(p, local=64, n=700, block_size=32)
    assert store_chunks(p, n=700, approximate=c.approximate) == [(400, 500)]  # the gap the engine computes
    q = plan([(P, 0, 300, 0, 0, 0, N), (H, 300, 400, 7, 0, 100, A)], bounds=(0, 100, 300, 400))
    assert store_chunks(q, n=400) == [(0, 100), (100, 300)]
    assert store_chunks(q, n=400, skip_tail=True) == [(0, 100), (100, 300)]


def test_token_granular_run_is_every_hit_from_the_prefix_on():
    """SGLang's use: block size 1, no bridging, the last token not held back: the run is exactly
    the hits that start where the previous one ended, from the device prefix on."""
    p = plan([(E, 0, 10, 0, 0, 0, N), (H, 10, 50, 1, 0, 10, X), (H, 50, 90, 2, 0, 50, X), (P, 90, 95, 0, 0, 0, N),
              (H, 95, 120, 3, 5, 40, A)], bounds=(10, 50, 90, 120))
    run = load_run(p, local=10, n=120, bridge_recompute=False, compute_last=False)
    assert (run.local, run.end, run.tokens) == (10, 90, 80)
    assert [(i.chunk_hash, i.target_pos, i.row, i.start, i.end, i.exact) for i in run.items] == [
        (1, 10, 0, 10, 50, True), (2, 50, 0, 50, 90, True)]
    assert (run.gap_start, run.gap_end, run.planned) == (90, 95, 105)
    whole = plan([(H, 0, 64, 9, 0, 0, X)], bounds=(0, 64))
    assert load_run(whole, local=0, n=64, compute_last=False).tokens == 64  # the caller bounds the key
    assert load_run(whole, local=0, n=64).tokens == 63  # an engine that samples the last token computes it


def test_load_item_and_truncation():
    """A CHUNK_HIT's load serves rows from its chunk offset; an engine that takes fewer tokens
    than offered cuts the run's items at the new end (``bridged`` is capped, not recounted)."""
    seg = GUARDED.hits()[1]  # [204, 400) of chunk 22 from row 4, shifted (stored at 150)
    it = load_item(seg)
    assert it == LoadItem(22, 200, 4, 204, 400, False) and len(it) == 196 and it.fetch_item == (22, 200)
    assert load_item(seg, 300) == LoadItem(22, 200, 100, 300, 400, False)
    run = load_run(GUARDED, local=64, n=700, block_size=32)
    cut = run.truncated(128)
    assert isinstance(cut, LoadRun) and (cut.local, cut.end, cut.tokens, cut.bridged) == (64, 192, 128, 4)
    assert [(i.chunk_hash, i.start, i.end) for i in cut.items] == [(11, 64, 192)]
    assert (cut.planned, cut.gap_start, cut.gap_end) == (run.planned, run.gap_start, run.gap_end)
    cut = run.truncated(140)
    assert [(i.chunk_hash, i.row, i.start, i.end) for i in cut.items] == [(11, 64, 64, 200), (22, 0, 200, 204)]
    assert cut.bridged == 4 and run.truncated(2).bridged == 2


def test_store_chunks_served_and_tail():
    """``served`` replaces the plan's hits (an engine that loaded only some of them); a chunk
    past ``n`` or (``skip_tail``) ending at ``n`` is not stored."""
    assert served_ranges(GUARDED) == [(0, 200), (200, 400), (500, 700)]
    assert store_chunks(GUARDED, n=700) == [(400, 500)]
    assert store_chunks(GUARDED, n=700, served=[(0, 200)]) == [(200, 400), (400, 500), (500, 700)]
    assert store_chunks(GUARDED, n=700, served=[], approximate=[(250, 260)]) == [(0, 200), (400, 500), (500, 700)]
    assert store_chunks(GUARDED, n=700, served=[], skip_tail=True) == [(0, 200), (200, 400), (400, 500)]
    assert store_chunks(GUARDED, n=500, served=[]) == [(0, 200), (200, 400), (400, 500)]
    assert store_chunks(plan([(P, 0, 10, 0, 0, 0, N)], bounds=(0,)), n=10) == []
