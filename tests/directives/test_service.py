"""SpliceService (sidecar.directives.service): sessions and Splice transactions of one sidecar,
every outcome counted in plain counters (no Prometheus, no gRPC) that the server's edge drains
into its metrics. A real SessionTable on an injected clock."""

from __future__ import annotations

import numpy as np
import pytest

from sidecar.directives import Directive, EditMode, SessionConfig, SessionTable
from sidecar.directives.service import SpliceCounters, SpliceService
from sidecar.errors import FailedPrecondition, NotFound

T = "tenant-a"


def service(**kw) -> tuple[SpliceService, list[float], list[int]]:
    now = [0.0]
    table = SessionTable(config=SessionConfig(plan_ttl_s=1.0, idle_ttl_s=60.0), clock=lambda: now[0])
    svc = SpliceService(table=table, **kw)
    calls = [0]

    def counted() -> None:
        calls[0] += 1

    svc.on_count = counted
    return svc, now, calls


def toks(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.uint32)


def test_commit_and_abort_counted_in_plain_counters():
    svc, _, calls = service()
    info = svc.open(T, toks(64), 4)
    plan = svc.splice(T, info.session_id, 0, [Directive(start=8, end=8, replacement=[1, 2, 3, 4])])
    svc.commit(T, plan.plan_id)
    plan2 = svc.splice(T, info.session_id, 1, [Directive(start=0, end=2, mode=EditMode.FORGET)])
    svc.abort(T, plan2.plan_id)
    c = svc.counters.take()
    assert c.splices == {
        (EditMode.AMORTIZE, "planned"): 1, (EditMode.AMORTIZE, "committed"): 1,
        (EditMode.FORGET, "planned"): 1, (EditMode.FORGET, "aborted"): 1,
    }
    sm = plan.summary
    assert c.tokens == {"prefilled": sm.tokens_prefilled, "kept": sm.tokens_kept, "moved": sm.slots_moved,
                        "rotated": sm.slots_rotated, "refreshed": sm.refresh_proposals}
    assert c.invariant_violations == 0
    assert calls[0] == 4  # each count announced once, so the edge drains it at once
    assert svc.counters.take() == SpliceCounters()  # taken: zero until the next count


def test_refused_and_expired_plans_counted():
    svc, now, _ = service()
    info = svc.open(T, toks(32), 1)
    svc.splice(T, info.session_id, 0, [Directive(start=0, end=1)])
    with pytest.raises(FailedPrecondition, match="pending plan"):
        svc.splice(T, info.session_id, 0, [Directive(start=0, end=1)])
    svc.refused(EditMode.AMORTIZE)  # what the handler reports for the refused call
    now[0] = 5.0
    report = svc.sweep()
    assert len(report.plans_aborted) == 1
    c = svc.counters.take()
    assert c.splices == {(EditMode.AMORTIZE, "planned"): 1, (EditMode.AMORTIZE, "refused"): 1,
                         (EditMode.AMORTIZE, "expired"): 1}
    with pytest.raises(NotFound):
        svc.commit(T, report.plans_aborted[0])
    assert svc.counters.take().splices == {}  # already counted as expired


def test_forget_tenants_and_sweep_interval_are_plain_values():
    svc, _, _ = service(forget_tenants=("bank",), sweep_interval_s=0.25)
    assert svc.forces_forget("bank") and not svc.forces_forget("shop")
    assert svc.sweep_interval_s == 0.25
