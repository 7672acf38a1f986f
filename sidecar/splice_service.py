"""Splice at the edge: the session table, the tenants' forget setting, outcome metrics, expiry.

The servicer (``sidecar.server``) converts wire <-> domain and calls this; this calls the
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

from sidecar.config import DirectivesConfig
from sidecar.directives import (
    Directive,
    ExpiryReport,
    HeldSpan,
    Mode,
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
from sidecar.metrics import Metrics

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
    mode: Mode
    tenant: str
    session_id: SessionId
    deadline: float
    summary: PlanSummary


def plan_mode(plan: OpPlan) -> Mode:
    """A plan's metrics label: FORGET if any of its edits forgets (it re-prefills from there)."""
    return Mode.FORGET if any(e.mode is Mode.FORGET for e in plan.edits) else Mode.AMORTIZE


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
        self._splices = {(m, o): metrics.splices.labels(m.value, o) for m in Mode for o in OUTCOMES}
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

    def refused(self, mode: Mode) -> None:
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
                "in the plan bookkeeping (sidecar/splice_service.py)"
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
