"""``TieredStore``: chunk KV across GPU / CPU / disk / remote tiers, with placement policy.

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
* Writers (put, demotion, promotion, evict, delete) are serialized by one lock and may block on
  I/O; readers run concurrently and pin what they read, so a victim is never freed under a
  reader. A promotion is skipped rather than waited for when a writer is busy.
* Every change the caller did not directly ask for is reported by ``take_events()``; a chunk
  whose bytes are gone or corrupt is a miss (``None``), never an exception.
* Guards (resident claims, ``sidecar.claims``): ``set_guards`` marks chunks ``Guard.SOFT``
  (a second chance: skipped once as a victim), ``Guard.NO_DROP`` (may be demoted, never dropped
  from the last tier: the claim stays restorable) or ``Guard.HOLD`` (never demoted nor dropped).
  Victim selection skips them with one dict lookup per candidate; a put that only guarded
  chunks block is refused with ``CapacityError`` whose ``guarded_bytes`` says so.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from sidecar.identity import KVLayout
from sidecar.tiers.breaker import Breaker
from sidecar.tiers.codec import as_byte_tensor, payload_nbytes
from sidecar.tiers.config import StoreConfig
from sidecar.tiers.envelope import (
    HEADER_NBYTES,
    MAX_AUX_BYTES,
    MAX_TEXT_CHARS,
    CorruptChunkError,
    checksum,
    object_nbytes,
    parse_header,
    write_header,
)
from sidecar.tiers.errors import CapacityError, QuotaExceededError, TierUnavailableError
from sidecar.tiers.events import EventBuffer, EventKind, Reason, TierEvent
from sidecar.tiers.l2_tiers import DiskTier, LoadFailure, RemoteTier
from sidecar.tiers.memory_tiers import CpuTier, DeviceTier, MemoryTier
from sidecar.tiers.stats import Counters, StoreStats
from sidecar.tiers.types import MAX_KEY_BYTES, TIER_ORDER, ChunkKey, ChunkMeta, FetchedChunk, PutResult, Tier

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Entry:
    meta: ChunkMeta
    obj_nbytes: int
    local: Tier | None = None
    remote: bool = False
    readers: dict[Tier, int] = field(default_factory=dict)
    moving: bool = False

    @property
    def key(self) -> ChunkKey:
        return self.meta.key

    @property
    def tenant(self) -> str:
        return self.meta.tenant

    def tiers(self) -> frozenset[Tier]:
        held = {self.local} if self.local is not None else set()
        if self.remote:
            held.add(Tier.REMOTE)
        return frozenset(held)

    def fastest(self) -> Tier | None:
        return self.local if self.local is not None else (Tier.REMOTE if self.remote else None)


class Guard(enum.IntEnum):
    """How a claimed chunk may be chosen as a victim (see the module docstring)."""

    NONE = 0
    SOFT = 1
    NO_DROP = 2
    HOLD = 3


class _NoRoom(Exception):
    def __init__(self, tier: Tier, requested: int, reason: str) -> None:
        super().__init__(f"{tier.value}: {reason}")
        self.tier = tier
        self.requested = requested
        self.reason = reason


class _IOFailure(Exception):
    pass


def _host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.device.type == "cpu" and src.device.type == "cpu":
        # numpy's memcpy is single-threaded and predictable; torch's copy_ spreads one memcpy
        # over the intra-op pool, which collapses on a busy 2-core host.
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


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
    from a worker thread, e.g. ``asyncio.to_thread``, in an event-loop server)."""

    def __init__(self, config: StoreConfig) -> None:
        self._config = config
        self._lock = threading.Lock()  # the index: entries, LRUs, accounting, counters
        self._cv = threading.Condition(self._lock)  # readers draining
        self._write_lock = threading.Lock()  # serializes every mutation of placement
        self._closed = False
        self._active_reads = 0  # pins held by readers; close() waits for them before freeing pools
        self._scratch: torch.Tensor | None = None
        self._events = EventBuffer(config.max_events)
        self._counters = Counters()
        self._mem: dict[Tier, MemoryTier] = {}
        self._disk: DiskTier | None = None
        self._remote: RemoteTier | None = None
        self._breakers = {Tier.DISK: Breaker("disk"), Tier.REMOTE: Breaker("remote")}
        try:
            self._open_backends(config)
        except BaseException:
            self._close_backends()
            raise
        self._chain: tuple[Tier, ...] = tuple(t for t in TIER_ORDER if self._has(t))
        self._capacity = {t: self._backend(t).capacity_bytes for t in self._chain}
        self._used = {t: 0 for t in self._chain}
        self._lru: dict[Tier, OrderedDict[ChunkKey, _Entry]] = {t: OrderedDict() for t in self._chain}
        self._tenant_lru: dict[tuple[str, Tier], OrderedDict[ChunkKey, _Entry]] = {}
        self._tenant_used: Counter[tuple[str, Tier]] = Counter()
        self._tenant_bytes: Counter[str] = Counter()
        self._entries: dict[ChunkKey, _Entry] = {}
        # Remote copies this store is deleting: not looked up as "foreign" chunks meanwhile (a
        # RESP GET of a key deleted after its EXISTS hangs the connection until the timeout).
        self._remote_removing: Counter[ChunkKey] = Counter()
        self._guards: dict[ChunkKey, Guard] = {}
        self._second_chance: set[ChunkKey] = set()  # SOFT chunks already given their extra lap
        # Footprint of HOLD / NO_DROP chunks per tier, kept up to date by _attach, _detach and
        # set_guards, so the guarded share of a full tier is O(1) on every Store.
        self._guard_fp: dict[Guard, Counter[Tier]] = {Guard.HOLD: Counter(), Guard.NO_DROP: Counter()}
        if self._disk is not None:
            self._recover()

    def _open_backends(self, config: StoreConfig) -> None:
        if config.gpu_bytes > 0:
            device = torch.device(config.gpu_device)
            if device.type == "cuda" and not torch.cuda.is_available():
                logger.warning("store.gpu_bytes=%d but CUDA is not available: GPU tier disabled", config.gpu_bytes)
            else:
                self._mem[Tier.GPU] = DeviceTier(capacity_bytes=config.gpu_bytes, device=config.gpu_device)
        if config.cpu_bytes > 0:
            self._mem[Tier.CPU] = CpuTier(
                capacity_bytes=config.cpu_bytes, align_bytes=config.cpu_align_bytes, namespace=config.namespace
            )
        if config.disk_bytes > 0:
            assert config.disk_path is not None
            self._disk = DiskTier(
                path=config.disk_path,
                capacity_bytes=config.disk_bytes,
                namespace=config.namespace,
                workers=config.disk_workers,
                timeout_s=config.io_timeout_s,
            )
        if config.remote_bytes > 0:
            assert config.remote_url is not None
            self._remote = RemoteTier(
                url=config.remote_url,
                capacity_bytes=config.remote_bytes,
                namespace=config.namespace,
                workers=config.remote_workers,
                timeout_s=config.io_timeout_s,
            )

    def _has(self, tier: Tier) -> bool:
        if tier in (Tier.GPU, Tier.CPU):
            return tier in self._mem
        return (self._disk if tier == Tier.DISK else self._remote) is not None

    def _backend(self, tier: Tier):
        if tier in self._mem:
            return self._mem[tier]
        backend = self._disk if tier == Tier.DISK else self._remote
        assert backend is not None, f"tier {tier.value} is not configured; this indicates a placement bug"
        return backend

    def _footprint(self, tier: Tier, obj_nbytes: int) -> int:
        return self._backend(tier).footprint(obj_nbytes)

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
            e = self._entries.get(_check_key(key))
            return e.fastest() if e is not None else None

    def tiers_of(self, key: bytes) -> frozenset[Tier]:
        with self._lock:
            e = self._entries.get(_check_key(key))
            return e.tiers() if e is not None else frozenset()

    def contains(self, key: bytes) -> bool:
        return self.locate(key) is not None

    def meta(self, key: bytes) -> ChunkMeta | None:
        with self._lock:
            e = self._entries.get(_check_key(key))
            return e.meta if e is not None else None

    def list_chunks(self, tier: Tier | None = None) -> list[ChunkMeta]:
        """Metadata of every chunk held (in ``tier`` only, when given), least recently used
        first. After a restart, ``list_chunks(Tier.DISK)`` is what the disk tier recovered."""
        with self._lock:
            if tier is None:
                return [e.meta for e in self._entries.values()]
            lru = self._lru.get(Tier(tier))
            return [e.meta for e in lru.values()] if lru is not None else []

    def tenant_usage(self, tenant: str) -> int:
        """Payload bytes of ``tenant``'s chunks held anywhere (what ``max_bytes`` bounds)."""
        with self._lock:
            return self._tenant_bytes[tenant]

    def tenant_tier_usage(self, tenant: str) -> dict[Tier, tuple[int, int]]:
        """(bytes, objects) of ``tenant``'s chunks in each configured tier (its own ``Stats``)."""
        with self._lock:
            return {t: (self._tenant_used[(tenant, t)], len(self._tenant_lru.get((tenant, t), ()))) for t in self._lru}

    def set_guards(self, guards: dict[bytes, "Guard"]) -> None:
        """Set (``Guard.NONE``: clear) the guard of each key. Keys need not be held yet: a
        guard applies from the chunk's first put on. Cheap (index lock, one dict write each)."""
        with self._lock:
            for key, g in guards.items():
                key = _check_key(key)
                e = self._entries.get(key)
                if e is not None:
                    self._account_guard(e, -1)
                if g:
                    self._guards[key] = Guard(g)
                else:
                    self._guards.pop(key, None)
                self._second_chance.discard(key)
                if e is not None:
                    self._account_guard(e, +1)

    def _account_guard(self, e: _Entry, sign: int) -> None:
        """Add (``sign`` +1) or remove ``e``'s copies from the guarded footprints. Index lock held."""
        fp = self._guard_fp.get(self._guards.get(e.key, Guard.NONE))
        if fp is None:
            return
        for tier in e.tiers():
            fp[tier] += sign * self._footprint(tier, e.obj_nbytes)

    def guarded_bytes(self, tier: Tier) -> int:
        """Footprint of ``tier``'s chunks that victim selection may not take there."""
        with self._lock:
            return self._guarded_bytes(Tier(tier)) if Tier(tier) in self._lru else 0

    def capacity_of(self, tier: Tier) -> int:
        return self._capacity.get(Tier(tier), 0)

    def object_footprint(self, payload_nbytes: int) -> int:
        """Bytes a new chunk of ``payload_nbytes`` takes in the fastest tier."""
        return self._footprint(self._chain[0], object_nbytes(payload_nbytes)) if self._chain else 0

    def room(self, need: int) -> tuple[int, int, int] | None:
        """None when ``need`` more bytes fit the tiers' free space; otherwise (capacity, used,
        guarded) over all tiers, ``guarded`` being what victim selection may never take (the
        resident claims' share; kept incrementally, O(tiers))."""
        with self._lock:
            cap = sum(self._capacity.values())
            used = sum(self._used.values())
            if used + need <= cap:
                return None
            return cap, used, sum(self._guarded_bytes(t) for t in self._chain)

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
                capacity=self._capacity,
                used=self._used,
                objects={t: len(lru) for t, lru in self._lru.items()},
                events_dropped=self._events.dropped,
                remote_reconnects=self._remote.reconnects if self._remote is not None else 0,
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
        bytes. ``publish`` also writes a remote copy for other sidecars.

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
        with self._writer():
            with self._lock:
                existing = self._entries.get(key)
                if existing is None:
                    self._check_quota(tenant, expected)
                    candidates = self._placements(obj_nbytes, tenant)
                else:
                    self._counters.duplicate_puts += 1
            if existing is not None:
                published = self._publish(existing) if publish else existing.remote
                return PutResult(key, existing.fastest() or Tier.REMOTE, False, published)
            placed: Tier | None = None
            last: _NoRoom | None = None
            for tier in candidates:
                try:
                    self._place_new(tier, meta, buf, obj_nbytes)
                except _NoRoom as exc:
                    last = exc
                    continue
                except _IOFailure:
                    logger.warning("write of %s to %s failed; trying the next tier", key.hex(), tier.value)
                    continue
                placed = tier
                break
            if placed is None:
                with self._lock:
                    self._counters.capacity_refusals += 1
                    tier = last.tier if last is not None else (candidates[-1] if candidates else None)
                    raise CapacityError(
                        tier=tier,
                        requested_bytes=obj_nbytes,
                        used_bytes=self._used[tier] if tier is not None else 0,
                        capacity_bytes=self._capacity[tier] if tier is not None else 0,
                        pinned_bytes=self._pinned_bytes(tier) if tier is not None else 0,
                        reason=last.reason if last is not None else "larger than any tier",
                        guarded_bytes=self._guarded_bytes(tier) if tier is not None else 0,
                    )
            entry = self._entries[key]
            published = self._publish(entry) if publish else entry.remote
            return PutResult(key, placed, True, published)

    def _check_quota(self, tenant: str, nbytes: int) -> None:
        limit = self._config.quota_for(tenant).max_bytes
        used = self._tenant_bytes[tenant]
        if limit is not None and used + nbytes > limit:
            self._counters.quota_refusals += 1
            raise QuotaExceededError(tenant=tenant, requested_bytes=nbytes, used_bytes=used, quota_bytes=limit)

    def _placements(self, obj_nbytes: int, tenant: str) -> list[Tier]:
        """Tiers a new object may go to, fastest first: it fits the tier (and the tenant's share
        of it) and enough unpinned bytes could be demoted out of the way. Index lock held."""
        deadline = time.monotonic() + self._config.pin_wait_s
        per_tier = self._config.quota_for(tenant).max_bytes_per_tier
        while True:
            out = []
            for tier in self._chain:
                fp = self._footprint(tier, obj_nbytes)
                share = per_tier.get(tier)
                if fp > self._capacity[tier] or (share is not None and fp > share):
                    continue
                if self._reclaimable(tier, fp, tenant):
                    out.append(tier)
            if out:
                return out
            if not any(self._pinned_bytes(t) for t in self._chain) or not self._wait_unpin(deadline):
                break
        self._counters.capacity_refusals += 1
        tier = next((t for t in self._chain if self._footprint(t, obj_nbytes) <= self._capacity[t]), None)
        guarded = self._guarded_bytes(tier) if tier is not None else 0
        raise CapacityError(
            tier=tier,
            requested_bytes=obj_nbytes,
            used_bytes=self._used[tier] if tier is not None else 0,
            capacity_bytes=self._capacity[tier] if tier is not None else max(self._capacity.values()),
            pinned_bytes=self._pinned_bytes(tier) if tier is not None else 0,
            reason=("held by resident claims" if guarded else "pinned by readers") if tier is not None
            else "larger than any tier",
            guarded_bytes=guarded,
        )

    def _reclaimable(self, tier: Tier, fp: int, tenant: str) -> bool:
        """Whether demoting unpinned chunks (LRU first) could make ``fp`` bytes of room."""
        deficit = self._used[tier] + fp - self._capacity[tier]
        share = self._config.quota_for(tenant).max_bytes_per_tier.get(tier)
        tenant_deficit = self._tenant_used[(tenant, tier)] + fp - share if share is not None else 0
        if deficit > 0:
            for e in self._lru[tier].values():
                if not self._busy(e, tier) and self._may_take(e, tier, final=True):
                    deficit -= self._footprint(tier, e.obj_nbytes)
                    if deficit <= 0:
                        break
        if tenant_deficit > 0:
            for e in self._tenant_lru.get((tenant, tier), {}).values():
                if not self._busy(e, tier) and self._may_take(e, tier, final=True):
                    tenant_deficit -= self._footprint(tier, e.obj_nbytes)
                    if tenant_deficit <= 0:
                        break
        return deficit <= 0 and tenant_deficit <= 0

    def _wait_unpin(self, deadline: float) -> bool:
        """Wait (index lock held) for a reader to unpin something; False once past ``deadline``.
        Readers hold pins for one copy, so a short wait avoids refusing on a transient pin."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self._cv.wait(remaining)
        return True

    def _guarded_bytes(self, tier: Tier) -> int:
        """Footprint in ``tier`` that victim selection may never take (HOLD anywhere, NO_DROP
        in the last tier). O(1)."""
        held = self._guard_fp[Guard.HOLD][tier]
        return held + self._guard_fp[Guard.NO_DROP][tier] if tier == self._chain[-1] else held

    def _pinned_bytes(self, tier: Tier) -> int:
        return sum(self._footprint(tier, e.obj_nbytes) for e in self._lru[tier].values() if self._busy(e, tier))

    def _encode_into(self, dst: torch.Tensor, meta: ChunkMeta, payload: torch.Tensor) -> ChunkMeta:
        """Write header + payload into ``dst`` (host); the checksum is of the stored bytes."""
        body = dst[HEADER_NBYTES:]
        _host_copy(body, payload)
        meta = replace(meta, checksum=checksum(body))
        write_header(dst[:HEADER_NBYTES], meta)
        return meta

    def _place_new(self, tier: Tier, meta: ChunkMeta, payload: torch.Tensor, obj_nbytes: int) -> None:
        self._make_room(tier, self._footprint(tier, obj_nbytes), meta.tenant)
        key = meta.key
        if tier == Tier.CPU:
            dst = self._stage_with_room(tier, key, obj_nbytes)
            try:
                meta = self._encode_into(dst, meta, payload)
            except BaseException:
                self._mem[tier].abort(key)
                raise
            self._mem[tier].commit(key)
        else:
            host = self._scratch_buffer(obj_nbytes)
            meta = self._encode_into(host, meta, payload)
            try:
                self._write_object(tier, key, host)
            except _IOFailure:
                self._scratch = None  # a timed-out write may still read it: never reuse
                raise
        with self._lock:
            e = _Entry(meta=meta, obj_nbytes=obj_nbytes)
            self._entries[key] = e
            self._tenant_bytes[e.tenant] += meta.payload_nbytes
            self._attach(e, tier)
            c = self._counters
            c.puts += 1
            c.put_bytes += meta.payload_nbytes
            c.tiers[tier].write_bytes += obj_nbytes

    def _scratch_buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer for encoding objects bound for the GPU, disk or remote tier, reused
        across puts (writers are serialized, and each write completes before the next)."""
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes]

    def _publish(self, e: _Entry) -> bool:
        """Give ``e`` a remote copy (best effort; False when there is no remote or it failed)."""
        if self._remote is None or e.remote:
            return e.remote
        with self._lock:
            if self._entries.get(e.key) is not e or e.local is None:
                return e.remote
            src = e.local
            e.moving = True
        try:
            fp = self._footprint(Tier.REMOTE, e.obj_nbytes)
            if fp > self._capacity[Tier.REMOTE]:
                return False
            self._make_room(Tier.REMOTE, fp, e.tenant)
            self._copy_object(e, src, Tier.REMOTE)
        except _SourceLost as lost:
            self._lose(e, lost.tier, Reason.CORRUPTION, writer_held=True)
            return False
        except (_NoRoom, _IOFailure) as exc:
            logger.warning("publishing %s to the remote tier failed: %s", e.key.hex(), exc)
            return False
        finally:
            e.moving = False
        with self._lock:
            self._attach(e, Tier.REMOTE)
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
        chunks to disk), unless another writer holds the store, in which case promotion is
        skipped rather than waited for.
        """
        keys = [_check_key(k) for k in keys]
        promote = self._config.promote_on_hit if promote is None else promote
        results: list[FetchedChunk | None] = [None] * len(keys)
        objects: dict[int, torch.Tensor] = {}
        with self._lock:
            self._check_open()
            reads: list[tuple[int, _Entry, Tier]] = []
            foreign: list[int] = []
            for i, key in enumerate(keys):
                e = self._entries.get(key)
                tier = e.fastest() if e is not None else None
                if e is None or tier is None:
                    if self._remote is not None and key not in self._remote_removing:
                        foreign.append(i)
                    continue
                self._pin(e, tier)
                reads.append((i, e, tier))
        failed = self._read(reads, results, objects)
        retry: list[tuple[int, _Entry, Tier]] = []
        for i, e, tier, reason in failed:
            self._lose(e, tier, reason)
            with self._lock:
                if e.remote and tier != Tier.REMOTE and self._entries.get(e.key) is e:
                    self._pin(e, Tier.REMOTE)
                    retry.append((i, e, Tier.REMOTE))
        for _, e, tier, reason in self._read(retry, results, objects):
            self._lose(e, tier, reason)
        fetched_foreign = self._read_foreign([keys[i] for i in foreign])
        for i, (chunk, obj) in zip(foreign, fetched_foreign, strict=True):
            if chunk is not None:
                results[i] = chunk
                objects[i] = obj
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

    def _pin(self, e: _Entry, tier: Tier) -> None:
        e.readers[tier] = e.readers.get(tier, 0) + 1
        self._active_reads += 1
        self._touch(e, tier)

    def _unpin(self, e: _Entry, tier: Tier) -> None:
        self._active_reads -= 1
        n = e.readers[tier] - 1
        if n:
            e.readers[tier] = n
        else:
            del e.readers[tier]

    def _read(
        self,
        reads: list[tuple[int, _Entry, Tier]],
        results: list[FetchedChunk | None],
        objects: dict[int, torch.Tensor],
    ) -> list[tuple[int, _Entry, Tier, Reason]]:
        """Read pinned entries into ``results``; returns the failures. Unpins everything."""
        failed: list[tuple[int, _Entry, Tier, Reason]] = []
        try:
            batches: dict[Tier, list[tuple[int, _Entry]]] = {}
            for i, e, tier in reads:
                if tier in self._mem:
                    payload = self._read_memory(tier, e)
                    if payload is None:
                        failed.append((i, e, tier, Reason.CORRUPTION))
                    else:
                        results[i] = FetchedChunk(e.meta, tier, payload)
                else:
                    batches.setdefault(tier, []).append((i, e))
            for tier, items in batches.items():
                backend = self._backend(tier)
                if self._breakers[tier].is_open():
                    continue  # misses while the tier is avoided; nothing is removed
                try:
                    objs = backend.load_many([e.key for _, e in items], [e.obj_nbytes for _, e in items])
                except TimeoutError:
                    # Slow, not lost: these are misses this time and nothing is removed.
                    logger.warning("%s read of %d chunks timed out", tier.value, len(items))
                    self._breakers[tier].failed()
                    with self._lock:
                        self._counters.io_errors += 1
                    continue
                for (i, e), obj in zip(items, objs, strict=True):
                    if isinstance(obj, LoadFailure):
                        reason = Reason.MISSING if obj is LoadFailure.MISSING else Reason.CORRUPTION
                        failed.append((i, e, tier, reason))
                    elif not self._object_ok(obj, e.meta):
                        if tier == Tier.REMOTE:
                            self._remote.suspect()
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

    def _read_memory(self, tier: Tier, e: _Entry) -> torch.Tensor | None:
        mem = self._mem[tier]
        view = mem.acquire(e.key)
        if view is None:  # only after a writer gave up waiting for this reader (logged there)
            return None
        try:
            body = view[HEADER_NBYTES:]
            out = torch.empty(e.meta.payload_nbytes, dtype=torch.uint8)
            _host_copy(out, body)
        finally:
            mem.release(e.key)
        if self._config.verify_memory_reads and checksum(out) != e.meta.checksum:
            return None
        return out

    @staticmethod
    def _object_ok(obj: torch.Tensor, meta: ChunkMeta) -> bool:
        try:
            stored = parse_header(obj)
        except CorruptChunkError:
            return False
        return (
            stored.key == meta.key
            and stored.checksum == meta.checksum
            and stored.payload_nbytes == meta.payload_nbytes
            and obj.numel() == object_nbytes(meta.payload_nbytes)
            and checksum(obj[HEADER_NBYTES:]) == meta.checksum
        )

    def _read_foreign(self, keys: list[ChunkKey]) -> list[tuple[FetchedChunk | None, torch.Tensor | None]]:
        """Chunks another sidecar published to the remote tier: header copy first, then body."""
        if not keys:
            return []
        assert self._remote is not None
        if self._breakers[Tier.REMOTE].is_open():
            return [(None, None)] * len(keys)
        metas = self._remote.load_headers(keys)
        found = [(i, m) for i, m in enumerate(metas) if m is not None]
        out: list[tuple[FetchedChunk | None, torch.Tensor | None]] = [(None, None)] * len(keys)
        if not found:
            return out
        try:
            objs = self._remote.load_many([m.key for _, m in found], [object_nbytes(m.payload_nbytes) for _, m in found])
        except TimeoutError:
            # The server went away between the header and the body reads: misses this time.
            logger.warning("remote read of %d foreign chunks timed out", len(found))
            self._breakers[Tier.REMOTE].failed()
            with self._lock:
                self._counters.io_errors += 1
            return out
        for (i, m), obj in zip(found, objs, strict=True):
            if isinstance(obj, LoadFailure):
                continue
            if not self._object_ok(obj, m):
                self._remote.suspect()
                with self._lock:
                    self._counters.checksum_failures += 1
                continue
            out[i] = (FetchedChunk(m, Tier.REMOTE, obj[HEADER_NBYTES:]), obj)
        return out

    def _promote_hits(self, results: list[FetchedChunk | None], objects: dict[int, torch.Tensor]) -> None:
        top = self._chain[0]
        wanted = [(i, r) for i, r in enumerate(results) if r is not None and r.tier != top]
        if not wanted or not self._write_lock.acquire(blocking=False):
            return
        try:
            if self._closed:
                return
            for i, r in wanted:
                self._promote(r, objects.get(i), top)
        finally:
            self._write_lock.release()

    def _promote(self, r: FetchedChunk, obj: torch.Tensor | None, top: Tier) -> None:
        key = r.meta.key
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                if r.tier != Tier.REMOTE or key in self._remote_removing:
                    return
                quota = self._config.quota_for(r.meta.tenant).max_bytes
                if quota is not None and self._tenant_bytes[r.meta.tenant] + r.meta.payload_nbytes > quota:
                    return
                # A chunk published by another sidecar: this store now tracks its remote copy.
                e = _Entry(meta=r.meta, obj_nbytes=object_nbytes(r.meta.payload_nbytes))
                self._entries[key] = e
                self._tenant_bytes[e.tenant] += r.meta.payload_nbytes
                self._attach(e, Tier.REMOTE)
            if e.moving or e.fastest() != r.tier or e.meta != r.meta:
                return
            fp = self._footprint(top, e.obj_nbytes)
            share = self._config.quota_for(e.tenant).max_bytes_per_tier.get(top)
            if fp > self._capacity[top] or (share is not None and fp > share):
                return
            if not self._reclaimable(top, fp, e.tenant):
                return
            e.moving = True
        src = r.tier
        try:
            self._make_room(top, fp, e.tenant)
            if obj is not None:
                self._write_object(top, key, obj)
            else:
                self._copy_object(e, src, top)
        except (_NoRoom, _IOFailure, _SourceLost) as exc:
            logger.debug("promotion of %s skipped: %s", key.hex(), exc)
            e.moving = False
            return
        with self._lock:
            if src != Tier.REMOTE:
                self._detach(e, src)
            self._attach(e, top)
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
                    e = self._entries.get(key)
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
        them). Keys this store does not know are still deleted from the remote tier (another
        sidecar, or this one before a restart, may have published them). Idempotent; returns
        how many chunks this store held."""
        keys = [_check_key(k) for k in keys]
        removed = 0
        unknown: list[ChunkKey] = []
        with self._writer():
            for key in keys:
                with self._lock:
                    e = self._entries.get(key)
                    if e is None:
                        unknown.append(key)
                        continue
                    held = e.tiers()
                    fastest = e.fastest()
                    for tier in held:
                        self._detach(e, tier)
                    self._forget(e)
                    self._emit(EventKind.DELETED, e, fastest, None, Reason.OPERATOR)
                for tier in held:
                    self._drain_and_remove(e, tier)
                removed += 1
            if unknown and self._remote is not None:
                with self._lock:
                    self._remote_removing.update(unknown)
                try:
                    if not self._remote.remove(unknown):
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
        with self._lock:
            if self._closed:
                return 0, 0
            todo = [(t, e) for t in (Tier.GPU, Tier.CPU) if t in self._lru
                    for e in reversed(self._lru[t].values()) if not e.remote]
        if Tier.DISK not in self._lru or not todo:
            return 0, len(todo)
        deadline = time.monotonic() + budget_s
        moved = 0
        with self._writer():
            for i, (tier, e) in enumerate(todo):
                if time.monotonic() >= deadline:
                    return moved, len(todo) - i
                with self._lock:
                    if e.local != tier or self._busy(e, tier):
                        continue
                try:
                    self._move_down(e, tier, Reason.SHUTDOWN)
                except _NoRoom:
                    continue
                with self._lock:
                    moved += e.local == Tier.DISK
        with self._lock:
            left = sum(1 for t in (Tier.GPU, Tier.CPU) if t in self._lru for e in self._lru[t].values() if not e.remote)
        return moved, left

    def close(self) -> None:
        """Release every backend; bounded by ``config.close_timeout_s`` per step (a hung remote
        is abandoned, not waited for). Calls after close raise ``TierUnavailableError``; reads
        in flight finish first, and if they do not the memory pools are leaked rather than freed
        under them. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            drained = self._cv.wait_for(lambda: self._active_reads == 0, timeout=self._config.close_timeout_s)
        acquired = self._write_lock.acquire(timeout=self._config.close_timeout_s)
        try:
            self._close_backends(free_memory=drained and acquired)
        finally:
            if acquired:
                self._write_lock.release()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _close_backends(self, free_memory: bool = True) -> None:
        timeout = self._config.close_timeout_s
        # Each LMCache adapter joins its demux thread (up to 0.5 s); close them side by side.
        closers = [
            threading.Thread(target=b.close, args=(timeout,), name="kv-sidecar-close", daemon=True)
            for b in (self._remote, self._disk)
            if b is not None
        ]
        for t in closers:
            t.start()
        for t in closers:
            t.join(timeout + 1.0)
        if not free_memory:
            logger.error("tiered store closed with operations in flight: memory pools not freed")
            return
        for mem in self._mem.values():
            mem.close()

    # ------------------------------------------------------------------ placement internals

    @contextmanager
    def _writer(self) -> Iterator[None]:
        with self._write_lock:
            with self._lock:
                self._check_open()
            yield

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailableError("the tiered store is closed")

    @staticmethod
    def _busy(e: _Entry, tier: Tier) -> bool:
        return e.moving or tier in e.readers

    def _may_take(self, e: _Entry, tier: Tier, *, final: bool = False) -> bool:
        """Whether victim selection may move ``e`` out of ``tier`` (its guard allows it).
        ``final``: a planning question (could it be taken at all), where SOFT counts as
        takeable; otherwise a SOFT chunk is takeable once it used its second chance (see
        ``_pick_victim``). Index lock held."""
        g = self._guards.get(e.key)
        if not g:
            return True
        if g is Guard.HOLD:
            return False
        if g is Guard.NO_DROP:
            # demotion keeps it restorable; the last tier would drop it
            return tier != self._chain[-1]
        return final or e.key in self._second_chance

    def _touch(self, e: _Entry, tier: Tier) -> None:
        if self._second_chance:
            self._second_chance.discard(e.key)
        self._lru[tier].move_to_end(e.key)
        self._tenant_lru[(e.tenant, tier)].move_to_end(e.key)

    def _attach(self, e: _Entry, tier: Tier) -> None:
        """Record a copy of ``e`` in ``tier`` (most recently used). Index lock held."""
        if tier == Tier.REMOTE:
            assert not e.remote, f"{e.key.hex()} already has a remote copy; placement bug"
            e.remote = True
        else:
            assert e.local is None, f"{e.key.hex()} already has a local copy in {e.local}; placement bug"
            e.local = tier
        fp = self._footprint(tier, e.obj_nbytes)
        self._lru[tier][e.key] = e
        self._tenant_lru.setdefault((e.tenant, tier), OrderedDict())[e.key] = e
        self._used[tier] += fp
        self._tenant_used[(e.tenant, tier)] += fp
        if self._guards:
            g = self._guard_fp.get(self._guards.get(e.key, Guard.NONE))
            if g is not None:
                g[tier] += fp

    def _detach(self, e: _Entry, tier: Tier) -> None:
        """Forget the copy of ``e`` in ``tier`` (the bytes are removed separately)."""
        if tier == Tier.REMOTE:
            e.remote = False
            self._remote_removing[e.key] += 1  # until _drain_and_remove has deleted it
        else:
            assert e.local == tier, f"{e.key.hex()} is in {e.local}, not {tier}; placement bug"
            e.local = None
        fp = self._footprint(tier, e.obj_nbytes)
        if self._guards:
            g = self._guard_fp.get(self._guards.get(e.key, Guard.NONE))
            if g is not None:
                g[tier] -= fp
        del self._lru[tier][e.key]
        lru = self._tenant_lru[(e.tenant, tier)]
        del lru[e.key]
        if not lru:
            del self._tenant_lru[(e.tenant, tier)]
        self._used[tier] -= fp
        self._tenant_used[(e.tenant, tier)] -= fp

    def _forget(self, e: _Entry) -> None:
        if self._entries.get(e.key) is e:
            del self._entries[e.key]
            self._tenant_bytes[e.tenant] -= e.meta.payload_nbytes
            if not self._tenant_bytes[e.tenant]:
                del self._tenant_bytes[e.tenant]

    def _emit(
        self,
        kind: EventKind,
        e: _Entry,
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

    def _pick_victim(self, tier: Tier, tenant: str | None) -> _Entry | None:
        lru = self._lru[tier] if tenant is None else self._tenant_lru.get((tenant, tier), {})
        victim = None
        lapped: list[_Entry] = []
        for e in lru.values():
            if self._busy(e, tier):
                continue
            if self._may_take(e, tier):
                victim = e
                break
            if self._guards.get(e.key) is Guard.SOFT:
                lapped.append(e)
        for e in lapped:  # CLOCK-style second chance: one more lap at the most-recent end
            self._second_chance.add(e.key)
            self._lru[tier].move_to_end(e.key)
            self._tenant_lru[(e.tenant, tier)].move_to_end(e.key)
        return victim if victim is not None or not lapped else self._pick_victim(tier, tenant)

    def _make_room(self, tier: Tier, fp: int, tenant: str) -> None:
        """Demote LRU chunks out of ``tier`` until ``fp`` more bytes fit it and the tenant's
        share of it. Raises ``_NoRoom`` when only pinned chunks are left."""
        share = self._config.quota_for(tenant).max_bytes_per_tier.get(tier)
        deadline = time.monotonic() + self._config.pin_wait_s
        while True:
            with self._lock:
                over_share = share is not None and self._tenant_used[(tenant, tier)] + fp > share
                over_tier = self._used[tier] + fp > self._capacity[tier]
                if not (over_share or over_tier):
                    return
                victim = self._pick_victim(tier, tenant if over_share else None)
                if victim is None:
                    if self._wait_unpin(deadline):
                        continue
                    raise _NoRoom(tier, fp, "pinned by readers")
            self._move_down(victim, tier, Reason.QUOTA if over_share else Reason.CAPACITY)

    def _stage_with_room(self, tier: Tier, key: ChunkKey, obj_nbytes: int) -> torch.Tensor:
        """Stage in a pool tier; when the allocator is fragmented, demote more LRU chunks."""
        mem = self._mem[tier]
        deadline = time.monotonic() + self._config.pin_wait_s
        while True:
            dst = mem.stage(key, obj_nbytes)
            if dst is not None:
                return dst
            with self._lock:
                victim = self._pick_victim(tier, None)
                if victim is None:
                    if self._wait_unpin(deadline):
                        continue
                    raise _NoRoom(tier, obj_nbytes, "allocator full")
            self._move_down(victim, tier, Reason.CAPACITY)

    def _write_object(self, tier: Tier, key: ChunkKey, obj: torch.Tensor) -> None:
        """Write a complete stored object (host or device tensor) into ``tier``."""
        if tier in self._mem:
            mem = self._mem[tier]
            dst = self._stage_with_room(tier, key, obj.numel())
            try:
                _host_copy(dst, obj)
            except BaseException:
                mem.abort(key)
                raise
            mem.commit(key)
            return
        breaker = self._breakers[tier]
        if breaker.is_open():
            raise _IOFailure(f"{tier.value} tier unavailable (backing off after I/O failures)")
        host = obj if obj.device.type == "cpu" else obj.cpu()
        if not self._backend(tier).store(key, host):
            breaker.failed()
            with self._lock:
                self._counters.io_errors += 1
            raise _IOFailure(f"{tier.value} write of {key.hex()} failed")
        breaker.succeeded()

    def _copy_object(self, e: _Entry, src: Tier, dst: Tier) -> None:
        """Copy ``e``'s stored object from ``src`` to ``dst`` (index untouched)."""
        if src in self._mem:
            mem = self._mem[src]
            view = mem.acquire(e.key)
            assert view is not None, f"{src.value} tier lost {e.key.hex()} during a move; placement bug"
            try:
                self._write_object(dst, e.key, view)
            finally:
                mem.release(e.key)
            return
        try:
            (obj,) = self._backend(src).load_many([e.key], [e.obj_nbytes])
        except TimeoutError as exc:
            raise _IOFailure(str(exc)) from exc
        if isinstance(obj, LoadFailure) or not self._object_ok(obj, e.meta):
            raise _SourceLost(src)
        self._write_object(dst, e.key, obj)

    def _move_down(self, e: _Entry, src: Tier, reason: Reason) -> None:
        """Demote ``e`` out of ``src`` to the next tier that takes it; drop it only when no
        lower tier could ever hold it. Writer lock held; ``e`` must not be pinned by a writer."""
        if src == Tier.REMOTE:
            self._drop_remote(e, reason)
            return
        with self._lock:
            e.moving = True
        try:
            lower = self._chain[self._chain.index(src) + 1 :]
            refused: _NoRoom | None = None
            io_failed = False
            dst: Tier | None = None
            for tier in lower:
                if tier == Tier.REMOTE and e.remote:
                    dst = tier  # the shared copy already exists: dropping the local one loses nothing
                    break
                fp = self._footprint(tier, e.obj_nbytes)
                share = self._config.quota_for(e.tenant).max_bytes_per_tier.get(tier)
                if fp > self._capacity[tier] or (share is not None and fp > share):
                    continue
                try:
                    self._make_room(tier, fp, e.tenant)
                    self._copy_object(e, src, tier)
                except _SourceLost as lost:
                    self._lose(e, lost.tier, Reason.CORRUPTION, writer_held=True)
                    return
                except _NoRoom as exc:
                    refused = exc
                    continue
                except _IOFailure:
                    io_failed = True  # the tier is failing (full, down): as if it were absent
                    continue
                dst = tier
                break
            if dst is None and refused is not None:
                raise _NoRoom(src, e.obj_nbytes, f"cannot demote: {refused.tier.value} {refused.reason}")
            if dst is None and io_failed:
                if self._guards.get(e.key) is Guard.NO_DROP:  # a claim keeps it: backpressure instead
                    raise _NoRoom(src, e.obj_nbytes, "cannot demote: the lower tiers are failing (claimed chunk)")
                reason = Reason.IO_ERROR  # dropped: every lower tier that could hold it is failing
            with self._lock:
                self._detach(e, src)
                if dst is None:
                    self._forget(e)
                    self._counters.evictions[reason] += 1
                    self._counters.tiers[src].evictions += 1
                    self._emit(EventKind.EVICTED, e, src, None, reason)
                else:
                    if dst != Tier.REMOTE or not e.remote:
                        self._attach(e, dst)
                        self._counters.tiers[dst].write_bytes += e.obj_nbytes
                    self._counters.demotions += 1
                    self._counters.tiers[dst].demotions_in += 1
                    self._emit(EventKind.DEMOTED, e, src, dst, reason)
            self._drain_and_remove(e, src)
        finally:
            e.moving = False

    def _drop_remote(self, e: _Entry, reason: Reason) -> None:
        with self._lock:
            self._detach(e, Tier.REMOTE)
            if e.local is None:
                self._forget(e)
            self._counters.evictions[reason] += 1
            self._counters.tiers[Tier.REMOTE].evictions += 1
            self._emit(EventKind.EVICTED, e, Tier.REMOTE, None, reason)
        self._drain_and_remove(e, Tier.REMOTE)

    def _lose(self, e: _Entry, tier: Tier, reason: Reason, *, writer_held: bool = False) -> None:
        """Bytes of ``e`` in ``tier`` were found missing or corrupt: forget and remove them."""
        if not writer_held:
            with self._write_lock:
                self._lose(e, tier, reason, writer_held=True)
            return
        with self._lock:
            if self._entries.get(e.key) is not e or tier not in e.tiers():
                return
            self._detach(e, tier)
            if not e.tiers():
                self._forget(e)
            c = self._counters
            c.losses[reason] += 1
            c.tiers[tier].misses += 1
            if reason == Reason.CORRUPTION:
                c.checksum_failures += 1
            self._emit(EventKind.LOST, e, tier, None, reason)
        logger.warning("chunk %s lost from %s (%s)", e.key.hex(), tier.value, reason.value)
        self._drain_and_remove(e, tier)

    def _drain_and_remove(self, e: _Entry, tier: Tier) -> None:
        """Remove the bytes of ``e`` from ``tier`` once no reader has them pinned."""
        with self._lock:
            if not self._cv.wait_for(lambda: tier not in e.readers, timeout=self._config.io_timeout_s):
                logger.error("readers of %s in %s did not finish; removing anyway", e.key.hex(), tier.value)
        if tier in self._mem:
            self._mem[tier].remove(e.key)
        elif tier == Tier.DISK:
            assert self._disk is not None
            self._disk.remove([e.key])
        else:
            assert self._remote is not None
            # While Redis is avoided the object stays there, unreferenced, until Redis evicts it.
            skipped = self._breakers[Tier.REMOTE].is_open()
            confirmed = skipped or self._remote.remove([e.key])
            with self._lock:
                self._remote_removing[e.key] -= 1
                if not self._remote_removing[e.key]:
                    del self._remote_removing[e.key]
                if not confirmed or skipped:
                    self._counters.io_errors += 1
            if not confirmed:
                self._breakers[Tier.REMOTE].failed()
                logger.error("remote delete of %s could not be confirmed", e.key.hex())

    def _recover(self) -> None:
        """Index what the disk tier holds (oldest first), evicting past its capacity."""
        assert self._disk is not None
        files, corrupt = self._disk.scan()
        over: list[_Entry] = []
        with self._lock:
            if corrupt:
                self._counters.checksum_failures += corrupt
                self._counters.losses[Reason.CORRUPTION] += corrupt
            for f in files:
                e = _Entry(meta=f.meta, obj_nbytes=f.nbytes)
                self._entries[e.key] = e
                self._tenant_bytes[e.tenant] += f.meta.payload_nbytes
                self._attach(e, Tier.DISK)
            self._counters.recovered_chunks = len(files)
            lru = iter(list(self._lru[Tier.DISK].values()))
            while self._used[Tier.DISK] > self._capacity[Tier.DISK]:
                e = next(lru)
                self._detach(e, Tier.DISK)
                self._forget(e)
                self._counters.evictions[Reason.CAPACITY] += 1
                self._counters.tiers[Tier.DISK].evictions += 1
                self._counters.recovered_chunks -= 1
                over.append(e)
        if over:
            self._disk.remove([e.key for e in over])
        logger.info(
            "disk tier recovered %d chunks (%d corrupt removed, %d over capacity)", len(files), corrupt, len(over)
        )


class _SourceLost(Exception):
    def __init__(self, tier: Tier) -> None:
        super().__init__(tier.value)
        self.tier = tier
