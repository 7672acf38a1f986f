"""Placement events: what moved or vanished, for the registry to drain with ``take_events()``.

Every change of where a chunk lives that the caller did not ask for in the same call (demotions
caused by a put, promotions on a hit, evictions, losses found on read) is reported, so the
registry always knows which tier holds a chunk. ``tiers_after`` is authoritative: an empty set
means the chunk's bytes are gone and the registry must treat it as a miss.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass

from sidecar.tiers.types import ChunkKey, Tier


class EventKind(str, enum.Enum):
    PROMOTED = "promoted"  # copied to a faster tier on a hit (the slower local copy is dropped)
    DEMOTED = "demoted"  # moved to a slower tier to make room (no data lost)
    EVICTED = "evicted"  # a copy dropped by policy (capacity, quota, operator); may be the last
    LOST = "lost"  # bytes found missing or corrupt on read; removed
    DELETED = "deleted"  # removed everywhere by an explicit delete


class Reason(str, enum.Enum):
    CAPACITY = "capacity"
    QUOTA = "quota"
    HIT = "hit"
    OPERATOR = "operator"
    CORRUPTION = "corruption"
    MISSING = "missing"
    IO_ERROR = "io_error"
    SHUTDOWN = "shutdown"  # memory tiers spilled to disk on a graceful stop


@dataclass(frozen=True, slots=True)
class TierEvent:
    kind: EventKind
    key: ChunkKey
    tenant: str
    source: Tier | None
    target: Tier | None
    nbytes: int
    reason: Reason
    tiers_after: frozenset[Tier]

    @property
    def present(self) -> bool:
        """Whether the chunk is still served by some tier after this event."""
        return bool(self.tiers_after)


class EventBuffer:
    """Bounded FIFO of events; ``take()`` swaps it out. Overflow drops the oldest and counts it
    (a non-zero ``dropped`` tells the registry to resync from ``TieredStore.list_chunks``)."""

    def __init__(self, max_events: int) -> None:
        self._events: deque[TierEvent] = deque(maxlen=max_events)
        self._lock = threading.Lock()
        self.dropped = 0

    def push(self, event: TierEvent) -> None:
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self.dropped += 1
            self._events.append(event)

    def take(self) -> list[TierEvent]:
        with self._lock:
            out = list(self._events)
            self._events.clear()
        return out
