"""The data plane: chunk KV in the tiered store, kept consistent with the registry.

    Store(tokens, layout, payload parts)          Fetch(items = (hash, target_pos))
      chunk tokens -> boundaries                    registry entry (scope-checked)
      every part names a boundary; sizes checked    store.get_many (checksum-verified, promoted)
      store.put per chunk (atomic, checksummed)     rotary parts rotated by target - source
      registry entry -> RESIDENT (visible now)      (fp32 math, one rounding) unless raw

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

    resolve_held(tokens, refs)                    fetch_session(span = runs of one chunk + delta)
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
import functools
import logging
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sidecar.directives.held import HeldKV, HeldRuns, HeldSpan
from sidecar.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from sidecar.identity import SHARED_SCOPE, CacheIdentity, KVLayout
from sidecar.registry.index import ChunkIndex, LookupQuery
from sidecar.registry.plan import SEG_END, SEG_HASH, SEG_KIND, SEG_OFFSET, SEG_SOURCE, SEG_START, AdmissionPolicy
from sidecar.registry.plan import SegmentKind
from sidecar.registry.registry import ChunkEntry, ChunkHash, EntryState, token_digest
from sidecar.tiers import (
    CapacityError,
    ChunkMeta,
    EventKind,
    FetchedChunk,
    QuotaExceededError,
    StoreConfig,
    TieredStore,
    Tier,
    chunk_key,
    decode_payload,
)

logger = logging.getLogger(__name__)

_AUX = struct.Struct("<BxxxIQI16s")  # version, source_pos, prefix_digest, num_tokens, token digest
_AUX_VERSION = 1
#: Fetch reads chunks in windows of about this many payload bytes (not all items at once)
_FETCH_WINDOW_BYTES = 32 << 20
_MAX_AUX_CONTEXT = 1024 - _AUX.size
#: Fetch windows with at most this many rotary-part bytes rotate on the event loop thread, not
#: in a worker (a 128-token DeepSeek-V2-Lite chunk has 0.4 MiB of k_pe: ~0.06 ms of kernel)
_INLINE_ROTATION_BYTES = 1 << 20


def encode_aux(entry: ChunkEntry) -> bytes:
    ctx = entry.left_context[-(_MAX_AUX_CONTEXT // 4) * 4 :] if entry.left_context else b""
    digest = entry.digest or token_digest(entry.tokens)
    return _AUX.pack(_AUX_VERSION, entry.source_pos, entry.prefix_digest, entry.num_tokens, digest) + ctx


def decode_aux(meta: ChunkMeta) -> ChunkEntry | None:
    aux = meta.aux
    if len(aux) < _AUX.size:
        return None
    version, src, prefix, ntok, digest = _AUX.unpack_from(aux)
    if version != _AUX_VERSION or ntok != meta.num_tokens:
        return None
    return ChunkEntry(
        key=ChunkHash(int.from_bytes(meta.key, "big")),
        scope=meta.scope,
        tokens=b"",
        source_pos=src,
        prefix_digest=prefix,
        left_context=bytes(aux[_AUX.size :]),
        state=EntryState.RESIDENT,
        num_tokens=ntok,
        digest=digest,
    )


@dataclass(slots=True)
class StoreOutcome:
    chunks_total: int
    chunks_registered: int
    chunks_refreshed: int
    chunks_stored: int
    bounds: tuple[int, ...]
    stored_bytes: int = 0


@dataclass(slots=True)
class FetchResult:
    """One Fetch item: ``payload`` (uint8 CPU tensor) is None for a miss."""

    index: int
    entry: ChunkEntry | None = None
    payload: torch.Tensor | None = None
    tier: str = ""
    delta: int = 0
    rotated: bool = False


@dataclass(slots=True)
class SessionRun:
    """One FetchSession run: ``num_tokens`` rows from ``chunk_offset`` of chunk ``chunk_hash``
    for session positions ``[target_pos, target_pos + num_tokens)``; ``payload`` (uint8 CPU
    tensor, ``KVLayout`` order) has its rotary parts rotated by ``delta`` unless raw."""

    index: int
    target_pos: int
    num_tokens: int
    chunk_hash: int
    chunk_offset: int
    source_pos: int
    delta: int
    rotated: bool
    tier: str
    payload: torch.Tensor


@dataclass(slots=True)
class DataPlaneCounters:
    fetched_chunks: int = 0
    fetched_bytes: int = 0
    fetch_misses: int = 0
    stored_chunks: int = 0
    stored_bytes: int = 0
    rotated_bytes: int = 0
    rotation_seconds: float = 0.0
    events: dict[str, int] = field(default_factory=dict)


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
    def __init__(self, index: ChunkIndex, config: StoreConfig) -> None:
        self.index = index
        self.store = TieredStore(config)
        self.counters = DataPlaneCounters()
        #: Store also copies each chunk to the remote tier, for peers (shared registry).
        self.publish_remote = False
        self.claims = None  # sidecar.claims.ClaimLedger, set by the server
        #: called with the reason of every registry eviction (the server counts them:
        #: kv_sidecar_registry_evictions_total{reason})
        self.on_registry_eviction: Callable[[str], None] | None = None
        self._events_dropped_seen = 0

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
                reg.set_state(entry, entry.state, min(ev.tiers_after, key=_TIER_RANK.__getitem__).value)
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
        ``register_from``, fresh objects, nothing registered) and the end of the last one. A
        payload part may only name one of their ``source_pos``, with ``num_tokens x
        layout.bytes_per_token`` bytes in all. Raises FailedPrecondition if ``identity`` does
        not name ``layout``."""
        check_layout(identity, layout)
        return self.index.entries(tokens, data, identity, scope, register_from=register_from)

    async def store_payloads(
        self,
        tokens: np.ndarray,
        data: bytes,
        identity: CacheIdentity,
        scope: str,
        tenant: str,
        layout: KVLayout,
        payloads: dict[int, bytearray],
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
        per_token = layout.bytes_per_token
        for start, buf in payloads.items():
            e = entries.get(start)
            if e is None:
                starts = sorted(entries)
                raise InvalidArgument(
                    f"payload.chunk_start: {start} is not a chunk boundary at or after register_from "
                    f"(boundaries: {starts[:8]}{'...' if len(starts) > 8 else ''})"
                )
            expected = e.num_tokens * per_token
            if len(buf) != expected:
                raise InvalidArgument(
                    f"payload.data: chunk at {start} has {len(buf)} bytes; layout x {e.num_tokens} tokens "
                    f"needs {expected}"
                )
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
        puts = [
            functools.partial(
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
        if index.publisher is not None:
            index.publisher.publish([reg.peek(e.key) for e in entries.values()], shared_copies)
        nbytes = sum(len(payloads[s]) for s in tiers)
        self.counters.stored_chunks += len(tiers)
        self.counters.stored_bytes += nbytes
        out_bounds = (*entries, end) if entries else ()
        return StoreOutcome(len(entries), registered, refreshed, len(tiers), out_bounds, nbytes)

    async def _rollback(self, keys: list[bytes]) -> None:
        if keys:
            await asyncio.to_thread(self.store.delete, keys)
            self.store.take_events()

    # ------------------------------------------------------------------ fetch

    async def fetch(
        self,
        tenant: str,
        identity: CacheIdentity,
        layout: KVLayout,
        rope,  # RopeSpec | None
        items: Sequence[tuple[int, int]],
        raw: bool,
        max_bytes: int | None = None,
    ) -> list[FetchResult]:
        """``fetch_stream`` collected into a list (tests, small callers)."""
        return [r async for r in self.fetch_stream(tenant, identity, layout, rope, items, raw, max_bytes)]

    async def fetch_stream(
        self,
        tenant: str,
        identity: CacheIdentity,
        layout: KVLayout,
        rope,  # RopeSpec | None
        items: Sequence[tuple[int, int]],
        raw: bool,
        max_bytes: int | None = None,
    ) -> AsyncIterator[FetchResult]:
        """Payloads for ``items`` in order, rotated to their target positions unless ``raw``,
        yielded one item at a time.

        An item whose chunk is unknown, belongs to another scope, or whose bytes are gone is a
        miss (``payload`` None). Nothing is changed except tier promotions (the Lookup that
        planned these hits already refreshed their registry recency and hit counts).

        Memory: chunks are read in windows of about ``_FETCH_WINDOW_BYTES``; a chunk named by
        several items is read once and kept only until its last item (one rotated copy per
        distinct delta), so 4,096 copies of one chunk cost one read, not 4,096. Results that
        share a chunk and delta share their payload: callers must not write to it.
        ``max_bytes``: the answered payload bytes (every hit item counted) may not exceed it,
        checked before anything is read (ResourceExhausted naming ``max_fetch_bytes``).
        Validation errors are raised before the first result."""
        check_layout(identity, layout)
        reg = self.index.registry
        per_token = layout.bytes_per_token
        entries: dict[int, ChunkEntry] = {}
        plan: list[tuple[int, ChunkEntry | None, int]] = []  # (hash, entry or None, delta) per item
        total = 0
        shifted = False
        for h, target in items:
            e = entries.get(h)
            if e is None:
                e = reg.peek(h)
                if e is None or e.state is not EntryState.RESIDENT or e.scope not in (tenant, SHARED_SCOPE):
                    plan.append((h, None, 0))
                    continue
                entries[h] = e
            delta = target - e.source_pos
            shifted = shifted or bool(delta)
            total += e.num_tokens * per_token
            plan.append((h, e, delta))
        if shifted and not raw:
            if rope is None:
                raise InvalidArgument("rope: required to rotate shifted chunks (or set raw)")
            check_rope(identity, layout, rope)
        if max_bytes is not None and total > max_bytes:
            raise ResourceExhausted(
                f"max_fetch_bytes: the hits of this Fetch hold {total} payload bytes, more than {max_bytes}; "
                "split it into smaller Fetches"
            )
        # Uses left of each chunk (raw payload) and of each (chunk, delta) (its rotated copy).
        left: dict[int, int] = {}
        left_rot: dict[tuple[int, int], int] = {}
        for h, e, delta in plan:
            if e is not None:
                left[h] = left.get(h, 0) + 1
                if delta and not raw:
                    left_rot[(h, delta)] = left_rot.get((h, delta), 0) + 1
        held: dict[int, FetchedChunk | None] = {}  # chunks read, kept until their last item
        rotated: dict[tuple[int, int], torch.Tensor] = {}
        counters = self.counters
        try:
            i = 0
            while i < len(plan):
                # The next window: items until the chunks still to read reach the window size.
                j, want, size = i, [], 0
                while j < len(plan) and (j == i or size < _FETCH_WINDOW_BYTES):
                    h, e, _ = plan[j]
                    if e is not None and h not in held and h not in want:
                        want.append(h)
                        size += e.num_tokens * per_token
                    j += 1
                if want:
                    got = await asyncio.to_thread(self.store.get_many, [chunk_key(h) for h in want])
                    for h, g in zip(want, got):
                        held[h] = self._checked_chunk(entries[h], g, layout)
                window: list[FetchResult] = []
                to_rotate: list[FetchResult] = []
                raw_here: set[int] = set()  # chunks whose raw payload an item of this window holds
                for k in range(i, j):
                    h, e, delta = plan[k]
                    r = FetchResult(index=k)
                    window.append(r)
                    g = held.get(h) if e is not None else None
                    if g is not None:
                        r.entry, r.delta, r.tier = e, delta, g.tier.value
                        if delta and not raw:
                            r.rotated = True
                            copy = rotated.get((h, delta))
                            if copy is None:
                                # In place when no other use of the raw payload is left, and no
                                # earlier item of this window (not yet sent) holds it raw.
                                own = left[h] == left_rot[(h, delta)] and h not in raw_here
                                copy = rotated[(h, delta)] = g.payload if own else g.payload.clone()
                                r.payload = copy
                                to_rotate.append(r)
                            r.payload = copy
                        else:
                            r.payload = g.payload
                            raw_here.add(h)
                    if e is not None:
                        left[h] -= 1
                        if not left[h]:
                            held.pop(h, None)
                        if delta and not raw:
                            left_rot[(h, delta)] -= 1
                            if not left_rot[(h, delta)]:
                                rotated.pop((h, delta), None)
                if to_rotate:
                    rotary = sum(p.bytes_per_token for p in layout.parts if p.rotary) * layout.num_layers
                    if sum(r.entry.num_tokens for r in to_rotate) * rotary <= _INLINE_ROTATION_BYTES:
                        # ~0.1 ms of kernel work: less than the worker-thread hop would cost
                        counters.rotated_bytes += _rotate_all(to_rotate, layout, rope, counters)
                    else:
                        counters.rotated_bytes += await asyncio.to_thread(_rotate_all, to_rotate, layout, rope, counters)
                for r in window:
                    if r.payload is None:
                        counters.fetch_misses += 1
                    else:
                        counters.fetched_chunks += 1
                        counters.fetched_bytes += r.payload.numel()
                    yield r
                i = j
        finally:
            await self.synced()

    def _checked_chunk(self, e: ChunkEntry, got: FetchedChunk | None, layout: KVLayout) -> FetchedChunk | None:
        """``got`` if it is the entry's chunk as the caller's layout reads it, else None (a miss)."""
        # got.meta.scope: the bytes must have been stored under the entry's scope (a 64-bit key
        # collision across scopes must not serve one tenant's KV to another).
        if got is None or got.meta.num_tokens != e.num_tokens or got.meta.layout_fingerprint != layout.fingerprint() \
                or got.meta.scope != e.scope:
            if got is None and e.tier == Tier.REMOTE.value and not self.store.contains(chunk_key(e.key)):
                # A peer's chunk (shared registry) whose remote copy is gone: stop planning it.
                self.index.registry.set_state(e, EntryState.OBSERVED, None)
            return None
        return got

    # ------------------------------------------------------------------ held sessions

    def resolve_held(
        self, tenant: str, identity: CacheIdentity, tokens: np.ndarray, refs: HeldKV, start: int, end: int
    ) -> HeldKV:
        """The references of a held session with ``[start, end)`` brought up to date (the
        ``sidecar.directives.Resolver`` contract; runs on the event loop, changes nothing else
        than registry recency).

        1. A backed token whose chunk is no longer served (evicted from every tier, deleted,
           or no longer in the tenant's or the shared scope) becomes unbacked; one whose chunk
           was re-Stored elsewhere follows the registry's canonical source position.
        2. Unbacked tokens are looked up exactly as Lookup finds chunks (``ChunkIndex.lookup``
           over the session's whole current sequence: same chunking, own scope then shared,
           token verification, RESIDENT chunks only), with no left-context window and no
           recompute: ``position_independent`` (positions below the carve-out are then only
           backed by chunks computed at their own position), or ``exact`` for tokens marked
           ``exact`` (re-prefilled by a FORGET directive). Backed tokens keep their reference:
           a kept token's canonical copy is never replaced by a copy the engine Stored after
           rotating it.
        """
        reg = self.index.registry
        backed = refs.backed[start:end]
        if backed.any():
            pos = np.flatnonzero(backed) + start
            uniq, inverse = np.unique(refs.chunk_hash[pos], return_inverse=True)
            served = np.zeros(len(uniq), dtype=bool)
            chunk_src = np.zeros(len(uniq), dtype=np.int64)
            for i, h in enumerate(uniq.tolist()):  # per chunk, not per token
                e = reg.peek(h)
                if e is not None and e.state is EntryState.RESIDENT and e.scope in (tenant, SHARED_SCOPE):
                    served[i] = True
                    chunk_src[i] = e.source_pos
            src = chunk_src[inverse] + refs.row[pos]
            moved = served[inverse] & (src != refs.source_pos[pos])
            # a copy computed elsewhere is not an exact copy any more
            ok = served[inverse] & ~(moved & refs.exact[pos])
            moved &= ok
            if moved.any():
                refs = refs.filled(pos[moved], refs.chunk_hash[pos[moved]], refs.row[pos[moved]], src[moved])
            refs = refs.dropped(pos[~ok])
        miss = ~refs.backed[start:end]
        if not miss.any():
            return refs
        data = tokens.astype("<u4", copy=False).tobytes()
        exact = refs.exact[start:end]
        for policy, want in (
            (AdmissionPolicy.POSITION_INDEPENDENT, miss & ~exact),
            (AdmissionPolicy.EXACT, miss & exact),
        ):
            if want.any():
                refs = self._resolve_with(tenant, identity, tokens, data, refs, start + int(np.argmax(want)), policy)
        return refs

    def _resolve_with(
        self,
        tenant: str,
        identity: CacheIdentity,
        tokens: np.ndarray,
        data: bytes,
        refs: HeldKV,
        first: int,
        policy: AdmissionPolicy,
    ) -> HeldKV:
        """Fill the unbacked tokens from ``first`` on whose ``exact`` flag matches ``policy``
        with the chunk hits a Lookup of the session's tokens returns under ``policy``."""
        plan = self.index.lookup(LookupQuery(
            tokens=tokens, data=data, identity=identity, scope=tenant, engine_prefix_len=first, policy=policy,
            left_context_window=0, recompute_tokens=0,
        ))
        hits = plan.table[plan.table[:, SEG_KIND] == SegmentKind.CHUNK_HIT]
        if not len(hits):
            return refs
        seg_start = hits[:, SEG_START].astype(np.int64)
        lengths = hits[:, SEG_END].astype(np.int64) - seg_start
        # One entry per token of every hit segment: its position, chunk, row and source.
        rel = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        pos = np.repeat(seg_start, lengths) + rel
        want = ~refs.backed[pos] & (refs.exact[pos] == (policy is AdmissionPolicy.EXACT))
        pos, rel = pos[want], rel[want]
        each = np.repeat(np.arange(len(hits)), lengths)[want]
        return refs.filled(
            pos,
            hits[each, SEG_HASH],
            hits[each, SEG_OFFSET].astype(np.int64) + rel,
            hits[each, SEG_SOURCE].astype(np.int64) + rel,
        )

    async def fetch_session(self, span: HeldSpan, layout: KVLayout, rope, raw: bool) -> list[SessionRun]:
        """The KV of ``span`` (a held session's range, every position backed): per run, its
        rows gathered from the run's canonical chunk and its rotary parts rotated ONCE by the
        run's ``delta`` (session position - canonical source position), unless ``raw``.

        Each chunk is read once, however many runs use it. A chunk whose bytes are gone since
        the span was resolved raises ``FailedPrecondition`` naming the positions (the registry
        learns the loss, so the next call resolves them again). Nothing is changed except tier
        promotions and that."""
        identity = span.identity
        check_layout(identity, layout)
        runs = span.runs
        deltas = runs.delta
        if not raw and deltas.any():
            if rope is None:
                raise InvalidArgument("rope: required to rotate the session's shifted rows (or set raw)")
            check_rope(identity, layout, rope)
        reg = self.index.registry
        hashes = list(dict.fromkeys(runs.chunk_hash.tolist()))  # each chunk once, in first-use order
        entries = [reg.peek(h) for h in hashes]
        fetched = await asyncio.to_thread(self.store.get_many, [chunk_key(h) for h in hashes]) if hashes else []
        chunks: dict[int, tuple[ChunkEntry, torch.Tensor, str]] = {}
        for h, e, got in zip(hashes, entries, fetched):
            if e is not None and got is not None and got.meta.num_tokens == e.num_tokens and (
                got.meta.layout_fingerprint == layout.fingerprint()
            ) and got.meta.scope == e.scope:
                chunks[h] = (e, got.payload, got.tier.value)
        await self.synced()
        for i, h in enumerate(runs.chunk_hash.tolist()):
            if h not in chunks:
                a = int(runs.target_pos[i])
                raise FailedPrecondition(
                    f"session {span.session_id}: positions [{a}, {a + int(runs.num_tokens[i])}) lost their stored KV "
                    f"(chunk {h:016x} is no longer held); Store them again"
                )
        out = await asyncio.to_thread(_gather_runs, runs, chunks, layout, rope, raw, self.counters)
        self.counters.fetched_bytes += sum(r.payload.numel() for r in out)
        return out

    # ------------------------------------------------------------------ operators

    def owned_keys(self, tenant: str, hashes: Sequence[int], may_write_shared: bool) -> list[int]:
        reg = self.index.registry
        out = []
        for h in hashes:
            e = reg.peek(h)
            if e is not None and (e.scope == tenant or (e.scope == SHARED_SCOPE and may_write_shared)):
                out.append(h)
        return out

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
        if gone and self.index.publisher is not None:
            self.index.publisher.unpublish(gone)
        await asyncio.to_thread(self.store.delete, [chunk_key(h) for h in hashes])
        reg.take_events()
        await self.synced()
        return n

    def close(self) -> None:
        self.store.close()


_TIER_RANK = {Tier.GPU: 0, Tier.CPU: 1, Tier.DISK: 2, Tier.REMOTE: 3}


def check_layout(identity: CacheIdentity, layout: KVLayout) -> None:
    fp = layout.fingerprint()
    if identity.kv_layout != fp:
        raise FailedPrecondition(
            f"identity.kv_layout: {identity.kv_layout!r} does not match the layout's fingerprint {fp!r} "
            "(payloads are only stored and served under an identity that names their layout)"
        )


def check_rope(identity: CacheIdentity, layout: KVLayout, rope) -> None:
    if identity.rope_fingerprint and identity.rope_fingerprint != rope.fingerprint:
        raise FailedPrecondition(
            f"identity.rope_fingerprint: {identity.rope_fingerprint!r} does not match rope's fingerprint {rope.fingerprint!r}"
        )
    for part in layout.parts:
        if part.rotary and part.shape[-1] != rope.key_dim:
            raise InvalidArgument(
                f"rope.key_dim: {rope.key_dim} does not match the last dim {part.shape[-1]} of rotary part {part.name!r}"
            )


def _rotate_all(results: list[FetchResult], layout: KVLayout, rope, counters: DataPlaneCounters) -> int:
    """Rotate the rotary parts of each fetched payload in place by its delta (fp32 math): one
    batched kernel call over every chunk and layer of the window (``rotate_payloads_``)."""
    from sidecar.rotation import rotate_payloads_

    done = rotate_payloads_([(r.payload, r.entry.num_tokens, r.delta) for r in results], layout, rope)
    counters.rotation_seconds += done.seconds
    return done.rotated_bytes


def _gather_runs(
    runs: HeldRuns, chunks: dict, layout: KVLayout, rope, raw: bool, counters: DataPlaneCounters
) -> list[SessionRun]:
    """Copy each run's rows out of its chunk into a payload of its own, rotating the rotary
    parts on the way (``rotate_keys`` reads the canonical rows and writes the run's buffer:
    one pass, one rounding). Runs in a worker thread."""
    import time

    from sidecar.rotation import rotate_keys

    seconds = 0.0
    rotated_bytes = 0
    views = {h: decode_payload(payload, layout, e.num_tokens) for h, (e, payload, _) in chunks.items()}
    out: list[SessionRun] = []
    per_token = layout.bytes_per_token
    cols = zip(runs.target_pos.tolist(), runs.num_tokens.tolist(), runs.chunk_hash.tolist(), runs.row.tolist(),
               runs.source_pos.tolist())
    for i, (target, n, h, row, src) in enumerate(cols):
        delta = target - src
        rotate = bool(delta) and not raw
        buf = torch.empty(n * per_token, dtype=torch.uint8)
        dst = decode_payload(buf, layout, n)
        for s_part, d_part in zip(views[h].parts, dst.parts):
            rows = s_part.tensor[row : row + n]
            if rotate and s_part.rotary:
                t0 = time.perf_counter()
                rotate_keys(rows, delta, rope, out=d_part.tensor)
                seconds += time.perf_counter() - t0
                rotated_bytes += d_part.tensor.numel() * d_part.tensor.element_size()
            else:
                d_part.tensor.copy_(rows)
        dst.write_back()
        out.append(SessionRun(
            index=i, target_pos=target, num_tokens=n, chunk_hash=h, chunk_offset=row, source_pos=src, delta=delta,
            rotated=rotate, tier=chunks[h][2], payload=buf,
        ))
    counters.rotated_bytes += rotated_bytes
    counters.rotation_seconds += seconds
    return out
