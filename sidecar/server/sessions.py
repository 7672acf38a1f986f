"""Splice at the edge: the session table, the tenants' forget setting, outcome metrics, expiry.

``SessionHandlers`` (the RPCs, below) convert wire <-> domain and call ``SpliceService``; it calls the
domain ``SessionTable`` and counts what happened. It is the only place that knows how a plan
ended, so it keeps a small record per pending plan (mode, tenant, session, deadline)::

    Splice ----> planned ---+--> CommitSplice --------------------> committed (+ splice tokens)
       |                    +--> AbortSplice / CloseSession -------> aborted
       +-> refused          +--> TTL passed (sweep, or a later call) -> expired

``refused`` also counts a CommitSplice that failed on an invariant (the plan is dropped).
Like the table, every method is synchronous and runs on the server's event loop, so each call
is atomic with respect to the others; ``run_sweeper`` is the periodic expiry task.

Held sessions: ``resolver`` (the data plane's ``resolve_held``) is handed to the table, which
uses it to find each token's canonical stored copy; ``held_span`` is what FetchSession serves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import time
from collections.abc import AsyncIterator

import grpc

import sidecar.api.sessions as wire
from sidecar.api.frames import Framer
from sidecar.api.kv import layout_from_wire, rope_from_wire
from sidecar.api.sessions import (
    directives_from_wire,
    op_plan_to_wire,
    plan_id_from_wire,
    request_mode,
    session_id_from_wire,
    session_to_wire,
    session_tokens_from_wire,
)
from sidecar.config import DirectivesConfig, SidecarConfig
from sidecar.dataplane import DataPlane
from sidecar.errors import InvalidArgument
from sidecar.server.edge import Edge, rpc, streaming
from sidecar.shm import ShmWriter
from sidecar.directives import (
    Directive,
    EditMode,
    ExpiryReport,
    HeldSpan,
    OpPlan,
    PlanId,
    PlanSummary,
    Resolver,
    SessionId,
    SessionInfo,
    SessionTable,
)
from sidecar.errors import InvariantViolation, NotFound
from sidecar.identity import CacheIdentity
from sidecar.server.metrics import Metrics

logger = logging.getLogger(__name__)

OUTCOMES = ("planned", "committed", "aborted", "expired", "refused")
#: ``kv_sidecar_splice_tokens_total{kind}`` <- ``PlanSummary`` field, counted on commit.
TOKEN_KINDS = (
    ("prefilled", "tokens_prefilled"),
    ("kept", "tokens_kept"),
    ("moved", "slots_moved"),
    ("rotated", "slots_rotated"),
    ("refreshed", "refresh_proposals"),
)


@dataclass(slots=True)
class _Tracked:
    mode: EditMode
    tenant: str
    session_id: SessionId
    deadline: float
    summary: PlanSummary


def plan_mode(plan: OpPlan) -> EditMode:
    """A plan's metrics label: FORGET if any of its edits forgets (it re-prefills from there)."""
    return EditMode.FORGET if any(e.mode is EditMode.FORGET for e in plan.edits) else EditMode.AMORTIZE


