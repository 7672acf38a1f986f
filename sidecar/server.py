"""The gRPC server: ``create_server(config) -> (server, port)`` on grpc.aio + uvloop.

The servicer is thin: it resolves the tenant, validates and converts the wire request
(``sidecar.wire``, ``sidecar.wire_directives``), calls the domain (``ChunkIndex``; sessions and
Splice through ``SpliceService``), converts the result back and counts it.
Exceptions map to gRPC statuses in one place (``sidecar.errors.status_for``); a request that
fails validation changes nothing.

Held sessions (docs/splice.md, "Sessions the sidecar holds"): OpenSession with ``held`` makes
the session table track each token's canonical stored copy (resolved by the data plane);
FetchSession streams a range of the session's current layout from those copies, each row
rotated once from its canonical source position, framed like Fetch.

Resident claims (docs/claims.md): Claim / ReleaseClaim / DemoteClaim / GetClaim /
ReportPool / AdmitActive / WatchEvents go through ``ClaimsService``; the ledger is wired into
the data plane (guards, materialization) and a background task expires claims. A claim refusal
(RESOURCE_EXHAUSTED) carries its blocking claim ids and capacity proof as trailing metadata.

Also served: gRPC health checking (``grpc.health.v1.Health``; NOT_SERVING during shutdown) and
server reflection (grpcurl works without the proto), plus Prometheus on ``metrics_port``. A
background task expires idle sessions and pending Splice plans (``directives.sweep_interval_s``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sidecar import __version__
from sidecar.config import SidecarConfig
from sidecar.dataplane import DataPlane
from sidecar.directives import SessionTable
from sidecar.fetch_spans import SpanResult, fetch_spans
from sidecar.fetch_spans import check as check_spans
from sidecar.fetch_spans import expand as expand_spans
from sidecar.errors import FailedPrecondition, InvalidArgument, InvariantViolation, SidecarError, status_for
from sidecar.identity import SHARED_SCOPE
from sidecar.registry.plan import FetchSpec
from sidecar.manifest_service import ManifestService
from sidecar.manifests import Outcome
from sidecar.metrics import Metrics
from sidecar.registry.chunker import warmup
from sidecar.registry.compiled import warmup as compiled_warmup
from sidecar.registry.index import ChunkIndex, LookupQuery
from sidecar.registry.plan import AdmissionPolicy
from sidecar.registry.registry import InMemoryRegistry
from sidecar.registry.shared import SharedRegistry
from sidecar.shm import ShmWriter, open_writer
from sidecar.splice_service import SpliceService
from sidecar.auth.limits import TenantLimiter
from sidecar.claims_service import ClaimsService
from sidecar.auth.tls import server_credentials
from sidecar.config import LOOPBACK_HOSTS
from sidecar.tenancy import Tenancy
from sidecar.tiers import RemoteEndpoint
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc
from sidecar.wire import (
    IdentityCache,
    RequestLimits,
    layout_from_wire,
    plan_to_wire,
    policy_from_wire,
    repair_from_wire,
    rope_from_wire,
    tokens_from_wire,
)
from sidecar.wire_directives import (
    directives_from_wire,
    plan_id_from_wire,
    request_mode,
    session_id_from_wire,
    session_to_wire,
    session_tokens_from_wire,
)
from sidecar.wire_directives import plan_to_wire as op_plan_to_wire

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVSidecar"].full_name
#: Health name of the shared (Redis) registry: NOT_SERVING while Redis does not answer (the
#: sidecar still serves from its local registry; docs/operations.md, "Shared registry").
REGISTRY_HEALTH_NAME = f"{SERVICE_NAME}.registry"
TIER_NAMES = frozenset(("gpu", "cpu", "disk", "remote"))
_PING = pb.PingResponse()
_CLOSED = pb.CloseSessionResponse()
_METHODS = (
    "Lookup", "Store", "Fetch", "Evict", "Delete", "Stats", "Ping",
    "OpenSession", "AppendSession", "GetSession", "CloseSession", "Splice", "CommitSplice", "AbortSplice",
    "FetchSession", "ImportManifest", "GetWarmUpPlan", "ExportManifest",
    "Claim", "ReleaseClaim", "DemoteClaim", "GetClaim", "ReportPool", "AdmitActive", "WatchEvents",
)
#: Streaming methods whose responses are pre-serialized frames (``fetch_frames``).
_FRAMED = frozenset(("Fetch", "FetchSession"))
#: tenants whose Lookup totals Stats keeps (least recently active dropped past it)
_TENANT_TOTALS = 4096


def _serialize_fetch(msg: pb.FetchResponse | pb.FetchSessionResponse | bytes) -> bytes:
    """Fetch / FetchSession responses may arrive pre-serialized (payload parts, see ``fetch_frames``)."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


