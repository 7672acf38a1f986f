"""``sidecar.payload``: the engine clients' views agree with the codec byte for byte."""

from __future__ import annotations

import pytest
import torch

from sidecar.identity import KVLayout
from sidecar.payload import decode_payload, encode_payload, is_stacked, stacked_payload, stacked_view


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_stacked_view_is_the_codec_layout(dtype):
    """``stacked_view`` of an ``encode_payload`` payload is ``[L, 2, n, H, D]`` with K then V of
    every layer, without a copy; ``stacked_payload`` gives the same bytes back."""
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    layout = KVLayout.gqa(num_layers=3, num_kv_heads=2, head_dim=8, dtype=name)
    n = 5
    g = torch.Generator().manual_seed(0)
    layers = [{"k": torch.randn(n, 2, 8, generator=g).to(dtype), "v": torch.randn(n, 2, 8, generator=g).to(dtype)}
              for _ in range(3)]
    data = encode_payload(layers, layout)
    view = stacked_view(data, layout, n)
    assert view.shape == (3, 2, n, 2, 8) and view.dtype == dtype
    assert view.data_ptr() == data.data_ptr()  # a view of the payload, not a copy
    parts = decode_payload(data, layout, n)
    for li in range(3):
        assert torch.equal(view[li, 0], layers[li]["k"]) and torch.equal(view[li, 1], layers[li]["v"])
        assert torch.equal(view[li, 0], parts.part(li, "k"))
    assert bytes(stacked_payload(view)) == bytes(data.numpy())
    assert bytes(stacked_view(bytearray(bytes(data.numpy())), layout, n).contiguous().view(torch.uint8).numpy()) \
        == bytes(data.numpy())  # from a bytes-like buffer too


def test_stacked_view_refuses_what_it_cannot_view():
    """Layouts whose parts differ (MLA) are read part by part; a wrong size is a caller mistake."""
    mla = KVLayout.mla(num_layers=2, kv_lora_rank=16, qk_rope_head_dim=8)
    assert not is_stacked(mla) and is_stacked(KVLayout.gqa(num_layers=1, num_kv_heads=1, head_dim=4))
    with pytest.raises(ValueError, match="decode_payload"):
        stacked_view(bytes(mla.bytes_per_token * 3), mla, 3)
    gqa = KVLayout.gqa(num_layers=1, num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="needs"):
        stacked_view(bytes(gqa.bytes_per_token * 3 + 2), gqa, 3)
