"""The data plane: chunk KV in the tiered store, kept consistent with the registry.

    Store(tokens, layout, payload parts)          Fetch(FetchQuery: items, layout, rope, ...)
      chunk tokens -> boundaries                    keys (another shard's plan translated),
      parts checked and staged (intake.py)            spans expanded (fetch_query.py)
      store.put per chunk (atomic, checksummed)     registry entry (scope-checked)
      registry entry -> RESIDENT (visible now)      store.get_many (checksum-verified, promoted)
                                                    rotary parts rotated by target - source
    Lookup(LookupQuery)                             (fp32 math, one rounding) unless raw
      ChunkIndex.plan (near cache filled first)     spans joined, head ranges sliced
      the plan of another TP cut if it reuses more  -> one FetchAnswer per item

Consistency rules (the registry always knows where a chunk's bytes are):

* A registry entry is ``RESIDENT`` only while some tier holds its payload. Store events are
  drained after every store call: a chunk evicted or lost from its last tier turns back into
  ``OBSERVED`` (a miss for engines, never an error); demotions/promotions update ``tier``.
* A registry entry evicted by the registry's own capacity limits takes its payload with it.
* A Store that fails part-way (quota, capacity, a bad part) deletes what it stored itself and
  registers nothing: the store and registry are as before the call.
* Payloads carry ``aux`` metadata (source position, prefix digest, an xxh3-128 of the chunk's
  tokens, left context), so a restart over a populated disk tier rebuilds the registry from
  ``list_chunks`` and verifies recovered entries by the digest before serving them.

Held sessions (docs/splice.md, "Sessions the sidecar holds")::

    held.resolve(tokens, refs)                    held.fetch(span = runs of one chunk + delta)
      chunk the session's tokens as Lookup does     store.get_many of each chunk once
      (ChunkIndex.lookup: own scope + shared,       rows gathered per run, rotary parts rotated
      verified, RESIDENT only) -> unbacked tokens   ONCE by position - canonical source position
      get (chunk, row, source position)             (fp32 math, one rounding) unless raw

Resident claims (``sidecar.claims``): ``claims`` is the ledger when the server has one. Every
key a sync or Store touches is tested against ``claims.watched`` (one dict lookup) and the
changed claimed keys are handed to ``claims.on_keys`` once per call. A Store that the tiers
refuse because guarded (claimed) chunks fill them is refused with ``ClaimBlocked`` (blocking
claim ids + capacity proof), after relaxing demotable claims and retrying once.

Pins: Fetch copies payloads out of the tiers inside ``get_many`` (which pins and unpins in its
own ``finally``, in a worker thread that completes even when the call is cancelled); nothing is
pinned while the response streams, so a client that disconnects mid-Fetch leaks nothing
(``TieredStore.pins_in_flight`` is the gauge).

Store and tier calls block (memory copies, file and Redis I/O), so they run in worker threads;
the registry is only touched on the event loop thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import numpy as np

from sidecar.claims import ClaimLedger
from sidecar.dataplane.cuts import CutFamilies
from sidecar.dataplane.fetch_query import FetchAnswer, FetchPath, FetchQuery
from sidecar.dataplane.held_reads import HeldReads
from sidecar.dataplane.intake import StoreIntake, check_payloads, chunk_sizes
from sidecar.dataplane.pool import PoolPath
from sidecar.dataplane.reads import ChunkReads, check_layout
from sidecar.dataplane.records import DataPlaneCounters, StoreOutcome, decode_aux, encode_aux
from sidecar.errors import ResourceExhausted
from sidecar.identity import SHARED_SCOPE, CacheIdentity, KVLayout
from sidecar.registry.chunk_index import ChunkIndex, LookupQuery
from sidecar.registry.entry import ChunkEntry, EntryState
from sidecar.registry.lookup_plan import LookupPlan
from sidecar.tiers import (
    TIER_RANK,
    CapacityError,
    EventKind,
    QuotaExceededError,
    StoreConfig,
    Tier,
    TieredStore,
    chunk_key,
)
from sidecar.tiers.store_pool import Slot, slot_checksums

logger = logging.getLogger(__name__)


def _put_all(puts: list[Callable[[], Any]]) -> tuple[list[Any], BaseException | None]:
    """Run ``puts`` in order (on a worker thread) until one raises: (the results, its exception
    or None). The caller decides what an exception means (relax claims and retry, roll back)."""
    out = []
    for put in puts:
        try:
            out.append(put())
        except BaseException as exc:  # noqa: BLE001 - handed to the event loop, which re-raises it
            return out, exc
    return out, None


class DataPlane:
    """Store, Fetch and Lookup over one chunk index and one tier store, kept consistent (the
    module docstring). Its paths are parts it composes, each given what it reads: ``fetches``
    (a Fetch from query to answers, ``fetch_query``) over ``reads`` (chunk reads,
    ``reads``), ``held`` (held sessions, ``held_reads``), ``pool`` (leases and reservations of
    the shared pool, ``pool``), ``cuts`` (the tensor-parallel cuts that stored, ``cuts``)."""

    def __init__(
        self, index: ChunkIndex, store: TieredStore | StoreConfig, *, claims: ClaimLedger | None = None,
        publish_remote: bool = False, on_registry_eviction: Callable[[str], None] | None = None,
        pool_lease_ttl_s: float = 2.0, pool_reservation_ttl_s: float = 30.0, pool_max_leases: int = 4096,
    ) -> None:
        """``store``: the tier store (or its config, to build one); ``claims``: the ledger whose
        guards every Store and sync consults (None: no claims); ``publish_remote``: Store also
        copies each chunk to the remote tier, for peers (shared registry);
        ``on_registry_eviction``: called with the reason of every registry eviction (the server
        counts them: kv_sidecar_registry_evictions_total{reason})."""
        self.index = index
        self.store = store if isinstance(store, TieredStore) else TieredStore(store)
        self.counters = DataPlaneCounters()
        self.publish_remote = publish_remote
        self.claims = claims
        self.on_registry_eviction = on_registry_eviction
        self._events_dropped_seen = 0
        #: Fetch by lease and Store by reservation through the shared pool (``dataplane.pool``)
        self.pool = PoolPath(self, lease_ttl_s=pool_lease_ttl_s, reservation_ttl_s=pool_reservation_ttl_s,
                             max_leases=pool_max_leases)
        #: the tensor-parallel cuts of each model that have stored (``dataplane.cuts``)
        self.cuts = CutFamilies()
        self.reads = ChunkReads(index, self.store, self.counters, self.synced)
        self.fetches = FetchPath(index, self.reads)
        self.held = HeldReads(index, self.store, self.counters, self.synced)

    # ------------------------------------------------------------------ Lookup and Fetch

    async def lookup(self, query: LookupQuery) -> LookupPlan:
        """The plan of ``query`` (``ChunkIndex.plan``: the shared registry's near cache filled
        first), or, when another tensor-parallel cut of the model that has stored reuses more of
        the prompt, that cut's plan naming its shard (``LookupPlan.plan_shard``, ``dataplane.cuts``)."""
        plan = await self.index.plan(query)
        others = self.cuts.others(query.identity)
        if not others or plan.summary.prefill_tokens == 0:
            return plan

        def reused(p: LookupPlan) -> int:
            return p.summary.exact_tokens + p.summary.shifted_tokens

        best = plan
        for lead in others:
            alt = await self.index.plan(dataclasses.replace(query, identity=lead))
            if reused(alt) > reused(best):
                alt.plan_shard = lead.shard
                best = alt
        return best

    def fetch(self, query: FetchQuery, *, gather: bool = False) -> AsyncIterator[FetchAnswer]:
        """One answer per item of ``query``, in order (``FetchPath.fetch``: every refusal before
        the first answer)."""
        return self.fetches.fetch(query, gather=gather)

    # ------------------------------------------------------------------ consistency

    def recover(self) -> int:
        """Rebuild registry entries for chunks the tiers already hold (restart recovery)."""
        reg = self.index.registry
        n = 0
        seen: set[bytes] = set()
        for tier in self.store.tiers:  # fastest first: a chunk is registered at its fastest tier
            for meta in self.store.list_chunks(tier):
                if meta.key in seen:
                    continue
                seen.add(meta.key)
                entry = decode_aux(meta)
                if entry is None:
                    logger.warning("chunk %s has no usable registry metadata; deleting it", meta.key.hex())
                    self.store.delete([meta.key])
                    continue
                reg.set_state(entry, entry.state, tier.value)  # not registered yet
                if reg.insert(entry):
                    n += 1
        self.sync()
        if n:
            logger.info("recovered %d chunks from the tiers", n)
        return n

    def adopt_resident(self, entry: ChunkEntry) -> bool:
        """Take in a chunk whose payload the tiers already hold (``entry``: RESIDENT, at its
        ``tier``; a manifest import's prefetch): insert it, or upgrade the entry of the same
        tokens (an OBSERVED one included) to describe that stored copy, RESIDENT. True when the
        key is new here."""
        reg = self.index.registry
        old = reg.peek(entry.key)
        if old is not None and reg.matches(old, entry.tokens):
            reg.update(old, source_pos=entry.source_pos, prefix_digest=entry.prefix_digest,
                       left_context=entry.left_context)
            reg.set_state(old, EntryState.RESIDENT, entry.tier)
            return False
        return reg.insert(entry)

    def _tier_of(self, key: bytes) -> str | None:
        tier = self.store.locate(key)
        return tier.value if tier is not None else None

    def sync(self) -> None:
        """Apply store events to the registry and registry evictions to the store. Blocks on
        tier I/O (the deletes wait for the tiers' writer lock, held across disk and Redis I/O):
        for startup and worker threads; coroutines ``await synced()``."""
        dropped, touched = self._registry_drops()
        if dropped:
            self.store.delete(dropped)
        self._apply_store_events(touched)

    async def synced(self) -> None:
        """``sync`` for coroutines on the event loop: the same steps in the same order, with the
        deletes of registry-evicted payloads in a worker thread (the registry, which has already
        dropped those entries, and the event drain stay on the loop)."""
        dropped, touched = self._registry_drops()
        if dropped:
            await asyncio.to_thread(self.store.delete, dropped)
        self._apply_store_events(touched)

    def _registry_drops(self) -> tuple[list[bytes], list[int]]:
        """Drain registry evictions: (store keys whose payload goes with them, claimed keys touched)."""
        watched = self.claims.watched if self.claims is not None else {}
        touched: list[int] = []
        dropped: list[bytes] = []
        counted = self.on_registry_eviction
        for ev in self.index.registry.take_events():
            dropped.append(chunk_key(ev.key))
            if ev.key in watched:
                touched.append(ev.key)
            if counted is not None:
                counted(ev.reason)
        return dropped, touched

    def _apply_store_events(self, touched: list[int]) -> None:
        """Drain store events into the registry (state, tier); hand claimed keys to the ledger."""
        reg = self.index.registry
        claims = self.claims
        watched = claims.watched if claims is not None else {}
        counts = self.counters.events
        for ev in self.store.take_events():
            counts[ev.kind.value] = counts.get(ev.kind.value, 0) + 1
            h = int.from_bytes(ev.key, "big")
            if h in watched:
                touched.append(h)
            entry = reg.peek(h)
            if entry is None:
                continue
            if not ev.tiers_after or ev.kind is EventKind.DELETED:
                reg.set_state(entry, EntryState.OBSERVED, None)
            else:
                reg.set_state(entry, entry.state, min(ev.tiers_after, key=TIER_RANK.__getitem__).value)
        dropped_events = self.store.stats().events_dropped
        if dropped_events != self._events_dropped_seen:
            self._events_dropped_seen = dropped_events
            touched.extend(self._resync())
        if touched:
            claims.on_keys(touched)

    def _resync(self) -> list[int]:
        """The tier event buffer overflowed (events were lost): re-read where every chunk lives
        from the store and correct the registry's state and tier (O(entries); rare). Returns
        the keys whose state changed."""
        where: dict[int, str] = {}
        for meta in self.store.list_chunks():
            h = int.from_bytes(meta.key, "big")
            tier = self.store.locate(meta.key)
            if tier is not None:
                where[h] = tier.value
        changed = []
        reg = self.index.registry
        for entry in reg.entries():
            tier = where.get(entry.key)
            if entry.state is EntryState.RESIDENT and tier is None:
                reg.set_state(entry, EntryState.OBSERVED, None)
                changed.append(entry.key)
            elif tier is not None and (entry.state is not EntryState.RESIDENT or entry.tier != tier):
                if entry.state is EntryState.RESIDENT:
                    reg.set_state(entry, EntryState.RESIDENT, tier)
                else:
                    continue  # metadata-only entry: its KV came back only through a Store
                changed.append(entry.key)
        self.counters.events["resync"] = self.counters.events.get("resync", 0) + 1
        return changed

    # ------------------------------------------------------------------ store

    def store_entries(
        self, tokens: np.ndarray, data: bytes, identity: CacheIdentity, scope: str, layout: KVLayout,
        register_from: int,
    ) -> tuple[list[ChunkEntry], int]:
        """The entries a Store of ``tokens`` would register (every chunk at or after
        ``register_from``, fresh objects, nothing registered; an occurrence computed after
        another left context than its chunk's held copy keyed as another copy of it,
        ``ChunkIndex.copy_keys``) and the end of the last one. A
        payload part may only name one of their ``source_pos``, with ``num_tokens x
        layout.bytes_per_token`` bytes in all. Raises FailedPrecondition if ``identity`` does
        not name ``layout``."""
        check_layout(identity, layout)
        self.cuts.saw(identity)  # a cut of its model that Stores (``dataplane.cuts``)
        return self.index.entries(tokens, data, identity, scope, register_from=register_from, copies=True)

    def store_intake(
        self, tokens: np.ndarray, data: bytes, identity: CacheIdentity, scope: str, register_from: int,
        layout: Callable[[], KVLayout | None], max_chunk_bytes: int,
    ) -> StoreIntake:
        """A Store stream's intake (``sidecar.dataplane.intake``): its payload parts checked as
        they arrive and staged, its commit checked; then ``store_stream``."""
        def chunking(kv: KVLayout) -> tuple[list[ChunkEntry], int]:
            return self.store_entries(tokens, data, identity, scope, kv, register_from)

        return StoreIntake(chunking, tokens, data, identity, scope, register_from, layout, max_chunk_bytes)

    async def store_stream(self, intake: StoreIntake, tenant: str) -> StoreOutcome:
        """Store what a closed ``intake`` holds (``store_payloads``: all or nothing), or, when it
        carried no payload, register its chunks' metadata (OBSERVED)."""
        if intake.payloads:
            return await self.store_payloads(
                intake.tokens, intake.data, intake.identity, intake.scope, tenant, intake.layout, intake.payloads,
                intake.register_from, intake.chunked,
            )
        result = self.index.register(intake.tokens, intake.data, intake.identity, intake.scope,
                                     register_from=intake.register_from)
        await self.synced()
        return StoreOutcome(result.chunks_total, result.chunks_registered, result.chunks_refreshed, 0, result.bounds)

    async def store_payloads(
        self,
        tokens: np.ndarray,
        data: bytes,
        identity: CacheIdentity,
        scope: str,
        tenant: str,
        layout: KVLayout,
        payloads: Mapping[int, memoryview | bytearray | Slot],
        register_from: int,
        chunked: tuple[list[ChunkEntry], int] | None = None,
    ) -> StoreOutcome:
        """Validate every payload against the chunking and layout, store them, then register.

        ``chunked``: what ``store_entries`` returned for the same arguments (the server
        computes it from the header, to check each part as it arrives); computed if None.
        All-or-nothing: on any refusal the chunks this call stored are deleted again."""
        index = self.index
        # Entries (metadata) for every chunk past register_from, payload or not.
        listed, end = chunked if chunked is not None else self.store_entries(
            tokens, data, identity, scope, layout, register_from
        )
        entries = {e.source_pos: e for e in listed}
        # The stream's StoreIntake (and a reservation's slots) already fit: a guard for any caller.
        check_payloads(chunk_sizes(listed, layout), payloads)
        stored: list[bytes] = []
        tiers: dict[int, str] = {}
        held: dict[int, ChunkEntry] = {}  # chunks the tiers already held: their copy stays canonical
        shared_copies: set[int] = set()  # keys whose bytes the shared remote tier holds
        order = sorted(payloads)
        if self.claims is not None and self.claims.watched:
            # Feasibility first: a Store that only fits by breaking accepted claims is refused
            # whole (it would otherwise evict its own chunks and claim success).
            peek = index.registry.peek
            need = sum(
                self.store.object_footprint(len(payloads[s])) for s in order
                if (old := peek(entries[s].key)) is None or old.state is not EntryState.RESIDENT
            )
            if need:
                self.claims.check_store(tenant, need)
        slots = [payloads[s] for s in order if isinstance(payloads[s], Slot)]
        sums = dict(zip(map(id, slots), await slot_checksums(slots))) if len(slots) > 1 else {}
        puts = [
            functools.partial(
                self.store.put_slot, payloads[start], layout=layout,  # written in place in the shared pool
                num_tokens=entries[start].num_tokens, tenant=tenant, scope=scope,
                source_position=entries[start].source_pos, aux=encode_aux(entries[start]), publish=self.publish_remote,
                payload_checksum=sums.get(id(payloads[start])),
            ) if isinstance(payloads[start], Slot) else functools.partial(
                self.store.put, chunk_key(entries[start].key), payloads[start], layout=layout,
                num_tokens=entries[start].num_tokens, tenant=tenant, scope=scope,
                source_position=entries[start].source_pos, aux=encode_aux(entries[start]), publish=self.publish_remote,
            )
            for start in order
        ]

        def took(start: int, result: Any) -> None:
            if result.published:
                shared_copies.add(entries[start].key)
            if result.stored:
                stored.append(result.key)
            else:
                meta = self.store.meta(result.key)
                canonical = decode_aux(meta) if meta is not None else None
                if canonical is not None:
                    held[start] = canonical
            tiers[start] = result.tier.value

        try:
            i = 0
            while i < len(order):
                # The chunks in one worker-thread job until one fails: one hand-off per Store,
                # not one per chunk (each costs the event loop and the worker the GIL twice).
                results, exc = await asyncio.to_thread(_put_all, puts[i:])
                for result in results:
                    took(order[i], result)
                    i += 1
                if exc is None:
                    break
                if not isinstance(exc, CapacityError) or self.claims is None:
                    raise exc
                await self.synced()  # guards may have moved chunks: the ledger must see where they are
                verdict = self.claims.store_refusal(exc, tenant, sum(self.store.object_footprint(len(payloads[s])) for s in order))
                if verdict is True:
                    took(order[i], await asyncio.to_thread(puts[i]))  # demotable claims relaxed: once more
                    i += 1
                elif verdict is False:
                    raise exc
                else:
                    raise verdict from exc
        except QuotaExceededError as exc:
            await self._rollback(stored)
            raise ResourceExhausted(f"limits.max_bytes (tenant quota): {exc}") from exc
        except CapacityError as exc:
            await self._rollback(stored)
            raise ResourceExhausted(f"capacity: {exc}") from exc
        except ResourceExhausted:
            await self._rollback(stored)
            raise
        except BaseException:
            await self._rollback(stored)
            raise
        # Register on the loop thread: visible to the very next Lookup.
        reg = index.registry
        registered = refreshed = 0
        new: list[ChunkEntry] = []
        for start, e in entries.items():
            old = reg.peek(e.key)
            if start in tiers:
                canonical = held.get(start)
                if canonical is not None:
                    # The tiers kept an earlier copy: the entry must describe where THAT copy was
                    # computed, or Fetch would rotate it by the wrong delta.
                    reg.update(e, source_pos=canonical.source_pos, prefix_digest=canonical.prefix_digest,
                               left_context=canonical.left_context)
                reg.set_state(e, EntryState.RESIDENT, tiers[start])
                if old is not None and reg.matches(old, e.tokens) and (
                    old.state is not EntryState.RESIDENT or canonical is not None
                ):
                    # An OBSERVED entry may have been registered at another position: the payload
                    # just stored (or the one the tiers held) is the canonical copy now.
                    reg.update(old, source_pos=e.source_pos, prefix_digest=e.prefix_digest, left_context=e.left_context)
                    reg.set_state(old, EntryState.RESIDENT, tiers[start])
            if reg.insert(e):
                registered += 1
                new.append(e)
            else:
                refreshed += 1
        index.announce(identity, new)
        await self.synced()
        if self.claims is not None:
            watched = self.claims.watched
            mine = [e.key for e in entries.values() if e.key in watched]
            if mine:
                self.claims.on_keys(mine)
        if index.shared is not None:
            index.shared.publish([reg.peek(e.key) for e in entries.values()], shared_copies)
        nbytes = sum(len(payloads[s]) for s in tiers)
        self.counters.stored_chunks += len(tiers)
        self.counters.stored_bytes += nbytes
        out_bounds = (*entries, end) if entries else ()
        return StoreOutcome(len(entries), registered, refreshed, len(tiers), out_bounds, nbytes)

    async def _rollback(self, keys: list[bytes]) -> None:
        if keys:
            await asyncio.to_thread(self.store.delete, keys)
            self.store.take_events()

    # ------------------------------------------------------------------ operators

    def owned_keys(self, tenant: str, hashes: Sequence[int], may_write_shared: bool) -> list[int]:
        """The keys of ``hashes`` that ``tenant`` may evict or delete, each with every other copy
        of its chunk (the same tokens computed after other left contexts): Evict and Delete act
        on a chunk's content wherever it was stored. Each key once, in order."""
        reg = self.index.registry
        out: dict[int, None] = {}
        for h in hashes:
            e = reg.peek(h)
            if e is not None and (e.scope == tenant or (e.scope == SHARED_SCOPE and may_write_shared)):
                out[h] = None
                for k in reg.copies(h):
                    out[k] = None
        return list(out)

    async def evict(self, hashes: Sequence[int], tier: str) -> int:
        keys = [chunk_key(h) for h in hashes]
        if tier:
            t = Tier(tier)
            keys = [k for k in keys if t in self.store.tiers_of(k)]
        n = await asyncio.to_thread(self.store.evict, keys) if keys else 0
        await self.synced()
        return n

    async def delete(self, hashes: Sequence[int]) -> int:
        reg = self.index.registry
        n = 0
        gone = [(h, e.scope) for h in hashes if (e := reg.peek(h)) is not None]
        for h in hashes:
            if reg.delete(h):
                n += 1
        if gone and self.index.shared is not None:
            self.index.shared.unpublish(gone)
        await asyncio.to_thread(self.store.delete, [chunk_key(h) for h in hashes])
        reg.take_events()
        await self.synced()
        return n

    def close(self) -> None:
        self.store.close()


