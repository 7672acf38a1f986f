"""Back off from a tier whose I/O fails (a full disk, a Redis that is down).

Without it every demotion or read would pay the failure again (a full timeout for a dead
Redis), under the store's writer lock, and Stores would stall behind it. While a tier's breaker
is open, the store treats the tier as absent: demotions skip it (an entry nothing else can take
is dropped, reason ``io_error``), reads of it are misses, and deletes are left for later. The
first call after the back-off tries the tier again; a success closes the breaker. Back-off
doubles from ``initial_s`` to ``max_s``, with jitter (as the shared registry reconnects).

A tier that can tell cheaply whether it answers (the remote tier's PING) passes ``probe``:
while the breaker is open a watcher thread probes every ``PROBE_EVERY_S`` and closes it as soon
as the tier answers, so a Redis that comes back is used again within a fraction of a second,
however long the back-off had grown.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

INITIAL_S = 0.1
MAX_S = 5.0
PROBE_EVERY_S = 0.2


class Breaker:
    def __init__(self, name: str, initial_s: float = INITIAL_S, max_s: float = MAX_S,
                 probe: Callable[[], bool] | None = None) -> None:
        self.name = name
        self._initial, self._max = initial_s, max_s
        self._lock = threading.Lock()
        self._backoff = 0.0
        self._until = 0.0
        self.trips = 0
        self._probe = probe
        self._watcher: threading.Thread | None = None
        self._stopped = threading.Event()

    def is_open(self) -> bool:
        """True while the tier is being avoided."""
        return time.monotonic() < self._until

    def failed(self) -> None:
        with self._lock:
            self._backoff = min(self._max, self._backoff * 2) if self._backoff else self._initial
            self._until = time.monotonic() + self._backoff * random.uniform(0.5, 1.0)
            self.trips += 1
            if self._probe is not None and self._watcher is None and not self._stopped.is_set():
                self._watcher = threading.Thread(target=self._watch, name=f"kv-sidecar-{self.name}-probe", daemon=True)
                self._watcher.start()

    def succeeded(self) -> None:
        if self._backoff:
            with self._lock:
                self._backoff = 0.0
                self._until = 0.0

    def _watch(self) -> None:
        assert self._probe is not None
        while not self._stopped.wait(PROBE_EVERY_S):
            if self.is_open() and self._probe():
                self.succeeded()
            with self._lock:
                if not self.is_open():  # closed, or its back-off ran out: the next call tries the tier
                    self._watcher = None
                    return
        with self._lock:
            self._watcher = None

    def close(self, timeout: float = 1.0) -> None:
        """Stop the watcher (the store is closing)."""
        self._stopped.set()
        watcher = self._watcher
        if watcher is not None:
            watcher.join(timeout)
