"""``TieredStore``: chunk KV across GPU / CPU / disk / remote tiers, the orchestrator.

Three parts (vLLM keeps ``BlockPool`` apart from ``KVCacheManager`` the same way):

* ``sidecar.tiers.placement``: the index and the pure decisions (which tier, which victim,
  accounting, quotas, guards); no I/O, no locks;
* ``sidecar.tiers.tier_io``: the backends (``sidecar.tiers.backends``) and every movement of
  bytes; no decisions;
* the orchestrator: the public API, the locks, and the sequences (make room, write, attach),
  composed of one core and one small class per path, each holding the core and nothing of the
  others (vLLM's connectors delegate to one class per role the same way):

  - ``store_core.StoreCore``: the shared state (the ``Placement``, ``TierIO``, counters,
    events), the locks and pins, and every move of an existing chunk: making room, demotion,
    eviction, publication of a remote copy, loss and removal of bytes (what every path calls,
    under one lock model: why the moves stay one class);
  - ``store_writes.Writes``: ``put`` of a new chunk;
  - ``store_reads.Reads``: ``get_many`` and promotion of hits;
  - ``store_pool.PoolSlots``: the shared pool's leases and slots;
  - this module: ``TieredStore``, which builds them from its config and exposes the public API
    by plain delegation, plus queries, operator actions (``evict``, ``delete``, ``spill``) and
    ``close``; the disk tier is re-indexed when the core is built.

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
    index (``lock`` + ``cv``)      the ``Placement`` and counters; held for dict operations only

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
from collections.abc import Sequence

from sidecar.identity import KVLayout
from sidecar.tiers.config import StoreConfig
from sidecar.tiers.envelope import object_nbytes
from sidecar.tiers.events import EventKind, Reason, TierEvent
from sidecar.tiers.placement import Entry, Guard
from sidecar.tiers.stats import StoreStats
from sidecar.tiers.store_core import NoRoom, StoreCore, check_key
from sidecar.tiers.store_pool import PoolRead, PoolSlots, Slot
from sidecar.tiers.store_reads import Reads
from sidecar.tiers.store_writes import Writes
from sidecar.tiers.types import ChunkKey, ChunkMeta, FetchedChunk, PutResult, Tier

logger = logging.getLogger(__name__)

__all__ = ["Guard", "TieredStore"]


class TieredStore:
    """Chunk KV store over LMCache tiers. Thread-safe; every method may block on I/O (call it
    from a worker thread, e.g. ``asyncio.to_thread``, in an event-loop server).

    LMCache's own ``StorageManager`` (L1 + L2 with its store/prefetch controllers) is not used:
    it evicts on a timer by dropping at a watermark instead of demoting synchronously, has no
    per-tenant quotas, guards or read pins, and learns recency only from explicit touches; the
    store drives LMCache's L1 manager and L2 adapters directly instead.

    The contracts of the public methods are here; ``put`` runs in ``Writes``, ``get_many`` in
    ``Reads``, the shared pool's methods in ``PoolSlots``, every move in ``StoreCore``."""

    def __init__(self, config: StoreConfig) -> None:
        self._core = core = StoreCore(config)  # opens the backends, re-indexes the disk tier
        self._writes = Writes(core)
        self._reads = Reads(core)
        self._pool_slots = PoolSlots(core)

    # Internals the tests reach for (they check LMCache's own state against the index).
    @property
    def _mem(self):
        return self._core.io.mem

    @property
    def _disk(self):
        return self._core.io.disk

    @property
    def _entries(self) -> dict[ChunkKey, Entry]:
        return self._core.place.entries

    @property
    def _write_lock(self) -> threading.RLock:
        """The mover lock under its old name (tests/dataplane/test_sync_off_loop.py holds it to stand for
        a slow tier move)."""
        return self._core.mover

    # ------------------------------------------------------------------ public API: writes and reads

    def put(
        self,
        key: bytes,
        payload: object,
        *,
        layout: KVLayout,
        num_tokens: int,
        tenant: str,
        scope: str | None = None,
        source_position: int = 0,
        aux: bytes = b"",
        publish: bool = False,
    ) -> PutResult:
        """Store one chunk payload atomically (readers see it only once complete and checksummed).

        Idempotent per key: if ``key`` is already held nothing changes and ``stored`` is False
        (with ``publish`` a missing remote copy is still written). ``payload`` is bytes-like, a
        numpy array or a contiguous tensor of exactly ``layout.bytes_per_token * num_tokens``
        bytes. ``publish`` also writes a remote copy for other sidecars. Puts of different
        keys run in parallel (see the lock model in the module docstring).

        Raises ``ValueError``/``TypeError`` for bad arguments, ``QuotaExceededError`` when the
        tenant's ``max_bytes`` would be exceeded, ``CapacityError`` when no tier can take the
        chunk without dropping data it must keep; all of these leave the store unchanged.
        """
        return self._writes.put(key, payload, layout=layout, num_tokens=num_tokens, tenant=tenant, scope=scope,
                                source_position=source_position, aux=aux, publish=publish)

    def get(self, key: bytes, *, promote: bool | None = None) -> FetchedChunk | None:
        """``get_many([key])[0]``."""
        return self._reads.get_many([key], promote=promote)[0]

    def get_many(self, keys: Sequence[bytes], *, promote: bool | None = None) -> list[FetchedChunk | None]:
        """Payloads of ``keys`` in order; ``None`` for a miss (absent, lost, corrupt: never an
        error). Every payload is checksum-verified. Disk and remote reads are batched into one
        LMCache task each. A key this store never saw is looked up on the remote tier (another
        sidecar may have published it). Hits below the fastest tier are then promoted on the
        calling thread (``promote`` overrides ``config.promote_on_hit``; this may demote other
        chunks to disk), unless a mover is busy, in which case promotion is skipped rather than
        waited for.
        """
        return self._reads.get_many(keys, promote=promote)

    # ------------------------------------------------------------------ public API: the shared pool

    @property
    def pool(self):
        """The shared pool (``sidecar.shm.pool.PoolFile``), or None when there is none."""
        return self._pool_slots.pool

    def lease(self, keys: list[bytes]) -> list[PoolRead | None]:
        """Pin the CPU copy of each key and say where its payload is (None: not in the pool)."""
        return self._pool_slots.lease(keys)

    def unlease(self, reads: list[PoolRead]) -> None:
        """End leases; an object removed while leased is freed with its last lease."""
        self._pool_slots.unlease(reads)

    @property
    def leased(self) -> int:
        """Chunks pinned by leases now."""
        return self._pool_slots.leased

    def reserve_slot(self, key: bytes, nbytes: int, tenant: str) -> Slot | None:
        """A slot for ``key``'s payload of ``nbytes`` (None: the key is held already, or there is
        no shared pool). Raises ``QuotaExceededError`` / ``CapacityError`` as ``put`` would."""
        return self._pool_slots.reserve_slot(key, nbytes, tenant)

    def drop_slot(self, slot: Slot) -> bool:
        """Free a slot that will not be committed; False when it was not reserved (any more)."""
        return self._pool_slots.drop_slot(slot)

    def put_slot(self, slot: Slot, *, layout: KVLayout, num_tokens: int, tenant: str, scope: str | None = None,
                 source_position: int = 0, aux: bytes = b"", publish: bool = False,
                 payload_checksum: int | None = None) -> PutResult:
        """``put`` of a filled slot: checksummed as its bytes are now (``payload_checksum``: as
        the caller computed them from the slot just before, ``slot_checksums``), its header
        written, and indexed in the CPU tier, without a copy. The slot is used up either way."""
        return self._pool_slots.put_slot(slot, layout=layout, num_tokens=num_tokens, tenant=tenant, scope=scope,
                                         source_position=source_position, aux=aux, publish=publish,
                                         payload_checksum=payload_checksum)

    # ------------------------------------------------------------------ public API: queries

    @property
    def config(self) -> StoreConfig:
        return self._core.config

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The configured tiers, fastest first."""
        return self._core.chain

    def locate(self, key: bytes) -> Tier | None:
        """The fastest tier holding ``key`` (``None``: not held, as far as this store knows)."""
        core = self._core
        with core.lock:
            e = core.place.entries.get(check_key(key))
            return e.fastest() if e is not None else None

    def tiers_of(self, key: bytes) -> frozenset[Tier]:
        core = self._core
        with core.lock:
            e = core.place.entries.get(check_key(key))
            return e.tiers() if e is not None else frozenset()

    def contains(self, key: bytes) -> bool:
        return self.locate(key) is not None

    def meta(self, key: bytes) -> ChunkMeta | None:
        core = self._core
        with core.lock:
            e = core.place.entries.get(check_key(key))
            return e.meta if e is not None else None

    def list_chunks(self, tier: Tier | None = None) -> list[ChunkMeta]:
        """Metadata of every chunk held (in ``tier`` only, when given), least recently used
        first. After a restart, ``list_chunks(Tier.DISK)`` is what the disk tier recovered."""
        core = self._core
        with core.lock:
            if tier is None:
                return [e.meta for e in core.place.entries.values()]
            lru = core.place.lru.get(Tier(tier))
            return [e.meta for e in lru.values()] if lru is not None else []

    def tenant_usage(self, tenant: str) -> int:
        """Payload bytes of ``tenant``'s chunks held anywhere (what ``max_bytes`` bounds; a put
        in flight counts from its start)."""
        core = self._core
        with core.lock:
            return core.place.tenant_bytes[tenant]

    def tenant_tier_usage(self, tenant: str) -> dict[Tier, tuple[int, int]]:
        """(bytes, objects) of ``tenant``'s chunks in each configured tier (its own ``Stats``)."""
        p = self._core.place
        with self._core.lock:
            return {t: (p.tenant_used[(tenant, t)], len(p.tenant_lru.get((tenant, t), ()))) for t in p.lru}

    def set_guards(self, guards: dict[bytes, Guard]) -> None:
        """Set (``Guard.NONE``: clear) the guard of each key. Keys need not be held yet: a
        guard applies from the chunk's first put on. Cheap (index lock, one dict write each)."""
        core = self._core
        with core.lock:
            for key, g in guards.items():
                core.place.set_guard(check_key(key), g)

    def guarded_bytes(self, tier: Tier) -> int:
        """Footprint of ``tier``'s chunks that victim selection may not take there."""
        core = self._core
        with core.lock:
            return core.place.guarded_bytes(Tier(tier)) if Tier(tier) in core.place.lru else 0

    def capacity_of(self, tier: Tier) -> int:
        return self._core.place.capacity.get(Tier(tier), 0)

    def object_footprint(self, payload_nbytes: int) -> int:
        """Bytes a new chunk of ``payload_nbytes`` takes in the fastest tier."""
        core = self._core
        return core.io.footprint(core.chain[0], object_nbytes(payload_nbytes)) if core.chain else 0

    def room(self, need: int) -> tuple[int, int, int] | None:
        """None when ``need`` more bytes fit the tiers' free space; otherwise (capacity, used,
        guarded) over all tiers, ``guarded`` being what victim selection may never take (the
        resident claims' share; kept incrementally, O(tiers))."""
        core = self._core
        with core.lock:
            return core.place.room(need)

    def pins_in_flight(self) -> int:
        """Read pins held right now (each ``get_many`` releases its own on every path)."""
        core = self._core
        with core.lock:
            return core.active_reads

    def take_events(self) -> list[TierEvent]:
        """Drain placement events in the order they happened (see ``sidecar.tiers.events``)."""
        return self._core.events.take()

    def stats(self) -> StoreStats:
        core = self._core
        with core.lock:
            return core.counters.snapshot(
                capacity=core.place.capacity,
                used=core.place.used,
                objects={t: len(lru) for t, lru in core.place.lru.items()},
                events_dropped=core.events.dropped,
                remote_reconnects=core.io.remote.reconnects if core.io.remote is not None else 0,
            )

    # ------------------------------------------------------------------ public API: operators

    def evict(self, keys: Sequence[bytes]) -> int:
        """Operator eviction: move each chunk one tier down from its fastest tier (dropped when
        it is already in the last tier). Returns how many chunks moved or were dropped."""
        core = self._core
        keys = [check_key(k) for k in keys]
        done = 0
        with core.writer():
            for key in keys:
                with core.lock:
                    e = core.place.entries.get(key)
                    tier = e.fastest() if e is not None else None
                if e is None or tier is None:
                    continue
                try:
                    core.move_down(e, tier, Reason.OPERATOR)
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
        core = self._core
        removed = 0
        for key in keys:
            with core.stripe(key), core.writer():
                with core.lock:
                    e = core.place.entries.get(key)
                    if e is None:
                        unknown.append(key)
                        continue
                    held = e.tiers()
                    fastest = e.fastest()
                    for tier in held:
                        core.detach(e, tier)
                    core.place.forget(e)
                    core.emit(EventKind.DELETED, e, fastest, None, Reason.OPERATOR)
                for tier in held:
                    core.drain_and_remove(e, tier, deleting=True)
                removed += 1
        return removed

    def _delete_remote(self, unknown: list[ChunkKey]) -> None:
        core = self._core
        if not unknown or core.io.remote is None:
            return
        with core.writer():
            with core.lock:
                core.remote_removing.update(unknown)
            try:
                if not core.io.remote.remove(unknown):
                    logger.error("remote delete of %d unknown chunks could not be confirmed", len(unknown))
            finally:
                with core.lock:
                    core.remote_removing.subtract(unknown)
                    for key in unknown:
                        if core.remote_removing[key] <= 0:
                            del core.remote_removing[key]

    def spill(self, budget_s: float) -> tuple[int, int]:
        """Move what only the memory tiers (GPU, CPU) hold down to the disk tier, most recently
        used first, for at most ``budget_s`` seconds: a graceful stop then loses nothing a
        restart could recover (the disk tier is re-indexed at start). Returns (moved, left):
        ``left`` counts the chunks still only in memory (no disk tier, no room, time out).
        Older disk chunks make room by the ordinary LRU order."""
        core = self._core
        lru = core.place.lru
        memory = tuple(core.io.mem)  # the configured memory tiers (GPU, CPU), fastest first
        with core.lock:
            if core.closed:
                return 0, 0
            todo = [(t, e) for t in memory for e in reversed(lru[t].values()) if not e.remote]
        if Tier.DISK not in lru or not todo:
            return 0, len(todo)
        deadline = time.monotonic() + budget_s
        moved = 0
        with core.writer():
            for i, (tier, e) in enumerate(todo):
                if time.monotonic() >= deadline:
                    return moved, len(todo) - i
                with core.lock:
                    if e.local != tier or e.busy(tier):
                        continue
                try:
                    core.move_down(e, tier, Reason.SHUTDOWN)
                except NoRoom:
                    continue
                with core.lock:
                    moved += e.local == Tier.DISK
        with core.lock:
            left = sum(1 for t in memory for e in lru[t].values() if not e.remote)
        return moved, left

    def close(self) -> None:
        """Release every backend; bounded by ``config.close_timeout_s`` per step (a hung remote
        is abandoned, not waited for). Calls after close raise ``TierUnavailableError``; reads
        and puts in flight finish first, and if they do not the memory pools are leaked rather
        than freed under them. Idempotent."""
        core = self._core
        with core.lock:
            if core.closed:
                return
            core.closed = True
        self._pool_slots.drop_all_slots()
        with core.lock:
            drained = core.cv.wait_for(
                lambda: core.active_reads == 0 and core.active_puts == 0, timeout=core.config.close_timeout_s
            )
        acquired = core.mover.acquire(timeout=core.config.close_timeout_s)
        try:
            core.io.close(free_memory=drained and acquired)
        finally:
            if acquired:
                core.mover.release()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
