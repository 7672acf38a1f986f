"""Stored-object header: round trip and every integrity check."""

from __future__ import annotations

import pytest
import torch

from sidecar.tiers.envelope import (
    HEADER_NBYTES,
    CorruptChunkError,
    checksum,
    object_nbytes,
    parse_header,
    payload_ok,
    write_header,
)
from sidecar.tiers.types import ChunkKey, ChunkMeta


def _object(payload: torch.Tensor) -> tuple[torch.Tensor, ChunkMeta]:
    meta = ChunkMeta(
        key=ChunkKey(b"\x00\x01key"),
        tenant="tenant-a",
        scope="shared",
        layout_fingerprint="abc123",
        num_tokens=7,
        payload_nbytes=payload.numel(),
        source_position=96,
        aux=b"\xff" * 40,
        checksum=checksum(payload),
        created_at=1234.5,
    )
    obj = torch.empty(object_nbytes(payload.numel()), dtype=torch.uint8)
    obj[HEADER_NBYTES:] = payload
    write_header(obj[:HEADER_NBYTES], meta)
    return obj, meta


def test_header_round_trip() -> None:
    obj, meta = _object(torch.arange(1000, dtype=torch.int32).view(torch.uint8))
    assert parse_header(obj) == meta
    assert parse_header(bytes(obj[:HEADER_NBYTES].numpy())) == meta
    assert payload_ok(obj, meta)


@pytest.mark.parametrize("offset", [0, 9, 20, 30, 45, HEADER_NBYTES - 1])
def test_any_header_byte_flip_is_detected(offset: int) -> None:
    obj, _ = _object(torch.ones(64, dtype=torch.uint8))
    obj[offset] ^= 0x40
    if offset == HEADER_NBYTES - 1:
        parse_header(obj)  # padding is not covered: flipping it is harmless
        return
    with pytest.raises(CorruptChunkError):
        parse_header(obj)


def test_payload_flip_and_truncation_are_detected() -> None:
    obj, meta = _object(torch.zeros(4096, dtype=torch.uint8))
    bad = obj.clone()
    bad[HEADER_NBYTES + 100] = 1
    assert not payload_ok(bad, meta)
    assert not payload_ok(obj[:-1], meta)
    with pytest.raises(CorruptChunkError, match="truncated"):
        parse_header(b"\x00" * 100)
