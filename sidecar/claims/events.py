"""Claim events: a bounded buffer with per-watcher cursors (docs/claims.md).

``emit`` is O(1) and never waits: the buffer is a ring of ``capacity`` events numbered by a
global sequence. A watcher reads from its own cursor; one that falls behind the oldest retained
event is dropped and told how many events it missed (``gap``), so a slow watcher never holds
back the server or other watchers. Counts by event type are kept for the metrics edge.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from sidecar.claims.model import CapacityProof

EVENT_TYPES = (
    "claim_accepted", "claim_materialized", "claim_demoted", "claim_expired", "claim_harmed", "claim_released",
    "claim_refused", "active_admitted", "active_deferred", "active_refused",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ClaimEvent:
    seq: int
    event: str
    tenant: str
    claim_id: str = ""
    request_id: str = ""
    time: float = 0.0
    mode: str = ""
    blocking_claim_ids: tuple[str, ...] = ()
    proof: CapacityProof | None = None
    leading_tokens: int = 0
    predicate_min_tokens: int = 0
    reason: str = ""


@dataclass(slots=True)
class EventLog:
    capacity: int
    _buf: deque = field(init=False)
    _next: int = field(init=False, default=1)
    _wake: asyncio.Event | None = field(init=False, default=None)
    counts: Counter = field(init=False, default_factory=Counter)
    watchers_dropped: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._buf = deque(maxlen=self.capacity)

    @property
    def next_seq(self) -> int:
        return self._next

    @property
    def oldest_seq(self) -> int:
        return self._buf[0].seq if self._buf else self._next

    def emit(self, event: str, tenant: str, **fields) -> ClaimEvent:
        ev = ClaimEvent(seq=self._next, event=event, tenant=tenant, time=time.time(), **fields)
        self._next += 1
        self._buf.append(ev)
        self.counts[event] += 1
        if self._wake is not None:
            self._wake.set()
            self._wake = None
        return ev

    def read(self, cursor: int) -> tuple[int, list[ClaimEvent]]:
        """(events missed before the oldest retained one, retained events with seq >= cursor)."""
        oldest = self.oldest_seq
        gap = max(0, oldest - cursor)
        start = max(cursor, oldest) - oldest
        if start >= len(self._buf):
            return gap, []
        return gap, [self._buf[i] for i in range(start, len(self._buf))]

    async def wait(self, cursor: int) -> None:
        """Return once an event with seq >= ``cursor`` exists (event-loop thread)."""
        while self._next <= cursor:
            if self._wake is None:
                self._wake = asyncio.Event()
            await self._wake.wait()

    def snapshot(self, tenant: str) -> list[ClaimEvent]:
        return [e for e in self._buf if e.tenant == tenant]
