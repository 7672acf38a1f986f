"""``sidecar.dataplane.spans.join``: the rows of a span's chunks joined into one payload, byte for
byte what per-part tensor views give (every layout shape: uniform GQA blocks, MLA's two widths,
a 1-byte part next to wider ones); ``pieces`` (the slices a shared-memory Fetch writes with one
gathering write) concatenate to the same bytes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sidecar.dataplane.spans import join, pieces
from sidecar.identity import KVLayout, KVPart
from sidecar.payload import decode_payload, payload_nbytes

LAYOUTS = {
    "gqa": KVLayout.gqa(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32"),
    "mla": KVLayout.mla(num_layers=2, kv_lora_rank=16, qk_rope_head_dim=4, dtype="bfloat16"),
}


def _chunk(layout: KVLayout, n: int, seed: int) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    payload = torch.randint(0, 256, (payload_nbytes(layout, n),), dtype=torch.uint8, generator=g)
    return SimpleNamespace(entry=SimpleNamespace(num_tokens=n), payload=payload)


def _reference(results, rows, layout: KVLayout, num_tokens: int) -> torch.Tensor:
    """Per part, per chunk: the rows through tensor views (what join did before it copied whole runs)."""
    out = torch.empty(payload_nbytes(layout, num_tokens), dtype=torch.uint8)
    dst = decode_payload(out, layout, num_tokens)
    srcs = [decode_payload(r.payload, layout, r.entry.num_tokens) for r in results]
    for p, view in enumerate(dst.parts):
        pos = 0
        for src, (a, b) in zip(srcs, rows):
            view.tensor[pos : pos + b - a].copy_(src.parts[p].tensor[a:b])
            pos += b - a
    dst.write_back()
    return out


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("rows", [[(4, 32)], [(0, 32)], [(5, 32), (0, 20), (0, 7)], [(31, 32), (0, 1)]])
def test_join_equals_per_part_views(name: str, rows: list[tuple[int, int]]) -> None:
    layout = LAYOUTS[name]
    sizes = [32, 20, 40][: len(rows)]
    results = [_chunk(layout, n, i) for i, n in enumerate(sizes)]
    num_tokens = sum(b - a for a, b in rows)
    got = join(results, rows, layout, num_tokens)
    assert torch.equal(got, _reference(results, rows, layout, num_tokens))
    assert b"".join(pieces(results, rows, layout)) == got.numpy().tobytes()
    if rows == [(0, 32)]:
        assert got.data_ptr() == results[0].payload.data_ptr()  # a whole chunk: no copy


def test_join_with_a_one_byte_part_between_wider_ones() -> None:
    layout = KVLayout(num_layers=2, parts=(KVPart(name="flag", shape=(3,), dtype="uint8"),
                                           KVPart(name="k", shape=(2, 4), dtype="float32", rotary=True)))
    rows = [(1, 9), (0, 5)]
    results = [_chunk(layout, 9, 0), _chunk(layout, 6, 1)]
    got = join(results, rows, layout, 13)
    assert torch.equal(got, _reference(results, rows, layout, 13))
    assert b"".join(pieces(results, rows, layout)) == got.numpy().tobytes()
