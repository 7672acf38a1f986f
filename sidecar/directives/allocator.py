"""Block ids for one session's mirror: a simulated pool, so no block is referenced twice.

The ids are the mirror's own: an engine binds each ALLOCATEd id to a physical block of its
pool and translates (a ``dict`` or a small tensor per session). Keeping a per-session id space
lets the invariant checker prove that no block is live twice or used after FREE without
knowing anything about the engine.

Allocation is two-phase because planning is pure: ``peek(n)`` says which ids a plan will get,
``take(n)`` claims exactly those at commit. Nothing else may allocate in between; the session
table guarantees it (one pending plan per session, no append while one is pending).
"""

from __future__ import annotations

import numpy as np

from sidecar.errors import InvariantViolation

_BUG = "this indicates a bug in the session mirror (sidecar/directives)"


class BlockAllocator:
    """Live/free state of block ids ``0, 1, 2, ...``. Freed ids are reused before new ones."""

    __slots__ = ("_live", "_free", "_next")

    def __init__(self) -> None:
        self._live = np.zeros(64, dtype=bool)  # indexed by block id; grows by doubling
        self._free = np.zeros(0, dtype=np.int64)  # released ids, reused first (FIFO)
        self._next = 0  # high-water mark: ids >= _next were never handed out

    @property
    def live_count(self) -> int:
        return self._next - len(self._free)

    def peek(self, n: int) -> np.ndarray:
        """The ids ``take(n)`` would return now (int64), without claiming them."""
        k = min(n, len(self._free))
        if k == n:
            return self._free[:n].copy()
        return np.concatenate((self._free[:k], np.arange(self._next, self._next + n - k, dtype=np.int64)))

    def take(self, n: int) -> np.ndarray:
        """Claim ``n`` ids (the ones ``peek(n)`` returned) and mark them live."""
        ids = self.peek(n)
        k = min(n, len(self._free))
        self._free = self._free[k:]
        self._next += n - k
        if self._next > len(self._live):
            grown = np.zeros(max(self._next, 2 * len(self._live)), dtype=bool)
            grown[: len(self._live)] = self._live
            self._live = grown
        if self._live[ids].any():
            raise InvariantViolation(f"block allocator handed out a live block; {_BUG}")
        self._live[ids] = True
        return ids

    def release(self, ids: np.ndarray) -> None:
        """Return live ids to the free list. Releasing a free or unknown id is a bug."""
        if len(ids) == 0:
            return
        ids = np.asarray(ids, dtype=np.int64)
        if ids.min() < 0 or ids.max() >= self._next or not self._live[ids].all():
            raise InvariantViolation(f"release of a block that is not live (double free); {_BUG}")
        if len(np.unique(ids)) != len(ids):
            raise InvariantViolation(f"release of the same block twice in one call; {_BUG}")
        self._live[ids] = False
        self._free = np.concatenate((self._free, ids))

    def is_live(self, ids: np.ndarray) -> np.ndarray:
        """bool per id: currently allocated (ids outside the known range are not live)."""
        ids = np.asarray(ids, dtype=np.int64)
        inside = (ids >= 0) & (ids < self._next)
        out = np.zeros(len(ids), dtype=bool)
        out[inside] = self._live[ids[inside]]
        return out

    def state(self) -> tuple[int, tuple[int, ...]]:
        """(high-water mark, free list): enough to prove the allocator is unchanged."""
        return self._next, tuple(self._free.tolist())
