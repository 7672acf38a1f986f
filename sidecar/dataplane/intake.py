"""The checks of a Store, in one place: its header, each payload part as it arrives, its commit.

A Store stream (docs/architecture.md, "The reuse path") is a header, payload parts, a commit.
The gRPC handler decodes each message and hands it here; nothing is registered or stored until
``StoreIntake.close`` has accepted the commit and the caller runs ``DataPlane.store_payloads``
(or registers a header-only Store)::

    header   check_register_from                         header.register_from
    part 1   StoreIntake.add -> the chunking, once:       header.layout (required with parts)
               DataPlane.store_entries (layout named
               by the identity, chunks >= register_from)
             a chunk boundary, not after its last part    payload.chunk_start
             at most layout x tokens (and the message     payload.data
               limit) bytes per chunk
    part k   written into the chunk's staging
    commit   StoreIntake.close: every chunk ended,        payload.last
             counts as carried                            commit.chunks, commit.payload_bytes

Staging: a chunk whose payload comes in one part is kept as that part (a view of the received
message: no copy before the tier's own); a chunk in several parts gets one buffer of its exact
size on its first part, each part copied once into place (no growing buffer). At most the
header's chunks' bytes are ever held: a part past its chunk's size is refused as it arrives.
Every refusal is an ``InvalidArgument`` whose message starts with the field.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

from sidecar.errors import InvalidArgument
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.registry.entry import ChunkEntry

#: a chunk's payload while it arrives or once complete: the received part itself, or its staging
Staged = memoryview


def check_register_from(num_tokens: int, register_from: int) -> None:
    """A Store header's ``register_from`` lies within its tokens."""
    if register_from > num_tokens:
        raise InvalidArgument(f"header.register_from: {register_from} exceeds the sequence length {num_tokens}")


def chunk_sizes(entries: Iterable[ChunkEntry], layout: KVLayout) -> dict[int, int]:
    """Chunk start -> its payload bytes (``layout.bytes_per_token`` x its tokens)."""
    per_token = layout.bytes_per_token
    return {e.source_pos: e.num_tokens * per_token for e in entries}


def check_start(sizes: Mapping[int, int], start: int) -> int:
    """The payload bytes of the chunk at ``start``; a start that is no chunk boundary at or after
    register_from is refused."""
    expected = sizes.get(start)
    if expected is None:
        starts = sorted(sizes)
        raise InvalidArgument(
            f"payload.chunk_start: {start} is not a chunk boundary at or after register_from "
            f"(boundaries: {starts[:8]}{'...' if len(starts) > 8 else ''})"
        )
    return expected


def check_complete(start: int, nbytes: int, expected: int) -> None:
    """A chunk's whole payload is exactly its layout x tokens bytes."""
    if nbytes != expected:
        raise InvalidArgument(f"payload.data: chunk at {start} has {nbytes} bytes; its layout x tokens need {expected}")


def check_payloads(sizes: Mapping[int, int], payloads: Mapping[int, object]) -> None:
    """Every payload of ``payloads`` ({chunk start: bytes-like or slot}) names a chunk and has
    its exact size (``DataPlane.store_payloads``'s guard for callers other than the stream)."""
    for start, buf in payloads.items():
        check_complete(start, len(buf), check_start(sizes, start))


class StoreIntake:
    """One Store stream's payload parts, checked as they arrive and staged (module docstring).

    Built from a checked header (``DataPlane.store_intake``). ``layout`` is called once, when
    the first part arrives (a header-only Store never decodes it); None: the header has none.
    ``chunking(layout)``: the entries a Store of these tokens would register and the end of the
    last one (``DataPlane.store_entries``). ``max_chunk_bytes`` bounds one chunk's payload (the
    server's message limit). Not reusable: one per stream, used on the event loop only."""

    def __init__(self, chunking: Callable[[KVLayout], tuple[list[ChunkEntry], int]], tokens: np.ndarray,
                 data: bytes, identity: CacheIdentity, scope: str, register_from: int,
                 layout: Callable[[], KVLayout | None], max_chunk_bytes: int) -> None:
        check_register_from(len(tokens), register_from)
        self._chunked_by = chunking
        self.tokens = tokens
        self.data = data
        self.identity = identity
        self.scope = scope
        self.register_from = register_from
        self._layout_of = layout
        self.max_chunk_bytes = max_chunk_bytes
        self.layout: KVLayout | None = None
        #: what ``DataPlane.store_entries`` answered (set with the first part)
        self.chunked: tuple[list[ChunkEntry], int] | None = None
        self.sizes: dict[int, int] = {}
        #: chunk start -> its staged payload (complete once in ``_done``)
        self.payloads: dict[int, Staged] = {}
        self._filled: dict[int, int] = {}  # bytes received so far, per chunk still arriving
        self._done: set[int] = set()
        self.nbytes = 0

    def _chunking(self) -> None:
        layout = self._layout_of()
        if layout is None:
            raise InvalidArgument("header.layout: required when payload parts follow")
        self.chunked = self._chunked_by(layout)
        self.layout = layout
        self.sizes = chunk_sizes(self.chunked[0], layout)

    def add(self, start: int, data: memoryview, last: bool) -> None:
        """Take the next part of the chunk at ``start`` (``data``: read now or kept as it is, never
        written). Refused, and nothing kept, if it does not fit the header's chunking."""
        if self.chunked is None:
            self._chunking()
        expected = check_start(self.sizes, start)
        if start in self._done:
            raise InvalidArgument(f"payload.chunk_start: chunk at {start} received after its last part")
        have = self._filled.get(start, 0)
        n = have + len(data)
        if n > expected:
            raise InvalidArgument(
                f"payload.data: chunk at {start} has more than the {expected} bytes its layout x tokens need"
            )
        if n > self.max_chunk_bytes:
            raise InvalidArgument(f"payload.data: chunk at {start} exceeds {self.max_chunk_bytes} bytes")
        if last:
            check_complete(start, n, expected)
        staged = self.payloads.get(start)
        if staged is None and last:
            self.payloads[start] = data  # the whole chunk in one part: kept as received
        else:
            if staged is None:
                staged = self.payloads[start] = memoryview(np.empty(expected, dtype=np.uint8))
            staged[have:n] = data
        self.nbytes += len(data)
        if last:
            self._done.add(start)
            self._filled.pop(start, None)
        else:
            self._filled[start] = n

    def close(self, chunks: int, payload_bytes: int) -> dict[int, Staged]:
        """Accept the commit: every chunk that had a part got its last one, and the commit's
        counts are what the stream carried. Returns the payloads ({chunk start: bytes})."""
        if self._filled:
            raise InvalidArgument(f"payload.last: chunks at {sorted(self._filled)[:8]} never received their last part")
        if chunks != len(self.payloads):
            raise InvalidArgument(f"commit.chunks: {chunks}, but the stream carried {len(self.payloads)} payloads")
        if payload_bytes != self.nbytes:
            raise InvalidArgument(
                f"commit.payload_bytes: {payload_bytes}, but the stream carried {self.nbytes} payload bytes"
            )
        return self.payloads
