"""Fetch by lease and Store by reservation: the shared pool's half of the data plane.

An engine on the sidecar's host maps the CPU tier's pool (``sidecar.shm.pool``) and moves KV
bytes itself; the sidecar only says where::

    LeaseFetch(items)                               ReserveStore(header)
      registry entries (scope-checked), spans         chunk the tokens as a Store would
      expanded to chunks                              one slot per chunk not held yet (quota,
      hits below the CPU tier promoted into it        room, demotions as a put)
      store.lease: pinned, offset + stamp      <-     engine gathers its KV into the slots
    <- slots (offset, rows, source pos, delta)      CommitStore(counts)
      engine rotates + places straight from the       store_payloads with the slots as payloads:
      pool, checks the stamp, ReleaseLease            checksummed in place, registered RESIDENT

Leases and reservations are bounded in time: a lease not released after ``lease_ttl_s`` is
released by the sidecar (``reap``: on every call here and on the server's timer), a reservation
not committed after ``reservation_ttl_s`` is aborted, so a killed engine leaves no pin and no
staged object behind. Both belong to the tenant that made them: another tenant's id is
NOT_FOUND, like an unknown one.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sidecar.dataplane.fetch_query import FetchQuery
from sidecar.dataplane.reads import check_fetch_bytes, check_layout
from sidecar.dataplane.records import StoreOutcome
from sidecar.dataplane.spans import expand as expand_spans
from sidecar.errors import InvalidArgument, NotFound, ResourceExhausted
from sidecar.identity import SHARED_SCOPE, CacheIdentity, KVLayout
from sidecar.registry.entry import EntryState
from sidecar.registry.lookup_plan import FetchSpec
from sidecar.tiers import CapacityError, QuotaExceededError, chunk_key
from sidecar.tiers.store_pool import PoolRead, Slot


@dataclass(frozen=True, slots=True)
class LeasedSlot:
    """One chunk of an item's answer: rows ``[row_offset, row_offset + rows)`` of ``read``."""

    index: int
    read: PoolRead
    row_offset: int
    rows: int
    source_pos: int  # of row ``row_offset``
    delta: int
    tier: str


@dataclass(frozen=True, slots=True)
class LeaseAnswer:
    pool: str
    lease: str
    ttl_s: float
    slots: list[LeasedSlot]
    misses: list[int]


@dataclass(slots=True)
class _Lease:
    tenant: str
    reads: list[PoolRead]
    deadline: float
    granting: bool = False  # its grant is still pinning: not reaped meanwhile


@dataclass(slots=True)
class Reservation:
    """A Store in the making: the header's chunking and one slot per chunk to write."""

    id: str
    tenant: str
    deadline: float
    slots: dict[int, Slot]  # chunk start -> slot
    held: list[int]  # chunk starts the tiers hold already
    bounds: list[int]
    store_args: tuple = field(repr=False)  # (tokens, data, identity, scope, layout, register_from, chunked)


