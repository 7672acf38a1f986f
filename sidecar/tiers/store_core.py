"""``StoreCore``: the state every path of ``TieredStore`` shares, its locks, and every move of
an existing chunk: making room (demote-before-evict), demotion, eviction, publication of a
remote copy, loss, removal of bytes.

``TieredStore`` (``store``) builds one core from its ``StoreConfig`` and hands it to each of
its paths, a small class apiece that holds the core and nothing of the others: ``Writes``
(``store_writes``), ``Reads`` (``store_reads``) and ``PoolSlots`` (``store_pool``). The paths
call the core, never each other; the store's operator actions call it too. The lock order and
the placement rules are in ``sidecar.tiers.store``'s docstring; what each method holds is in its
own.

The moves stay one class, not one per kind of move: they are recursive under one lock model.
Making room demotes (``reserve_room`` -> ``move_down``), a demotion makes room one tier down
(``move_down`` -> ``reserve_room``), staging in a fragmented pool demotes (``stage_with_room``
-> ``move_down``), a copy whose source is gone loses it (``lose``), and every one of them holds
the same re-entrant mover and takes the index lock only around ``Placement`` calls. Split over
several objects, that recursion would cross them and no one class would show the lock model.

The core's attributes and methods are the paths' working surface (public names, one package):
``lock``/``cv``/``mover``/``stripe(key)`` are the locks, ``place`` the index (only under
``lock``), ``io`` the backends, ``counters``/``events`` what ``stats``/``take_events`` read;
``closed``, ``active_reads``, ``active_puts`` and ``graves`` change under ``lock`` only.
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


class StoreCore:
    """Shared state, locks and chunk moves of one ``TieredStore``; built from its config (the
    backends opened, the disk tier's chunks indexed).

    Every method here runs with the locks its docstring names; the ones that move bytes hold
    the mover (re-entrant) and take the index lock only around ``Placement`` calls.
    """

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.lock = threading.Lock()  # the index: placement, counters
        self.cv = threading.Condition(self.lock)  # readers unpinning, writers finishing
        self.mover = threading.RLock()  # moves of existing chunks (see ``sidecar.tiers.store``)
        self.stripes = tuple(threading.Lock() for _ in range(STRIPES))  # one writer per key
        self.closed = False
        self.active_reads = 0  # pins held by readers; close() waits for them before freeing pools
        self.active_puts = 0  # puts writing without the mover; close() waits for them too
        self.graves: dict = {}  # id(entry) -> (entry, L1 name): CPU objects removed while leased, freed at the last unlease
        self.events = EventBuffer(config.max_events)
        self.counters = Counters()
        self.io = TierIO(config)
        self.chain: tuple[Tier, ...] = self.io.chain
        self.place = Placement(
            self.chain,
            {t: self.io.backend(t).capacity_bytes for t in self.chain},
            self.io.footprint,
            config.quota_for,
        )
        # Remote copies this store is deleting: not looked up as "foreign" chunks meanwhile (a
        # RESP GET of a key deleted after its EXISTS hangs the connection until the timeout).
        self.remote_removing: Counter[ChunkKey] = Counter()
        if self.io.disk is not None:
            self._recover()

    # ------------------------------------------------------------------ locks and pins

    def stripe(self, key: ChunkKey) -> threading.Lock:
        return self.stripes[hash(key) % STRIPES]

    @contextmanager
    def writer(self) -> Iterator[None]:
        """The mover, once the store is known to be open."""
        with self.mover:
            with self.lock:
                self.check_open()
            yield

    def check_open(self) -> None:
        if self.closed:
            raise TierUnavailableError("the tiered store is closed")

    def pin(self, e: Entry, tier: Tier) -> None:
        """A read pin on ``e``'s copy in ``tier`` (index lock held): victim selection skips it,
        a removal waits for it, ``close`` waits for every pin before freeing the pools."""
        e.readers[tier] = e.readers.get(tier, 0) + 1
        self.active_reads += 1
        self.place.touch(e, tier)

    def unpin(self, e: Entry, tier: Tier) -> None:
        """Drop a ``pin`` (index lock held; the caller notifies ``cv``)."""
        self.active_reads -= 1
        n = e.readers[tier] - 1
        if n:
            e.readers[tier] = n
        else:
            del e.readers[tier]

    def detach(self, e: Entry, tier: Tier) -> None:
        if tier == Tier.REMOTE:
            self.remote_removing[e.key] += 1  # until drain_and_remove has deleted it
        self.place.detach(e, tier)

    def emit(
        self,
        kind: EventKind,
        e: Entry,
        source: Tier | None,
        target: Tier | None,
        reason: Reason,
        tiers_after: frozenset[Tier] | None = None,
    ) -> None:
        self.events.push(
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

    def release(self, tier: Tier, tenant: str, fp: int) -> None:
        with self.lock:
            self.place.release(tier, tenant, fp)
            self.cv.notify_all()

    # ------------------------------------------------------------------ making room

    def reserve_room(self, tier: Tier, fp: int, tenant: str) -> None:
        """Reserve ``fp`` bytes in ``tier`` (and the tenant's share of it) for a write. When they
        fit, one index-lock step; otherwise, under the mover, demote LRU chunks out of the way
        first. Raises ``NoRoom`` when only pinned or guarded chunks are left."""
        p = self.place
        with self.lock:
            if p.fits(tier, fp, tenant):
                p.reserve(tier, tenant, fp)
                return
        deadline = time.monotonic() + self.config.pin_wait_s
        with self.mover:
            while True:
                with self.lock:
                    over_share, over_tier = p.over(tier, fp, tenant)
                    if not (over_share or over_tier):
                        p.reserve(tier, tenant, fp)
                        return
                    victim = p.pick_victim(tier, tenant if over_share else None)
                    if victim is None:
                        if self.wait_unpin(deadline):
                            continue
                        raise NoRoom(tier, fp, "pinned by readers")
                self.move_down(victim, tier, Reason.QUOTA if over_share else Reason.CAPACITY)

    def stage_with_room(self, tier: Tier, key: ChunkKey, obj_nbytes: int,
                        stage: Callable[[], torch.Tensor | None] | None = None) -> torch.Tensor:
        """Stage in a pool tier (room reserved); when the allocator is fragmented, demote more.
        ``stage``: how to stage (default: ``stage(key, obj_nbytes)`` of the tier's backend)."""
        mem = self.io.mem[tier]
        if stage is None:
            stage = functools.partial(mem.stage, key, obj_nbytes)
        dst = stage()
        if dst is not None:
            return dst
        deadline = time.monotonic() + self.config.pin_wait_s
        with self.mover:
            while True:
                dst = stage()
                if dst is not None:
                    return dst
                with self.lock:
                    victim = self.place.pick_victim(tier, None)
                    if victim is None:
                        if self.wait_unpin(deadline):
                            continue
                        raise NoRoom(tier, obj_nbytes, "allocator full")
                self.move_down(victim, tier, Reason.CAPACITY)

    def wait_unpin(self, deadline: float) -> bool:
        """Wait (index lock held) for a reader to unpin something or a write to finish; False
        once past ``deadline``. Readers hold pins for one copy, so a short wait avoids refusing
        on a transient pin."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self.cv.wait(remaining)
        return True

    # ------------------------------------------------------------------ moving bytes

    def write_object(self, tier: Tier, key: ChunkKey, obj: torch.Tensor) -> None:
        """Write a complete stored object (host or device tensor) into ``tier`` (room reserved)."""
        if tier in self.io.mem:
            mem = self.io.mem[tier]
            dst = self.stage_with_room(tier, key, obj.numel())
            try:
                host_copy(dst, obj)
            except BaseException:
                mem.abort(key)
                raise
            mem.commit(key)
            return
        try:
            self.io.store_l2(tier, key, obj)
        except IOFailure:
            with self.lock:
                self.counters.io_errors += 1
            raise

    def copy_object(self, e: Entry, src: Tier, dst: Tier) -> None:
        """Copy ``e``'s stored object from ``src`` to ``dst`` (index untouched)."""
        if src in self.io.mem:
            mem = self.io.mem[src]
            view = mem.acquire(e.key)
            assert view is not None, f"{src.value} tier lost {e.key.hex()} during a move; placement bug"
            try:
                self.write_object(dst, e.key, view)
            finally:
                mem.release(e.key)
            return
        obj = self.io.load_object(src, e.key, e.obj_nbytes, e.meta)
        self.write_object(dst, e.key, obj)

    def move_down(self, e: Entry, src: Tier, reason: Reason) -> None:
        """Demote ``e`` out of ``src`` to the next tier that takes it; drop it only when no
        lower tier could ever hold it. Mover held; ``e`` must not be pinned by a writer."""
        if src == Tier.REMOTE:
            self._drop_remote(e, reason)
            return
        p = self.place
        with self.lock:
            e.moving = True
        try:
            refused: NoRoom | None = None
            io_failed = False
            dst: Tier | None = None
            for tier in p.lower(src):
                if tier == Tier.REMOTE and e.remote:
                    dst = tier  # the shared copy already exists: dropping the local one loses nothing
                    break
                fp = self.io.footprint(tier, e.obj_nbytes)
                if not p.could_hold(tier, fp, e.tenant):
                    continue
                try:
                    self.reserve_room(tier, fp, e.tenant)
                except NoRoom as exc:
                    refused = exc
                    continue
                try:
                    self.copy_object(e, src, tier)
                except SourceLost as lost:
                    self.release(tier, e.tenant, fp)
                    self.lose(e, lost.tier, Reason.CORRUPTION)
                    return
                except NoRoom as exc:
                    self.release(tier, e.tenant, fp)
                    refused = exc
                    continue
                except IOFailure:
                    self.release(tier, e.tenant, fp)
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
            with self.lock:
                self.detach(e, src)
                if dst is None:
                    p.forget(e)
                    self.counters.evictions[reason] += 1
                    self.counters.tiers[src].evictions += 1
                    self.emit(EventKind.EVICTED, e, src, None, reason)
                else:
                    if dst != Tier.REMOTE or not e.remote:
                        p.attach(e, dst, reserved=True)
                        self.counters.tiers[dst].write_bytes += e.obj_nbytes
                    self.counters.demotions += 1
                    self.counters.tiers[dst].demotions_in += 1
                    self.emit(EventKind.DEMOTED, e, src, dst, reason)
            self.drain_and_remove(e, src)
        finally:
            e.moving = False

    def _drop_remote(self, e: Entry, reason: Reason) -> None:
        with self.lock:
            self.detach(e, Tier.REMOTE)
            if e.local is None:
                self.place.forget(e)
            self.counters.evictions[reason] += 1
            self.counters.tiers[Tier.REMOTE].evictions += 1
            self.emit(EventKind.EVICTED, e, Tier.REMOTE, None, reason)
        self.drain_and_remove(e, Tier.REMOTE)

    def publish(self, e: Entry) -> bool:
        """Give ``e`` a remote copy (best effort; False when there is no remote or it failed).
        Takes the mover: a put (``Writes``, ``PoolSlots``) calls it once its chunk is indexed."""
        if self.io.remote is None or e.remote:
            return e.remote
        with self.mover:
            with self.lock:
                if self.closed or self.place.entries.get(e.key) is not e or e.local is None or e.remote or e.moving:
                    return e.remote
                src = e.local
                e.moving = True
            fp = self.io.footprint(Tier.REMOTE, e.obj_nbytes)
            try:
                if fp > self.place.capacity[Tier.REMOTE]:
                    return False
                self.reserve_room(Tier.REMOTE, fp, e.tenant)
                try:
                    self.copy_object(e, src, Tier.REMOTE)
                except BaseException:
                    self.release(Tier.REMOTE, e.tenant, fp)
                    raise
            except SourceLost as lost:
                e.moving = False
                self.lose(e, lost.tier, Reason.CORRUPTION)
                return False
            except (NoRoom, IOFailure) as exc:
                logger.warning("publishing %s to the remote tier failed: %s", e.key.hex(), exc)
                return False
            finally:
                e.moving = False
            with self.lock:
                self.place.attach(e, Tier.REMOTE, reserved=True)
                self.counters.tiers[Tier.REMOTE].write_bytes += e.obj_nbytes
            return True

    # ------------------------------------------------------------------ losing and removing bytes

    def lose(self, e: Entry, tier: Tier, reason: Reason) -> None:
        """Bytes of ``e`` in ``tier`` were found missing or corrupt: forget and remove them."""
        with self.mover:
            with self.lock:
                if self.place.entries.get(e.key) is not e or tier not in e.tiers():
                    return
                self.detach(e, tier)
                if not e.tiers():
                    self.place.forget(e)
                c = self.counters
                c.losses[reason] += 1
                c.tiers[tier].misses += 1
                if reason == Reason.CORRUPTION:
                    c.checksum_failures += 1
                self.emit(EventKind.LOST, e, tier, None, reason)
            logger.warning("chunk %s lost from %s (%s)", e.key.hex(), tier.value, reason.value)
            self.drain_and_remove(e, tier)

    def drain_and_remove(self, e: Entry, tier: Tier, *, deleting: bool = False) -> None:
        """Remove the bytes of ``e`` from ``tier`` once no reader has them pinned. A remote
        removal the server does not confirm is counted (``io_errors``) and logged: as an ERROR
        for a ``delete`` (the caller asked for the bytes to be gone), as a WARNING when the chunk
        was evicted, moved or found lost (the copy left behind is the chunk's own valid bytes)."""
        with self.lock:
            leased = (lambda: e.leases) if tier == Tier.CPU else (lambda: 0)
            if not self.cv.wait_for(lambda: e.readers.get(tier, 0) <= leased(), timeout=self.config.io_timeout_s):
                logger.error("readers of %s in %s did not finish; removing anyway", e.key.hex(), tier.value)
            elif leased():
                # Engines read it in the shared pool under leases: its memory is freed when the
                # last one ends (``PoolSlots.unlease``), never under them; the key is free to be
                # stored again.
                self.graves[id(e)] = (e, self.io.mem[Tier.CPU].retire(e.key))
                return
        confirmed = self.io.remove(tier, e.key)
        if tier == Tier.REMOTE:
            with self.lock:
                self.remote_removing[e.key] -= 1
                if not self.remote_removing[e.key]:
                    del self.remote_removing[e.key]
                if not confirmed:
                    self.counters.io_errors += 1
            if not confirmed and deleting:
                logger.error("remote delete of %s could not be confirmed", e.key.hex())
            elif not confirmed:
                logger.warning("remote copy of %s could not be removed (remote tier unreachable); left on the server",
                               e.key.hex())

    # ------------------------------------------------------------------ restart

    def _recover(self) -> None:
        """Index what the disk tier holds (oldest first), evicting past its capacity."""
        disk = self.io.disk
        assert disk is not None
        files, corrupt = disk.scan()
        over: list[Entry] = []
        p = self.place
        with self.lock:
            if corrupt:
                self.counters.checksum_failures += corrupt
                self.counters.losses[Reason.CORRUPTION] += corrupt
            p.load(Tier.DISK, [Entry(meta=f.meta, obj_nbytes=f.nbytes) for f in files])
            self.counters.recovered_chunks = len(files)
            lru = iter(list(p.lru[Tier.DISK].values()))
            while p.used[Tier.DISK] > p.capacity[Tier.DISK]:
                e = next(lru)
                p.detach(e, Tier.DISK)
                p.forget(e)
                self.counters.evictions[Reason.CAPACITY] += 1
                self.counters.tiers[Tier.DISK].evictions += 1
                self.counters.recovered_chunks -= 1
                over.append(e)
        if over:
            disk.remove([e.key for e in over])
        logger.info(
            "disk tier recovered %d chunks (%d corrupt removed, %d over capacity)", len(files), corrupt, len(over)
        )
