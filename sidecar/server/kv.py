"""The data-plane RPCs: Lookup, Store, Fetch, Evict, Delete, Stats, Ping.

Thin handlers: resolve the tenant (``Edge``), decode the wire request (``sidecar.api.kv``) into
its domain query, make one domain call (``DataPlane.lookup``, ``DataPlane.fetch``, a Store's
``StoreIntake`` then ``DataPlane.store_stream``, ...), encode the result and count it. A request
that fails validation changes nothing.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import grpc
import numpy as np

import sidecar.api.kv as wire
from sidecar import __version__
from sidecar.api.frames import Framer
from sidecar.api.kv import (
    fetch_items_from_wire,
    layout_from_wire,
    lookup_plan_to_wire,
    policy_from_wire,
    repair_from_wire,
    required_layout,
    rope_from_wire,
    tokens_from_wire,
)
from sidecar.api.store_frames import StorePart
from sidecar.claims import ClaimLedger
from sidecar.config import SidecarConfig
from sidecar.dataplane import DataPlane
from sidecar.dataplane.fetch_query import FetchQuery
from sidecar.dataplane.intake import StoreIntake, check_register_from
from sidecar.errors import FailedPrecondition, InvalidArgument
from sidecar.identity import SHARED_SCOPE, CacheIdentity, KVLayout
from sidecar.registry.chunk_index import ChunkIndex, LookupQuery
from sidecar.registry.lookup_plan import AdmissionPolicy
from sidecar.server.edge import Edge, rpc, streaming
from sidecar.shm import ShmWriter
from sidecar.tiers import TIER_NAMES

_PING = wire.PingResponse()

#: tenants whose Lookup totals Stats keeps (least recently active dropped past it)
_TENANT_TOTALS = 4096
_T = TypeVar("_T")


def _store_layout(header: wire.StoreHeader) -> KVLayout | None:
    """A Store header's layout, decoded when its first payload part arrives (None: it has none)."""
    return layout_from_wire(header.layout, "header.layout") if header.HasField("layout") else None


