"""Resident claims at the edge: Claim ... WatchEvents (``ClaimHandlers``; docs/claims.md).

Each handler decodes its request (``sidecar.api.claims``), makes one call to the domain
``ClaimsService`` (``sidecar.claims.service``: validation, object resolution, the ledger) and
encodes the answer. The service counts AdmitActive refusals and dropped event watchers in plain
ints; ``ClaimHandlers`` drains them into the Prometheus counters each time the service counts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

import sidecar.api.claims as wire
from sidecar.api.claims import (
    admission_to_wire,
    claim_id_from_wire,
    claim_object_from_wire,
    claim_to_wire,
    decision_to_wire,
    dropped_to_wire,
    event_to_wire,
    mode_from_wire,
)
from sidecar.api.kv import tokens_from_wire
from sidecar.claims import Claim, PoolReport
from sidecar.claims.service import ClaimsService
from sidecar.config import SidecarConfig
from sidecar.errors import InvalidArgument
from sidecar.server.edge import Edge, rpc, streaming
from sidecar.server.metrics import Metrics


class ClaimsMetrics:
    """The Prometheus side of a ``ClaimsService``'s counts: ``drain`` adds them to ``metrics``."""

    def __init__(self, service: ClaimsService, metrics: Metrics) -> None:
        self.service = service
        self.metrics = metrics

    def drain(self) -> None:
        c = self.service.counters.take()
        if c.admit_refusals:
            self.metrics.active_refusals.inc(c.admit_refusals)
        if c.watchers_dropped:
            self.metrics.event_watchers_dropped.inc(c.watchers_dropped)


class ClaimHandlers:
    """Claim / ReleaseClaim / DemoteClaim / GetClaim / ReportPool / AdmitActive / WatchEvents."""

    def __init__(self, edge: Edge, config: SidecarConfig, claims: ClaimsService) -> None:
        self.edge = edge
        self.config = config
        self.claims = claims
        # the service's counts reach the metrics as soon as it counts
        self.claims_metrics = ClaimsMetrics(claims, edge.metrics)
        claims.on_count = self.claims_metrics.drain

    def _info(self, c: Claim) -> wire.ClaimInfo:
        return claim_to_wire(c, self.claims.expires_in(c))

    @rpc
    async def Claim(self, request: wire.ClaimRequest, context: grpc.aio.ServicerContext) -> wire.ClaimDecision:
        tenant = self.edge.tenancy.resolve(context)  # claiming shared chunks needs no write grant: caps bound it
        identity = self.edge.identities.get(request.identity, True) if request.HasField("identity") else None
        cid = claim_id_from_wire(request.claim_id)
        if identity is None:
            raise InvalidArgument("identity: required (chunk keys are salted with it)")
        mode = mode_from_wire(request.mode)
        obj = claim_object_from_wire(request)
        tokens = tokens_from_wire(obj.tokens, "tokens", self.config.max_prompt_tokens) if obj.tokens else None
        decision, reason, c = self.claims.claim(
            tenant, cid, mode=mode, shared=request.shared, identity=identity,
            duration_s=request.duration_s if request.HasField("duration_s") else None,
            predicate_min_tokens=request.predicate_min_tokens, footprint_blocks=request.footprint_blocks,
            chunk_hashes=obj.chunk_hashes, tokens=tokens, session_id=obj.session_id,
        )
        return decision_to_wire(decision, reason, self._info(c))

    @rpc
    async def ReleaseClaim(self, request: wire.ReleaseClaimRequest, context: grpc.aio.ServicerContext) -> wire.ClaimInfo:
        tenant = self.edge.tenancy.resolve(context)
        return self._info(self.claims.release(tenant, claim_id_from_wire(request.claim_id)))

    @rpc
    async def DemoteClaim(self, request: wire.DemoteClaimRequest, context: grpc.aio.ServicerContext) -> wire.ClaimInfo:
        tenant = self.edge.tenancy.resolve(context)
        return self._info(self.claims.demote(tenant, claim_id_from_wire(request.claim_id), request.reason))

    @rpc
    async def GetClaim(self, request: wire.GetClaimRequest, context: grpc.aio.ServicerContext) -> wire.ClaimInfo:
        tenant = self.edge.tenancy.resolve(context)
        return self._info(self.claims.get(tenant, claim_id_from_wire(request.claim_id)))

    @rpc
    async def ReportPool(self, request: wire.ReportPoolRequest, context: grpc.aio.ServicerContext) -> wire.ReportPoolResponse:
        self.edge.tenancy.resolve(context)
        pool = PoolReport(usable_blocks=request.usable_blocks, free_blocks=request.free_blocks,
                          block_size=request.block_size, hard_protection=request.hard_protection,
                          engine_id=request.engine_id[:128])
        return wire.ReportPoolResponse(protected_resident_blocks=self.claims.report_pool(pool))

    @rpc
    async def AdmitActive(self, request: wire.AdmitActiveRequest, context: grpc.aio.ServicerContext) -> wire.AdmitActiveResponse:
        tenant = self.edge.tenancy.resolve(context)
        rid = claim_id_from_wire(request.request_id, "request_id")
        adm = self.claims.admit(tenant, rid, request.active_live_blocks)
        return admission_to_wire(adm, tenant, self.claims.config.defer_retry_s)

    @streaming
    async def WatchEvents(self, request: wire.WatchEventsRequest, context: grpc.aio.ServicerContext
                          ) -> AsyncIterator[wire.ClaimEventMsg]:
        tenant = self.edge.tenancy.resolve(context)
        capacity = self.claims.ledger.events.capacity
        async for ev in self.claims.watch(tenant, request.since_seq, request.follow):
            yield dropped_to_wire(ev[0], ev[1], capacity) if isinstance(ev, tuple) else event_to_wire(ev)
        self.edge.ok["WatchEvents"].inc()
