"""``TieredStore``: chunk KV across GPU / CPU / disk / remote tiers, the orchestrator.

Three parts (vLLM keeps ``BlockPool`` apart from ``KVCacheManager`` the same way):

* ``sidecar.tiers.placement``: the index and the pure decisions (which tier, which victim,
  accounting, quotas, guards); no I/O, no locks;
* ``sidecar.tiers.tier_io``: the backends (``sidecar.tiers.backends``) and every movement of
  bytes; no decisions;
* the orchestrator: the public API, the locks, and the sequences (make room, write, attach),
  one module per path, all methods of ``TieredStore``:

  - this module: construction, queries, operator actions (``evict``, ``delete``, ``spill``),
    ``close`` and disk recovery at start;
  - ``store_writes``: ``put`` (new chunks) and publication of remote copies;
  - ``store_reads``: ``get``/``get_many`` and promotion of hits;
  - ``store_moves``: the shared state and lock helpers, making room, demotion, eviction, loss
    and removal of bytes (what both paths call).

Placement (one chunk has at most one *local* copy, in GPU, CPU or disk, plus optionally a copy
on the shared remote tier)::

    put ──> fastest tier with room ──(full)──> LRU victims demoted one tier down
              GPU ──demote──> CPU ──demote──> disk ──demote──> remote ──evict──> gone
              ^                                                   |
              └────────────── promote on hit (copy up; the slower local copy is dropped,
                              the remote copy is kept because other sidecars share it)

* Recency is the store's own LRU per tier (``OrderedDict.move_to_end`` on every hit), not
  LMCache's: LMCache's L1 eviction policy only learns recency from explicit touches.
* Room is made synchronously before a write (demote-before-evict); a chunk is dropped only
  from the last tier, or never when some lower tier exists but cannot take it: the put is then
  refused with ``CapacityError`` (backpressure), never silently dropped.
* Capacity is per tier in stored-object bytes; per-tenant quotas bound a tenant's total
  payload bytes (refusal) and, optionally, its share of each tier (its own LRU chunks demoted).
* Every change the caller did not directly ask for is reported by ``take_events()``; a chunk
  whose bytes are gone or corrupt is a miss (``None``), never an exception.
* Guards (resident claims, ``sidecar.claims``): ``set_guards`` marks chunks ``Guard.SOFT``
  (a second chance: skipped once as a victim), ``Guard.NO_DROP`` (may be demoted, never dropped
  from the last tier: the claim stays restorable) or ``Guard.HOLD`` (never demoted nor dropped).
  A put that only guarded chunks block is refused with ``CapacityError`` whose
  ``guarded_bytes`` says so.

Lock model (acquired in this order, never the reverse)::

    key stripe (1 of 64, by key)   a put holds its key's stripe from "is it new?" to "attached",
                                   so one key is written once; delete takes the stripes too;
                                   a promotion (mover held) only tries its key's stripe and is
                                   skipped when it is taken (never waits: no order inversion)
    mover (re-entrant)             every move of an existing chunk: demotion, eviction,
                                   promotion, publication, delete, loss; and making room
    index (``_lock`` + ``_cv``)    the ``Placement`` and counters; held for dict operations only

A put of a new chunk reserves its bytes in the target tier under the index lock (``reserve``:
counted as used before the write starts), then encodes, checksums and writes WITHOUT holding
the mover or the index lock, so Stores of different chunks run in parallel; only a put that
must first make room (demote victims) takes the mover. Readers pin what they read, so a victim
is never freed under a reader; a promotion is skipped rather than waited for when a mover is
busy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence

from sidecar.tiers.config import StoreConfig
from sidecar.tiers.envelope import object_nbytes
from sidecar.tiers.events import EventBuffer, EventKind, Reason, TierEvent
from sidecar.tiers.placement import Entry, Guard, Placement
from sidecar.tiers.stats import Counters, StoreStats
from sidecar.tiers.store_moves import STRIPES, NoRoom, check_key
from sidecar.tiers.store_pool import StorePool
from sidecar.tiers.store_reads import StoreReads
from sidecar.tiers.store_writes import StoreWrites
from sidecar.tiers.tier_io import TierIO
from sidecar.tiers.types import ChunkKey, ChunkMeta, Tier

logger = logging.getLogger(__name__)

__all__ = ["Guard", "TieredStore"]


class TieredStore(StoreWrites, StoreReads, StorePool):
    """Chunk KV store over LMCache tiers. Thread-safe; every method may block on I/O (call it
    from a worker thread, e.g. ``asyncio.to_thread``, in an event-loop server).

    LMCache's own ``StorageManager`` (L1 + L2 with its store/prefetch controllers) is not used:
    it evicts on a timer by dropping at a watermark instead of demoting synchronously, has no
    per-tenant quotas, guards or read pins, and learns recency only from explicit touches; the
    store drives LMCache's L1 manager and L2 adapters directly instead.

    ``put`` is defined in ``StoreWrites`` (``store_writes``), ``get``/``get_many`` in
    ``StoreReads`` (``store_reads``); queries, operator actions and ``close`` here."""

    def __init__(self, config: StoreConfig) -> None:
        self._config = config
        self._lock = threading.Lock()  # the index: placement, counters
        self._cv = threading.Condition(self._lock)  # readers unpinning, writers finishing
        self._mover = threading.RLock()  # moves of existing chunks (see the module docstring)
        self._stripes = tuple(threading.Lock() for _ in range(STRIPES))
        self._closed = False
        self._active_reads = 0  # pins held by readers; close() waits for them before freeing pools
        self._active_puts = 0  # puts writing without the mover; close() waits for them too
        self._slots = {}  # slots reserved in the shared pool, by slot id (``store_pool``)
        self._leased = 0  # chunks pinned by the shared pool's leases
        self._graves: dict = {}  # CPU objects removed while leased (``store_moves._drain_and_remove``)
        self._events = EventBuffer(config.max_events)
        self._counters = Counters()
        self._io = TierIO(config)
        self._chain = self._io.chain
        self._place = Placement(
            self._chain,
            {t: self._io.backend(t).capacity_bytes for t in self._chain},
            self._io.footprint,
            config.quota_for,
        )
        # Remote copies this store is deleting: not looked up as "foreign" chunks meanwhile (a
        # RESP GET of a key deleted after its EXISTS hangs the connection until the timeout).
        self._remote_removing: Counter[ChunkKey] = Counter()
        if self._io.disk is not None:
            self._recover()

    # Internals the tests reach for (they check LMCache's own state against the index).
    @property
    def _mem(self):
        return self._io.mem

    @property
    def _disk(self):
        return self._io.disk

    @property
    def _entries(self) -> dict[ChunkKey, Entry]:
        return self._place.entries

    @property
    def _write_lock(self) -> threading.RLock:
        """The mover lock under its old name (tests/dataplane/test_sync_off_loop.py holds it to stand for
        a slow tier move)."""
        return self._mover

    # ------------------------------------------------------------------ public API: queries

    @property
    def config(self) -> StoreConfig:
        return self._config

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The configured tiers, fastest first."""
        return self._chain

    def locate(self, key: bytes) -> Tier | None:
        """The fastest tier holding ``key`` (``None``: not held, as far as this store knows)."""
        with self._lock:
            e = self._place.entries.get(check_key(key))
            return e.fastest() if e is not None else None

    def tiers_of(self, key: bytes) -> frozenset[Tier]:
        with self._lock:
            e = self._place.entries.get(check_key(key))
            return e.tiers() if e is not None else frozenset()

    def contains(self, key: bytes) -> bool:
        return self.locate(key) is not None

    def meta(self, key: bytes) -> ChunkMeta | None:
        with self._lock:
            e = self._place.entries.get(check_key(key))
            return e.meta if e is not None else None

    def list_chunks(self, tier: Tier | None = None) -> list[ChunkMeta]:
        """Metadata of every chunk held (in ``tier`` only, when given), least recently used
        first. After a restart, ``list_chunks(Tier.DISK)`` is what the disk tier recovered."""
        with self._lock:
            if tier is None:
                return [e.meta for e in self._place.entries.values()]
            lru = self._place.lru.get(Tier(tier))
            return [e.meta for e in lru.values()] if lru is not None else []

    def tenant_usage(self, tenant: str) -> int:
        """Payload bytes of ``tenant``'s chunks held anywhere (what ``max_bytes`` bounds; a put
        in flight counts from its start)."""
        with self._lock:
            return self._place.tenant_bytes[tenant]

    def tenant_tier_usage(self, tenant: str) -> dict[Tier, tuple[int, int]]:
        """(bytes, objects) of ``tenant``'s chunks in each configured tier (its own ``Stats``)."""
        p = self._place
        with self._lock:
            return {t: (p.tenant_used[(tenant, t)], len(p.tenant_lru.get((tenant, t), ()))) for t in p.lru}

    def set_guards(self, guards: dict[bytes, Guard]) -> None:
        """Set (``Guard.NONE``: clear) the guard of each key. Keys need not be held yet: a
        guard applies from the chunk's first put on. Cheap (index lock, one dict write each)."""
        with self._lock:
            for key, g in guards.items():
                self._place.set_guard(check_key(key), g)

    def guarded_bytes(self, tier: Tier) -> int:
        """Footprint of ``tier``'s chunks that victim selection may not take there."""
        with self._lock:
            return self._place.guarded_bytes(Tier(tier)) if Tier(tier) in self._place.lru else 0

    def capacity_of(self, tier: Tier) -> int:
        return self._place.capacity.get(Tier(tier), 0)

    def object_footprint(self, payload_nbytes: int) -> int:
        """Bytes a new chunk of ``payload_nbytes`` takes in the fastest tier."""
        return self._io.footprint(self._chain[0], object_nbytes(payload_nbytes)) if self._chain else 0

    def room(self, need: int) -> tuple[int, int, int] | None:
        """None when ``need`` more bytes fit the tiers' free space; otherwise (capacity, used,
        guarded) over all tiers, ``guarded`` being what victim selection may never take (the
        resident claims' share; kept incrementally, O(tiers))."""
        with self._lock:
            return self._place.room(need)

    def pins_in_flight(self) -> int:
        """Read pins held right now (each ``get_many`` releases its own on every path)."""
        with self._lock:
            return self._active_reads

    def take_events(self) -> list[TierEvent]:
        """Drain placement events in the order they happened (see ``sidecar.tiers.events``)."""
        return self._events.take()

    def stats(self) -> StoreStats:
        with self._lock:
            return self._counters.snapshot(
                capacity=self._place.capacity,
                used=self._place.used,
                objects={t: len(lru) for t, lru in self._place.lru.items()},
                events_dropped=self._events.dropped,
                remote_reconnects=self._io.remote.reconnects if self._io.remote is not None else 0,
            )

    # ------------------------------------------------------------------ public API: operators

    def evict(self, keys: Sequence[bytes]) -> int:
        """Operator eviction: move each chunk one tier down from its fastest tier (dropped when
        it is already in the last tier). Returns how many chunks moved or were dropped."""
        keys = [check_key(k) for k in keys]
        done = 0
        with self._writer():
            for key in keys:
                with self._lock:
                    e = self._place.entries.get(key)
                    tier = e.fastest() if e is not None else None
                if e is None or tier is None:
                    continue
                try:
                    self._move_down(e, tier, Reason.OPERATOR)
                except NoRoom as exc:
                    logger.warning("evict %s: %s", key.hex(), exc)
                    continue
                done += 1
        return done

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove chunks from every tier, the remote copy included (waits for in-flight reads of
        them, and for a put of the same key in flight). Keys this store does not know are still
        deleted from the remote tier (another sidecar, or this one before a restart, may have
        published them). Idempotent; returns how many chunks this store held."""
        keys = [check_key(k) for k in keys]
        unknown: list[ChunkKey] = []
        removed = self._delete(keys, unknown)
        self._delete_remote(unknown)
        return removed

    def _delete(self, keys: list[ChunkKey], unknown: list[ChunkKey]) -> int:
        removed = 0
        for key in keys:
            with self._stripe(key), self._writer():
                with self._lock:
                    e = self._place.entries.get(key)
                    if e is None:
                        unknown.append(key)
                        continue
                    held = e.tiers()
                    fastest = e.fastest()
                    for tier in held:
                        self._detach(e, tier)
                    self._place.forget(e)
                    self._emit(EventKind.DELETED, e, fastest, None, Reason.OPERATOR)
                for tier in held:
                    self._drain_and_remove(e, tier, deleting=True)
                removed += 1
        return removed

    def _delete_remote(self, unknown: list[ChunkKey]) -> None:
        if not unknown or self._io.remote is None:
            return
        with self._writer():
            with self._lock:
                self._remote_removing.update(unknown)
            try:
                if not self._io.remote.remove(unknown):
                    logger.error("remote delete of %d unknown chunks could not be confirmed", len(unknown))
            finally:
                with self._lock:
                    self._remote_removing.subtract(unknown)
                    for key in unknown:
                        if self._remote_removing[key] <= 0:
                            del self._remote_removing[key]

    def spill(self, budget_s: float) -> tuple[int, int]:
        """Move what only the memory tiers (GPU, CPU) hold down to the disk tier, most recently
        used first, for at most ``budget_s`` seconds: a graceful stop then loses nothing a
        restart could recover (the disk tier is re-indexed at start). Returns (moved, left):
        ``left`` counts the chunks still only in memory (no disk tier, no room, time out).
        Older disk chunks make room by the ordinary LRU order."""
        lru = self._place.lru
        memory = tuple(self._io.mem)  # the configured memory tiers (GPU, CPU), fastest first
        with self._lock:
            if self._closed:
                return 0, 0
            todo = [(t, e) for t in memory for e in reversed(lru[t].values()) if not e.remote]
        if Tier.DISK not in lru or not todo:
            return 0, len(todo)
        deadline = time.monotonic() + budget_s
        moved = 0
        with self._writer():
            for i, (tier, e) in enumerate(todo):
                if time.monotonic() >= deadline:
                    return moved, len(todo) - i
                with self._lock:
                    if e.local != tier or e.busy(tier):
                        continue
                try:
                    self._move_down(e, tier, Reason.SHUTDOWN)
                except NoRoom:
                    continue
                with self._lock:
                    moved += e.local == Tier.DISK
        with self._lock:
            left = sum(1 for t in memory for e in lru[t].values() if not e.remote)
        return moved, left

    def close(self) -> None:
        """Release every backend; bounded by ``config.close_timeout_s`` per step (a hung remote
        is abandoned, not waited for). Calls after close raise ``TierUnavailableError``; reads
        and puts in flight finish first, and if they do not the memory pools are leaked rather
        than freed under them. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._drop_all_slots()
        with self._lock:
            drained = self._cv.wait_for(
                lambda: self._active_reads == 0 and self._active_puts == 0, timeout=self._config.close_timeout_s
            )
        acquired = self._mover.acquire(timeout=self._config.close_timeout_s)
        try:
            self._io.close(free_memory=drained and acquired)
        finally:
            if acquired:
                self._mover.release()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ restart

    def _recover(self) -> None:
        """Index what the disk tier holds (oldest first), evicting past its capacity."""
        disk = self._io.disk
        assert disk is not None
        files, corrupt = disk.scan()
        over: list[Entry] = []
        p = self._place
        with self._lock:
            if corrupt:
                self._counters.checksum_failures += corrupt
                self._counters.losses[Reason.CORRUPTION] += corrupt
            p.load(Tier.DISK, [Entry(meta=f.meta, obj_nbytes=f.nbytes) for f in files])
            self._counters.recovered_chunks = len(files)
            lru = iter(list(p.lru[Tier.DISK].values()))
            while p.used[Tier.DISK] > p.capacity[Tier.DISK]:
                e = next(lru)
                p.detach(e, Tier.DISK)
                p.forget(e)
                self._counters.evictions[Reason.CAPACITY] += 1
                self._counters.tiers[Tier.DISK].evictions += 1
                self._counters.recovered_chunks -= 1
                over.append(e)
        if over:
            disk.remove([e.key for e in over])
        logger.info(
            "disk tier recovered %d chunks (%d corrupt removed, %d over capacity)", len(files), corrupt, len(over)
        )
