"""What the data plane hands back and keeps: result types, counters, the payload's ``aux`` record.

``aux`` rides with every stored payload (source position, prefix digest, an xxh3-128 of the
chunk's tokens, the chunk a copy computed after another left context is a copy of, left
context), so a restart over a populated disk tier rebuilds the registry from ``list_chunks``
(each chunk's copies bounded again) and verifies recovered entries by the digest before
serving them.
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

#: version 1: version, source_pos, prefix_digest, num_tokens, token digest; version 2 adds the
#: chunk key a copy is a copy of (``ChunkEntry.base_key``; 0 for a canonical copy)
_AUX_V1 = struct.Struct("<BxxxIQI16s")
_AUX = struct.Struct("<BxxxIQI16sQ")
_AUX_VERSION = 2
_MAX_AUX_CONTEXT = 1024 - _AUX.size


def encode_aux(entry: ChunkEntry) -> bytes:
    ctx = entry.left_context[-(_MAX_AUX_CONTEXT // 4) * 4 :] if entry.left_context else b""
    digest = entry.digest or token_digest(entry.tokens)
    return _AUX.pack(_AUX_VERSION, entry.source_pos, entry.prefix_digest, entry.num_tokens, digest,
                     entry.base_key) + ctx


def decode_aux(meta: ChunkMeta) -> ChunkEntry | None:
    """The registry entry a stored payload's ``aux`` describes (RESIDENT, tokens unknown until
    verified), or None when it is unreadable. Reads both versions (payloads a sidecar before
    copies stored: canonical copies)."""
    aux = meta.aux
    if len(aux) < _AUX_V1.size:
        return None
    version = aux[0]
    if version == _AUX_VERSION and len(aux) >= _AUX.size:
        _, src, prefix, ntok, digest, base = _AUX.unpack_from(aux)
        ctx = aux[_AUX.size :]
    elif version == 1:
        _, src, prefix, ntok, digest = _AUX_V1.unpack_from(aux)
        base, ctx = 0, aux[_AUX_V1.size :]
    else:
        return None
    if ntok != meta.num_tokens:
        return None
    return ChunkEntry(
        key=ChunkHash(int.from_bytes(meta.key, "big")),
        scope=meta.scope,
        tokens=b"",
        source_pos=src,
        prefix_digest=prefix,
        left_context=bytes(ctx),
        state=EntryState.RESIDENT,
        num_tokens=ntok,
        digest=digest,
        base_key=base,
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


