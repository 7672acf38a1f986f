"""Resident claims at the edge: the RPCs, request validation, the expiry sweeper (docs/claims.md).

``ClaimHandlers`` convert the wire (``sidecar.api.claims``) and call ``ClaimsService``, which
works in domain types: it validates a request completely before the ledger changes anything
(INVALID_ARGUMENT names the field), resolves the claim object to ordered chunk keys and calls
the ``ClaimLedger``. Claims are tenant-scoped: another tenant's claim id is NOT_FOUND, exactly
like an unknown one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import numpy as np

import sidecar.api.claims as wire
from sidecar.api.claims import (
    ClaimObject,
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
from sidecar.claims import AdmissionVerdict, Claim, ClaimEvent, ClaimLedger, ClaimsConfig, Decision, PoolReport
from sidecar.claims import ProtectionMode
from sidecar.config import SidecarConfig
from sidecar.errors import InvalidArgument
from sidecar.identity import SHARED_SCOPE, CacheIdentity
from sidecar.registry.chunk_index import ChunkIndex
from sidecar.server.edge import Edge, rpc, streaming
from sidecar.server.metrics import Metrics
from sidecar.server.sessions import SpliceService

logger = logging.getLogger(__name__)


class ClaimsService:
    """The claims ledger behind the RPCs: validation, object resolution, the expiry sweeper.

    ``ledger`` is shared with the data plane, which consults it on every Store and sync."""

    def __init__(self, config: ClaimsConfig, index: ChunkIndex, ledger: ClaimLedger, sessions: SpliceService,
                 metrics: Metrics) -> None:
        self.config = config
        self.index = index
        self.sessions = sessions
        self.metrics = metrics
        self.ledger = ledger

    def claim(self, tenant: str, claim_id: str, *, mode: ProtectionMode, obj: ClaimObject, shared: bool,
              identity: CacheIdentity, duration_s: float | None, predicate_min_tokens: int,
              footprint_blocks: int, max_tokens: int) -> tuple[Decision, str, Claim]:
        cfg = self.config
        if duration_s is not None and not 0 < duration_s <= cfg.max_duration_s:
            raise InvalidArgument(f"duration_s: {duration_s} must be in (0, claims.max_duration_s={cfg.max_duration_s}]")
        if mode is ProtectionMode.EXPIRING and duration_s is None:
            raise InvalidArgument("duration_s: required for mode expiring")
        scope = SHARED_SCOPE if shared else tenant
        if obj.chunk_hashes:
            keys, lengths = self._hash_object(tenant, list(obj.chunk_hashes), shared)
        else:
            if obj.tokens:
                tokens = tokens_from_wire(obj.tokens, "tokens", max_tokens)
                data = obj.tokens
            else:
                info, _ = self.sessions.get(tenant, obj.session_id)
                tokens = np.ascontiguousarray(info.layout.tokens, dtype="<u4")
                data = tokens.tobytes()
            keys, lengths = self._token_object(tokens, data, identity, scope, predicate_min_tokens)
        if len(keys) > cfg.max_chunks_per_claim:
            raise InvalidArgument(f"object: {len(keys)} chunks exceeds claims.max_chunks_per_claim {cfg.max_chunks_per_claim}")
        total = sum(lengths)
        if predicate_min_tokens > total:
            raise InvalidArgument(f"predicate_min_tokens: {predicate_min_tokens} exceeds the object's {total} tokens")
        min_tokens = predicate_min_tokens or total
        return self.ledger.submit(
            tenant, claim_id, mode, tuple(keys), tuple(lengths), min_tokens, footprint_blocks, duration_s,
        )

    def _hash_object(self, tenant: str, hashes: list[int], shared: bool) -> tuple[list[int], list[int]]:
        if len(hashes) > self.config.max_chunks_per_claim:
            raise InvalidArgument(
                f"chunk_hashes: {len(hashes)} exceeds claims.max_chunks_per_claim {self.config.max_chunks_per_claim}"
            )
        reg = self.index.registry
        scopes = (SHARED_SCOPE,) if shared else (tenant, SHARED_SCOPE)
        lengths = []
        for i, h in enumerate(hashes):
            e = reg.peek(h)
            if e is None or e.scope not in scopes:  # another tenant's chunk reads as unknown
                raise InvalidArgument(f"chunk_hashes[{i}]: unknown chunk {h:016x}")
            lengths.append(e.num_tokens)
        if len(set(hashes)) != len(hashes):
            raise InvalidArgument("chunk_hashes: a chunk is named twice")
        return hashes, lengths

    def _token_object(self, tokens, data, identity, scope, min_tokens) -> tuple[list[int], list[int]]:
        """The chunks of ``tokens`` (as Store cuts them) covering the first ``min_tokens``
        tokens (all of them when 0)."""
        if not len(tokens):
            raise InvalidArgument("tokens: empty object")
        entries, _ = self.index.entries(tokens, bytes(data), identity, scope, register_from=0)
        keys, lengths, covered = [], [], 0
        for e in entries:
            keys.append(int(e.key))
            lengths.append(e.num_tokens)
            covered += e.num_tokens
            if min_tokens and covered >= min_tokens:
                break
        return keys, lengths

    def release(self, tenant: str, claim_id: str) -> Claim:
        return self.ledger.release(tenant, claim_id)

    def demote(self, tenant: str, claim_id: str, reason: str) -> Claim:
        return self.ledger.demote(tenant, claim_id, reason[:200])

    def get(self, tenant: str, claim_id: str) -> Claim:
        self.ledger.expire_due()
        return self.ledger.get(tenant, claim_id)

    def report_pool(self, pool: PoolReport) -> int:
        """The protected resident blocks the pool must keep, after the report."""
        return self.ledger.report_pool(pool)

    def admit(self, tenant: str, request_id: str, active_live_blocks: int) -> AdmissionVerdict:
        if active_live_blocks <= 0:
            raise InvalidArgument("active_live_blocks: must be > 0")
        adm = self.ledger.admit(tenant, request_id, active_live_blocks)
        if adm.decision.value == "refused":
            self.metrics.active_refusals.inc()
        return adm

    async def watch(self, tenant: str, since_seq: int, follow: bool) -> AsyncIterator[ClaimEvent | tuple[int, int]]:
        """Events of ``tenant`` from ``since_seq`` (0: the oldest retained). A watcher whose
        cursor falls behind the buffer gets ``(cursor, gap)`` once and the stream ends (it may
        resume with ``since_seq``: the gap is then reported again)."""
        log = self.ledger.events
        cursor = since_seq or log.oldest_seq
        while True:
            gap, evs = log.read(cursor)
            if gap:
                self.metrics.event_watchers_dropped.inc()
                log.watchers_dropped += 1
                yield cursor, gap
                return
            for ev in evs:
                cursor = ev.seq + 1
                if ev.tenant == tenant:
                    yield ev
            if not follow:
                return
            await log.wait(cursor)

    def info(self, c: Claim) -> wire.ClaimInfo:
        return claim_to_wire(c, self.ledger.expires_in(c))

    async def run_sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            try:
                self.ledger.expire_due()
            except Exception:  # noqa: BLE001 - the sweeper must survive a bad claim
                logger.exception("claim expiry sweep failed")


class ClaimHandlers:
    """Claim / ReleaseClaim / DemoteClaim / GetClaim / ReportPool / AdmitActive / WatchEvents."""

    def __init__(self, edge: Edge, config: SidecarConfig, claims: ClaimsService) -> None:
        self.edge = edge
        self.config = config
        self.claims = claims

    @rpc
    async def Claim(self, request: wire.ClaimRequest, context: grpc.aio.ServicerContext) -> wire.ClaimDecision:
        tenant = self.edge.tenancy.resolve(context)  # claiming shared chunks needs no write grant: caps bound it
        identity = self.edge.identities.get(request.identity, True) if request.HasField("identity") else None
        cid = claim_id_from_wire(request.claim_id)
        if identity is None:
            raise InvalidArgument("identity: required (chunk keys are salted with it)")
        decision, reason, c = self.claims.claim(
            tenant, cid, mode=mode_from_wire(request.mode), obj=claim_object_from_wire(request),
            shared=request.shared, identity=identity,
            duration_s=request.duration_s if request.HasField("duration_s") else None,
            predicate_min_tokens=request.predicate_min_tokens, footprint_blocks=request.footprint_blocks,
            max_tokens=self.config.max_prompt_tokens,
        )
        return decision_to_wire(decision, reason, self.claims.info(c))

    @rpc
    async def ReleaseClaim(self, request: wire.ReleaseClaimRequest, context: grpc.aio.ServicerContext) -> wire.ClaimInfo:
        tenant = self.edge.tenancy.resolve(context)
        return self.claims.info(self.claims.release(tenant, claim_id_from_wire(request.claim_id)))

    @rpc
    async def DemoteClaim(self, request: wire.DemoteClaimRequest, context: grpc.aio.ServicerContext) -> wire.ClaimInfo:
        tenant = self.edge.tenancy.resolve(context)
        return self.claims.info(self.claims.demote(tenant, claim_id_from_wire(request.claim_id), request.reason))

    @rpc
    async def GetClaim(self, request: wire.GetClaimRequest, context: grpc.aio.ServicerContext) -> wire.ClaimInfo:
        tenant = self.edge.tenancy.resolve(context)
        return self.claims.info(self.claims.get(tenant, claim_id_from_wire(request.claim_id)))

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