def _settled(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: an abandoned commit's refusal is not "never retrieved"


class KVHandlers:
    """Lookup / Store / Fetch / Evict / Delete / Stats / Ping. ``claims`` guards Evict and
    Delete of chunks a live protecting claim holds."""

    def __init__(self, edge: Edge, config: SidecarConfig, index: ChunkIndex, dataplane: DataPlane,
                 claims: ClaimLedger) -> None:
        self.edge = edge
        self.config = config
        self.index = index
        self.dataplane = dataplane
        self.claims = claims
        self.metrics = edge.metrics
        self.started = time.time()
        self._lookup_counters = {}
        self.totals = {"lookups": 0, "lookup_tokens": 0, "prefix": 0, "exact": 0, "shifted": 0, "prefill": 0}
        #: the same per tenant (its own Stats), least recently active dropped past the bound
        self.tenant_totals: OrderedDict[str, dict[str, int]] = OrderedDict()
        #: committed Stores still writing (they finish even when their call was cancelled)
        self._commits: set[asyncio.Task] = set()
        #: Store streams whose commit arrived, waiting for their end (the client's half-close)
        self.awaiting_close = 0
        #: told the identity of every Store that stored KV (routing names it in the heartbeat)
        self.on_stored: Callable[[CacheIdentity], None] | None = None

    # ------------------------------------------------------------------------------ Lookup

    @rpc
    async def Lookup(self, request: wire.LookupRequest, context: grpc.aio.ServicerContext) -> wire.LookupPlanMsg:
        t0 = time.perf_counter()
        tenant = self.edge.tenancy.resolve(context)
        query = self.lookup_query(request, tenant)
        plan = await self.dataplane.lookup(query)
        msg = lookup_plan_to_wire(plan)
        self._count_lookup(query, plan.summary, plan.seed_tokens)
        m = self.metrics
        m.lookup_hit_segment_tokens.observe_many(plan.hit_segment_tokens)
        m.lookup_seconds.observe(time.perf_counter() - t0)
        return msg

    def lookup_query(self, request: wire.LookupRequest, tenant: str) -> LookupQuery:
        """The validated ``LookupQuery`` of ``request`` (INVALID_ARGUMENT naming the field)."""
        cfg = self.config
        data = request.tokens  # each read of a bytes field copies it
        tokens = tokens_from_wire(data, "tokens", cfg.max_prompt_tokens)
        self.edge.limits.check_tokens(tenant, len(tokens))
        identity = self.edge.identities.get(request.identity, request.HasField("identity"))
        policy = policy_from_wire(request.policy, cfg.default_policy)
        n = len(tokens)
        if request.engine_prefix_len > n:
            raise InvalidArgument(f"engine_prefix_len: {request.engine_prefix_len} exceeds the prompt length {n}")
        limit = cfg.registry.left_context_tokens
        if request.left_context_window > limit:
            raise InvalidArgument(
                f"left_context_window: {request.left_context_window} exceeds registry.left_context_tokens {limit}"
            )
        if request.recompute_tokens > cfg.chunker.max_size:
            raise InvalidArgument(
                f"recompute_tokens: {request.recompute_tokens} exceeds the maximum chunk size {cfg.chunker.max_size}"
            )
        if policy is AdmissionPolicy.EXACT:
            if request.left_context_window or request.recompute_tokens:
                raise InvalidArgument("policy: left_context_window / recompute_tokens apply to position_independent only")
            window = k = 0
        else:
            # Unset optional fields take the server's defaults; an explicit 0 turns a guard off.
            has = request.HasField
            window = request.left_context_window if has("left_context_window") else cfg.default_left_context_window
            k = request.recompute_tokens if has("recompute_tokens") else cfg.default_recompute_tokens
        repair = repair_from_wire(request.repair_scope, cfg.default_repair_scope)
        return LookupQuery(
            tokens=tokens,
            data=data,
            identity=identity,
            scope=tenant,
            engine_prefix_len=request.engine_prefix_len,
            policy=policy,
            left_context_window=window,
            recompute_tokens=k,
            repair_scope=repair,
            dry_run=request.dry_run,
        )

    def _count_lookup(self, query: LookupQuery, s: Any, seed_tokens: int = 0) -> None:
        key = (query.policy, query.dry_run)
        counters = self._lookup_counters.get(key)
        if counters is None:
            dry = "true" if query.dry_run else "false"
            m = self.metrics
            counters = (
                m.lookups.labels(query.policy.value, dry),
                *(m.lookup_tokens.labels(kind, dry) for kind in ("prefix", "exact", "shifted", "prefill")),
                m.lookup_seed_tokens.labels(dry),
            )
            self._lookup_counters[key] = counters
        lookups, prefix, exact, shifted, prefill, seeded = counters
        lookups.inc()
        # each inc takes a lock: adding 0 changes nothing (the children exist since .labels())
        if s.prefix_tokens:
            prefix.inc(s.prefix_tokens)
        if s.exact_tokens:
            exact.inc(s.exact_tokens)
        if s.shifted_tokens:
            shifted.inc(s.shifted_tokens)
        if s.prefill_tokens:
            prefill.inc(s.prefill_tokens)
        if seed_tokens:
            seeded.inc(seed_tokens)
        tenant = query.scope  # a Lookup's scope is its tenant
        mine = self.tenant_totals.get(tenant)
        if mine is None:
            mine = self.tenant_totals[tenant] = dict.fromkeys(self.totals, 0)
            if len(self.tenant_totals) > _TENANT_TOTALS:
                self.tenant_totals.popitem(last=False)
        else:
            self.tenant_totals.move_to_end(tenant)
        for t in (self.totals, mine):
            t["lookups"] += 1
            t["lookup_tokens"] += s.total_tokens
            t["prefix"] += s.prefix_tokens
            t["exact"] += s.exact_tokens
            t["shifted"] += s.shifted_tokens
            t["prefill"] += s.prefill_tokens

    # ------------------------------------------------------------------------------- Store

    @rpc
    async def Store(
        self, request_iterator: AsyncIterator[StorePart | wire.StoreRequest], context: grpc.aio.ServicerContext
    ) -> wire.StoreResponse:
        tenant = self.edge.tenancy.resolve(context)
        intake: StoreIntake | None = None
        # Read the whole stream before changing anything: a bad message anywhere leaves the
        # registry and the tiers untouched. Each part is checked as it arrives (StoreIntake:
        # chunk boundaries, each chunk's exact size), so a bad part is refused before more is
        # buffered. Payload parts come decoded in place (sidecar.api.store_frames: ``data`` is
        # a view of the received message). Only the client's commit message commits: grpc.aio
        # ends the request stream of a cancelled or expired call exactly like a half-close, so
        # the end of the stream proves nothing.
        commit = None
        messages = aiter(request_iterator)  # read on after the commit (below)
        async for msg in messages:
            if type(msg) is StorePart:
                if intake is None:
                    raise InvalidArgument("header: the first Store message must carry the header")
                intake.add(msg.chunk_start, msg.data, msg.last)
                continue
            which = msg.WhichOneof("msg")
            if which == "commit":
                commit = msg.commit
                break
            if which != "header":
                raise InvalidArgument("msg: empty StoreRequest (neither header nor payload)")
            if intake is not None:
                raise InvalidArgument("header: sent more than once in one Store stream")
            header = msg.header
            tokens, identity, scope = self.store_header(header, tenant)  # before reading any payload
            layout = functools.partial(_store_layout, header)
            intake = self.dataplane.store_intake(tokens, header.tokens, identity, scope, header.register_from, layout,
                                                 self.config.max_message_bytes)
        if commit is None:
            await asyncio.sleep(0)  # a cancel is delivered in a callback of its own: let it land
            if context.cancelled():
                raise asyncio.CancelledError("Store: the stream ended without a commit (cancelled)")
            raise InvalidArgument(
                "commit: the Store stream ended without a commit message; nothing was registered or stored"
            )
        if intake is None:
            raise InvalidArgument("header: Store stream carried no header")
        intake.close(commit.chunks, commit.payload_bytes)
        work = functools.partial(self._commit, intake, tenant)
        # The commit must be the stream's last message: read on to the stream's end (the
        # client half-closes after its commit) and refuse the whole Store if anything follows,
        # rather than store what came before and drop the rest. A cancel meanwhile ends the
        # stream like a half-close (or cancels this read): as far as the server can know the
        # commit was the last message, and the client decided to commit, so it is stored whole.
        self.awaiting_close += 1
        try:
            trailing = await anext(messages, None)
        except asyncio.CancelledError:
            self._spawn(work())
            raise
        finally:
            self.awaiting_close -= 1
        if trailing is not None:
            kind = "payload" if type(trailing) is StorePart else trailing.WhichOneof("msg") or "message"
            raise InvalidArgument(
                f"commit: must be the last message of a Store stream, but a {kind} "
                "followed it; nothing of this stream was registered or stored"
            )
        # Committed by the client: it completes (or is refused whole) even if the call is
        # cancelled now, so a cancel never leaves half a Store, or half its metrics, behind.
        return await self.committed(work())

    def store_header(self, header: wire.StoreHeader, tenant: str) -> tuple[np.ndarray, CacheIdentity, str]:
        """A Store header's tokens, identity and scope (the tenant's, or shared when granted)."""
        self.edge.limits.check_tokens(tenant, len(header.tokens) // 4)
        tokens = tokens_from_wire(header.tokens, "header.tokens", self.config.max_prompt_tokens)
        identity = self.edge.identities.get(header.identity, header.HasField("identity"))
        check_register_from(len(tokens), header.register_from)
        scope = tenant
        if header.shared:
            self.edge.tenancy.check_shared_write(tenant)
            scope = SHARED_SCOPE
        return tokens, identity, scope

    def store_response(self, out: Any, identity: CacheIdentity, seconds: float) -> wire.StoreResponse:
        """Count a Store that stored payloads and answer it."""
        m = self.metrics
        m.store_bytes.inc(out.stored_bytes)
        m.store_seconds.observe(seconds)
        if self.on_stored is not None and out.chunks_stored:
            self.on_stored(identity)
        return self._answer(out.chunks_total, out.chunks_registered, out.chunks_refreshed, out.chunks_stored, out.bounds)

    def _answer(self, total: int, registered: int, refreshed: int, stored: int, bounds) -> wire.StoreResponse:
        m = self.metrics
        m.store_chunks.labels("registered").inc(registered)
        m.store_chunks.labels("refreshed").inc(refreshed)
        m.store_chunks.labels("stored").inc(stored)
        return wire.StoreResponse(
            chunks_total=total, chunks_registered=registered, chunks_refreshed=refreshed,
            chunks_observed=total - stored, chunks_stored=stored,
            chunk_bounds=np.asarray(bounds, dtype="<u4").tobytes(),
        )

    async def _commit(self, intake: StoreIntake, tenant: str) -> wire.StoreResponse:
        t0 = time.perf_counter()
        out = await self.dataplane.store_stream(intake, tenant)
        if intake.payloads:
            return self.store_response(out, intake.identity, time.perf_counter() - t0)
        return self._answer(out.chunks_total, out.chunks_registered, out.chunks_refreshed, 0, out.bounds)

    def fetch_query(self, request: wire.FetchRequest, tenant: str, field: str = "") -> FetchQuery:
        """The ``FetchQuery`` of ``request`` (decoded; INVALID_ARGUMENT naming the field, under
        ``field`` when the request is nested in another)."""
        cfg = self.config
        identity = self.edge.identities.get(request.identity, request.HasField("identity"))
        layout = required_layout(request, f"{field}layout")
        plan_identity = None
        if request.HasField("plan_identity"):
            if not request.plan_identity.model_id:
                raise InvalidArgument(f"{field}plan_identity.model_id is required")
            plan_identity = self.edge.identities.get(request.plan_identity, True)
        return FetchQuery(
            tenant=tenant, identity=identity, layout=layout,
            items=fetch_items_from_wire(request.items, cfg.max_fetch_items),
            rope=rope_from_wire(request.rope) if request.HasField("rope") else None, raw=request.raw,
            plan_identity=plan_identity,
            heads=(request.heads.start, request.heads.count) if request.HasField("heads") else None,
            max_items=cfg.max_fetch_items, max_bytes=cfg.max_fetch_bytes,
        )

    def _spawn(self, work: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        """Run a committed write to its end whatever happens to its call (``drain`` waits for
        it on shutdown): a cancel after the commit message must not leave half a Store (or its
        thread's writes) behind."""
        task = asyncio.ensure_future(work)
        self._commits.add(task)
        task.add_done_callback(_settled)
        task.add_done_callback(self._commits.discard)
        return task

    async def committed(self, work: Coroutine[Any, Any, _T]) -> _T:
        """``_spawn`` ``work`` and wait for its result, which a cancel of the call does not stop."""
        return await asyncio.shield(self._spawn(work))

    async def drain(self) -> None:
        """Wait for committed Stores whose calls are gone (server shutdown)."""
        while self._commits:
            await asyncio.gather(*self._commits, return_exceptions=True)

    # ------------------------------------------------------------------------------- Fetch

    @streaming
    async def Fetch(self, request: wire.FetchRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[wire.FetchResponse]:
        t0 = time.perf_counter()
        shm: ShmWriter | None = None
        answers = None
        try:
            tenant = self.edge.tenancy.resolve(context)
            shm = self.edge.open_shm(request, context)
            # into shared memory, a span's pieces are gathered by one write, not joined first
            answers = self.dataplane.fetch(self.fetch_query(request, tenant), gather=shm is not None)
            a = await anext(answers, None)  # every refusal comes before the first answer
        except BaseException as exc:
            if answers is not None:
                await answers.aclose()
            if shm is not None:
                shm.close()
            if not isinstance(exc, Exception):
                raise  # cancelled
            await self.edge.abort("Fetch", exc, context)
        nbytes = 0
        try:
            framer = Framer(self.config.fetch_part_bytes, shm)
            while a is not None:
                if a.data is None:
                    frames = framer.add(wire.FetchResponse(index=a.index, status=wire.CHUNK_STATUS_MISS, last=True), None)
                else:
                    nbytes += a.nbytes
                    meta = wire.FetchResponse(
                        index=a.index, status=wire.CHUNK_STATUS_OK, num_tokens=a.num_tokens, source_pos=a.source_pos,
                        delta=a.delta, rotated=a.rotated, tier=a.tier,
                    )
                    frames = framer.add(meta, a.data)  # copied here: the answer's buffer may be reused
                for frame in frames:
                    yield frame
                a = None
                try:
                    a = await anext(answers, None)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a tier failing mid-stream
                    await self.edge.abort("Fetch", exc, context)
            for frame in framer.flush():
                yield frame
        finally:
            await answers.aclose()
            self.edge.close_shm(shm)
        m = self.metrics
        m.fetch_bytes.inc(nbytes)
        m.fetch_seconds.observe(time.perf_counter() - t0)
        self.edge.ok["Fetch"].inc()

    # ----------------------------------------------------------------------- Evict / Delete

    @rpc
    async def Evict(self, request: wire.EvictRequest, context: grpc.aio.ServicerContext) -> wire.EvictResponse:
        tenant = self.edge.tenancy.resolve(context)
        if request.tier and request.tier not in TIER_NAMES:
            raise InvalidArgument(f"tier: unknown tier {request.tier!r} (one of {sorted(TIER_NAMES)})")
        keys = self.dataplane.owned_keys(tenant, request.chunk_hashes, self.edge.tenancy.may_write_shared(tenant))
        self._check_unclaimed(tenant, keys)
        return wire.EvictResponse(evicted=await self.dataplane.evict(keys, request.tier))

    def _check_unclaimed(self, tenant: str, keys: list[int]) -> None:
        """Evict/Delete of a chunk a live protecting claim holds would break it silently."""
        holders = self.claims.obligated_holders(keys)
        if holders:
            own = sorted(c.claim_id for c in holders if c.tenant == tenant)
            others = len(holders) - len(own)
            raise FailedPrecondition(
                f"chunk_hashes: held by live claims {own}" + (f" and {others} of other tenants" if others else "")
                + "; release or demote them first"
            )

    @rpc
    async def Delete(self, request: wire.DeleteRequest, context: grpc.aio.ServicerContext) -> wire.DeleteResponse:
        tenant = self.edge.tenancy.resolve(context)
        keys = self.dataplane.owned_keys(tenant, request.chunk_hashes, self.edge.tenancy.may_write_shared(tenant))
        self._check_unclaimed(tenant, keys)
        return wire.DeleteResponse(deleted=await self.dataplane.delete(keys))

    # ------------------------------------------------------------------------------- Stats

    @rpc
    async def Stats(self, request: wire.StatsRequest, context: grpc.aio.ServicerContext) -> wire.StatsResponse:
        """The caller's own share of the server (its registry entries, lookups, tier bytes);
        the whole server for the tenants in ``auth.operators``. Another tenant's traffic and
        usage never show in a tenant's Stats."""
        tenant = self.edge.tenancy.resolve(context)
        reg = self.index.registry
        if tenant in self.config.auth.operators:
            st = reg.snapshot_stats()
            store_stats = await asyncio.to_thread(self.dataplane.store.stats)
            registry = wire.RegistryStats(
                entries=st.entries, bytes=st.bytes, capacity_entries=reg.config.capacity_entries,
                capacity_bytes=reg.config.capacity_bytes, evictions=st.evictions, hits=st.hits,
                verify_failures=st.verify_failures,
            )
            tiers = [wire.TierStats(tier=t.value, bytes=ts.used_bytes, objects=ts.objects, capacity_bytes=ts.capacity_bytes,
                                  hits=ts.hits, misses=ts.misses) for t, ts in store_stats.tiers.items()]
            totals, checksum_failures, pins = self.totals, store_stats.checksum_failures, self.dataplane.store.pins_in_flight()
        else:
            registry = wire.RegistryStats(entries=reg.scope_entries(tenant), capacity_entries=reg.config.capacity_entries,
                                        capacity_bytes=reg.config.capacity_bytes)
            usage = await asyncio.to_thread(self.dataplane.store.tenant_tier_usage, tenant)
            tiers = [wire.TierStats(tier=t.value, bytes=b, objects=n) for t, (b, n) in usage.items()]
            totals = self.tenant_totals.get(tenant) or dict.fromkeys(self.totals, 0)
            checksum_failures = pins = 0
        t = totals
        return wire.StatsResponse(
            version=__version__,
            registry=registry,
            lookups=t["lookups"],
            lookup_tokens=t["lookup_tokens"],
            recovered_prefix_tokens=t["prefix"],
            recovered_exact_tokens=t["exact"],
            recovered_shifted_tokens=t["shifted"],
            prefill_tokens=t["prefill"],
            uptime_s=time.time() - self.started,
            tiers=tiers,
            checksum_failures=checksum_failures,
            pins_in_flight=pins,
            claims_active=self.claims.live_count(tenant),
        )

    async def Ping(self, request: wire.PingRequest, context: grpc.aio.ServicerContext) -> wire.PingResponse:
        return _PING
