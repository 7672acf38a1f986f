"""Payload codec: layout round trips, zero-copy views, rotary parts, bad sizes."""

from __future__ import annotations

import pytest
import torch

from sidecar.identity import KVLayout, KVPart
from sidecar.payload import decode_payload, encode_payload, payload_nbytes, rotary_views

LAYOUTS = {
    "gqa": KVLayout.gqa(num_layers=3, num_kv_heads=2, head_dim=16, dtype="bfloat16"),
    "mha_fp32": KVLayout.gqa(num_layers=1, num_kv_heads=4, head_dim=8, dtype="float32"),
    "mla": KVLayout.mla(num_layers=2, kv_lora_rank=32, qk_rope_head_dim=8, dtype="float16"),
}


def _layers(layout: KVLayout, n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    from sidecar.payload import TORCH_DTYPES

    out = []
    for _ in range(layout.num_layers):
        layer = {}
        for p in layout.parts:
            t = torch.randn((n, *p.shape), generator=g) * 4
            layer[p.name] = t.to(TORCH_DTYPES[p.dtype])
        out.append(layer)
    return out


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_encode_decode_round_trip(name: str) -> None:
    layout = LAYOUTS[name]
    layers = _layers(layout, 5)
    payload = encode_payload(layers, layout)
    assert payload.dtype == torch.uint8 and payload.numel() == payload_nbytes(layout, 5)
    view = decode_payload(payload, layout, 5)
    for i, layer in enumerate(layers):
        for part_name, t in layer.items():
            torch.testing.assert_close(view.part(i, part_name), t, rtol=0, atol=0)
        assert view.layer(i).keys() == layer.keys()


def test_layout_order_is_layer_major_then_parts() -> None:
    layout = LAYOUTS["gqa"]
    view = decode_payload(torch.zeros(payload_nbytes(layout, 4), dtype=torch.uint8), layout, 4)
    assert [(v.layer, v.name) for v in view.parts] == [(layer, p) for layer in range(3) for p in ("k", "v")]
    offsets = [v.offset for v in view.parts]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert offsets[1] == 4 * 2 * 16 * 2  # one bf16 [4, 2, 16] part


def test_views_are_zero_copy_and_rotary_parts_rewrite_the_payload() -> None:
    layout = LAYOUTS["gqa"]
    payload = encode_payload(_layers(layout, 3), layout)
    before = payload.clone()
    rot = rotary_views(payload, layout, 3)
    assert [(v.layer, v.name) for v in rot] == [(0, "k"), (1, "k"), (2, "k")]
    assert all(v.zero_copy for v in rot)
    for v in rot:
        v.tensor.mul_(-1)  # what a rotation does: rewrite K in place
    view = decode_payload(payload, layout, 3)
    old = decode_payload(before, layout, 3)
    for i in range(3):
        torch.testing.assert_close(view.part(i, "k"), -old.part(i, "k"))
        torch.testing.assert_close(view.part(i, "v"), old.part(i, "v"))  # V untouched


def test_mla_rotary_part_is_k_pe() -> None:
    layout = LAYOUTS["mla"]
    rot = rotary_views(encode_payload(_layers(layout, 2), layout), layout, 2)
    assert [v.name for v in rot] == ["k_pe", "k_pe"]
    assert rot[0].tensor.shape == (2, 8) and rot[0].tensor.dtype == torch.float16


def test_decode_accepts_bytes_like() -> None:
    layout = LAYOUTS["mha_fp32"]
    layers = _layers(layout, 2)
    raw = bytearray(encode_payload(layers, layout).numpy().tobytes())
    view = decode_payload(raw, layout, 2)
    torch.testing.assert_close(view.part(0, "v"), layers[0]["v"])
    view.part(0, "v").zero_()  # a bytearray is writable: the view writes through
    assert not any(raw[view.parts[1].offset : view.parts[1].offset + 64])


def test_misaligned_part_falls_back_to_a_copy_and_writes_back() -> None:
    layout = KVLayout(
        num_layers=1,
        parts=(
            KVPart(name="scale", shape=(1,), dtype="int8"),
            KVPart(name="k", shape=(2,), dtype="bfloat16", rotary=True),
        ),
    )
    n = 3  # 3 int8 bytes put the bf16 part at an odd offset
    payload = torch.arange(payload_nbytes(layout, n), dtype=torch.uint8)
    view = decode_payload(payload, layout, n)
    (k,) = view.rotary_parts()
    assert not k.zero_copy and k.offset == 3
    k.tensor.zero_()
    assert payload[3:].tolist() != [0] * 12  # not written through yet
    view.write_back()
    assert payload[3:].tolist() == [0] * 12 and payload[:3].tolist() == [0, 1, 2]


def test_size_mismatch_is_a_value_error() -> None:
    layout = LAYOUTS["gqa"]
    with pytest.raises(ValueError, match="payload is 10 bytes"):
        decode_payload(torch.zeros(10, dtype=torch.uint8), layout, 4)
    with pytest.raises(ValueError, match="num_tokens"):
        payload_nbytes(layout, 0)
    layers = _layers(layout, 2)
    layers[1]["v"] = layers[1]["v"][:1]
    with pytest.raises(ValueError, match=r"layers\[1\]\['v'\]"):
        encode_payload(layers, layout)
