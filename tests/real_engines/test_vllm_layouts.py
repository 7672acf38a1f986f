"""The worker's standard-layout row copies on caches built by vLLM's own code (no engine, no GPU).

Every ``KVCacheLayout`` vLLM defines, GQA and MLA, bf16 / fp16 / fp32: the flat buffer, its
``KVCacheTensor`` strides (``compute_layout_strides``, as ``kv_cache_utils`` computes them) and the
per-layer views (``create_kv_cache_views``) are vLLM's; the reference addresses each element by
vLLM's byte strides on the flat buffer. The main suite runs the same checks on views built from the
permutation table alone (tests/clients/vllm/test_layouts.py).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from clients.vllm.layouts import LatentKV, PagedSpec, StandardKV  # noqa: E402

L, B, BS = 3, 6, 16


def vllm_cache(vspec, layout: KVCacheLayout):
    layer_stride, block_stride, *_ = compute_layout_strides(vspec, B, L, layout)
    size = L * B * vspec.page_size_bytes
    tensor = KVCacheTensor(size=size, layers=[f"layer.{i}" for i in range(L)], layer_stride=layer_stride,
                           block_stride=block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    views = create_kv_cache_views(raw, vspec, B, layout, tensor)
    return raw, views, compute_layout_strides(vspec, B, L, layout, fixed_strides=(layer_stride, block_stride,
                                                                                   None, None, None))


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_rows_land_where_vllm_addresses_them(layout, dtype, mla):
    """``StandardKV`` / ``LatentKV`` ``scatter`` (the worker's loads) puts each row's cell content
    at vLLM's byte address of its (layer, block, head, token), and ``gather`` (its Stores) reads
    the same rows back."""
    if mla:
        vspec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=24, dtype=dtype)
        spec = PagedSpec.from_vllm(vspec, mla=True, rope_dim=8)
    else:
        vspec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=dtype)
        spec = PagedSpec.from_vllm(vspec, mla=False)
    raw, views, byte_strides = vllm_cache(vspec, layout)
    cache = (LatentKV if mla else StandardKV)(views, spec)
    table = torch.tensor([4, 1, 5], dtype=torch.int64)
    start, n = 5, 30
    positions = torch.arange(start, start + n)
    shape = (L, n, spec.content) if mla else (L, 2, n, spec.num_heads, spec.head_size)
    rows = torch.randint(1, 100, shape).to(dtype)
    cache.scatter(rows, table, positions)

    item = dtype.itemsize
    flat = raw.view(torch.uint8)
    assert byte_strides[4] == 1  # C counts bytes and is innermost in every layout
    written = 0
    for layer in range(L):
        for i in range(n):
            pos = start + i
            block, tok = table[pos // BS].item(), pos % BS
            for h in range(spec.num_heads):
                at = layer * byte_strides[0] + block * byte_strides[1] + h * byte_strides[2] + tok * byte_strides[3]
                got = flat[at: at + spec.content * item].view(dtype)
                want = rows[layer, i] if mla else torch.cat((rows[layer, 0, i, h], rows[layer, 1, i, h]))
                assert torch.equal(got, want), (layout.name, layer, i, h)
                written += spec.content * item
    assert int((flat != 0).sum()) <= written
    assert torch.equal(cache.gather(table, positions), rows)
