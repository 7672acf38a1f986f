"""The worker's standard-layout row copies (``clients.vllm.layouts``) against an independent reference.

Caches are built the way vLLM builds them (one flat buffer, per-layer logical ``[B, H, N, C]``
views whose strides follow a ``KVCacheLayout`` permutation of ``[L, B, H, N, C]``), here from the
permutation table alone; ``tests/real_engines/test_vllm_layouts.py`` builds them with vLLM's own
``create_kv_cache_views``. The reference addresses every element by stride arithmetic on the flat
buffer, one token at a time.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from clients.vllm.layouts import LatentKV, PagedSpec, StandardKV, UnsupportedLayout, runs
from clients.vllm.refusals import Refused

#: vLLM's KVCacheLayout values (vllm/v1/kv_cache_layout.py): physical order of the logical axes.
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
L, B, BS = 3, 7, 4


def strides(shape: tuple[int, ...], order: tuple[int, ...]) -> list[int]:
    out = [0] * 5
    step = 1
    for dim in reversed(order):
        out[dim] = step
        step *= shape[dim]
    return out


def build(spec: PagedSpec, order: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    shape = (L, B, spec.num_heads, spec.block_size, spec.content)
    st = strides(shape, order)
    raw = torch.zeros(L * B * spec.num_heads * spec.block_size * spec.content, dtype=spec.dtype)
    views = [torch.as_strided(raw, shape[1:], st[1:], storage_offset=layer * st[0]) for layer in range(L)]
    return raw, views, st


def spec_of(kind: str, dtype: torch.dtype) -> PagedSpec:
    if kind == "mla":
        vspec = SimpleNamespace(num_kv_heads=1, head_size=12, head_size_v=0, dtype=dtype, block_size=BS)
        return PagedSpec.from_vllm(vspec, mla=True, rope_dim=4)
    vspec = SimpleNamespace(num_kv_heads=2, head_size=8, dtype=dtype, block_size=BS)
    return PagedSpec.from_vllm(vspec, mla=False)


def reference_cell(raw: torch.Tensor, st: list[int], layer: int, block: int, head: int, tok: int, c: int) -> float:
    return raw[layer * st[0] + block * st[1] + head * st[2] + tok * st[3] + c * st[4]].item()


def cache_of(spec: PagedSpec, views: list[torch.Tensor]) -> StandardKV | LatentKV:
    return (LatentKV if spec.mla else StandardKV)(views, spec)


def random_rows(spec: PagedSpec, n: int) -> torch.Tensor:
    """Rows as the worker moves them: ``[L, 2, n, H, D]`` (GQA) or latent rows ``[L, n, C]``."""
    shape = (L, n, spec.content) if spec.mla else (L, 2, n, spec.num_heads, spec.head_size)
    return torch.randint(1, 100, shape).to(spec.dtype)


def cell_row(spec: PagedSpec, rows: torch.Tensor, layer: int, i: int, h: int) -> list[float]:
    """Row ``i``'s content of head ``h`` as the cell holds it: [K | V] (GQA) or the latent row."""
    if spec.mla:
        return rows[layer, i].float().tolist()
    return torch.cat((rows[layer, 0, i, h], rows[layer, 1, i, h])).float().tolist()


