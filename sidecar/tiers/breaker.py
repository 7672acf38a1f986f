"""Back off from a tier whose I/O fails (a full disk, a Redis that is down).

Without it every demotion or read would pay the failure again (a full timeout for a dead
Redis), under the store's writer lock, and Stores would stall behind it. While a tier's breaker
is open, the store treats the tier as absent: demotions skip it (an entry nothing else can take
is dropped, reason ``io_error``), reads of it are misses, and deletes are left for later. The
first call after the back-off tries the tier again; a success closes the breaker. Back-off
doubles from ``initial_s`` to ``max_s``, with jitter (as the shared registry reconnects).
"""

from __future__ import annotations

import random
import threading
import time

INITIAL_S = 0.1
MAX_S = 5.0


class Breaker:
    def __init__(self, name: str, initial_s: float = INITIAL_S, max_s: float = MAX_S) -> None:
        self.name = name
        self._initial, self._max = initial_s, max_s
        self._lock = threading.Lock()
        self._backoff = 0.0
        self._until = 0.0
        self.trips = 0

    def is_open(self) -> bool:
        """True while the tier is being avoided."""
        return time.monotonic() < self._until

    def failed(self) -> None:
        with self._lock:
            self._backoff = min(self._max, self._backoff * 2) if self._backoff else self._initial
            self._until = time.monotonic() + self._backoff * random.uniform(0.5, 1.0)
            self.trips += 1

    def succeeded(self) -> None:
        if self._backoff:
            with self._lock:
                self._backoff = 0.0
                self._until = 0.0
