"""The standard-layout row copies (``clients.vllm.layouts``) against an independent reference.

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

from clients.vllm.layouts import PagedSpec, Run, StandardKV, UnsupportedLayout, gather, load_, save
from sidecar.api.payload import decode_payload

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


#: (start, n) of the run: partial head + whole blocks + partial tail; whole blocks only; inside one
#: block; a whole block then a partial tail
RUNS = ((3, 10), (0, 8), (1, 2), (4, 5))


@pytest.mark.parametrize("start, n", RUNS)
@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_load_and_gather_match_the_reference(layout, dtype, kind, start, n):
    spec = spec_of(kind, dtype)
    raw, views, st = build(spec, LAYOUTS[layout])
    for v in views:
        spec.check_view(v)
    table = torch.tensor([5, 2, 6, 0], dtype=torch.int64)  # a request's blocks, out of order
    run = Run.of(table, start, n, BS)
    layout_p = spec.payload_layout(L)
    payload = torch.randint(1, 100, (layout_p.bytes_per_token * n // dtype.itemsize,), dtype=torch.int32).to(dtype)
    payload = payload.view(torch.uint8)
    load_(views, spec, payload, run)

    pv = decode_payload(payload, layout_p, n)
    slices = spec.slices()
    written = 0
    for layer in range(L):
        for p, (lo, hi) in enumerate(slices):
            src = pv.parts[layer * len(slices) + p].tensor
            for i in range(n):
                pos = start + i
                block, tok = table[pos // BS].item(), pos % BS
                for h in range(spec.num_heads):
                    row = src[i] if spec.mla else src[i, h]
                    got = [reference_cell(raw, st, layer, block, h, tok, c) for c in range(lo, hi)]
                    assert got == row.float().tolist(), (layer, p, i, h)
                    written += hi - lo
    assert int((raw != 0).sum()) == written  # nothing outside the run's cells changed

    back = save(views, spec, run)
    assert torch.equal(back, payload)


def test_gather_into_a_caller_buffer_and_a_single_token():
    """A bytes payload in, a bytearray out (``decode_payload``'s inputs), one token in one block."""
    spec = spec_of("gqa", torch.bfloat16)
    _, views, _ = build(spec, LAYOUTS["BLNHC"])
    run = Run.of(torch.tensor([4], dtype=torch.int64), 2, 1, BS)
    rows = torch.arange(spec.payload_layout(L).bytes_per_token, dtype=torch.uint8)
    load_(views, spec, rows.numpy().tobytes(), run)
    out = bytearray(len(rows))
    gather(views, spec, run, out)
    assert bytes(out) == rows.numpy().tobytes()


@pytest.mark.parametrize("change, why", [
    ({"dtype": torch.float8_e4m3fn}, "dtype"),
    ({"kv_quant_mode": SimpleNamespace(name="FP8_PER_TENSOR")}, "quantization"),
    ({"num_head_slots": 4}, "num_head_slots"),
    ({"state_content_bytes": 64}, "state_content_bytes"),
    ({"tokens_per_state": 2}, "tokens_per_state"),
])
def test_refused_groups_name_what_and_why(change, why):
    fields = {"num_kv_heads": 2, "head_size": 8, "dtype": torch.bfloat16, "block_size": BS, **change}
    with pytest.raises(UnsupportedLayout, match=why):
        PagedSpec.from_vllm(SimpleNamespace(**fields), mla=False)


def test_mla_needs_one_latent_row_and_its_rope_part():
    ok = {"num_kv_heads": 1, "head_size": 12, "head_size_v": 0, "dtype": torch.float16, "block_size": BS}
    with pytest.raises(UnsupportedLayout, match="rope_dim"):
        PagedSpec.from_vllm(SimpleNamespace(**ok), mla=True, rope_dim=0)
    with pytest.raises(UnsupportedLayout, match="heads"):
        PagedSpec.from_vllm(SimpleNamespace(**{**ok, "num_kv_heads": 2}), mla=True, rope_dim=4)
    spec = PagedSpec.from_vllm(SimpleNamespace(**ok), mla=True, rope_dim=4)
    assert spec.slices() == ((0, 8), (8, 12))
    assert [p.name for p in spec.payload_layout(2).parts] == ["c_kv", "k_pe"]


def test_a_view_of_another_shape_is_refused():
    spec = spec_of("gqa", torch.float16)
    with pytest.raises(UnsupportedLayout, match=r"\[B, H, N, C\]"):
        spec.check_view(torch.zeros(B, BS, 2, 16, dtype=torch.float16))  # NHD without the view


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_standard_kv_moves_rows_like_the_cpu_paged_cache_interface(layout):
    """``StandardKV`` (the worker's cache on non-CPU devices) scatters ``[L, 2, n, H, D]`` rows at
    token positions and gathers the same rows back, in every layout; the cells it writes are the
    ones ``load_`` writes for the same payload."""
    spec = spec_of("gqa", torch.float16)
    _, views, _ = build(spec, LAYOUTS[layout])
    _, ref_views, _ = build(spec, LAYOUTS[layout])
    kv = StandardKV(views, spec)
    table = torch.tensor([3, 6, 1, 0], dtype=torch.int64)
    positions = torch.arange(2, 13, dtype=torch.int64)
    rows = torch.randint(1, 50, (L, 2, len(positions), spec.num_heads, spec.head_size)).to(torch.float16)
    kv.scatter(rows, table, positions)
    assert torch.equal(kv.gather(table, positions), rows)
    load_(ref_views, spec, rows.contiguous().view(torch.uint8).view(-1), Run.of(table, 2, len(positions), BS))
    assert all(torch.equal(a, b) for a, b in zip(views, ref_views))