class PoolPath:
    """The data plane's shared-pool calls (composed into ``DataPlane`` as ``plane.pool``)."""

    def __init__(self, plane, *, lease_ttl_s: float = 2.0, reservation_ttl_s: float = 30.0,
                 max_leases: int = 4096) -> None:
        self.plane = plane
        self.lease_ttl_s = lease_ttl_s
        self.reservation_ttl_s = reservation_ttl_s
        self.max_leases = max_leases
        self._leases: dict[str, _Lease] = {}
        self._reservations: dict[str, Reservation] = {}
        self._tasks: set[asyncio.Task] = set()  # grants that finish even when their call is cancelled
        self.expired_leases = 0
        self.expired_reservations = 0

    @property
    def name(self) -> str:
        """The pool's file name ("" when the CPU tier's pool is private)."""
        pool = self.plane.store.pool
        return pool.name if pool is not None else ""

    @property
    def size(self) -> int:
        pool = self.plane.store.pool
        return pool.size if pool is not None else 0

    def _require(self) -> str:
        name = self.name
        if not name:
            raise InvalidArgument("pool: this sidecar has no shared pool (store.cpu_shared is off or /dev/shm "
                                  "had no room); use Fetch and Store")
        return name

    # ------------------------------------------------------------------ leases

    async def lease_fetch(self, query: FetchQuery) -> LeaseAnswer:
        """Lease every hit of ``query``'s items in the pool (see the module docstring): its
        whole chunks (``query.heads`` and ``rope`` are not read: the engine reads its heads
        from the slots and rotates them itself)."""
        name = self._require()
        tenant, identity, layout, max_bytes = query.tenant, query.identity, query.layout, query.max_bytes
        check_layout(identity, layout)
        items = self.plane.fetches.keys(query)
        await self.reap()
        if len(self._leases) >= self.max_leases:
            raise ResourceExhausted(f"pool_max_leases: {self.max_leases} leases are held; release them "
                                    "(ReleaseLease) or wait for them to expire")
        specs = [it if isinstance(it, FetchSpec) else FetchSpec(it[0], it[1], 0, 0, ()) for it in items]
        reg = self.plane.index.registry
        flat, groups = expand_spans(specs, reg.peek)
        fp = layout.fingerprint()
        per_token = layout.bytes_per_token
        entries = []
        for h, _ in flat:
            e = reg.peek(h)
            ok = e is not None and e.state is EntryState.RESIDENT and e.scope in (tenant, SHARED_SCOPE)
            entries.append(e if ok else None)
        total = sum(e.num_tokens * per_token for e in entries if e is not None)
        check_fetch_bytes(total, max_bytes)
        # Pinning runs to its end even if this call is cancelled meanwhile (a deadline, a killed
        # engine): its pins are recorded under a lease at once, which the TTL ends if nobody
        # releases it, so no pin is ever left without an owner.
        return await self._shielded(self._grant(tenant, name, flat, groups, entries, fp, per_token))

    async def _shielded(self, work):
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _grant(self, tenant: str, name: str, flat, groups, entries, fp: str, per_token: int) -> LeaseAnswer:
        keys = [chunk_key(e.key) for e in entries if e is not None]
        store = self.plane.store
        lease = secrets.token_hex(16)
        record = _Lease(tenant, [], time.monotonic() + self.lease_ttl_s, granting=True)
        self._leases[lease] = record
        try:
            got = await asyncio.to_thread(store.lease, keys)
            record.reads.extend(r for r in got if r is not None)
            tiers = {k: e.tier for k, e in zip(keys, (e for e in entries if e is not None))}
            below = [k for k, r in zip(keys, got) if r is None and store.contains(k)]
            if below:  # on disk or remote: promoted into the pool first, then leased
                await asyncio.to_thread(store.get_many, below, promote=True)
                again = await asyncio.to_thread(store.lease, below)
                record.reads.extend(r for r in again if r is not None)
                more = dict(zip(below, again))
                got = [more.get(k) if r is None else r for k, r in zip(keys, got)]
            await self.plane.synced()
            reads = iter(got)
            per_item: list[PoolRead | None] = []
            drop: list[PoolRead] = []
            for e in entries:
                r = next(reads) if e is not None else None
                if r is not None and (r.meta.num_tokens != e.num_tokens or r.meta.layout_fingerprint != fp
                                      or r.meta.scope != e.scope):
                    drop.append(r)
                    r = None
                per_item.append(r)
            slots: list[LeasedSlot] = []
            misses: list[int] = []
            kept: list[PoolRead] = []
            at = 0
            c = self.plane.counters
            for index, g in enumerate(groups):
                n = g.count if g.rows is not None else 1
                mine = list(zip(flat[at : at + n], entries[at : at + n], per_item[at : at + n]))
                at += n
                rows = g.rows if g.rows is not None else ((0, mine[0][1].num_tokens if mine and mine[0][1] else 0),)
                if not mine or any(r is None for _, _, r in mine):
                    misses.append(index)
                    drop.extend(r for _, _, r in mine if r is not None)
                    c.fetch_misses += 1
                    continue
                for ((_, target), e, r), (a, b) in zip(mine, rows, strict=True):
                    slots.append(LeasedSlot(index, r, a, b - a, e.source_pos + a, target - e.source_pos,
                                            tiers.get(chunk_key(e.key)) or "cpu"))
                    kept.append(r)
                    c.fetched_bytes += (b - a) * per_token
                c.fetched_chunks += 1
        except BaseException:
            self._leases.pop(lease, None)
            if record.reads:
                await asyncio.to_thread(store.unlease, record.reads)
            raise
        record.reads = kept
        record.granting = False
        if not kept:
            self._leases.pop(lease, None)
            lease = ""
        if drop:
            await asyncio.to_thread(store.unlease, drop)
        return LeaseAnswer(name, lease, self.lease_ttl_s, slots, misses)

    async def release(self, tenant: str, lease: str) -> int:
        """End a lease; how many chunks it held. NOT_FOUND naming ``lease`` for an unknown,
        released, expired or another tenant's lease."""
        got = self._leases.get(lease)
        if got is None or got.tenant != tenant:
            raise NotFound(f"lease: {lease[:40]!r} is not held (released, expired, or never granted)")
        del self._leases[lease]
        await self._shielded(asyncio.to_thread(self.plane.store.unlease, got.reads))
        return len(got.reads)

    # ------------------------------------------------------------------ reservations

    async def reserve_store(self, tenant: str, tokens: np.ndarray, data: bytes, identity: CacheIdentity, scope: str,
                            layout: KVLayout, register_from: int, starts: Sequence[int]) -> Reservation:
        """Slots for the chunks of a Store (``starts``: only these; empty: all)."""
        self._require()
        await self.reap()
        plane = self.plane
        chunked = plane.store_entries(tokens, data, identity, scope, layout, register_from)
        listed, _ = chunked
        by_start = {e.source_pos: e for e in listed}
        if starts:
            bad = [s for s in starts if s not in by_start]
            if bad:
                raise InvalidArgument(f"chunk_starts: {bad[:8]} are not chunk boundaries at or after register_from "
                                      f"(boundaries: {sorted(by_start)[:8]}...)")
            if len(set(starts)) != len(starts):
                raise InvalidArgument("chunk_starts: a chunk is named twice")
            chosen = [by_start[s] for s in starts]
        else:
            chosen = listed
        per_token = layout.bytes_per_token
        store = plane.store

        def reserve() -> tuple[dict[int, Slot], list[int]]:
            made: dict[int, Slot] = {}
            held: list[int] = []
            try:
                for e in chosen:
                    slot = store.reserve_slot(chunk_key(e.key), e.num_tokens * per_token, tenant)
                    if slot is None:
                        held.append(e.source_pos)
                    else:
                        made[e.source_pos] = slot
            except BaseException:
                for slot in made.values():
                    store.drop_slot(slot)
                raise
            return made, held

        bounds = [e.source_pos for e in listed] + ([listed[-1].source_pos + listed[-1].num_tokens] if listed else [])

        async def make() -> Reservation:
            # Recorded as soon as its slots exist: a call cancelled meanwhile leaves a
            # reservation the TTL aborts, never slots without an owner.
            try:
                slots, held = await asyncio.to_thread(reserve)
            except QuotaExceededError as exc:
                raise ResourceExhausted(f"limits.max_bytes (tenant quota): {exc}") from exc
            except CapacityError as exc:
                raise ResourceExhausted(f"capacity: {exc}") from exc
            rid = secrets.token_hex(16)
            res = Reservation(rid, tenant, time.monotonic() + self.reservation_ttl_s, slots, held, bounds,
                              (tokens, data, identity, scope, layout, register_from, chunked))
            self._reservations[rid] = res
            await plane.synced()  # demotions made room: the registry follows
            return res

        return await self._shielded(make())

    def _take(self, tenant: str, rid: str) -> Reservation:
        res = self._reservations.get(rid)
        if res is None or res.tenant != tenant:
            raise NotFound(f"reservation: {rid[:40]!r} is not open (committed, aborted, expired, or never made)")
        del self._reservations[rid]
        return res

    async def commit_store(self, tenant: str, rid: str, chunks: int, payload_bytes: int
                           ) -> tuple[StoreOutcome, CacheIdentity]:
        """Store the reservation's slots (``store_payloads``: all or nothing) and say under which
        identity. The counts must match its slots; a mismatch aborts the reservation (nothing
        stored or registered)."""
        res = self._take(tenant, rid)
        try:
            nbytes = sum(s.nbytes for s in res.slots.values())
            if chunks != len(res.slots):
                raise InvalidArgument(f"commit.chunks: {chunks}, but the reservation has {len(res.slots)} slots; "
                                      "nothing was stored")
            if payload_bytes != nbytes:
                raise InvalidArgument(f"commit.payload_bytes: {payload_bytes}, but the reservation's slots hold "
                                      f"{nbytes} payload bytes; nothing was stored")
            tokens, data, identity, scope, layout, register_from, chunked = res.store_args
            out = await self.plane.store_payloads(tokens, data, identity, scope, tenant, layout, dict(res.slots),
                                                  register_from, chunked)
            return out, identity
        finally:
            await self._drop(res)  # whatever was not committed (all of it on a refusal)

    async def abort_store(self, tenant: str, rid: str) -> int:
        res = self._take(tenant, rid)
        return await self._shielded(self._drop(res))

    async def _drop(self, res: Reservation) -> int:
        store = self.plane.store
        slots = list(res.slots.values())
        if not slots:
            return 0
        return sum(await asyncio.to_thread(lambda: [store.drop_slot(s) for s in slots]))

    # ------------------------------------------------------------------ expiry

    async def reap(self, now: float | None = None) -> tuple[int, int]:
        """Release expired leases and abort expired reservations: (leases, reservations). Runs
        to its end even if the call that started it is cancelled (what it took out of the
        tables must be released)."""
        return await self._shielded(self._reap(time.monotonic() if now is None else now))

    async def _reap(self, now: float) -> tuple[int, int]:
        leases = [k for k, v in self._leases.items() if v.deadline <= now and not v.granting]
        reads: list[PoolRead] = []
        for k in leases:
            reads.extend(self._leases.pop(k).reads)
        rids = [k for k, v in self._reservations.items() if v.deadline <= now]
        expired = [self._reservations.pop(k) for k in rids]
        self.expired_leases += len(leases)
        self.expired_reservations += len(rids)
        if reads:
            await asyncio.to_thread(self.plane.store.unlease, reads)
        for res in expired:
            await self._drop(res)
        return len(leases), len(rids)

    async def close(self) -> None:
        """Release every lease and abort every reservation (the server is stopping)."""
        await self.reap(float("inf"))

    @property
    def leases(self) -> int:
        return len(self._leases)

    @property
    def reservations(self) -> int:
        return len(self._reservations)