class _Undecodable:
    """A request message that is not valid protobuf of its type, or is past a ``wire`` limit
    (the deserializer never raises: gRPC would answer UNKNOWN / INTERNAL and log an ERROR
    record for a client's bad bytes)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(cls: type, limits: RequestLimits) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            msg = cls.FromString(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError and friends: the client's bytes
            return _Undecodable(f"request: not a valid {cls.DESCRIPTOR.full_name} message ({type(exc).__name__})")
        # String / repeated field bounds (wire.*), refused like undecodable bytes: before any
        # handler sees (or caches) the oversized value.
        err = limits.error(msg)
        return msg if err is None else _Undecodable(err)

    return parse


def _checked(servicer: pb_grpc.KVSidecarServicer, name: str, behaviour: Callable, client_streaming: bool,
             server_streaming: bool) -> Callable:
    """``behaviour`` behind a check for undecodable messages: INVALID_ARGUMENT, counted, nothing run."""
    rejected = servicer.metrics.requests.labels(name, "INVALID_ARGUMENT")

    async def refuse(context: grpc.aio.ServicerContext, bad: _Undecodable) -> None:
        rejected.inc()
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad.error)

    if client_streaming:  # Store: each message checked as it arrives; the handler's own error path applies
        async def messages(it: AsyncIterator[Any]) -> AsyncIterator[Any]:
            async for msg in it:
                if isinstance(msg, _Undecodable):
                    raise InvalidArgument(msg.error)
                yield msg

        async def stream_in(request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            return await behaviour(messages(request_iterator), context)

        return stream_in
    if server_streaming:
        async def stream_out(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await refuse(context, request)
            async for msg in behaviour(request, context):
                yield msg

        return stream_out

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await refuse(context, request)
        return await behaviour(request, context)

    return unary


def _add_servicer(servicer: pb_grpc.KVSidecarServicer, server: grpc.aio.Server) -> None:
    """Register every method of the service (as the generated code does), except that
    undecodable request bytes become INVALID_ARGUMENT (``_lenient``, ``_checked``) and the
    serializers of Fetch and FetchSession accept pre-encoded frames so multi-MiB payload parts
    are copied once, not three times (bytes slice -> message -> wire)."""
    desc = pb.DESCRIPTOR.services_by_name["KVSidecar"]
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    wire = servicer.config.wire
    limits = RequestLimits(wire.max_string_bytes, wire.max_repeated)
    for m in desc.methods:
        request_cls = getattr(pb, m.input_type.name)
        response_cls = getattr(pb, m.output_type.name)
        kind = (m.client_streaming, m.server_streaming)
        handlers[m.name] = kinds[kind](
            _checked(servicer, m.name, getattr(servicer, m.name), *kind),
            request_deserializer=_lenient(request_cls, limits),
            response_serializer=_serialize_fetch if m.name in _FRAMED else response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(desc.full_name, handlers),))


#: how long a stop waits for the rotation kernels' warm-up still running (it takes seconds)
_WARMUP_JOIN_S = 60.0


def _warm_rotation() -> None:
    from sidecar.rotation.batch import warmup as rotation_warmup

    t0 = time.perf_counter()
    try:
        calls = rotation_warmup()
    except Exception:  # noqa: BLE001 - a warm-up failure only moves the cost to the first Fetch
        logger.warning("rotation kernel warm-up failed; the first rotated Fetch compiles them", exc_info=True)
        return
    logger.info("rotation kernels ready in %.2f s (%d kernel calls)", time.perf_counter() - t0, calls)


# Hand-written on purpose (issue 14): protobuf's Python API cannot serialize a message around an
# already-encoded multi-MiB bytes field without copying it; a tag + varint header is all it takes.
_DATA_TAG = bytes([(8 << 3) | 2])  # FetchResponse.data / FetchSessionResponse.data: field 8, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def fetch_frames(
    meta: pb.FetchResponse | pb.FetchSessionResponse, payload: memoryview, part_bytes: int
) -> Iterator[bytes]:
    """Wire frames of one chunk (or FetchSession run): ``meta`` (without data) on the first
    part, ``index`` and ``last`` on every part. Each frame is the protobuf encoding of a message
    of ``meta``'s type (fields may appear in any order), built with one copy of the payload."""
    n = len(payload)
    off = 0
    first = True
    cls = type(meta)
    while True:
        end = min(n, off + part_bytes)
        head = meta if first else cls(index=meta.index)
        head.last = end >= n
        yield b"".join((head.SerializeToString(), _DATA_TAG, _varint(end - off), payload[off:end]))
        first = False
        off = end
        if off >= n:
            return


class _Framer:
    """The frames of one Fetch / FetchSession answer. A payload goes into the caller's
    shared-memory buffer when there is one and it fits; such answers (and misses) are held and
    sent several to a message (``more``: up to ``_BATCH_ITEMS``), since a stream message costs
    as much as writing half a MiB. Any other payload is sent inline in ``part_bytes`` parts,
    after the held answers, so answers keep their order."""

    _BATCH_ITEMS = 64

    def __init__(self, part_bytes: int, shm: ShmWriter | None) -> None:
        self.part_bytes = part_bytes
        self.shm = shm
        self._held: list[pb.FetchResponse | pb.FetchSessionResponse] = []

    def add(self, meta: pb.FetchResponse | pb.FetchSessionResponse,
            payload: memoryview | list[memoryview] | None) -> list[bytes]:
        """Frames to send now for one answer (``payload`` None: a miss, metadata only; a list:
        the payload's pieces in order, only with a buffer)."""
        if self.shm is None:
            return [meta.SerializeToString()] if payload is None else list(fetch_frames(meta, payload, self.part_bytes))
        if payload is not None:
            at = self.shm.put(payload)
            if at is None:  # inline, after what is held
                whole = memoryview(b"".join(payload)) if isinstance(payload, list) else payload
                return [*self.flush(), *fetch_frames(meta, whole, self.part_bytes)]
            meta.shm_offset, meta.shm_length = at
            meta.last = True
        self._held.append(meta)
        return self.flush() if len(self._held) >= self._BATCH_ITEMS else []

    def flush(self) -> list[bytes]:
        if not self._held:
            return []
        head, *rest = self._held
        head.more.extend(rest)
        self._held = []
        return [head.SerializeToString()]


