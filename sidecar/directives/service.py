"""Sessions and Splice transactions of one sidecar: the session table, the tenants' forget
setting, outcome counts, expiry.

``SpliceService`` calls the ``SessionTable`` and counts what happened; the server's handlers
(``sidecar/server/splice.py``) convert wire <-> domain around it. It is the only place that
knows how a plan ended, so it keeps a small record per pending plan (mode, tenant, session,
deadline)::

    Splice ----> planned ---+--> CommitSplice --------------------> committed (+ splice tokens)
       |                    +--> AbortSplice / CloseSession -------> aborted
       +-> refused          +--> TTL passed (sweep, or a later call) -> expired

``refused`` also counts a CommitSplice that failed on an invariant (the plan is dropped).
Counts are plain ints (``SpliceCounters``); after each count the service calls ``on_count``,
with which the server's edge drains them into its metrics. Like the table, every method is
synchronous and runs on the server's event loop, so each call is atomic with respect to the
others; ``run_sweeper`` is the periodic expiry task.

Held sessions: ``resolver`` (the data plane's ``held.resolve``) is handed to the table, which
uses it to find each token's canonical stored copy; ``held_span`` is what FetchSession serves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from sidecar.directives.directive import Directive, EditMode
from sidecar.directives.held import HeldSpan, Resolver
from sidecar.directives.mirror import SessionInfo
from sidecar.directives.op_plan import OpPlan, PlanId, PlanSummary, SessionId
from sidecar.directives.sessions import ExpiryReport, SessionConfig, SessionTable
from sidecar.errors import InvariantViolation, NotFound
from sidecar.identity import CacheIdentity

logger = logging.getLogger(__name__)

OUTCOMES = ("planned", "committed", "aborted", "expired", "refused")
#: ``SpliceCounters.tokens`` kind <- ``PlanSummary`` field, counted on commit.
TOKEN_KINDS = (
    ("prefilled", "tokens_prefilled"),
    ("kept", "tokens_kept"),
    ("moved", "slots_moved"),
    ("rotated", "slots_rotated"),
    ("refreshed", "refresh_proposals"),
)


@dataclass(slots=True)
class SpliceCounters:
    """What a ``SpliceService`` counted since the edge last took the counts (``take``)."""

    #: (mode, outcome) -> plans; outcome one of ``OUTCOMES``
    splices: dict[tuple[EditMode, str], int] = field(default_factory=dict)
    #: ``TOKEN_KINDS`` kind -> tokens of committed plans
    tokens: dict[str, int] = field(default_factory=dict)
    #: expiry sweeps that failed on a broken invariant
    invariant_violations: int = 0

    def take(self) -> SpliceCounters:
        """The counts so far; they start again from zero here."""
        out = SpliceCounters(self.splices, self.tokens, self.invariant_violations)
        self.splices, self.tokens, self.invariant_violations = {}, {}, 0
        return out


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


def _nothing() -> None:
    return None


class SpliceService:
    """Sessions and Splice transactions of one sidecar (see the module docstring).

    ``table`` may be given (tests inject one); by default it is built from ``session_config``.
    Time is the table's clock. ``resolver`` finds held sessions' stored copies (installed on
    the table). ``forget_tenants``: tenants whose edits are all planned as FORGET;
    ``sweep_interval_s``: the period of ``run_sweeper``. Errors are the table's
    (``sidecar.errors``), unchanged.
    """

    def __init__(
        self,
        session_config: SessionConfig | None = None,
        *,
        table: SessionTable | None = None,
        resolver: Resolver | None = None,
        forget_tenants: Iterable[str] = (),
        sweep_interval_s: float = 1.0,
    ) -> None:
        self.table = table if table is not None else SessionTable(config=session_config or SessionConfig())
        if resolver is not None:
            self.table.resolver = resolver
        self.sweep_interval_s = sweep_interval_s
        self._clock = self.table.clock
        self._forget = frozenset(forget_tenants)
        self._plans: dict[PlanId, _Tracked] = {}
        #: counts not yet drained by the edge
        self.counters = SpliceCounters()
        #: called after every count (the edge drains ``counters`` into its metrics)
        self.on_count: Callable[[], None] = _nothing

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
        self._count(mode, "planned")
        return plan

    def refused(self, mode: EditMode) -> None:
        """A Splice that produced no plan (any error, from decoding to an invariant)."""
        self._count(mode, "refused")

    def commit(self, tenant: str, plan_id: PlanId) -> SessionInfo:
        try:
            info = self.table.commit(plan_id, tenant)
        except NotFound:
            self._gone(plan_id, tenant)
            raise
        except Exception:
            self._finish(plan_id, "refused")  # the table dropped the plan before failing
            raise
        tracked = self._finish(plan_id, "committed", counted=False)
        if tracked is not None:
            tokens = self.counters.tokens
            for kind, name in TOKEN_KINDS:
                tokens[kind] = tokens.get(kind, 0) + getattr(tracked.summary, name)
            self.on_count()
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
                "in the plan bookkeeping (sidecar/directives/service.py)"
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
        interval = self.sweep_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                report = self.sweep()
            except InvariantViolation:
                self.counters.invariant_violations += 1
                self.on_count()
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

    def _count(self, mode: EditMode, outcome: str) -> None:
        splices = self.counters.splices
        splices[mode, outcome] = splices.get((mode, outcome), 0) + 1
        self.on_count()

    def _finish(self, plan_id: PlanId, outcome: str, *, counted: bool = True) -> _Tracked | None:
        """Stop tracking the plan and count its outcome (``counted``: announce it now, else the
        caller adds to the counts and announces them)."""
        tracked = self._plans.pop(plan_id, None)
        if tracked is not None:
            splices = self.counters.splices
            splices[tracked.mode, outcome] = splices.get((tracked.mode, outcome), 0) + 1
            if counted:
                self.on_count()
        return tracked

    def _gone(self, plan_id: PlanId, tenant: str) -> None:
        """The table no longer holds this tenant's plan: if we were tracking it, it expired."""
        tracked = self._plans.get(plan_id)
        if tracked is not None and tracked.tenant == tenant:
            self._finish(plan_id, "expired")
