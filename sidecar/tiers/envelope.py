"""The stored object: a fixed 4 KiB header (metadata + checksums) followed by the payload.

Every tier stores the same bytes, so a demotion or promotion moves one buffer and never
re-encodes. The header is fixed-size so any reader can size a load from the header alone (RESP
gets need the exact size) and the payload starts page-aligned (typed views, O_DIRECT)::

    offset  size
    0       8     magic b"KVSCHK01"
    8       4     header version (1)
    12      4     meta_len: bytes of the JSON metadata below
    16      8     payload_nbytes
    24      8     payload checksum: xxh3-64 of the payload
    32      8     header checksum: xxh3-64 of bytes [0, 32) + the metadata
    40      m     metadata, UTF-8 JSON (key, tenant, scope, layout, tokens, position, aux)
    40+m    ...   zero padding up to 4096
    4096    n     payload

``parse_header`` raises ``CorruptChunkError`` for anything inconsistent (magic, version, header
checksum, lengths); ``payload_ok`` checks the payload checksum.
"""

from __future__ import annotations

import base64
import json
import struct

import numpy as np
import torch
import xxhash

from sidecar.tiers.types import ChunkKey, ChunkMeta

MAGIC = b"KVSCHK01"
VERSION = 1
HEADER_NBYTES = 4096
MAX_AUX_BYTES = 1024
MAX_TEXT_CHARS = 256
_FIXED = struct.Struct("<8sIIQQQ")
_META_MAX = HEADER_NBYTES - _FIXED.size


class CorruptChunkError(Exception):
    """A stored object failed an integrity check (internal: the store turns it into a miss)."""


def object_nbytes(payload_nbytes: int) -> int:
    """Bytes of the stored object holding a payload of ``payload_nbytes``."""
    return HEADER_NBYTES + payload_nbytes


def checksum(payload: torch.Tensor) -> int:
    """xxh3-64 of a 1-D uint8 CPU tensor (~20-30 GB/s; reads the memory once)."""
    return xxhash.xxh3_64_intdigest(memoryview(payload.numpy()))


def meta_json(meta: ChunkMeta) -> bytes:
    """The metadata part of the header (also the body of a disk index record)."""
    doc = {
        "k": meta.key.hex(),
        "t": meta.tenant,
        "s": meta.scope,
        "l": meta.layout_fingerprint,
        "n": meta.num_tokens,
        "p": meta.source_position,
        "c": meta.created_at,
        "a": base64.b64encode(meta.aux).decode("ascii"),
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def write_header(header: torch.Tensor, meta: ChunkMeta) -> None:
    """Fill ``header`` (a 1-D uint8 CPU tensor of ``HEADER_NBYTES``) for ``meta``."""
    body = meta_json(meta)
    if len(body) > _META_MAX:
        raise ValueError(f"chunk metadata is {len(body)} bytes, at most {_META_MAX} fit the header")
    fixed = _FIXED.pack(MAGIC, VERSION, len(body), meta.payload_nbytes, meta.checksum, 0)
    digest = xxhash.xxh3_64_intdigest(fixed[:32] + body)
    arr = header.numpy()
    arr[: _FIXED.size] = np.frombuffer(fixed[:32] + struct.pack("<Q", digest), dtype=np.uint8)
    arr[_FIXED.size : _FIXED.size + len(body)] = np.frombuffer(body, dtype=np.uint8)
    arr[_FIXED.size + len(body) :] = 0


def encoded_header(meta: ChunkMeta) -> torch.Tensor:
    out = torch.empty(HEADER_NBYTES, dtype=torch.uint8)
    write_header(out, meta)
    return out


def parse_header(header: torch.Tensor | bytes | memoryview) -> ChunkMeta:
    """Metadata of a stored object from its first ``HEADER_NBYTES`` bytes."""
    raw = bytes(header.numpy()[:HEADER_NBYTES]) if isinstance(header, torch.Tensor) else bytes(header[:HEADER_NBYTES])
    if len(raw) < HEADER_NBYTES:
        raise CorruptChunkError(f"header truncated to {len(raw)} bytes")
    magic, version, meta_len, payload_len, payload_sum, header_sum = _FIXED.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        raise CorruptChunkError("bad magic or version")
    if meta_len > _META_MAX:
        raise CorruptChunkError("metadata length out of range")
    body = raw[_FIXED.size : _FIXED.size + meta_len]
    if xxhash.xxh3_64_intdigest(raw[:32] + body) != header_sum:
        raise CorruptChunkError("header checksum mismatch")
    return meta_from_json(body, payload_nbytes=int(payload_len), checksum=int(payload_sum))


def meta_from_json(body: bytes, *, payload_nbytes: int, checksum: int) -> ChunkMeta:
    """Inverse of ``meta_json``; raises ``CorruptChunkError`` for unreadable metadata."""
    try:
        doc = json.loads(body)
        return ChunkMeta(
            key=ChunkKey(bytes.fromhex(doc["k"])),
            tenant=doc["t"],
            scope=doc["s"],
            layout_fingerprint=doc["l"],
            num_tokens=int(doc["n"]),
            payload_nbytes=payload_nbytes,
            source_position=int(doc["p"]),
            aux=base64.b64decode(doc["a"]),
            checksum=checksum,
            created_at=float(doc["c"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptChunkError(f"unreadable metadata: {exc}") from exc


def payload_ok(obj: torch.Tensor, meta: ChunkMeta) -> bool:
    """Whether a stored object (1-D uint8 CPU tensor) carries ``meta``'s payload intact."""
    if obj.numel() != object_nbytes(meta.payload_nbytes):
        return False
    return checksum(obj[HEADER_NBYTES:]) == meta.checksum