def _rpc(method: str) -> Callable:
    """Map exceptions to statuses (one place) and count every call by method and code. The
    call holds one of its tenant's stream slots (``limits.max_concurrent_streams``) while the
    handler runs, released on every path (error, cancellation) by the ``finally``."""

    def deco(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(fn)
        async def wrapper(self: "KVSidecarServicer", request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                tenant = self._enter(method, context)
                try:
                    result = await fn(self, request, context)
                finally:
                    self._leave(method, tenant)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - every error leaves through _abort
                await self._abort(method, exc, context)
            self._ok[method].inc()
            return result

        return wrapper

    return deco


def _streaming(method: str) -> Callable:
    """``_rpc``'s stream slot for server-streaming handlers (async generators that map their
    own errors): taken before the first message, released when the generator ends, fails, or
    is closed because the client cancelled."""

    def deco(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        @functools.wraps(fn)
        async def wrapper(self: "KVSidecarServicer", request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                tenant = self._enter(method, context)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - every error leaves through _abort
                await self._abort(method, exc, context)
            try:
                async for msg in fn(self, request, context):
                    yield msg
            finally:
                self._leave(method, tenant)

        return wrapper

    return deco


class KVSidecarServicer(pb_grpc.KVSidecarServicer):
    def __init__(
        self, config: SidecarConfig, index: ChunkIndex, dataplane: DataPlane, metrics: Metrics, sessions: SpliceService
    ) -> None:
        self.config = config
        self.index = index
        self.dataplane = dataplane
        self.metrics = metrics
        self.sessions = sessions
        self.shared: SharedRegistry | None = None  # set by SidecarServer when configured
        self.tenancy = Tenancy(config.auth, config.default_tenant, config.tls)
        self.limits = TenantLimiter(
            config.limits,
            # directives.max_sessions_per_tenant, or an injected table's own (smaller) limit
            default_sessions=min(config.directives.max_sessions_per_tenant, sessions.table.config.max_sessions_per_tenant),
            forget_tenants=config.directives.forget_tenants,
        )
        self._inflight = {m: metrics.inflight.labels(m) for m in _METHODS}
        self.identities = IdentityCache()
        self.started = time.time()
        self._ok = {m: metrics.requests.labels(m, "OK") for m in _METHODS}
        self._lookup_counters = {}
        self.totals = {"lookups": 0, "lookup_tokens": 0, "prefix": 0, "exact": 0, "shifted": 0, "prefill": 0}
        #: the same per tenant (its own Stats), least recently active dropped past the bound
        self.tenant_totals: OrderedDict[str, dict[str, int]] = OrderedDict()

    def _enter(self, method: str, context: grpc.aio.ServicerContext) -> str:
        """Resolve the call's tenant and take one of its stream slots (refused past the limit)."""
        tenant = self.tenancy.resolve(context)
        self.limits.acquire(tenant)
        self._inflight[method].inc()
        return tenant

    def _leave(self, method: str, tenant: str) -> None:
        self._inflight[method].dec()
        self.limits.release(tenant)

    async def _abort(self, method: str, exc: Exception, context: grpc.aio.ServicerContext) -> None:
        """End the call with the status ``status_for`` maps ``exc`` to; count it (and any broken
        invariant); log internal errors. Shared by ``_rpc`` and the streaming Fetch."""
        code, message = status_for(exc)
        if isinstance(exc, InvariantViolation):
            self.metrics.invariant_violations.inc()
        if code is grpc.StatusCode.INTERNAL:
            logger.exception("%s failed", method)
        self.metrics.requests.labels(method, code.name).inc()
        trailers = exc.trailing_metadata() if isinstance(exc, SidecarError) else ()
        await context.abort(code, message, trailers)

    # ------------------------------------------------------------------------------ Lookup

    @_rpc("Lookup")
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupPlan:
        t0 = time.perf_counter()
        tenant = self.tenancy.resolve(context)
        query = self._lookup_query(request, tenant)
        shared = self.shared
        chunks = await shared.fill(self.index, query) if shared is not None else None
        plan = self.index.lookup(query, chunks)
        msg = plan_to_wire(plan)
        self._count_lookup(query, plan.summary, plan.seed_tokens)
        m = self.metrics
        m.lookup_hit_segment_tokens.observe_many(plan.hit_segment_tokens)
        m.lookup_seconds.observe(time.perf_counter() - t0)
        return msg

    def _lookup_query(self, request: pb.LookupRequest, tenant: str) -> LookupQuery:
        cfg = self.config
        data = request.tokens  # each read of a bytes field copies it
        tokens = tokens_from_wire(data, "tokens", cfg.max_prompt_tokens)
        self.limits.check_tokens(tenant, len(tokens))
        identity = self.identities.get(request.identity, request.HasField("identity"))
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

    @_rpc("Store")
    async def Store(
        self, request_iterator: AsyncIterator[pb.StoreRequest], context: grpc.aio.ServicerContext
    ) -> pb.StoreResponse:
        tenant = self.tenancy.resolve(context)
        header = None
        payloads: dict[int, bytearray] = {}
        complete: set[int] = set()
        sizes: dict[int, int] | None = None  # chunk start -> its payload bytes (layout x tokens)
        chunked = layout = None
        max_chunk = self.config.max_message_bytes
        # Read the whole stream before changing anything: a bad message anywhere leaves the
        # registry and the tiers untouched. Each message is checked as it arrives against what
        # the header allows (chunk boundaries, each chunk's exact size), so a bad part is
        # refused before more is buffered and at most sum(sizes) bytes are ever held.
        async for msg in request_iterator:
            which = msg.WhichOneof("msg")
            if which == "header":
                if header is not None:
                    raise InvalidArgument("header: sent more than once in one Store stream")
                header = msg.header
                self.limits.check_tokens(tenant, len(header.tokens) // 4)  # before reading any payload
                tokens = tokens_from_wire(header.tokens, "header.tokens", self.config.max_prompt_tokens)
                identity = self.identities.get(header.identity, header.HasField("identity"))
                if header.register_from > len(tokens):
                    raise InvalidArgument(
                        f"header.register_from: {header.register_from} exceeds the sequence length {len(tokens)}"
                    )
                scope = tenant
                if header.shared:
                    self.tenancy.check_shared_write(tenant)
                    scope = SHARED_SCOPE
            elif which == "payload":
                if header is None:
                    raise InvalidArgument("header: the first Store message must carry the header")
                if sizes is None:
                    if not header.HasField("layout"):
                        raise InvalidArgument("header.layout: required when payload parts follow")
                    layout = layout_from_wire(header.layout, "header.layout")
                    chunked = self.dataplane.store_entries(
                        tokens, header.tokens, identity, scope, layout, header.register_from
                    )
                    per_token = layout.bytes_per_token
                    sizes = {e.source_pos: e.num_tokens * per_token for e in chunked[0]}
                part = msg.payload
                start = part.chunk_start
                expected = sizes.get(start)
                if expected is None:
                    starts = sorted(sizes)
                    raise InvalidArgument(
                        f"payload.chunk_start: {start} is not a chunk boundary at or after register_from "
                        f"(boundaries: {starts[:8]}{'...' if len(starts) > 8 else ''})"
                    )
                if start in complete:
                    raise InvalidArgument(f"payload.chunk_start: chunk at {start} received after its last part")
                buf = payloads.get(start)
                if buf is None:
                    buf = payloads[start] = bytearray()
                n = len(buf) + len(part.data)
                if n > expected:
                    raise InvalidArgument(
                        f"payload.data: chunk at {start} has more than the {expected} bytes its layout x tokens need"
                    )
                if n > max_chunk:
                    raise InvalidArgument(f"payload.data: chunk at {start} exceeds {max_chunk} bytes")
                buf += part.data
                if part.last:
                    if n != expected:
                        raise InvalidArgument(
                            f"payload.data: chunk at {start} has {n} bytes; its layout x tokens need {expected}"
                        )
                    complete.add(start)
            else:
                raise InvalidArgument("msg: empty StoreRequest (neither header nor payload)")
        # grpc.aio ends the request stream of a cancelled call exactly like a half-close, and
        # delivers the cancellation (CancelledError into this task) in a callback of its own:
        # let it land before committing anything, or a cancelled Store would be registered.
        await asyncio.sleep(0)
        if context.cancelled():
            raise asyncio.CancelledError("Store: the client cancelled before half-closing its stream")
        if header is None:
            raise InvalidArgument("header: Store stream carried no header")
        incomplete = sorted(set(payloads) - complete)
        if incomplete:
            raise InvalidArgument(f"payload.last: chunks at {incomplete[:8]} never received their last part")
        m = self.metrics
        if payloads:
            t0 = time.perf_counter()
            out = await self.dataplane.store_payloads(
                tokens, header.tokens, identity, scope, tenant, layout, payloads, header.register_from, chunked
            )
            m.store_bytes.inc(out.stored_bytes)
            m.store_seconds.observe(time.perf_counter() - t0)
            registered, refreshed, stored, bounds = (
                out.chunks_registered, out.chunks_refreshed, out.chunks_stored, out.bounds
            )
            total = out.chunks_total
        else:
            result = self.index.register(tokens, header.tokens, identity, scope, register_from=header.register_from)
            await self.dataplane.synced()
            registered, refreshed, stored, bounds = (
                result.chunks_registered, result.chunks_refreshed, 0, result.bounds
            )
            total = result.chunks_total
        m.store_chunks.labels("registered").inc(registered)
        m.store_chunks.labels("refreshed").inc(refreshed)
        m.store_chunks.labels("stored").inc(stored)
        return pb.StoreResponse(
            chunks_total=total,
            chunks_registered=registered,
            chunks_refreshed=refreshed,
            chunks_observed=total - stored,
            chunks_stored=stored,
            chunk_bounds=np.asarray(bounds, dtype="<u4").tobytes(),
        )

    # ------------------------------------------------------------------------------- Fetch

    @_streaming("Fetch")
    async def Fetch(self, request: pb.FetchRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.FetchResponse]:
        t0 = time.perf_counter()
        shm: ShmWriter | None = None
        try:
            tenant = self.tenancy.resolve(context)
            shm = self._open_shm(request, context)
            identity = self.identities.get(request.identity, request.HasField("identity"))
            if not request.HasField("layout"):
                raise InvalidArgument("layout: required")
            layout = layout_from_wire(request.layout)
            rope = rope_from_wire(request.rope) if request.HasField("rope") else None
            if len(request.items) > self.config.max_fetch_items:
                raise InvalidArgument(f"items: {len(request.items)} exceeds max_fetch_items {self.config.max_fetch_items}")
            if any(it.num_tokens or it.next_hashes or it.row_offset for it in request.items):
                # Span items (one per plan hit segment): expanded to per-chunk items, joined back.
                specs = [FetchSpec(it.chunk_hash, it.target_pos, it.num_tokens, it.row_offset, tuple(it.next_hashes))
                         for it in request.items]
                check_spans(specs)
                items, groups = expand_spans(specs, self.index.registry.peek)
                if len(items) > self.config.max_fetch_items:
                    raise InvalidArgument(f"items: {len(items)} chunks exceed max_fetch_items {self.config.max_fetch_items}")
                results = fetch_spans(self.dataplane.fetch_stream(
                    tenant, identity, layout, rope, items, request.raw, self.config.max_fetch_bytes
                ), groups, layout, as_pieces=shm is not None)  # into shared memory: gathered, not joined
            else:
                items = [(it.chunk_hash, it.target_pos) for it in request.items]
                # Item by item (the data plane reads in bounded windows, duplicates once); every
                # validation error and the max_fetch_bytes refusal come with the first result.
                results = self.dataplane.fetch_stream(
                    tenant, identity, layout, rope, items, request.raw, self.config.max_fetch_bytes
                )
            r = await anext(results, None)
        except BaseException as exc:
            if shm is not None:
                shm.close()
            if not isinstance(exc, Exception):
                raise  # cancelled
            await self._abort("Fetch", exc, context)
        nbytes = 0
        try:
            framer = _Framer(self.config.fetch_part_bytes, shm)
            while r is not None:
                span = isinstance(r, SpanResult)
                if r.payload is None and not (span and r.pieces):
                    frames = framer.add(pb.FetchResponse(index=r.index, status=pb.CHUNK_STATUS_MISS, last=True), None)
                else:
                    if span:
                        data = r.pieces if r.pieces else memoryview(r.payload.numpy())
                        ntok, src = r.num_tokens, r.source_pos
                    else:
                        data = memoryview(r.payload.numpy())
                        ntok, src = r.entry.num_tokens, r.entry.source_pos
                    nbytes += len(data) if isinstance(data, memoryview) else sum(len(p) for p in data)
                    meta = pb.FetchResponse(
                        index=r.index, status=pb.CHUNK_STATUS_OK, num_tokens=ntok, source_pos=src,
                        delta=r.delta, rotated=r.rotated, tier=r.tier,
                    )
                    frames = framer.add(meta, data)
                for frame in frames:
                    yield frame
                r = None  # a chunk shared by later items is kept by the data plane only while needed
                try:
                    r = await anext(results, None)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a tier failing mid-stream
                    await self._abort("Fetch", exc, context)
            for frame in framer.flush():
                yield frame
        finally:
            await results.aclose()
            self._close_shm(shm)
        m = self.metrics
        m.fetch_bytes.inc(nbytes)
        m.fetch_seconds.observe(time.perf_counter() - t0)
        self._ok["Fetch"].inc()

    def _open_shm(self, request: pb.FetchRequest | pb.FetchSessionRequest, context: grpc.aio.ServicerContext
                  ) -> ShmWriter | None:
        """The writer into the caller's shared-memory buffer (sidecar/shm), or None: no buffer
        named, or its payloads go inline (counted by reason)."""
        if not request.HasField("shm"):
            return None
        writer, why = open_writer(request.shm.name, request.shm.token, context.peer(),
                                  enabled=self.config.fetch_shared_memory)
        if writer is None:
            self.metrics.shm_fallbacks.labels(why).inc()
        return writer

    def _close_shm(self, writer: ShmWriter | None) -> None:
        if writer is None:
            return
        writer.close()
        self.metrics.shm_bytes.inc(writer.bytes)
        if writer.failed or writer.spilled:
            self.metrics.shm_fallbacks.labels("write_failed" if writer.failed else "full").inc()

    # ----------------------------------------------------------------------- Evict / Delete

    @_rpc("Evict")
    async def Evict(self, request: pb.EvictRequest, context: grpc.aio.ServicerContext) -> pb.EvictResponse:
        tenant = self.tenancy.resolve(context)
        if request.tier and request.tier not in TIER_NAMES:
            raise InvalidArgument(f"tier: unknown tier {request.tier!r} (one of {sorted(TIER_NAMES)})")
        keys = self.dataplane.owned_keys(tenant, request.chunk_hashes, self.tenancy.may_write_shared(tenant))
        self._check_unclaimed(tenant, keys)
        return pb.EvictResponse(evicted=await self.dataplane.evict(keys, request.tier))

    def _check_unclaimed(self, tenant: str, keys: list[int]) -> None:
        """Evict/Delete of a chunk a live protecting claim holds would break it silently."""
        holders = self.claims.ledger.obligated_holders(keys)
        if holders:
            own = sorted(c.claim_id for c in holders if c.tenant == tenant)
            others = len(holders) - len(own)
            raise FailedPrecondition(
                f"chunk_hashes: held by live claims {own}" + (f" and {others} of other tenants" if others else "")
                + "; release or demote them first"
            )

    @_rpc("Delete")
    async def Delete(self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext) -> pb.DeleteResponse:
        tenant = self.tenancy.resolve(context)
        keys = self.dataplane.owned_keys(tenant, request.chunk_hashes, self.tenancy.may_write_shared(tenant))
        self._check_unclaimed(tenant, keys)
        return pb.DeleteResponse(deleted=await self.dataplane.delete(keys))

    # ------------------------------------------------------------------------------- Stats

    @_rpc("Stats")
    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        """The caller's own share of the server (its registry entries, lookups, tier bytes);
        the whole server for the tenants in ``auth.operators``. Another tenant's traffic and
        usage never show in a tenant's Stats (issue 13)."""
        tenant = self.tenancy.resolve(context)
        reg = self.index.registry
        if tenant in self.config.auth.operators:
            st = reg.snapshot_stats()
            store_stats = await asyncio.to_thread(self.dataplane.store.stats)
            registry = pb.RegistryStats(
                entries=st.entries, bytes=st.bytes, capacity_entries=reg.config.capacity_entries,
                capacity_bytes=reg.config.capacity_bytes, evictions=st.evictions, hits=st.hits,
                verify_failures=st.verify_failures,
            )
            tiers = [pb.TierStats(tier=t.value, bytes=ts.used_bytes, objects=ts.objects, capacity_bytes=ts.capacity_bytes,
                                  hits=ts.hits, misses=ts.misses) for t, ts in store_stats.tiers.items()]
            totals, checksum_failures, pins = self.totals, store_stats.checksum_failures, self.dataplane.store.pins_in_flight()
        else:
            registry = pb.RegistryStats(entries=reg.scope_entries(tenant), capacity_entries=reg.config.capacity_entries,
                                        capacity_bytes=reg.config.capacity_bytes)
            usage = await asyncio.to_thread(self.dataplane.store.tenant_tier_usage, tenant)
            tiers = [pb.TierStats(tier=t.value, bytes=b, objects=n) for t, (b, n) in usage.items()]
            totals = self.tenant_totals.get(tenant) or dict.fromkeys(self.totals, 0)
            checksum_failures = pins = 0
        t = totals
        return pb.StatsResponse(
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
            claims_active=self.claims.ledger.live_count(tenant),
        )

    async def Ping(self, request: pb.PingRequest, context: grpc.aio.ServicerContext) -> pb.PingResponse:
        return _PING

    # ---------------------------------------------------------------------- sessions / Splice

    @_rpc("OpenSession")
    async def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        tenant = self.tenancy.resolve(context)
        identity = None
        if request.HasField("identity"):
            identity = self.identities.get(request.identity, True)  # validated; used by held sessions only
        if request.held:
            if identity is None:
                raise InvalidArgument("identity: required for a held session (the identity its KV is Stored under)")
            if not identity.kv_layout:
                raise InvalidArgument(
                    "identity.kv_layout: required for a held session (its KV is served by FetchSession)"
                )
        elif identity is not None:
            identity = None  # not held: planning does not use it
        tokens = session_tokens_from_wire(request.tokens)
        self.limits.check_tokens(tenant, len(tokens))
        self.limits.check_sessions(tenant, self.sessions.table)
        return session_to_wire(self.sessions.open(tenant, tokens, request.block_size, identity))

    @_rpc("AppendSession")
    async def AppendSession(self, request: pb.AppendSessionRequest, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        tenant = self.tenancy.resolve(context)
        sid = session_id_from_wire(request.session_id)
        tokens = session_tokens_from_wire(request.tokens)
        self.limits.check_tokens(tenant, len(tokens))
        return session_to_wire(self.sessions.append(tenant, sid, tokens))

    @_rpc("GetSession")
    async def GetSession(self, request: pb.GetSessionRequest, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        tenant = self.tenancy.resolve(context)
        info, pending = self.sessions.get(tenant, session_id_from_wire(request.session_id))
        return session_to_wire(info, pending)

    @_rpc("CloseSession")
    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseSessionResponse:
        tenant = self.tenancy.resolve(context)
        self.sessions.close(tenant, session_id_from_wire(request.session_id))
        return _CLOSED

    @_rpc("Splice")
    async def Splice(self, request: pb.SpliceRequest, context: grpc.aio.ServicerContext) -> pb.OpPlan:
        t0 = time.perf_counter()
        tenant = self.tenancy.resolve(context)
        sessions = self.sessions
        forget = self.limits.forget_by_default(tenant)  # limits.forget_by_default, directives.forget_tenants
        try:
            sid = session_id_from_wire(request.session_id)
            directives = directives_from_wire(
                request.directives, max_directives=sessions.table.config.max_directives, force_forget=forget
            )
            plan = sessions.splice(tenant, sid, request.expected_version, directives)
        except Exception:
            sessions.refused(request_mode(request.directives, forget))
            raise
        msg = op_plan_to_wire(plan, sessions.table.config.plan_ttl_s)
        self.metrics.splice_seconds.observe(time.perf_counter() - t0)
        return msg

    @_rpc("CommitSplice")
    async def CommitSplice(self, request: pb.CommitSpliceRequest, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        tenant = self.tenancy.resolve(context)
        return session_to_wire(self.sessions.commit(tenant, plan_id_from_wire(request.plan_id)))

    @_rpc("AbortSplice")
    async def AbortSplice(self, request: pb.AbortSpliceRequest, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        tenant = self.tenancy.resolve(context)
        return session_to_wire(self.sessions.abort(tenant, plan_id_from_wire(request.plan_id)))

    @_streaming("FetchSession")
    async def FetchSession(
        self, request: pb.FetchSessionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.FetchSessionResponse]:
        shm: ShmWriter | None = None
        try:
            tenant = self.tenancy.resolve(context)
            sid = session_id_from_wire(request.session_id)
            if not request.HasField("layout"):
                raise InvalidArgument("layout: required")
            layout = layout_from_wire(request.layout)
            rope = rope_from_wire(request.rope) if request.HasField("rope") else None
            end = request.end if request.HasField("end") else None
            span = self.sessions.held_span(tenant, sid, request.start, end, max_tokens=self.config.max_prompt_tokens)
            runs = await self.dataplane.fetch_session(span, layout, rope, request.raw)
            shm = self._open_shm(request, context)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error leaves through _abort
            await self._abort("FetchSession", exc, context)
        nbytes = 0
        try:
            framer = _Framer(self.config.fetch_part_bytes, shm)
            for r in runs:
                mv = memoryview(r.payload.numpy())
                nbytes += len(mv)
                meta = pb.FetchSessionResponse(
                    index=r.index, num_tokens=r.num_tokens, source_pos=r.source_pos, delta=r.delta, rotated=r.rotated,
                    tier=r.tier, target_pos=r.target_pos, chunk_hash=r.chunk_hash, chunk_offset=r.chunk_offset,
                    version=span.version,
                )
                for frame in framer.add(meta, mv):
                    yield frame
            for frame in framer.flush():
                yield frame
        finally:
            self._close_shm(shm)
        self.metrics.fetch_bytes.inc(nbytes)
        self._ok["FetchSession"].inc()

    # ------------------------------------------------------------------------------ claims

    @_rpc("Claim")
    async def Claim(self, request: pb.ClaimRequest, context: grpc.aio.ServicerContext) -> pb.ClaimDecision:
        tenant = self.tenancy.resolve(context)  # claiming shared chunks needs no write grant: caps bound it
        identity = self.identities.get(request.identity, True) if request.HasField("identity") else None
        return self.claims.claim(tenant, request, identity, self.config.max_prompt_tokens)

    @_rpc("ReleaseClaim")
    async def ReleaseClaim(self, request: pb.ReleaseClaimRequest, context: grpc.aio.ServicerContext) -> pb.ClaimInfo:
        return self.claims.release(self.tenancy.resolve(context), request.claim_id)

    @_rpc("DemoteClaim")
    async def DemoteClaim(self, request: pb.DemoteClaimRequest, context: grpc.aio.ServicerContext) -> pb.ClaimInfo:
        return self.claims.demote(self.tenancy.resolve(context), request.claim_id, request.reason)

    @_rpc("GetClaim")
    async def GetClaim(self, request: pb.GetClaimRequest, context: grpc.aio.ServicerContext) -> pb.ClaimInfo:
        return self.claims.get(self.tenancy.resolve(context), request.claim_id)

    @_rpc("ReportPool")
    async def ReportPool(
        self, request: pb.ReportPoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportPoolResponse:
        self.tenancy.resolve(context)
        return self.claims.report_pool(request)

    @_rpc("AdmitActive")
    async def AdmitActive(
        self, request: pb.AdmitActiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdmitActiveResponse:
        return self.claims.admit(self.tenancy.resolve(context), request)

    @_streaming("WatchEvents")
    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ClaimEvent]:
        tenant = self.tenancy.resolve(context)
        async for ev in self.claims.watch(tenant, request):
            yield ev
        self._ok["WatchEvents"].inc()

    # ---------------------------------------------------------------------------- manifests

    @_rpc("ImportManifest")
    async def ImportManifest(
        self, request: pb.ImportManifestRequest, context: grpc.aio.ServicerContext
    ) -> pb.ImportManifestResponse:
        tenant = self.tenancy.resolve(context)
        svc = self.manifests
        res = await svc.import_lines(tenant, request.lines, shared=request.shared, prefetch=not request.no_prefetch)
        o = res.outcomes
        return pb.ImportManifestResponse(
            lines=res.lines, prefetched=o[Outcome.PREFETCHED], planned=o[Outcome.PLANNED], present=o[Outcome.PRESENT],
            malformed=o[Outcome.MALFORMED], refused=o[Outcome.REFUSED],
            warmup_pending=svc.pending(tenant, request.shared),
        )

    @_rpc("GetWarmUpPlan")
    async def GetWarmUpPlan(self, request: pb.WarmUpPlanRequest, context: grpc.aio.ServicerContext) -> pb.WarmUpPlan:
        tenant = self.tenancy.resolve(context)
        if not request.HasField("identity"):
            raise InvalidArgument("identity: required (the plan holds the chunks of one identity)")
        identity = self.identities.get(request.identity, True)
        seqs, pending = self.manifests.warm_up_plan(
            tenant, identity, shared=request.shared, max_sequences=request.max_sequences
        )
        return pb.WarmUpPlan(sequences=seqs, tokens=sum(len(q) for q in seqs) // 4, pending_chunks=pending)

    @_streaming("ExportManifest")
    async def ExportManifest(
        self, request: pb.ExportManifestRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ExportManifestResponse]:
        try:
            tenant = self.tenancy.resolve(context)
            if not request.HasField("identity"):
                raise InvalidArgument("identity: required (chunk keys are salted with it)")
            identity = self.identities.get(request.identity, True)
            batches = list(self.manifests.export(tenant, identity, include_shared=request.include_shared))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error leaves through _abort
            await self._abort("ExportManifest", exc, context)
        for lines in batches:
            yield pb.ExportManifestResponse(lines=lines)
        self._ok["ExportManifest"].inc()


class SidecarServer:
    """A started sidecar: gRPC server, health, metrics endpoint. Stop with ``await stop()``.

    ``session_table`` replaces the session table built from ``config.directives`` (tests); its
    ``config`` then rules the session limits and TTLs.
    """

    def __init__(self, config: SidecarConfig, *, session_table: SessionTable | None = None) -> None:
        self.config = config
        self.metrics = Metrics(__version__)
        self.index = ChunkIndex(config.chunker, InMemoryRegistry(config.registry))
        self.dataplane = DataPlane(self.index, config.limits.store_config(config.store))  # limits.max_bytes*
        self.metrics.watch_registry(self.index.registry)
        self.metrics.watch_dataplane(self.dataplane)
        evictions = self.metrics.evictions
        self.dataplane.on_registry_eviction = lambda reason: evictions.labels(reason).inc()
        self.shared_registry = self._shared_registry(config)
        # The table's own per-tenant cap is the largest any tenant may have; the servicer enforces
        # each tenant's limits.max_sessions before the table is asked.
        directives = dataclasses.replace(
            config.directives,
            max_sessions_per_tenant=config.limits.session_ceiling(config.directives.max_sessions_per_tenant),
        )
        self.sessions = SpliceService(
            directives, self.metrics, table=session_table, resolver=self.dataplane.resolve_held
        )
        self.metrics.watch_sessions(self.sessions.table)
        self.servicer = KVSidecarServicer(config, self.index, self.dataplane, self.metrics, self.sessions)
        self.servicer.shared = self.shared_registry
        self.manifests = ManifestService(
            config.manifests, self.index, self.dataplane, self.servicer.tenancy, self.metrics, config.max_prompt_tokens
        )
        self.servicer.manifests = self.manifests
        self.claims = ClaimsService(config.claims, self.index, self.dataplane.store, self.sessions, self.metrics)
        self.dataplane.claims = self.claims.ledger
        self.servicer.claims = self.claims
        self.metrics.watch_claims(self.claims.ledger, self.dataplane.store)
        opts = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            # Off, so a second sidecar on a taken port fails to bind instead of silently taking
            # half the connections; on for the workers of one supervisor, which share the port.
            ("grpc.so_reuseport", int(config.worker_index >= 0)),
        ]
        self.grpc = grpc.aio.server(options=opts)
        _add_servicer(self.servicer, self.grpc)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.grpc,
        )
        self.port = 0
        self.metrics_port = -1
        self._stopped = False
        self._sweeper: asyncio.Task | None = None
        self._rotation_warmup: threading.Thread | None = None
        self._claim_sweeper: asyncio.Task | None = None

    async def start(self) -> int:
        cfg = self.config
        host = cfg.bind_host
        if host != cfg.host:
            logger.warning("no authentication configured: binding %s instead of %s (loopback only)", host, cfg.host)
        elif not cfg.authenticated:
            logger.info("no authentication configured: serving on loopback only")
        for warning in self.servicer.tenancy.startup_warnings():
            logger.warning("%s", warning)
        if cfg.tls.enabled:
            self.port = self.grpc.add_secure_port(f"{host}:{cfg.port}", server_credentials(cfg.tls))
        else:
            if cfg.authenticated and host not in LOOPBACK_HOSTS:
                if not cfg.tls.allow_insecure:
                    raise ValueError(
                        f"tls: refusing to serve authenticated calls on {host} without TLS (bearer tokens would "
                        "cross the network in clear): set tls.cert_file and tls.key_file, or tls.allow_insecure: "
                        "true on a private network"
                    )
                logger.warning(
                    "INSECURE: serving bearer-token calls on %s:%d WITHOUT TLS (tls.allow_insecure is set): "
                    "anyone on this network can read the tokens", host, cfg.port,
                )
            self.port = self.grpc.add_insecure_port(f"{host}:{cfg.port}")
        if self.port == 0:
            raise OSError(f"could not bind gRPC port {host}:{cfg.port}")
        warmup(cfg.chunker)
        if cfg.registry.compiled_lookup:
            compiled_warmup(cfg.chunker)
        self.dataplane.recover()  # logs what it rebuilt
        await self.manifests.import_startup()  # warm start before the first request (logs what it did)
        await self.grpc.start()
        self._sweeper = asyncio.get_running_loop().create_task(self.sessions.run_sweeper(), name="session-expiry")
        self._claim_sweeper = asyncio.get_running_loop().create_task(self.claims.run_sweeper(), name="claim-expiry")
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        # The rotation kernels are compiled (or loaded from numba's cache) behind the serving
        # port: Lookups do not need them and a restart should not wait for them, but the first
        # rotated Fetch should not pay them either (it waits for this thread if it comes first).
        self._rotation_warmup = threading.Thread(target=_warm_rotation, name="kv-sidecar-rotation-warmup", daemon=True)
        self._rotation_warmup.start()
        if self.shared_registry is not None:
            await self._start_shared_registry()
        if cfg.metrics_port >= 0:
            self.metrics_port = self.metrics.serve_http(cfg.metrics_host, cfg.metrics_port)
        logger.info("kv-sidecar %s serving %s on %s:%d", __version__, SERVICE_NAME, host, self.port)
        return self.port

    def _shared_registry(self, config: SidecarConfig) -> SharedRegistry | None:
        """The shared (Redis) registry in front of which the local one is a near cache, or None."""
        sr = config.shared_registry
        if not sr.enabled:
            return None
        store = config.store
        shared_tier = ""
        if store.remote_url and store.remote_bytes > 0:
            ep = RemoteEndpoint.parse(store.remote_url)
            shared_tier = f"{ep.host}:{ep.port}/{store.namespace}"
        shared = SharedRegistry(sr, sidecar_id=sr.sidecar_id, shared_tier=shared_tier)
        self.index.publisher = shared
        self.dataplane.publish_remote = sr.publish_payloads and bool(shared_tier)
        self.metrics.watch_shared_registry(shared)
        return shared

    async def _start_shared_registry(self) -> None:
        shared = self.shared_registry
        assert shared is not None
        if not shared.sidecar_id:
            shared.sidecar_id = f"{socket.gethostname()}:{self.port}"
            if self.config.worker_index >= 0:
                shared.sidecar_id += f"/w{self.config.worker_index}"
        loop = asyncio.get_running_loop()

        def on_health(up: bool) -> None:  # any thread
            if not loop.is_closed():
                loop.call_soon_threadsafe(lambda: loop.create_task(self._set_registry_health(up)))

        up = await asyncio.to_thread(shared.start, on_health)
        await self._set_registry_health(up)
        logger.info("shared registry %s (sidecar id %s, shared tier %s)", "up" if up else "DOWN: degraded",
                    shared.sidecar_id, shared.shared_tier or "none")

    async def _set_registry_health(self, up: bool) -> None:
        if self._stopped and up:
            return
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        result = self.health.set(REGISTRY_HEALTH_NAME, status)
        if asyncio.iscoroutine(result):
            await result

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            result = self.health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting calls, let in-flight calls finish for ``grace`` seconds. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        grace_s = self.config.grace_period_s if grace is None else grace
        began = time.monotonic()
        await self.grpc.stop(grace_s)
        for task in (self._sweeper, self._claim_sweeper):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await asyncio.to_thread(self.manifests.close)  # writes what the producer still buffers
        if self.shared_registry is not None:
            await self._set_registry_health(False)
            await asyncio.to_thread(self.shared_registry.close, self.config.shared_registry.timeout_s * 10)
        # what only memory holds goes to disk within what is left of the grace period (at least
        # a second: the calls were stopped first), so a restart starts warm
        budget = max(1.0, grace_s - (time.monotonic() - began))
        moved, left = await asyncio.to_thread(self.dataplane.store.spill, budget)
        if moved or left:
            log = logger.warning if left else logger.info
            log("shutdown: %d chunks moved from memory to the disk tier, %d left in memory (lost)%s", moved, left,
                "" if "disk" in {t.value for t in self.dataplane.store.tiers} else ": no disk tier configured")
        await asyncio.to_thread(self.dataplane.close)
        self.metrics.close()
        warming = self._rotation_warmup
        if warming is not None and warming.is_alive():
            # A process that exits while numba's parallel workers run a warm-up kernel aborts
            # ("terminate called without an active exception"): let the warm-up finish first.
            await asyncio.to_thread(warming.join, _WARMUP_JOIN_S)
        logger.info("kv-sidecar stopped")

    async def wait_for_termination(self) -> None:
        await self.grpc.wait_for_termination()


async def create_server(config: SidecarConfig) -> tuple[SidecarServer, int]:
    """Build and start a sidecar; returns it and the bound gRPC port (config.port 0 = any)."""
    server = SidecarServer(config)
    port = await server.start()
    return server, port


class ServerThread:
    """A sidecar on its own event loop in a daemon thread, for synchronous callers.

    ``with ServerThread(config) as st: SyncSidecarClient(st.target)``.
    """

    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.server: SidecarServer | None = None
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "ServerThread":
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                self.server, self.port = loop.run_until_complete(create_server(self.config))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="kv-sidecar", daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            raise errors[0]
        return self

    def stop(self, grace: float = 0.5) -> None:
        if self._loop is None or self.server is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._loop)
        fut.result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join()
        self.server = None

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop when uvloop is installed, else asyncio's default."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; kept for embedding
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