class SpliceService:
    """Sessions and Splice transactions of one sidecar (see the module docstring).

    ``table`` may be given (tests inject one); by default it is built from ``config``. Time is
    the table's clock. ``resolver`` finds held sessions' stored copies (installed on the table).
    Errors are the table's (``sidecar.errors``), unchanged.
    """

    def __init__(
        self,
        config: DirectivesConfig,
        metrics: Metrics,
        *,
        table: SessionTable | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        self.config = config
        self.table = table if table is not None else SessionTable(config=config.session_config())
        if resolver is not None:
            self.table.resolver = resolver
        self._clock = self.table.clock
        self._forget = frozenset(config.forget_tenants)
        self._metrics = metrics
        self._plans: dict[PlanId, _Tracked] = {}
        self._splices = {(m, o): metrics.splices.labels(m.value, o) for m in EditMode for o in OUTCOMES}
        self._tokens = tuple((metrics.splice_tokens.labels(kind), field) for kind, field in TOKEN_KINDS)

    def forces_forget(self, tenant: str) -> bool:
        """The tenant's edits are all planned as FORGET (``directives.forget_tenants``)."""
        return tenant in self._forget

    # ------------------------------------------------------------------------------ sessions

    def open(
        self, tenant: str, tokens: object, block_size: int, identity: CacheIdentity | None = None
    ) -> SessionInfo:
        """Open a session; with ``identity`` a held one (its stored copies resolved now)."""
        return self.table.open(tenant, tokens, block_size=block_size, identity=identity)

    def append(self, tenant: str, session_id: SessionId, tokens: object) -> SessionInfo:
        return self.table.append(session_id, tenant, tokens)

    def get(self, tenant: str, session_id: SessionId) -> tuple[SessionInfo, PlanId | None]:
        """The session and its pending plan's id, if any."""
        info = self.table.get(session_id, tenant)
        plan = self.table.pending(session_id, tenant)
        return info, plan.plan_id if plan is not None else None

    def close(self, tenant: str, session_id: SessionId) -> None:
        """Forget the session; its pending plan, if any, counts as aborted."""
        plan = self.table.pending(session_id, tenant)
        self.table.close(session_id, tenant)
        if plan is not None:
            self._finish(plan.plan_id, "aborted")

    def held_span(
        self, tenant: str, session_id: SessionId, start: int, end: int | None, *, max_tokens: int | None = None
    ) -> HeldSpan:
        """What FetchSession serves for ``[start, end)`` of a held session (see
        ``SessionTable.held_span``)."""
        return self.table.held_span(session_id, tenant, start, end, max_tokens=max_tokens)

    # -------------------------------------------------------------------------------- splice

    def splice(
        self, tenant: str, session_id: SessionId, expected_version: int, directives: Sequence[Directive]
    ) -> OpPlan:
        """Plan and hold ``directives`` (already FORGET when the tenant forces it)."""
        plan = self.table.splice(session_id, tenant, expected_version, directives)
        mode = plan_mode(plan)
        deadline = self._clock() + self.table.config.plan_ttl_s  # not before the table's own
        self._plans[plan.plan_id] = _Tracked(mode, tenant, session_id, deadline, plan.summary)
        self._splices[mode, "planned"].inc()
        return plan

    def refused(self, mode: EditMode) -> None:
        """A Splice that produced no plan (any error, from decoding to an invariant)."""
        self._splices[mode, "refused"].inc()

    def commit(self, tenant: str, plan_id: PlanId) -> SessionInfo:
        try:
            info = self.table.commit(plan_id, tenant)
        except NotFound:
            self._gone(plan_id, tenant)
            raise
        except Exception:
            self._finish(plan_id, "refused")  # the table dropped the plan before failing
            raise
        tracked = self._finish(plan_id, "committed")
        if tracked is not None:
            for counter, field in self._tokens:
                counter.inc(getattr(tracked.summary, field))
        return info

    def abort(self, tenant: str, plan_id: PlanId) -> SessionInfo:
        """Drop the pending plan; returns the (unchanged) session."""
        tracked = self._plans.get(plan_id)
        try:
            self.table.abort(plan_id, tenant)
        except NotFound:
            self._gone(plan_id, tenant)
            raise
        self._finish(plan_id, "aborted")
        if tracked is None:
            raise InvariantViolation(
                f"plan {plan_id!s} was pending in the session table but not tracked; this indicates a bug "
                "in the plan bookkeeping (sidecar/server/sessions.py)"
            )
        return self.table.get(tracked.session_id, tenant)

    # -------------------------------------------------------------------------------- expiry

    def sweep(self) -> ExpiryReport:
        """Abort pending plans past their TTL and close idle sessions; count the expired plans,
        including those a call already expired on the way (the table does not report those)."""
        now = self._clock()
        report = self.table.expire(now)
        for pid in report.plans_aborted:
            self._finish(pid, "expired")
        closed = set(report.sessions_closed)
        for pid in [p for p, t in self._plans.items() if t.deadline <= now or t.session_id in closed]:
            self._finish(pid, "expired")
        return report

    async def run_sweeper(self) -> None:
        """Sweep every ``sweep_interval_s`` until cancelled (started and stopped by the server)."""
        interval = self.config.sweep_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                report = self.sweep()
            except InvariantViolation:
                self._metrics.invariant_violations.inc()
                logger.exception("session expiry sweep failed")
                continue
            except Exception:  # noqa: BLE001 - the sweeper must outlive one bad sweep
                logger.exception("session expiry sweep failed")
                continue
            if report.sessions_closed or report.plans_aborted:
                logger.info(
                    "expired %d idle sessions and %d pending plans",
                    len(report.sessions_closed), len(report.plans_aborted),
                )

    # ----------------------------------------------------------------------------- internals

    def _finish(self, plan_id: PlanId, outcome: str) -> _Tracked | None:
        tracked = self._plans.pop(plan_id, None)
        if tracked is not None:
            self._splices[tracked.mode, outcome].inc()
        return tracked

    def _gone(self, plan_id: PlanId, tenant: str) -> None:
        """The table no longer holds this tenant's plan: if we were tracking it, it expired."""
        tracked = self._plans.get(plan_id)
        if tracked is not None and tracked.tenant == tenant:
            self._finish(plan_id, "expired")


_CLOSED = wire.CloseSessionResponse()


class SessionHandlers:
    """OpenSession / AppendSession / GetSession / CloseSession / Splice / CommitSplice /
    AbortSplice / FetchSession: wire <-> domain (``sidecar.api.sessions``) around ``SpliceService``."""

    def __init__(self, edge: Edge, config: SidecarConfig, service: SpliceService, dataplane: DataPlane) -> None:
        self.edge = edge
        self.config = config
        self.service = service
        self.dataplane = dataplane
        self.metrics = edge.metrics


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
            if not request.HasField("layout"):
                raise InvalidArgument("layout: required")
            layout = layout_from_wire(request.layout)
            rope = rope_from_wire(request.rope) if request.HasField("rope") else None
            end = request.end if request.HasField("end") else None
            span = self.service.held_span(tenant, sid, request.start, end, max_tokens=self.config.max_prompt_tokens)
            runs = await self.dataplane.fetch_session(span, layout, rope, request.raw)
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
