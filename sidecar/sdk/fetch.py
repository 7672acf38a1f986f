"""Fetch and FetchSession on the client: the call's request, and its answer frames assembled.

An answer is a stream of frames (``sidecar.api.frames``: each a ``FetchResponse`` or
``FetchSessionResponse`` whose payload part is left in place). A payload that came inline is
split over ``last``-terminated runs of frames and copied once, into a writable buffer the
caller owns; a payload the sidecar wrote into the call's shared-memory buffer arrives as an
offset and a length and is a view of that buffer (no copy)::

    inline:  [meta | part 0] [part 1] ... [part k, last]   -> one FetchedKV, data = joined parts
    shm:     [meta, shm_offset, shm_length, last, more=[next answers ...]]
                                                          -> FetchedKV per answer, data = lease view
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from sidecar.api.frames import FetchFrame
from sidecar.api.kv import CHUNK_OK, fetch_request
from sidecar.api.splice import fetch_session_request
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.registry.lookup_plan import FetchSpec
from sidecar.sdk.results import FetchedKV, FetchedRun
from sidecar.shm import ALIGN, Lease

if TYPE_CHECKING:
    from sidecar.rotation import RopeSpec

#: Payload buffers are carved out of numpy blocks of at least this size: numpy backs allocations
#: of 4 MiB and more with transparent huge pages, so filling one takes a few page faults instead
#: of one per 4 KiB. A fresh ``bytearray`` per chunk made the client's copy of an 8K-token Fetch
#: (32 MiB) cost ~25 ms instead of ~7 on the 2-core VM (TTFT overhead).
_PAYLOAD_BLOCK = 16 << 20


@dataclass(frozen=True, slots=True)
class FrameCall:
    """A Fetch or FetchSession call, built once and sent by every attempt: the ``request``
    (each attempt names its own shared-memory buffer in it), the ``items`` the answers index
    (None: FetchSession, answers are runs in position order) and the payload bytes the call
    is known to return (``need``; 0: unknown), which sizes the buffer."""

    request: Any
    items: Sequence[tuple[int, int] | FetchSpec] | None
    need: int


def fetch_call(
    items: Sequence[tuple[int, int] | FetchSpec],
    *,
    identity: CacheIdentity,
    layout: KVLayout,
    rope: RopeSpec | None = None,
    raw: bool = False,
    plan_identity: CacheIdentity | None = None,
    heads: tuple[int, int] | None = None,
) -> FrameCall:
    """Fetch chunk KV: ``items`` are ``(chunk_hash, target_pos)`` with ``target_pos`` the
    position of the chunk's first token in the new sequence (``seg.start -
    seg.chunk_offset``), or ``FetchSpec`` spans (``plan.fetch_spans()``: one item per hit
    segment, its KV rows in position order, ``num_tokens`` = the segment's length). Results
    (``FetchedKV``) come in item order; misses have ``ok=False``. With ``raw`` the payloads
    stay at their source position. ``plan_identity``: the items' hashes come from a Lookup under
    this other shard of ``identity`` (a tensor-parallel rank fetching its own heads of the chunks
    rank 0 planned); each is served from the same tokens' chunk under ``identity``. ``heads``:
    ``(start, count)``, only those KV heads of each payload (a worker of another tensor-parallel
    cut fetching its share: the payloads are ``dataplane.cuts.heads_layout(layout, count)``).
    Idempotent (retried when transient)."""
    return FrameCall(fetch_request(identity, layout, rope, items, raw, plan_identity, heads), items,
                     fetch_need(items, layout))


def fetch_session_call(
    session_id: str,
    *,
    start: int = 0,
    end: int | None = None,
    layout: KVLayout,
    rope: RopeSpec | None = None,
    raw: bool = False,
) -> FrameCall:
    """The KV of positions ``[start, end)`` (``end`` None: the whole session) of a held
    session's committed layout, as ``FetchedRun``s tiling the range in position order:
    each row comes from its canonical stored copy, rotated once to its position (with
    ``raw``, left at its source position). FailedPrecondition when positions in the range
    have no stored KV (Store them first). Idempotent (retried when transient)."""
    return FrameCall(fetch_session_request(session_id, start, end, layout, rope, raw), None,
                     session_need(start, end, layout))


def fetch_need(items: Sequence[tuple[int, int] | FetchSpec], layout: KVLayout) -> int:
    """Payload bytes span items will return (plain items: unknown until answered), with room
    for the sidecar's alignment of each payload in a shared-memory buffer."""
    rows = sum(it.num_tokens for it in items if isinstance(it, FetchSpec))
    return rows * layout.bytes_per_token + ALIGN * len(items) if rows else 0


def session_need(start: int, end: int | None, layout: KVLayout) -> int:
    """Payload bytes of a FetchSession range, with alignment room for a run per row at most."""
    return (end - start) * (layout.bytes_per_token + ALIGN) if end is not None and end > start else 0


def _item_hash(it: tuple[int, int] | FetchSpec) -> int:
    return it.chunk_hash if isinstance(it, FetchSpec) else it[0]


class PayloadArena:
    """Writable payload buffers for one Fetch call, carved from shared numpy blocks (a block is
    freed when no buffer cut from it is referenced any more)."""

    def __init__(self) -> None:
        self._block = memoryview(bytearray())
        self._off = 0

    def take(self, n: int) -> memoryview:
        if self._off + n > len(self._block):
            self._block = memoryview(np.empty(max(n, _PAYLOAD_BLOCK), dtype=np.uint8))
            self._off = 0
        out = self._block[self._off : self._off + n]
        self._off += n
        return out


class FetchAssembler:
    """Joins one attempt's answer frames into ``FetchedKV`` results, in item order (or, without
    ``items``, a FetchSession stream into ``FetchedRun`` results, in position order). A payload
    the sidecar wrote into the call's shared-memory ``lease`` is a view of it (no copy); one
    that came inline is copied once, into a writable buffer the caller owns (``PayloadArena``)."""

    def __init__(self, items: Sequence[tuple[int, int] | FetchSpec] | None = None, lease: Lease | None = None) -> None:
        self.items = items
        self.lease = lease
        self.out: list[Any] = []
        self._first: FetchFrame | None = None
        self._parts: list[memoryview] = []
        self._arena = PayloadArena()

    def feed(self, msg: FetchFrame) -> None:
        if self._first is None:
            self._first = msg
        self._parts.append(msg.data)
        if msg.last:
            f = self._first
            if msg.shm_length:
                if self.lease is None:
                    raise ValueError("shm_length: a payload in shared memory, but this call named no buffer")
                data = self.lease.payload(msg.shm_offset, msg.shm_length)
            else:
                data = self._arena.take(sum(len(p) for p in self._parts))
                off = 0
                for p in self._parts:
                    data[off : off + len(p)] = p
                    off += len(p)
                if self.lease is not None:
                    self.lease.inline += off
            if self.items is None:
                self.out.append(
                    FetchedRun(
                        index=f.index, target_pos=f.target_pos, num_tokens=f.num_tokens, chunk_hash=f.chunk_hash,
                        chunk_offset=f.chunk_offset, source_pos=f.source_pos, delta=f.delta, rotated=f.rotated,
                        tier=f.tier, version=f.version, data=data,
                    )
                )
            else:
                self.out.append(
                    FetchedKV(
                        index=f.index, chunk_hash=_item_hash(self.items[f.index]), ok=f.status == CHUNK_OK,
                        num_tokens=f.num_tokens, source_pos=f.source_pos, delta=f.delta, rotated=f.rotated,
                        tier=f.tier, data=data,
                    )
                )
            self._first = None
            self._parts = []
        for nxt in msg.more or ():
            self.feed(nxt)
