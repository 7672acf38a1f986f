"""``TieredStore``: chunk KV across GPU / CPU / disk / remote tiers, the orchestrator.

Three parts (vLLM keeps ``BlockPool`` apart from ``KVCacheManager`` the same way):

* ``sidecar.tiers.placement``: the index and the pure decisions (which tier, which victim,
  accounting, quotas, guards); no I/O, no locks;
* ``sidecar.tiers.tier_io``: the backends and every movement of bytes; no decisions;
* this module: the public API, the locks, and the sequences (make room, write, attach).

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

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from sidecar.identity import KVLayout
from sidecar.tiers.codec import as_byte_tensor, payload_nbytes
from sidecar.tiers.config import StoreConfig
from sidecar.tiers.envelope import HEADER_NBYTES, MAX_AUX_BYTES, MAX_TEXT_CHARS, object_nbytes
from sidecar.tiers.errors import CapacityError, QuotaExceededError, TierUnavailableError
from sidecar.tiers.events import EventBuffer, EventKind, Reason, TierEvent
from sidecar.tiers.l2_tiers import LoadFailure
from sidecar.tiers.placement import Entry, Guard, Placement
from sidecar.tiers.stats import Counters, StoreStats
from sidecar.tiers.tier_io import IOFailure, SourceLost, TierIO, encode_into, host_copy, object_ok
from sidecar.tiers.types import MAX_KEY_BYTES, ChunkKey, ChunkMeta, FetchedChunk, PutResult, Tier

logger = logging.getLogger(__name__)

__all__ = ["Guard", "TieredStore"]

_STRIPES = 64


class _NoRoom(Exception):
    def __init__(self, tier: Tier, requested: int, reason: str) -> None:
        super().__init__(f"{tier.value}: {reason}")
        self.tier = tier
        self.requested = requested
        self.reason = reason


@functools.lru_cache(maxsize=256)
def _layout_fingerprint(layout: KVLayout) -> str:
    # KVLayout.fingerprint() JSON-encodes the layout on every call (~50 us); layouts are few.
    return layout.fingerprint()


def _check_key(key: object) -> ChunkKey:
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"key must be bytes, got {type(key).__name__}")
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    return ChunkKey(bytes(key))


def _check_text(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    if len(value) > MAX_TEXT_CHARS:
        raise ValueError(f"{name} must be at most {MAX_TEXT_CHARS} characters")
    return value


class TieredStore:
    """Chunk KV store over LMCache tiers. Thread-safe; every method may block on I/O (call it
    from a worker thread, e.g. ``asyncio.to_thread``, in an event-loop server).

    LMCache's own ``StorageManager`` (L1 + L2 with its store/prefetch controllers) is not used:
    it evicts on a timer by dropping at a watermark instead of demoting synchronously, has no
    per-tenant quotas, guards or read pins, and learns recency only from explicit touches; the
    store drives LMCache's L1 manager and L2 adapters directly instead."""

    def __init__(self, config: StoreConfig) -> None:
        self._config = config
        self._lock = threading.Lock()  # the index: placement, counters
        self._cv = threading.Condition(self._lock)  # readers unpinning, writers finishing
        self._mover = threading.RLock()  # moves of existing chunks (see the module docstring)
        self._stripes = tuple(threading.Lock() for _ in range(_STRIPES))
        self._closed = False
        self._active_reads = 0  # pins held by readers; close() waits for them before freeing pools
        self._active_puts = 0  # puts writing without the mover; close() waits for them too
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
        """The mover lock under its old name (tests/test_sync_off_loop.py holds it to stand for
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
            e = self._place.entries.get(_check_key(key))
            return e.fastest() if e is not None else None

    def tiers_of(self, key: bytes) -> frozenset[Tier]:
        with self._lock:
            e = self._place.entries.get(_check_key(key))
            return e.tiers() if e is not None else frozenset()

    def contains(self, key: bytes) -> bool:
        return self.locate(key) is not None

    def meta(self, key: bytes) -> ChunkMeta | None:
        with self._lock:
            e = self._place.entries.get(_check_key(key))
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
                self._place.set_guard(_check_key(key), g)

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

    # ------------------------------------------------------------------ public API: put

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
        key = _check_key(key)
        tenant = _check_text("tenant", tenant)
        scope = _check_text("scope", scope if scope is not None else tenant)
        if not isinstance(layout, KVLayout):
            raise TypeError("layout must be a KVLayout")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
            raise ValueError("num_tokens must be a positive int")
        if isinstance(source_position, bool) or not isinstance(source_position, int) or source_position < 0:
            raise ValueError("source_position must be a non-negative int")
        if not isinstance(aux, (bytes, bytearray)) or len(aux) > MAX_AUX_BYTES:
            raise ValueError(f"aux must be bytes of at most {MAX_AUX_BYTES}")
        buf = as_byte_tensor(payload)
        expected = payload_nbytes(layout, num_tokens)
        if buf.numel() != expected:
            raise ValueError(
                f"payload is {buf.numel()} bytes but kv_layout x num_tokens ({num_tokens}) needs {expected}"
            )
        if buf.device.type != "cpu":
            buf = buf.cpu()
        meta = ChunkMeta(
            key=key,
            tenant=tenant,
            scope=scope,
            layout_fingerprint=_layout_fingerprint(layout),
            num_tokens=num_tokens,
            payload_nbytes=expected,
            source_position=source_position,
            aux=bytes(aux),
            created_at=time.time(),
        )
        obj_nbytes = object_nbytes(expected)
        with self._stripe(key):
            with self._lock:
                self._check_open()
                existing = self._place.entries.get(key)
                if existing is not None:
                    self._counters.duplicate_puts += 1
                else:
                    try:
                        self._place.reserve_quota(tenant, expected)
                    except QuotaExceededError:
                        self._counters.quota_refusals += 1
                        raise
                    try:
                        candidates = self._candidates(obj_nbytes, tenant)
                    except BaseException:
                        self._place.release_quota(tenant, expected)
                        raise
                    self._active_puts += 1
            if existing is not None:
                published = self._publish(existing) if publish else existing.remote
                return PutResult(key, existing.fastest() or Tier.REMOTE, False, published)
            try:
                placed = self._place_new(candidates, meta, buf, obj_nbytes)
            finally:
                with self._lock:
                    self._active_puts -= 1
                    self._cv.notify_all()
                    entry = self._place.entries.get(key)
            published = (self._publish(entry) if publish else entry.remote) if entry is not None else False
            return PutResult(key, placed, True, published)

    def _stripe(self, key: ChunkKey) -> threading.Lock:
        return self._stripes[hash(key) % _STRIPES]

    def _candidates(self, obj_nbytes: int, tenant: str) -> list[Tier]:
        """``Placement.candidates``, waiting briefly for readers to unpin; raises
        ``CapacityError`` when no tier could take the object. Index lock held."""
        p = self._place
        deadline = time.monotonic() + self._config.pin_wait_s
        while True:
            out = p.candidates(obj_nbytes, tenant)
            if out:
                return out
            if not any(p.pinned_bytes(t) for t in self._chain) or not self._wait_unpin(deadline):
                break
        self._counters.capacity_refusals += 1
        tier = p.first_tier_that_holds(obj_nbytes)
        guarded = p.guarded_bytes(tier) if tier is not None else 0
        raise CapacityError(
            tier=tier,
            requested_bytes=obj_nbytes,
            used_bytes=p.used[tier] if tier is not None else 0,
            capacity_bytes=p.capacity[tier] if tier is not None else max(p.capacity.values()),
            pinned_bytes=p.pinned_bytes(tier) if tier is not None else 0,
            reason=("held by resident claims" if guarded else "pinned by readers") if tier is not None
            else "larger than any tier",
            guarded_bytes=guarded,
        )

    def _place_new(self, candidates: list[Tier], meta: ChunkMeta, buf: torch.Tensor, obj_nbytes: int) -> Tier:
        """Write a new chunk to the first candidate tier that takes it and index it; the
        tenant's quota is already reserved (given back on refusal)."""
        last: _NoRoom | None = None
        failed: IOFailure | None = None
        key = meta.key
        for tier in candidates:
            fp = self._io.footprint(tier, obj_nbytes)
            try:
                self._reserve_room(tier, fp, meta.tenant)
            except _NoRoom as exc:
                last = exc
                continue
            try:
                meta_written = self._write_new(tier, meta, buf, obj_nbytes)
            except _NoRoom as exc:
                self._release(tier, meta.tenant, fp)
                last = exc
                continue
            except IOFailure as exc:
                self._release(tier, meta.tenant, fp)
                logger.warning("write of %s to %s failed; trying the next tier", key.hex(), tier.value)
                failed = exc
                continue
            except BaseException:
                self._release(tier, meta.tenant, fp)
                with self._lock:
                    self._place.release_quota(meta.tenant, meta.payload_nbytes)
                raise
            with self._lock:
                e = Entry(meta=meta_written, obj_nbytes=obj_nbytes)
                self._place.add(e, quota_reserved=True)
                self._place.attach(e, tier, reserved=True)
                c = self._counters
                c.puts += 1
                c.put_bytes += meta.payload_nbytes
                c.tiers[tier].write_bytes += obj_nbytes
            return tier
        p = self._place
        with self._lock:
            p.release_quota(meta.tenant, meta.payload_nbytes)
            if last is None and failed is not None:  # not full: the backend failed every write
                raise TierUnavailableError(f"no tier took the chunk: {failed}")
            self._counters.capacity_refusals += 1
            tier = last.tier if last is not None else (candidates[-1] if candidates else None)
            raise CapacityError(
                tier=tier,
                requested_bytes=obj_nbytes,
                used_bytes=p.used[tier] if tier is not None else 0,
                capacity_bytes=p.capacity[tier] if tier is not None else 0,
                pinned_bytes=p.pinned_bytes(tier) if tier is not None else 0,
                reason=last.reason if last is not None else "larger than any tier",
                guarded_bytes=p.guarded_bytes(tier) if tier is not None else 0,
            )

    def _write_new(self, tier: Tier, meta: ChunkMeta, payload: torch.Tensor, obj_nbytes: int) -> ChunkMeta:
        """Encode (header + payload + checksum) into ``tier``; room is reserved. No lock held
        but the key's stripe: this is the part concurrent puts run side by side."""
        key = meta.key
        if tier == Tier.CPU:
            mem = self._io.mem[tier]
            dst = self._stage_with_room(tier, key, obj_nbytes)
            try:
                meta = encode_into(dst, meta, payload)
            except BaseException:
                mem.abort(key)
                raise
            mem.commit(key)
            return meta
        host = self._io.scratch(obj_nbytes)
        meta = encode_into(host, meta, payload)
        try:
            self._write_object(tier, key, host)
        except IOFailure:
            self._io.drop_scratch()
            raise
        return meta

    def _release(self, tier: Tier, tenant: str, fp: int) -> None:
        with self._lock:
            self._place.release(tier, tenant, fp)
            self._cv.notify_all()

    def _publish(self, e: Entry) -> bool:
        """Give ``e`` a remote copy (best effort; False when there is no remote or it failed)."""
        if self._io.remote is None or e.remote:
            return e.remote
        with self._mover:
            with self._lock:
                if self._closed or self._place.entries.get(e.key) is not e or e.local is None or e.remote or e.moving:
                    return e.remote
                src = e.local
                e.moving = True
            fp = self._io.footprint(Tier.REMOTE, e.obj_nbytes)
            try:
                if fp > self._place.capacity[Tier.REMOTE]:
                    return False
                self._reserve_room(Tier.REMOTE, fp, e.tenant)
                try:
                    self._copy_object(e, src, Tier.REMOTE)
                except BaseException:
                    self._release(Tier.REMOTE, e.tenant, fp)
                    raise
            except SourceLost as lost:
                e.moving = False
                self._lose(e, lost.tier, Reason.CORRUPTION)
                return False
            except (_NoRoom, IOFailure) as exc:
                logger.warning("publishing %s to the remote tier failed: %s", e.key.hex(), exc)
                return False
            finally:
                e.moving = False
            with self._lock:
                self._place.attach(e, Tier.REMOTE, reserved=True)
                self._counters.tiers[Tier.REMOTE].write_bytes += e.obj_nbytes
            return True

    # ------------------------------------------------------------------ public API: get

    def get(self, key: bytes, *, promote: bool | None = None) -> FetchedChunk | None:
        """``get_many([key])[0]``."""
        return self.get_many([key], promote=promote)[0]

    def get_many(self, keys: Sequence[bytes], *, promote: bool | None = None) -> list[FetchedChunk | None]:
        """Payloads of ``keys`` in order; ``None`` for a miss (absent, lost, corrupt: never an
        error). Every payload is checksum-verified. Disk and remote reads are batched into one
        LMCache task each. A key this store never saw is looked up on the remote tier (another
        sidecar may have published it). Hits below the fastest tier are then promoted on the
        calling thread (``promote`` overrides ``config.promote_on_hit``; this may demote other
        chunks to disk), unless a mover is busy, in which case promotion is skipped rather than
        waited for.
        """
        keys = [_check_key(k) for k in keys]
        promote = self._config.promote_on_hit if promote is None else promote
        results: list[FetchedChunk | None] = [None] * len(keys)
        objects: dict[int, torch.Tensor] = {}
        with self._lock:
            self._check_open()
            reads: list[tuple[int, Entry, Tier]] = []
            foreign: list[int] = []
            for i, key in enumerate(keys):
                e = self._place.entries.get(key)
                tier = e.fastest() if e is not None else None
                if e is None or tier is None:
                    if self._io.remote is not None and key not in self._remote_removing:
                        foreign.append(i)
                    continue
                self._pin(e, tier)
                reads.append((i, e, tier))
        failed = self._read(reads, results, objects)
        retry: list[tuple[int, Entry, Tier]] = []
        for i, e, tier, reason in failed:
            self._lose(e, tier, reason)
            with self._lock:
                if e.remote and tier != Tier.REMOTE and self._place.entries.get(e.key) is e:
                    self._pin(e, Tier.REMOTE)
                    retry.append((i, e, Tier.REMOTE))
        for _, e, tier, reason in self._read(retry, results, objects):
            self._lose(e, tier, reason)
        if foreign:
            fetched, bad = self._io.read_foreign([keys[i] for i in foreign])
            for i, (chunk, obj) in zip(foreign, fetched, strict=True):
                if chunk is not None:
                    results[i] = chunk
                    objects[i] = obj
            if bad:
                with self._lock:
                    self._counters.checksum_failures += bad
        with self._lock:
            c = self._counters
            c.gets += len(keys)
            for r in results:
                if r is None:
                    c.misses += 1
                else:
                    c.hits += 1
                    c.get_bytes += r.meta.payload_nbytes
                    c.tiers[r.tier].hits += 1
                    c.tiers[r.tier].read_bytes += object_nbytes(r.meta.payload_nbytes)
        if promote and self._chain:
            self._promote_hits(results, objects)
        return results

    def _pin(self, e: Entry, tier: Tier) -> None:
        e.readers[tier] = e.readers.get(tier, 0) + 1
        self._active_reads += 1
        self._place.touch(e, tier)

    def _unpin(self, e: Entry, tier: Tier) -> None:
        self._active_reads -= 1
        n = e.readers[tier] - 1
        if n:
            e.readers[tier] = n
        else:
            del e.readers[tier]

    def _read(
        self,
        reads: list[tuple[int, Entry, Tier]],
        results: list[FetchedChunk | None],
        objects: dict[int, torch.Tensor],
    ) -> list[tuple[int, Entry, Tier, Reason]]:
        """Read pinned entries into ``results``; returns the failures. Unpins everything."""
        failed: list[tuple[int, Entry, Tier, Reason]] = []
        try:
            batches: dict[Tier, list[tuple[int, Entry]]] = {}
            for i, e, tier in reads:
                if tier in self._io.mem:
                    payload = self._io.read_memory(tier, e.key, e.meta)
                    if payload is None:
                        failed.append((i, e, tier, Reason.CORRUPTION))
                    else:
                        results[i] = FetchedChunk(e.meta, tier, payload)
                else:
                    batches.setdefault(tier, []).append((i, e))
            for tier, items in batches.items():
                if not self._io.available(tier):
                    continue  # misses while the tier is avoided (breaker open); nothing is removed
                try:
                    objs = self._io.load_batch(tier, [e.key for _, e in items], [e.obj_nbytes for _, e in items])
                except TimeoutError:
                    # Slow, not lost: these are misses this time and nothing is removed.
                    logger.warning("%s read of %d chunks timed out", tier.value, len(items))
                    with self._lock:
                        self._counters.io_errors += 1
                    continue
                for (i, e), obj in zip(items, objs, strict=True):
                    if isinstance(obj, LoadFailure):
                        reason = Reason.MISSING if obj is LoadFailure.MISSING else Reason.CORRUPTION
                        failed.append((i, e, tier, reason))
                    elif not object_ok(obj, e.meta):
                        if tier == Tier.REMOTE:
                            self._io.remote.suspect()
                        failed.append((i, e, tier, Reason.CORRUPTION))
                    else:
                        results[i] = FetchedChunk(e.meta, tier, obj[HEADER_NBYTES:])
                        objects[i] = obj
        finally:
            with self._lock:
                for _, e, tier in reads:
                    self._unpin(e, tier)
                self._cv.notify_all()
        return failed

    def _promote_hits(self, results: list[FetchedChunk | None], objects: dict[int, torch.Tensor]) -> None:
        top = self._chain[0]
        wanted = [(i, r) for i, r in enumerate(results) if r is not None and r.tier != top]
        if not wanted or not self._mover.acquire(blocking=False):
            return
        try:
            if self._closed:
                return
            for i, r in wanted:
                self._promote(r, objects.get(i), top)
        finally:
            self._mover.release()

    def _promote(self, r: FetchedChunk, obj: torch.Tensor | None, top: Tier) -> None:
        """Copy a hit up to ``top`` and drop its slower local copy. Mover held. Skipped while
        the key's stripe is taken: a put of the same key may be placing it (a foreign chunk
        is not in the index yet, so both would stage the key in ``top``)."""
        stripe = self._stripe(r.meta.key)
        if not stripe.acquire(blocking=False):
            return
        try:
            self._promote_locked(r, obj, top)
        finally:
            stripe.release()

    def _promote_locked(self, r: FetchedChunk, obj: torch.Tensor | None, top: Tier) -> None:
        key = r.meta.key
        p = self._place
        with self._lock:
            e = p.entries.get(key)
            if e is None:
                if r.tier != Tier.REMOTE or key in self._remote_removing:
                    return
                quota = self._config.quota_for(r.meta.tenant).max_bytes
                if quota is not None and p.tenant_bytes[r.meta.tenant] + r.meta.payload_nbytes > quota:
                    return
                # A chunk published by another sidecar: this store now tracks its remote copy.
                e = Entry(meta=r.meta, obj_nbytes=object_nbytes(r.meta.payload_nbytes))
                p.add(e)
                p.attach(e, Tier.REMOTE)
            if e.moving or e.fastest() != r.tier or e.meta != r.meta:
                return
            fp = self._io.footprint(top, e.obj_nbytes)
            if not p.could_hold(top, fp, e.tenant) or not p.reclaimable(top, fp, e.tenant):
                return
            e.moving = True
        src = r.tier
        try:
            self._reserve_room(top, fp, e.tenant)
            try:
                if obj is not None:
                    self._write_object(top, key, obj)
                else:
                    self._copy_object(e, src, top)
            except BaseException:
                self._release(top, e.tenant, fp)
                raise
        except (_NoRoom, IOFailure, SourceLost) as exc:
            logger.debug("promotion of %s skipped: %s", key.hex(), exc)
            e.moving = False
            return
        with self._lock:
            if src != Tier.REMOTE:
                p.detach(e, src)
            p.attach(e, top, reserved=True)
            self._counters.promotions += 1
            self._counters.tiers[top].promotions_in += 1
            self._counters.tiers[top].write_bytes += e.obj_nbytes
            self._emit(EventKind.PROMOTED, e, src, top, Reason.HIT)
        if src != Tier.REMOTE:
            self._drain_and_remove(e, src)
        e.moving = False

    # ------------------------------------------------------------------ public API: operators

    def evict(self, keys: Sequence[bytes]) -> int:
        """Operator eviction: move each chunk one tier down from its fastest tier (dropped when
        it is already in the last tier). Returns how many chunks moved or were dropped."""
        keys = [_check_key(k) for k in keys]
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
                except _NoRoom as exc:
                    logger.warning("evict %s: %s", key.hex(), exc)
                    continue
                done += 1
        return done

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove chunks from every tier, the remote copy included (waits for in-flight reads of
        them, and for a put of the same key in flight). Keys this store does not know are still
        deleted from the remote tier (another sidecar, or this one before a restart, may have
        published them). Idempotent; returns how many chunks this store held."""
        keys = [_check_key(k) for k in keys]
        removed = 0
        unknown: list[ChunkKey] = []
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
        if unknown and self._io.remote is not None:
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
        return removed

    def spill(self, budget_s: float) -> tuple[int, int]:
        """Move what only the memory tiers (GPU, CPU) hold down to the disk tier, most recently
        used first, for at most ``budget_s`` seconds: a graceful stop then loses nothing a
        restart could recover (the disk tier is re-indexed at start). Returns (moved, left):
        ``left`` counts the chunks still only in memory (no disk tier, no room, time out).
        Older disk chunks make room by the ordinary LRU order."""
        lru = self._place.lru
        with self._lock:
            if self._closed:
                return 0, 0
            todo = [(t, e) for t in (Tier.GPU, Tier.CPU) if t in lru
                    for e in reversed(lru[t].values()) if not e.remote]
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
                except _NoRoom:
                    continue
                with self._lock:
                    moved += e.local == Tier.DISK
        with self._lock:
            left = sum(1 for t in (Tier.GPU, Tier.CPU) if t in lru for e in lru[t].values() if not e.remote)
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

    # ------------------------------------------------------------------ moving bytes

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

    def _reserve_room(self, tier: Tier, fp: int, tenant: str) -> None:
        """Reserve ``fp`` bytes in ``tier`` (and the tenant's share of it) for a write. When they
        fit, one index-lock step; otherwise, under the mover, demote LRU chunks out of the way
        first. Raises ``_NoRoom`` when only pinned or guarded chunks are left."""
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
                        raise _NoRoom(tier, fp, "pinned by readers")
                self._move_down(victim, tier, Reason.QUOTA if over_share else Reason.CAPACITY)

    def _stage_with_room(self, tier: Tier, key: ChunkKey, obj_nbytes: int) -> torch.Tensor:
        """Stage in a pool tier (room reserved); when the allocator is fragmented, demote more."""
        mem = self._io.mem[tier]
        dst = mem.stage(key, obj_nbytes)
        if dst is not None:
            return dst
        deadline = time.monotonic() + self._config.pin_wait_s
        with self._mover:
            while True:
                dst = mem.stage(key, obj_nbytes)
                if dst is not None:
                    return dst
                with self._lock:
                    victim = self._place.pick_victim(tier, None)
                    if victim is None:
                        if self._wait_unpin(deadline):
                            continue
                        raise _NoRoom(tier, obj_nbytes, "allocator full")
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
            refused: _NoRoom | None = None
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
                except _NoRoom as exc:
                    refused = exc
                    continue
                try:
                    self._copy_object(e, src, tier)
                except SourceLost as lost:
                    self._release(tier, e.tenant, fp)
                    self._lose(e, lost.tier, Reason.CORRUPTION)
                    return
                except _NoRoom as exc:
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
                raise _NoRoom(src, e.obj_nbytes, f"cannot demote: {refused.tier.value} {refused.reason}")
            if dst is None and io_failed:
                if p.guards.get(e.key) is Guard.NO_DROP:  # a claim keeps it: backpressure instead
                    raise _NoRoom(src, e.obj_nbytes, "cannot demote: the lower tiers are failing (claimed chunk)")
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
            if not self._cv.wait_for(lambda: tier not in e.readers, timeout=self._config.io_timeout_s):
                logger.error("readers of %s in %s did not finish; removing anyway", e.key.hex(), tier.value)
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