def assert_cells(spec: PagedSpec, raw: torch.Tensor, st: list[int], table: torch.Tensor, positions: list[int],
                 rows: torch.Tensor) -> None:
    """Every cell of ``positions`` holds its row (by stride arithmetic on the flat buffer, one
    token at a time), and nothing else was written."""
    written = 0
    for layer in range(L):
        for i, pos in enumerate(positions):
            block, tok = table[pos // BS].item(), pos % BS
            for h in range(spec.num_heads):
                got = [reference_cell(raw, st, layer, block, h, tok, c) for c in range(spec.content)]
                assert got == cell_row(spec, rows, layer, i, h), (layer, i, h)
                written += spec.content
    assert int((raw != 0).sum()) == written


#: (start, n) of the run: partial head + whole blocks + partial tail; whole blocks only; inside one
#: block; a whole block then a partial tail
RUNS = ((3, 10), (0, 8), (1, 2), (4, 5))


@pytest.mark.parametrize("start, n", RUNS)
@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_scatter_and_gather_match_the_reference(layout, dtype, kind, start, n):
    """The worker's copies (``StandardKV`` / ``LatentKV``: ``scatter`` for loads, ``gather`` for
    Stores) put each row in its cell and read the same rows back."""
    spec = spec_of(kind, dtype)
    raw, views, st = build(spec, LAYOUTS[layout])
    cache = cache_of(spec, views)
    table = torch.tensor([5, 2, 6, 0], dtype=torch.int64)  # a request's blocks, out of order
    positions = torch.arange(start, start + n)
    rows = random_rows(spec, n)
    cache.scatter(rows, table, positions)
    assert_cells(spec, raw, st, table, positions.tolist(), rows)
    assert torch.equal(cache.gather(table, positions), rows)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("layout", ["LBHNC", "BLNHC", "BHLNC"])
def test_gather_reads_positions_in_several_runs(layout, kind):
    """A Store job's chunks need not be contiguous: ``gather`` of positions in three runs (one
    token inside a block, a run over a whole block, a run ending mid-block), in the given order,
    equals the rows scattered there."""
    spec = spec_of(kind, torch.bfloat16)
    raw, views, st = build(spec, LAYOUTS[layout])
    cache = cache_of(spec, views)
    table = torch.tensor([5, 2, 6, 0], dtype=torch.int64)
    positions = torch.tensor([1, 3, 4, 5, 6, 7, 8, 9, 13, 14])
    assert [(r, s, k) for r, s, k in runs(positions)] == [(0, 1, 1), (1, 3, 7), (8, 13, 2)]
    rows = random_rows(spec, len(positions))
    cache.scatter(rows, table, positions)
    assert_cells(spec, raw, st, table, positions.tolist(), rows)
    assert torch.equal(cache.gather(table, positions), rows)
    assert torch.equal(cache.gather(table, positions.flip(0)), rows.flip(cache.token_axis))


@pytest.mark.parametrize("change, why", [
    ({"dtype": torch.float8_e4m3fn}, "dtype"),
    ({"kv_quant_mode": SimpleNamespace(name="FP8_PER_TENSOR")}, "quantization"),
    ({"num_head_slots": 4}, "num_head_slots"),
    ({"state_content_bytes": 64}, "state_content_bytes"),
    ({"tokens_per_state": 2}, "tokens_per_state"),
])
def test_refused_groups_name_what_and_why(change, why):
    fields = {"num_kv_heads": 2, "head_size": 8, "dtype": torch.bfloat16, "block_size": BS, **change}
    with pytest.raises(UnsupportedLayout, match=why) as info:
        PagedSpec.from_vllm(SimpleNamespace(**fields), mla=False)
    assert isinstance(info.value, Refused)  # the connector's one refusal mechanism (refusals.py)


def test_mla_needs_one_latent_row_and_its_rope_part():
    ok = {"num_kv_heads": 1, "head_size": 12, "head_size_v": 0, "dtype": torch.float16, "block_size": BS}
    with pytest.raises(UnsupportedLayout, match="rope_dim"):
        PagedSpec.from_vllm(SimpleNamespace(**ok), mla=True, rope_dim=0)
    with pytest.raises(UnsupportedLayout, match="heads"):
        PagedSpec.from_vllm(SimpleNamespace(**{**ok, "num_kv_heads": 2}), mla=True, rope_dim=4)
    spec = PagedSpec.from_vllm(SimpleNamespace(**ok), mla=True, rope_dim=4)
    assert (spec.content, spec.rope_dim) == (12, 4)
    with pytest.raises(UnsupportedLayout, match="GQA"):
        StandardKV(build(spec, LAYOUTS["LBHNC"])[1], spec)


def test_a_view_of_another_shape_is_refused():
    spec = spec_of("gqa", torch.float16)
    with pytest.raises(UnsupportedLayout, match=r"\[B, H, N, C\]"):
        spec.check_view(torch.zeros(B, BS, 2, 16, dtype=torch.float16))  # NHD without the view
