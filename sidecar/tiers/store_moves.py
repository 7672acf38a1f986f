"""The state every path of ``TieredStore`` shares, its lock helpers, and every move of an
existing chunk: making room (demote-before-evict), demotion, eviction, loss, removal.

``StoreMoves`` is the base of the write path (``store_writes``) and the read path
(``store_reads``); ``TieredStore`` (``store``) owns the state and the public API. The lock
order and the placement rules are in ``sidecar.tiers.store``'s docstring.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from sidecar.identity import KVLayout
from sidecar.tiers.config import StoreConfig
from sidecar.tiers.envelope import MAX_TEXT_CHARS
from sidecar.tiers.errors import TierUnavailableError
from sidecar.tiers.events import EventBuffer, EventKind, Reason, TierEvent
from sidecar.tiers.placement import Entry, Guard, Placement
from sidecar.tiers.stats import Counters
from sidecar.tiers.tier_io import IOFailure, SourceLost, TierIO, host_copy
from sidecar.tiers.types import MAX_KEY_BYTES, ChunkKey, Tier

logger = logging.getLogger(__name__)

STRIPES = 64


class NoRoom(Exception):
    """A tier could not make room for a write (only pinned or guarded chunks left, or the
    allocator is fragmented): the caller tries the next tier or refuses the put."""

    def __init__(self, tier: Tier, requested: int, reason: str) -> None:
        super().__init__(f"{tier.value}: {reason}")
        self.tier = tier
        self.requested = requested
        self.reason = reason




def check_key(key: object) -> ChunkKey:
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"key must be bytes, got {type(key).__name__}")
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    return ChunkKey(bytes(key))


def check_text(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    if len(value) > MAX_TEXT_CHARS:
        raise ValueError(f"{name} must be at most {MAX_TEXT_CHARS} characters")
    return value


@functools.lru_cache(maxsize=256)
def layout_fingerprint(layout: KVLayout) -> str:
    """``layout.fingerprint()``, cached: it JSON-encodes the layout on every call (~50 us);
    layouts are few."""
    return layout.fingerprint()


class StoreMoves:
    """Shared state, lock helpers and chunk moves of ``TieredStore`` (which sets the state).

    Every method here runs with the locks its docstring names; the ones that move bytes hold
    the mover (re-entrant) and take the index lock only around ``Placement`` calls.
    """

    _config: StoreConfig
    _lock: threading.Lock  # the index: placement, counters
    _cv: threading.Condition  # on _lock: readers unpinning, writers finishing
    _mover: threading.RLock  # moves of existing chunks
    _stripes: tuple[threading.Lock, ...]  # STRIPES key stripes: one writer per key
    _closed: bool
    _active_reads: int  # pins held by readers; close() waits for them before freeing pools
    _active_puts: int  # puts writing without the mover; close() waits for them too
    _events: EventBuffer
    _counters: Counters
    _io: TierIO
    _chain: tuple[Tier, ...]
    _place: Placement
    _remote_removing: Counter[ChunkKey]  # remote copies being deleted: not looked up meanwhile
    _graves: dict  # id(entry) -> (entry, L1 name): CPU objects removed while leased, freed at the last unlease

    def _stripe(self, key: ChunkKey) -> threading.Lock:
        return self._stripes[hash(key) % STRIPES]

    @contextmanager
    def _writer(self) -> Iterator[None]:
        with self._mover:
            with self._lock:
                self._check_open()
            yield

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailableError("the tiered store is closed")

    def _detach(self, e: Entry, tier: Tier) -> None:
        if tier == Tier.REMOTE:
            self._remote_removing[e.key] += 1  # until _drain_and_remove has deleted it
        self._place.detach(e, tier)

    def _emit(
        self,
        kind: EventKind,
        e: Entry,
        source: Tier | None,
        target: Tier | None,
        reason: Reason,
        tiers_after: frozenset[Tier] | None = None,
    ) -> None:
        self._events.push(
            TierEvent(
                kind=kind,
                key=e.key,
                tenant=e.tenant,
                source=source,
                target=target,
                nbytes=e.meta.payload_nbytes,
                reason=reason,
                tiers_after=e.tiers() if tiers_after is None else tiers_after,
            )
        )

    def _release(self, tier: Tier, tenant: str, fp: int) -> None:
        with self._lock:
            self._place.release(tier, tenant, fp)
            self._cv.notify_all()

    def _reserve_room(self, tier: Tier, fp: int, tenant: str) -> None:
        """Reserve ``fp`` bytes in ``tier`` (and the tenant's share of it) for a write. When they
        fit, one index-lock step; otherwise, under the mover, demote LRU chunks out of the way
        first. Raises ``NoRoom`` when only pinned or guarded chunks are left."""
        p = self._place
        with self._lock:
            if p.fits(tier, fp, tenant):
                p.reserve(tier, tenant, fp)
                return
        deadline = time.monotonic() + self._config.pin_wait_s
        with self._mover:
            while True:
                with self._lock:
                    over_share, over_tier = p.over(tier, fp, tenant)
                    if not (over_share or over_tier):
                        p.reserve(tier, tenant, fp)
                        return
                    victim = p.pick_victim(tier, tenant if over_share else None)
                    if victim is None:
                        if self._wait_unpin(deadline):
                            continue
                        raise NoRoom(tier, fp, "pinned by readers")
                self._move_down(victim, tier, Reason.QUOTA if over_share else Reason.CAPACITY)

    def _stage_with_room(self, tier: Tier, key: ChunkKey, obj_nbytes: int,
                         stage: Callable[[], torch.Tensor | None] | None = None) -> torch.Tensor:
        """Stage in a pool tier (room reserved); when the allocator is fragmented, demote more.
        ``stage``: how to stage (default: ``stage(key, obj_nbytes)`` of the tier's backend)."""
        mem = self._io.mem[tier]
        if stage is None:
            stage = functools.partial(mem.stage, key, obj_nbytes)
        dst = stage()
        if dst is not None:
            return dst
        deadline = time.monotonic() + self._config.pin_wait_s
        with self._mover:
            while True:
                dst = stage()
                if dst is not None:
                    return dst
                with self._lock:
                    victim = self._place.pick_victim(tier, None)
                    if victim is None:
                        if self._wait_unpin(deadline):
                            continue
                        raise NoRoom(tier, obj_nbytes, "allocator full")
                self._move_down(victim, tier, Reason.CAPACITY)

    def _wait_unpin(self, deadline: float) -> bool:
        """Wait (index lock held) for a reader to unpin something or a write to finish; False
        once past ``deadline``. Readers hold pins for one copy, so a short wait avoids refusing
        on a transient pin."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self._cv.wait(remaining)
        return True

    def _write_object(self, tier: Tier, key: ChunkKey, obj: torch.Tensor) -> None:
        """Write a complete stored object (host or device tensor) into ``tier`` (room reserved)."""
        if tier in self._io.mem:
            mem = self._io.mem[tier]
            dst = self._stage_with_room(tier, key, obj.numel())
            try:
                host_copy(dst, obj)
            except BaseException:
                mem.abort(key)
                raise
            mem.commit(key)
            return
        try:
            self._io.store_l2(tier, key, obj)
        except IOFailure:
            with self._lock:
                self._counters.io_errors += 1
            raise

    def _copy_object(self, e: Entry, src: Tier, dst: Tier) -> None:
        """Copy ``e``'s stored object from ``src`` to ``dst`` (index untouched)."""
        if src in self._io.mem:
            mem = self._io.mem[src]
            view = mem.acquire(e.key)
            assert view is not None, f"{src.value} tier lost {e.key.hex()} during a move; placement bug"
            try:
                self._write_object(dst, e.key, view)
            finally:
                mem.release(e.key)
            return
        obj = self._io.load_object(src, e.key, e.obj_nbytes, e.meta)
        self._write_object(dst, e.key, obj)

    def _move_down(self, e: Entry, src: Tier, reason: Reason) -> None:
        """Demote ``e`` out of ``src`` to the next tier that takes it; drop it only when no
        lower tier could ever hold it. Mover held; ``e`` must not be pinned by a writer."""
        if src == Tier.REMOTE:
            self._drop_remote(e, reason)
            return
        p = self._place
        with self._lock:
            e.moving = True
        try:
            refused: NoRoom | None = None
            io_failed = False
            dst: Tier | None = None
            for tier in p.lower(src):
                if tier == Tier.REMOTE and e.remote:
                    dst = tier  # the shared copy already exists: dropping the local one loses nothing
                    break
                fp = self._io.footprint(tier, e.obj_nbytes)
                if not p.could_hold(tier, fp, e.tenant):
                    continue
                try:
                    self._reserve_room(tier, fp, e.tenant)
                except NoRoom as exc:
                    refused = exc
                    continue
                try:
                    self._copy_object(e, src, tier)
                except SourceLost as lost:
                    self._release(tier, e.tenant, fp)
                    self._lose(e, lost.tier, Reason.CORRUPTION)
                    return
                except NoRoom as exc:
                    self._release(tier, e.tenant, fp)
                    refused = exc
                    continue
                except IOFailure:
                    self._release(tier, e.tenant, fp)
                    io_failed = True  # the tier is failing (full, down): as if it were absent
                    continue
                dst = tier
                break
            if dst is None and refused is not None:
                raise NoRoom(src, e.obj_nbytes, f"cannot demote: {refused.tier.value} {refused.reason}")
            if dst is None and io_failed:
                if p.guards.get(e.key) is Guard.NO_DROP:  # a claim keeps it: backpressure instead
                    raise NoRoom(src, e.obj_nbytes, "cannot demote: the lower tiers are failing (claimed chunk)")
                reason = Reason.IO_ERROR  # dropped: every lower tier that could hold it is failing
            with self._lock:
                self._detach(e, src)
                if dst is None:
                    p.forget(e)
                    self._counters.evictions[reason] += 1
                    self._counters.tiers[src].evictions += 1
                    self._emit(EventKind.EVICTED, e, src, None, reason)
                else:
                    if dst != Tier.REMOTE or not e.remote:
                        p.attach(e, dst, reserved=True)
                        self._counters.tiers[dst].write_bytes += e.obj_nbytes
                    self._counters.demotions += 1
                    self._counters.tiers[dst].demotions_in += 1
                    self._emit(EventKind.DEMOTED, e, src, dst, reason)
            self._drain_and_remove(e, src)
        finally:
            e.moving = False

    def _drop_remote(self, e: Entry, reason: Reason) -> None:
        with self._lock:
            self._detach(e, Tier.REMOTE)
            if e.local is None:
                self._place.forget(e)
            self._counters.evictions[reason] += 1
            self._counters.tiers[Tier.REMOTE].evictions += 1
            self._emit(EventKind.EVICTED, e, Tier.REMOTE, None, reason)
        self._drain_and_remove(e, Tier.REMOTE)

    def _lose(self, e: Entry, tier: Tier, reason: Reason) -> None:
        """Bytes of ``e`` in ``tier`` were found missing or corrupt: forget and remove them."""
        with self._mover:
            with self._lock:
                if self._place.entries.get(e.key) is not e or tier not in e.tiers():
                    return
                self._detach(e, tier)
                if not e.tiers():
                    self._place.forget(e)
                c = self._counters
                c.losses[reason] += 1
                c.tiers[tier].misses += 1
                if reason == Reason.CORRUPTION:
                    c.checksum_failures += 1
                self._emit(EventKind.LOST, e, tier, None, reason)
            logger.warning("chunk %s lost from %s (%s)", e.key.hex(), tier.value, reason.value)
            self._drain_and_remove(e, tier)

    def _drain_and_remove(self, e: Entry, tier: Tier, *, deleting: bool = False) -> None:
        """Remove the bytes of ``e`` from ``tier`` once no reader has them pinned. A remote
        removal the server does not confirm is counted (``io_errors``) and logged: as an ERROR
        for a ``delete`` (the caller asked for the bytes to be gone), as a WARNING when the chunk
        was evicted, moved or found lost (the copy left behind is the chunk's own valid bytes)."""
        with self._lock:
            leased = (lambda: e.leases) if tier == Tier.CPU else (lambda: 0)
            if not self._cv.wait_for(lambda: e.readers.get(tier, 0) <= leased(), timeout=self._config.io_timeout_s):
                logger.error("readers of %s in %s did not finish; removing anyway", e.key.hex(), tier.value)
            elif leased():
                # Engines read it in the shared pool under leases: its memory is freed when the
                # last one ends (``unlease``), never under them; the key is free to be stored again.
                self._graves[id(e)] = (e, self._io.mem[Tier.CPU].retire(e.key))
                return
        confirmed = self._io.remove(tier, e.key)
        if tier == Tier.REMOTE:
            with self._lock:
                self._remote_removing[e.key] -= 1
                if not self._remote_removing[e.key]:
                    del self._remote_removing[e.key]
                if not confirmed:
                    self._counters.io_errors += 1
            if not confirmed and deleting:
                logger.error("remote delete of %s could not be confirmed", e.key.hex())
            elif not confirmed:
                logger.warning("remote copy of %s could not be removed (remote tier unreachable); left on the server",
                               e.key.hex())

