"""What the data plane hands back and keeps: result types, counters, the payload's ``aux`` record.

``aux`` rides with every stored payload (source position, prefix digest, an xxh3-128 of the
chunk's tokens, left context), so a restart over a populated disk tier rebuilds the registry
from ``list_chunks`` and verifies recovered entries by the digest before serving them.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass, field

import torch

from sidecar.registry.entry import ChunkEntry, ChunkHash, EntryState, token_digest
from sidecar.tiers import (
    ChunkMeta,
)


logger = logging.getLogger(__name__)

_AUX = struct.Struct("<BxxxIQI16s")  # version, source_pos, prefix_digest, num_tokens, token digest
_AUX_VERSION = 1
_MAX_AUX_CONTEXT = 1024 - _AUX.size


def encode_aux(entry: ChunkEntry) -> bytes:
    ctx = entry.left_context[-(_MAX_AUX_CONTEXT // 4) * 4 :] if entry.left_context else b""
    digest = entry.digest or token_digest(entry.tokens)
    return _AUX.pack(_AUX_VERSION, entry.source_pos, entry.prefix_digest, entry.num_tokens, digest) + ctx


def decode_aux(meta: ChunkMeta) -> ChunkEntry | None:
    aux = meta.aux
    if len(aux) < _AUX.size:
        return None
    version, src, prefix, ntok, digest = _AUX.unpack_from(aux)
    if version != _AUX_VERSION or ntok != meta.num_tokens:
        return None
    return ChunkEntry(
        key=ChunkHash(int.from_bytes(meta.key, "big")),
        scope=meta.scope,
        tokens=b"",
        source_pos=src,
        prefix_digest=prefix,
        left_context=bytes(aux[_AUX.size :]),
        state=EntryState.RESIDENT,
        num_tokens=ntok,
        digest=digest,
    )


@dataclass(slots=True)
class StoreOutcome:
    chunks_total: int
    chunks_registered: int
    chunks_refreshed: int
    chunks_stored: int
    bounds: tuple[int, ...]
    stored_bytes: int = 0


@dataclass(slots=True)
class FetchResult:
    """One Fetch item: ``payload`` (uint8 CPU tensor) is None for a miss."""

    index: int
    entry: ChunkEntry | None = None
    payload: torch.Tensor | None = None
    tier: str = ""
    delta: int = 0
    rotated: bool = False


@dataclass(slots=True)
class SessionRun:
    """One FetchSession run: ``num_tokens`` rows from ``chunk_offset`` of chunk ``chunk_hash``
    for session positions ``[target_pos, target_pos + num_tokens)``; ``payload`` (uint8 CPU
    tensor, ``KVLayout`` order) has its rotary parts rotated by ``delta`` unless raw."""

    index: int
    target_pos: int
    num_tokens: int
    chunk_hash: int
    chunk_offset: int
    source_pos: int
    delta: int
    rotated: bool
    tier: str
    payload: torch.Tensor


@dataclass(slots=True)
class DataPlaneCounters:
    fetched_chunks: int = 0
    fetched_bytes: int = 0
    fetch_misses: int = 0
    stored_chunks: int = 0
    stored_bytes: int = 0
    rotated_bytes: int = 0
    rotation_seconds: float = 0.0
    events: dict[str, int] = field(default_factory=dict)


