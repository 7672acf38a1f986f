"""Store frames: how a Store's payload parts travel, encoder and decoder side by side.

A Store is a client stream of ``StoreRequest`` messages: the header, the payload parts, the
commit (docs/architecture.md, "The reuse path"). A payload part of several MiB is the protobuf
encoding of ``StoreRequest{payload: PayloadPart}``; the SDK writes it by hand (the part's
metadata, then the tag, the length and the payload slice: the payload's one copy on this side)
and the server reads it back with ``data`` left in the received message (a memoryview, no
copy). Both follow the standard protobuf wire format, so a raw-gRPC client that sends
``sidecar_pb2.StoreRequest`` messages is read the same (``tests/server/test_store_frames.py``
holds the two to each other and to protobuf)::

    frame = 0x12 || varint(len(part)) || part                       StoreRequest.payload (field 2)
    part  = 0x08 varint(chunk_start) || [0x18 0x01] || 0x12 varint(n) || payload[off:off + n]
            PayloadPart.chunk_start (1)   .last (3)     .data (2)

Headers and commits are small: they are protobuf messages on both sides.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from sidecar.api.frames import varint
from sidecar.api.kv import PART_BYTES, identity_to_wire, layout_to_wire, payload_view, tokens_to_wire
from sidecar.errors import InvalidArgument
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.v1 import sidecar_pb2 as pb

__all__ = ["STORE_METHOD", "StoreFrames", "StorePart", "parse_store_request", "serialize_store", "store_frames"]

STORE_METHOD = "/sidecar.v1.KVSidecar/Store"
_TYPE = pb.StoreRequest.DESCRIPTOR.full_name

# Hand-written on purpose: protobuf's Python API copies a bytes field on construction, on
# serialization, on parsing and on each read; a tag and a varint are all a part needs.
_PAYLOAD_TAG = 0x12  # StoreRequest.payload: field 2, length-delimited
_START_TAG = 0x08  # PayloadPart.chunk_start: field 1, varint
_DATA_TAG = 0x12  # PayloadPart.data: field 2, length-delimited
_LAST_TAG = 0x18  # PayloadPart.last: field 3, varint
_LAST = bytes((_LAST_TAG, 1))


def part_frame(chunk_start: int, data: memoryview, last: bool) -> bytes:
    """The wire frame of one payload part (``StoreRequest{payload}``): ``data`` copied once."""
    head = b"".join((bytes((_START_TAG,)), varint(chunk_start), _LAST if last else b"",
                     bytes((_DATA_TAG,)), varint(len(data))))
    return b"".join((bytes((_PAYLOAD_TAG,)), varint(len(head) + len(data)), head, data))


class StoreFrames:
    """The client stream of one Store, as wire frames (``bytes``), made as the stream is read:
    each part is copied from the caller's payload into its frame when gRPC asks for it, so a
    Store holds one frame at a time, not a copy of every payload. Iterable again (a retried
    call sends the same stream)."""

    def __init__(self, header: pb.StoreHeader, views: Sequence[tuple[int, memoryview]], part_bytes: int) -> None:
        if part_bytes <= 0:
            raise ValueError(f"part_bytes: must be positive, got {part_bytes}")
        self.header = header
        self.views = views
        self.part_bytes = part_bytes
        total = sum(len(mv) for _, mv in views)
        self._head = pb.StoreRequest(header=header).SerializeToString()
        self._commit = pb.StoreRequest(commit=pb.StoreCommit(chunks=len(views), payload_bytes=total)).SerializeToString()

    def __iter__(self) -> Iterator[bytes]:
        yield self._head
        step = self.part_bytes
        for start, mv in self.views:
            n = len(mv)
            off = 0
            while True:
                end = min(n, off + step)
                yield part_frame(start, mv[off:end], end >= n)
                off = end
                if off >= n:
                    break
        yield self._commit


def store_frames(
    tokens: np.ndarray | Sequence[int] | bytes,
    identity: CacheIdentity,
    register_from: int = 0,
    shared: bool = False,
    layout: KVLayout | None = None,
    payloads: Mapping[int, object] | None = None,
    part_bytes: int = PART_BYTES,
) -> StoreFrames:
    """The client stream of one Store (``sidecar.api.kv.store_messages``'s messages, as wire
    frames): a header (the whole sequence from position 0, chunks registered from
    ``register_from``), then, with ``layout`` and ``payloads`` ({chunk start: KV bytes at that
    chunk's positions, ``KVLayout`` order}), each payload in parts of at most ``part_bytes``
    in chunk order, the last part of each marked ``last``; then the commit. A payload is read
    where it lies (``payload_view``: no copy of a contiguous CPU array or tensor) until its
    parts are framed."""
    header = pb.StoreHeader(
        tokens=tokens_to_wire(tokens), identity=identity_to_wire(identity), register_from=register_from, shared=shared
    )
    if not payloads:
        return StoreFrames(header, (), part_bytes)
    if layout is None:
        raise ValueError("layout: required with payloads")
    header.layout.CopyFrom(layout_to_wire(layout))
    return StoreFrames(header, [(start, payload_view(payloads[start])) for start in sorted(payloads)], part_bytes)


def serialize_store(msg: pb.StoreRequest | bytes) -> bytes:
    """The client's request serializer for Store: frames arrive encoded, messages are encoded."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


# ---------------------------------------------------------------------------------- decoder


@dataclass(slots=True)
class StorePart:
    """A ``PayloadPart`` decoded without copying ``data`` (a memoryview into the received frame)."""

    chunk_start: int
    data: memoryview
    last: bool


class _Other(Exception):
    """Not the one-part form this decoder reads in place: protobuf parses the frame."""


def _readvarint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while pos < end:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            break
    raise _Other


def _truncated(field: str, declared: int, present: int) -> InvalidArgument:
    return InvalidArgument(f"{field}: declares {declared} bytes but {present} follow "
                           f"(a truncated {_TYPE} message)")


def parse_store_request(frame: bytes) -> StorePart | pb.StoreRequest:
    """The server's request deserializer for Store: a message that is one payload part (what
    the SDK and protobuf encoders send) as a ``StorePart`` whose ``data`` is a view of
    ``frame``; any other message (a header, a commit, an empty or unusual one) as protobuf
    parses it (a payload then copied once, as protobuf reads it). Raises ``InvalidArgument``
    naming the field for a part cut short (its length past the end), protobuf's ``DecodeError``
    for other bytes that are not a ``StoreRequest``."""
    buf = memoryview(frame)
    n = len(buf)
    if n and buf[0] == _PAYLOAD_TAG:
        try:
            return _parse_part(buf, n)
        except _Other:
            pass
    msg = pb.StoreRequest.FromString(frame)
    if msg.WhichOneof("msg") == "payload":
        p = msg.payload
        return StorePart(p.chunk_start, memoryview(p.data), p.last)
    return msg


def _parse_part(buf: memoryview, n: int) -> StorePart:
    size, pos = _readvarint(buf, 1, n)
    end = pos + size
    start, last, data = 0, False, memoryview(b"")
    while pos < min(end, n):
        tag, pos = _readvarint(buf, pos, n)
        if tag == _DATA_TAG:
            length, pos = _readvarint(buf, pos, n)
            if pos + length > min(end, n):
                raise _truncated("payload.data", length, min(end, n) - pos)
            data = buf[pos : pos + length]
            pos += length
        elif tag == _START_TAG:
            value, pos = _readvarint(buf, pos, n)
            start = value & 0xFFFFFFFF  # uint32, as protobuf reads a wider varint
        elif tag == _LAST_TAG:
            value, pos = _readvarint(buf, pos, n)
            last = value != 0
        else:
            raise _Other  # an unknown field: protobuf's rules apply
    if end > n:
        raise _truncated("payload", size, n - (end - size))
    if pos != end:
        raise _Other
    return StorePart(start, data, last)
