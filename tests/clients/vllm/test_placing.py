"""``placing.place`` on CPU: a load's items, exact and shifted, from views of one shared buffer
(as the shared pool's are), into the CPU backend's cache and a standard layout. The cache then
holds each item's rows rotated by its delta (the torch reference rotation), at its positions,
untouched elsewhere, and the source bytes are never written."""

from __future__ import annotations

import pytest
import torch

from clients.vllm.layouts import PagedSpec, StandardKV
from clients.vllm.paged import BlockLayout, PagedKV
from clients.vllm.placing import Scratch, place
from clients.vllm.rows import GqaRows
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


def test_the_scratch_is_reused_across_loads():
    s = Scratch()
    a = s.take(1000)
    assert s.take(600).data_ptr() == a.data_ptr()
    assert s.take(5000).numel() == 5000
