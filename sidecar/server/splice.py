"""Sessions and Splice at the edge: OpenSession ... FetchSession (``SessionHandlers``).

Each handler decodes its request (``sidecar.api.splice``), makes one call to the domain
``SpliceService`` (``sidecar.directives.service``) and encodes the answer; FetchSession then
streams the held span's KV that the data plane reads. The service counts plans by mode and
outcome and committed tokens in plain ints; ``SessionHandlers`` drains them into the
Prometheus counters (``kv_sidecar_splices_total``, ``kv_sidecar_splice_tokens_total``) each
time the service counts, the expiry sweep's included.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

import sidecar.api.splice as wire
from sidecar.api.frames import Framer
from sidecar.api.kv import required_layout, rope_from_wire
from sidecar.api.splice import (
    directives_from_wire,
    op_plan_to_wire,
    plan_id_from_wire,
    request_mode,
    session_id_from_wire,
    session_to_wire,
    session_tokens_from_wire,
)
from sidecar.config import SidecarConfig
from sidecar.dataplane import DataPlane
from sidecar.directives import EditMode
from sidecar.directives.service import OUTCOMES, TOKEN_KINDS, SpliceService
from sidecar.errors import InvalidArgument
from sidecar.server.edge import Edge, rpc, streaming
from sidecar.server.metrics import Metrics
from sidecar.shm import ShmWriter


class SpliceMetrics:
    """The Prometheus side of a ``SpliceService``'s counts: ``drain`` adds them to ``metrics``."""

    def __init__(self, service: SpliceService, metrics: Metrics) -> None:
        self.service = service
        self.metrics = metrics
        self._splices = {(m, o): metrics.splices.labels(m.value, o) for m in EditMode for o in OUTCOMES}
        self._tokens = {kind: metrics.splice_tokens.labels(kind) for kind, _ in TOKEN_KINDS}

    def drain(self) -> None:
        c = self.service.counters.take()
        for key, n in c.splices.items():
            self._splices[key].inc(n)
        for kind, n in c.tokens.items():
            self._tokens[kind].inc(n)
        if c.invariant_violations:
            self.metrics.invariant_violations.inc(c.invariant_violations)


_CLOSED = wire.CloseSessionResponse()


class SessionHandlers:
    """OpenSession / AppendSession / GetSession / CloseSession / Splice / CommitSplice /
    AbortSplice / FetchSession: wire <-> domain (``sidecar.api.splice``) around ``SpliceService``."""

    def __init__(self, edge: Edge, config: SidecarConfig, service: SpliceService, dataplane: DataPlane) -> None:
        self.edge = edge
        self.config = config
        self.service = service
        self.dataplane = dataplane
        self.metrics = edge.metrics
        # the service's counts reach the metrics as soon as it counts (calls and sweeps alike)
        self.splice_metrics = SpliceMetrics(service, edge.metrics)
        service.on_count = self.splice_metrics.drain

    @rpc
    async def OpenSession(self, request: wire.OpenSessionRequest, context: grpc.aio.ServicerContext) -> wire.SessionInfo:
        tenant = self.edge.tenancy.resolve(context)
        identity = None
        if request.HasField("identity"):
            identity = self.edge.identities.get(request.identity, True)  # validated; used by held sessions only
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
        self.edge.limits.check_tokens(tenant, len(tokens))
        self.edge.limits.check_sessions(tenant, self.service.table)
        return session_to_wire(self.service.open(tenant, tokens, request.block_size, identity))

    @rpc
    async def AppendSession(self, request: wire.AppendSessionRequest, context: grpc.aio.ServicerContext) -> wire.SessionInfo:
        tenant = self.edge.tenancy.resolve(context)
        sid = session_id_from_wire(request.session_id)
        tokens = session_tokens_from_wire(request.tokens)
        self.edge.limits.check_tokens(tenant, len(tokens))
        return session_to_wire(self.service.append(tenant, sid, tokens))

    @rpc
    async def GetSession(self, request: wire.GetSessionRequest, context: grpc.aio.ServicerContext) -> wire.SessionInfo:
        tenant = self.edge.tenancy.resolve(context)
        info, pending = self.service.get(tenant, session_id_from_wire(request.session_id))
        return session_to_wire(info, pending)

    @rpc
    async def CloseSession(
        self, request: wire.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> wire.CloseSessionResponse:
        tenant = self.edge.tenancy.resolve(context)
        self.service.close(tenant, session_id_from_wire(request.session_id))
        return _CLOSED

    @rpc
    async def Splice(self, request: wire.SpliceRequest, context: grpc.aio.ServicerContext) -> wire.OpPlanMsg:
        t0 = time.perf_counter()
        tenant = self.edge.tenancy.resolve(context)
        service = self.service
        forget = self.edge.limits.forget_by_default(tenant)  # limits.forget_by_default, directives.forget_tenants
        try:
            sid = session_id_from_wire(request.session_id)
            directives = directives_from_wire(
                request.directives, max_directives=service.table.config.max_directives, force_forget=forget
            )
            plan = service.splice(tenant, sid, request.expected_version, directives)
        except Exception:
            service.refused(request_mode(request.directives, forget))
            raise
        msg = op_plan_to_wire(plan, service.table.config.plan_ttl_s)
        self.metrics.splice_seconds.observe(time.perf_counter() - t0)
        return msg

    @rpc
    async def CommitSplice(self, request: wire.CommitSpliceRequest, context: grpc.aio.ServicerContext) -> wire.SessionInfo:
        tenant = self.edge.tenancy.resolve(context)
        return session_to_wire(self.service.commit(tenant, plan_id_from_wire(request.plan_id)))

    @rpc
    async def AbortSplice(self, request: wire.AbortSpliceRequest, context: grpc.aio.ServicerContext) -> wire.SessionInfo:
        tenant = self.edge.tenancy.resolve(context)
        return session_to_wire(self.service.abort(tenant, plan_id_from_wire(request.plan_id)))

    @streaming
    async def FetchSession(
        self, request: wire.FetchSessionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wire.FetchSessionResponse]:
        shm: ShmWriter | None = None
        try:
            tenant = self.edge.tenancy.resolve(context)
            sid = session_id_from_wire(request.session_id)
            layout = required_layout(request)
            rope = rope_from_wire(request.rope) if request.HasField("rope") else None
            end = request.end if request.HasField("end") else None
            span = self.service.held_span(tenant, sid, request.start, end, max_tokens=self.config.max_prompt_tokens)
            runs = await self.dataplane.held.fetch(span, layout, rope, request.raw)
            shm = self.edge.open_shm(request, context)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error leaves through _abort
            await self.edge.abort("FetchSession", exc, context)
        nbytes = 0
        try:
            framer = Framer(self.config.fetch_part_bytes, shm)
            for r in runs:
                mv = memoryview(r.payload.numpy())
                nbytes += len(mv)
                meta = wire.FetchSessionResponse(
                    index=r.index, num_tokens=r.num_tokens, source_pos=r.source_pos, delta=r.delta, rotated=r.rotated,
                    tier=r.tier, target_pos=r.target_pos, chunk_hash=r.chunk_hash, chunk_offset=r.chunk_offset,
                    version=span.version,
                )
                for frame in framer.add(meta, mv):
                    yield frame
            for frame in framer.flush():
                yield frame
        finally:
            self.edge.close_shm(shm)
        self.metrics.fetch_bytes.inc(nbytes)
        self.edge.ok["FetchSession"].inc()
