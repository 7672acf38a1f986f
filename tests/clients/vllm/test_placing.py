"""``placing.place`` on CPU: a load's items, exact and shifted, from views of one shared buffer
(as the shared pool's are), into the CPU backend's cache and a standard layout. The cache then
holds each item's rows rotated by its delta (the torch reference rotation), at its positions,
untouched elsewhere, and the source bytes are never written."""

from __future__ import annotations

import pytest
import torch

from clients.vllm import paged
from clients.vllm.layouts import PagedSpec, StandardKV
from clients.vllm.paged import BlockLayout, PagedKV
from clients.vllm.placing import Scratch, place
from clients.vllm.rows import GqaRows, HeadParts
from clients.vllm.staging import Staging
from sidecar.identity import KVLayout
from sidecar.rotation import Pairing, RopeSpec, RotaryLayout, rotate_keys_native

L, H, D, B = 2, 2, 16, 4
LAYOUT = KVLayout.gqa(num_layers=L, num_kv_heads=H, head_dim=D)
ROPE = RopeSpec(rotary_dim=D, key_dim=D, layout=RotaryLayout.LEADING, pairing=Pairing.HALF,
                inv_freq=tuple(10000 ** (-(2 * i) / D) for i in range(D // 2)))
BLOCKS = 16


def cache(kind: str):
    layers = [torch.zeros((BLOCKS, H, B, 2 * D), dtype=torch.bfloat16) for _ in range(L)]
    if kind == "cpu_backend":
        return PagedKV(layers, BlockLayout.vec(H, B, D))
    return StandardKV(layers, PagedSpec(mla=False, num_heads=H, block_size=B, head_size=D, head_size_v=D,
                                        dtype=torch.bfloat16))


@pytest.mark.parametrize("kind", ["cpu_backend", "standard"])
def test_exact_and_shifted_items_land_rotated_and_the_source_is_never_written(kind):
    g = torch.Generator().manual_seed(0)
    # one "pool" holding three chunks as payloads; the items are views of it, the middle one
    # partial (rows 2..7 of an 8-row chunk) and placed off block boundaries
    chunks = [torch.randn(L, 2, 8, H, D, generator=g).to(torch.bfloat16) for _ in range(3)]
    pool = torch.cat([c.reshape(-1) for c in chunks]).view(torch.uint8).clone()
    per = 8 * LAYOUT.bytes_per_token
    view = [GqaRows.of(pool[i * per:(i + 1) * per], LAYOUT, 8) for i in range(3)]
    items = [(0, 8, view[0], 0), (8, 14, view[1].narrow(2, 2, 6), 5), (20, 28, view[2], -3)]
    before = pool.clone()
    c = cache(kind)
    table = torch.randperm(BLOCKS, generator=g)[:8]
    rotated = place(c, GqaRows, items, table, staging=Staging(torch.device("cpu")), rope=ROPE, layout=LAYOUT,
                    scratch=Scratch())
    assert rotated == 6 + 8
    assert torch.equal(pool, before)
    for start, end, rows, delta in items:
        want = rows.clone()
        if delta:
            want[:, 0] = rotate_keys_native(rows[:, 0], delta, ROPE)
        assert torch.equal(c.gather(table, torch.arange(start, end)), want), (start, delta)
    assert not c.gather(table, torch.arange(14, 20)).any()  # the gap between items stays as it was


@pytest.mark.parametrize("kind", ["cpu_backend", "standard"])
def test_items_held_as_head_ranges_of_several_buffers_land_whole_without_a_join(kind):
    """Items whose heads sit in several buffers (each source rank's chunk in the shared pool, as
    a re-sharded load reads them): every part lands in its head range, exact ones straight from
    their views (the scratch is never taken), shifted ones rotated in the scratch; the sources
    are never written, and cells outside the items stay as they were."""
    g = torch.Generator().manual_seed(1)
    whole = [torch.randn(L, 2, 8, H, D, generator=g).to(torch.bfloat16) for _ in range(3)]
    pools = [torch.stack([w[:, :, :, h:h + 1] for w in whole]).contiguous().view(-1).view(torch.uint8)
             for h in range(H)]  # pool h: head h of the three chunks, each chunk a payload of one head
    one = KVLayout.gqa(num_layers=L, num_kv_heads=1, head_dim=D)
    per = 8 * one.bytes_per_token
    heads = [[GqaRows.of(p[i * per:(i + 1) * per], one, 8) for p in pools] for i in range(3)]
    split = [HeadParts(tuple((heads[i][h], h) for h in range(H))) for i in range(3)]
    before = [p.clone() for p in pools]
    table = torch.randperm(BLOCKS, generator=g)[:8]

    def placed(items, scratch):
        c = cache(kind)
        rotated = place(c, GqaRows, items, table, staging=Staging(torch.device("cpu")), rope=ROPE, layout=LAYOUT,
                        scratch=scratch)
        return c, rotated

    exact = Scratch()
    c, rotated = placed([(0, 8, split[0], 0), (8, 16, split[1], 0)], exact)
    assert rotated == 0 and exact.size == 0  # no join, no copy but the cache's own
    for start, w in ((0, whole[0]), (8, whole[1])):
        assert torch.equal(c.gather(table, torch.arange(start, start + 8)), w)
    shifted = Scratch()
    narrowed = HeadParts(tuple((p.narrow(2, 2, 6), h) for p, h in split[1].parts))
    c, rotated = placed([(0, 8, split[0], 0), (8, 14, narrowed, 5), (20, 28, split[2], -3)], shifted)
    assert rotated == 6 + 8 and shifted.size == 14 * LAYOUT.bytes_per_token  # the rotation's own copy only
    for start, w, delta in ((0, whole[0], 0), (8, whole[1].narrow(2, 2, 6), 5), (20, whole[2], -3)):
        want = w.clone()
        if delta:
            want[:, 0] = rotate_keys_native(w[:, 0], delta, ROPE)
        assert torch.equal(c.gather(table, torch.arange(start, start + want.shape[2])), want), (start, delta)
    assert not c.gather(table, torch.arange(14, 20)).any()
    assert all(torch.equal(p, b) for p, b in zip(pools, before))


@pytest.mark.parametrize("kind", ["cpu_backend", "standard"])
def test_a_head_range_scatter_writes_only_those_heads(kind):
    c = cache(kind)
    table = torch.arange(BLOCKS)
    positions = torch.arange(3, 13)  # off block boundaries at both ends
    base = torch.randn(L, 2, 10, H, D).to(torch.bfloat16)
    c.scatter(base, table, positions)
    part = torch.randn(L, 2, 10, 1, D).to(torch.bfloat16)
    c.scatter(HeadParts(((part, 1),)), table, positions)
    want = base.clone()
    want[:, :, :, 1:] = part
    assert torch.equal(c.gather(table, positions), want)
    assert not c.gather(table, torch.cat((torch.arange(3), torch.arange(13, 20)))).any()


@pytest.mark.parametrize("limit", [1, 10 ** 6], ids=["a-layer-at-a-time", "all-layers-at-once"])
def test_whole_blocks_from_head_parts_land_whatever_the_layer_grouping(monkeypatch, limit):
    """The CPU backend's cache builds whole blocks a group of layers at a time (``paged._BUILD_ELEMS``);
    every grouping gives the same cells, here from three parts of uneven head counts."""
    monkeypatch.setattr(paged, "_BUILD_ELEMS", limit)
    heads, layers = 4, 3
    c = PagedKV([torch.zeros((BLOCKS, heads, B, 2 * D), dtype=torch.bfloat16) for _ in range(layers)],
                BlockLayout.vec(heads, B, D))
    rows = torch.randn(layers, 2, 3 * B, heads, D).to(torch.bfloat16)
    parts = HeadParts(((rows[:, :, :, 1:3].clone(), 1), (rows[:, :, :, 3:].clone(), 3), (rows[:, :, :, :1].clone(), 0)))
    table = torch.tensor([7, 1, 4, 9], dtype=torch.int64)
    c.scatter(parts, table, torch.arange(B, 4 * B))
    assert torch.equal(c.gather(table, torch.arange(B, 4 * B)), rows)
    assert not c.gather(table, torch.arange(B)).any()
    with pytest.raises(ValueError, match="^rows: head parts"):
        c.scatter(HeadParts(((rows[:, :, :, :1], 0), (rows[:, :, :, 2:3], 2))), table, torch.arange(B, 4 * B))
    assert torch.equal(c.gather(table, torch.arange(B, 4 * B)), rows)  # refused before any write


def test_head_parts_join_into_one_buffer_in_head_order():
    """The CUDA placement's host join: the parts at their head offsets, as one ``[L, 2, n, H, D]``."""
    rows = torch.randn(L, 2, 5, H, D).to(torch.bfloat16)
    parts = HeadParts(tuple((rows[:, :, :, h:h + 1].clone(), h) for h in reversed(range(H))))
    assert parts.num_heads == H
    out = torch.empty(L * 2 * 5 * H * D * 2, dtype=torch.uint8)
    assert torch.equal(parts.join(GqaRows.of(out, LAYOUT, 5)), rows)


def test_the_scratch_is_reused_across_loads():
    s = Scratch()
    a = s.take(1000)
    assert s.take(600).data_ptr() == a.data_ptr()
    assert s.take(5000).numel() == 5000
