"""Fetch frames: how a Fetch / FetchSession answer travels, encoder and decoder side by side.

A payload of several MiB is sent in ``part_bytes`` parts; each part is one stream message, the
protobuf encoding of a ``FetchResponse`` (or ``FetchSessionResponse``) whose ``data`` field (8)
holds the part. The encoder writes that encoding by hand (metadata, then the tag, the length and
the payload slice, one copy); the decoder reads it back without copying ``data``. Both follow the
standard protobuf wire format, so a raw-gRPC client that parses with ``sidecar_pb2`` reads the
same frames (``tests/api/test_frames.py`` holds the two to each other and to protobuf)::

    frame = FetchResponse(index, status, ..., last) || 0x42 || varint(len) || payload[off:end]

A client that passes a shared-memory buffer gets small answers as metadata only
(``shm_offset``, ``shm_length``), batched into one message (``more``) by ``Framer``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sidecar.v1 import sidecar_pb2 as pb

if TYPE_CHECKING:
    from sidecar.shm import ShmWriter

__all__ = ["FETCH_METHOD", "FETCH_SESSION_METHOD", "FetchFrame", "Framer", "fetch_frames", "parse_fetch_frame",
           "serialize_fetch"]


def serialize_fetch(msg: "pb.FetchResponse | pb.FetchSessionResponse | bytes") -> bytes:
    """The server's response serializer for Fetch / FetchSession: frames arrive pre-encoded."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


# Hand-written on purpose: protobuf's Python API cannot serialize a message around an
# already-encoded multi-MiB bytes field without copying it; a tag + varint header is all it takes.
_DATA_TAG = bytes([(8 << 3) | 2])  # FetchResponse.data / FetchSessionResponse.data: field 8, length-delimited


def varint(n: int) -> bytes:
    """``n`` as a protobuf base-128 varint."""
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def fetch_frames(
    meta: pb.FetchResponse | pb.FetchSessionResponse, payload: memoryview, part_bytes: int
) -> Iterator[bytes]:
    """Wire frames of one chunk (or FetchSession run): ``meta`` (without data) on the first
    part, ``index`` and ``last`` on every part. Each frame is the protobuf encoding of a message
    of ``meta``'s type (fields may appear in any order), built with one copy of the payload."""
    n = len(payload)
    off = 0
    first = True
    cls = type(meta)
    while True:
        end = min(n, off + part_bytes)
        head = meta if first else cls(index=meta.index)
        head.last = end >= n
        yield b"".join((head.SerializeToString(), _DATA_TAG, varint(end - off), payload[off:end]))
        first = False
        off = end
        if off >= n:
            return


class Framer:
    """The frames of one Fetch / FetchSession answer. A payload goes into the caller's
    shared-memory buffer when there is one and it fits; such answers (and misses) are held and
    sent several to a message (``more``: up to ``_BATCH_ITEMS``), since a stream message costs
    as much as writing half a MiB. Any other payload is sent inline in ``part_bytes`` parts,
    after the held answers, so answers keep their order."""

    _BATCH_ITEMS = 64

    def __init__(self, part_bytes: int, shm: ShmWriter | None) -> None:
        self.part_bytes = part_bytes
        self.shm = shm
        self._held: list[pb.FetchResponse | pb.FetchSessionResponse] = []

    def add(self, meta: pb.FetchResponse | pb.FetchSessionResponse,
            payload: memoryview | list[memoryview] | None) -> list[bytes]:
        """Frames to send now for one answer (``payload`` None: a miss, metadata only; a list:
        the payload's pieces in order, only with a buffer)."""
        if self.shm is None:
            return [meta.SerializeToString()] if payload is None else list(fetch_frames(meta, payload, self.part_bytes))
        if payload is not None:
            at = self.shm.put(payload)
            if at is None:  # inline, after what is held
                whole = memoryview(b"".join(payload)) if isinstance(payload, list) else payload
                return [*self.flush(), *fetch_frames(meta, whole, self.part_bytes)]
            meta.shm_offset, meta.shm_length = at
            meta.last = True
        self._held.append(meta)
        return self.flush() if len(self._held) >= self._BATCH_ITEMS else []

    def flush(self) -> list[bytes]:
        if not self._held:
            return []
        head, *rest = self._held
        head.more.extend(rest)
        self._held = []
        return [head.SerializeToString()]


FETCH_METHOD = "/sidecar.v1.KVSidecar/Fetch"
FETCH_SESSION_METHOD = "/sidecar.v1.KVSidecar/FetchSession"


@dataclass(slots=True)
class FetchFrame:
    """A FetchResponse or FetchSessionResponse (same field numbers where they share a meaning)
    decoded without copying ``data`` (a memoryview into the received frame)."""

    index: int = 0
    status: int = 0
    num_tokens: int = 0
    source_pos: int = 0
    delta: int = 0
    rotated: bool = False
    tier: str = ""
    data: memoryview = memoryview(b"")
    last: bool = False
    target_pos: int = 0  # FetchSessionResponse only (fields 10..13)
    chunk_hash: int = 0
    chunk_offset: int = 0
    version: int = 0
    shm_offset: int = 0  # shm_length > 0: the payload is in the call's shared-memory buffer
    shm_length: int = 0
    more: "list[FetchFrame] | None" = None  # the next answers, sent in this message (shared memory)


def _readvarint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def parse_fetch_frame(frame: bytes | memoryview) -> FetchFrame:
    """Decode a FetchResponse or FetchSessionResponse (standard protobuf wire format, any field
    order) with its payload left in place: multi-MiB parts are not copied by a protobuf parse
    and a field access."""
    buf = memoryview(frame)
    out = FetchFrame()
    pos, n = 0, len(buf)
    while pos < n:
        tag, pos = _readvarint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _readvarint(buf, pos)
            if field == 1:
                out.index = value
            elif field == 2:
                out.status = value
            elif field == 3:
                out.num_tokens = value
            elif field == 4:
                out.source_pos = value
            elif field == 5:
                out.delta = (value >> 1) ^ -(value & 1)  # sint64 zigzag
            elif field == 6:
                out.rotated = bool(value)
            elif field == 9:
                out.last = bool(value)
            elif field == 10:
                out.target_pos = value
            elif field == 12:
                out.chunk_offset = value
            elif field == 13:
                out.version = value
            elif field == 14:
                out.shm_offset = value
            elif field == 15:
                out.shm_length = value
        elif wire == 2:
            size, pos = _readvarint(buf, pos)
            if field == 7:
                out.tier = bytes(buf[pos : pos + size]).decode()
            elif field == 8:
                out.data = buf[pos : pos + size]
            elif field == 16:
                if out.more is None:
                    out.more = []
                out.more.append(parse_fetch_frame(buf[pos : pos + size]))
            pos += size
        elif wire == 1:
            if field == 11:
                out.chunk_hash = int.from_bytes(buf[pos : pos + 8], "little")
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"FetchResponse: unsupported wire type {wire}")
    return out
