"""Resident claims on vLLM: the connector's admit gate holds a request the sidecar refuses, re-asks
after the retry hint, serves it after ``admit_max_wait_s`` (vLLM cannot reject a request), and
admits at once when nothing blocks (fake scheduler and clock, real sidecar arbitration)."""

from __future__ import annotations

from sidecar.client import SyncSidecarClient
from sidecar.identity import CacheIdentity
from tests.clients.vllm.fakes import FakeScheduler, Request

GATE = dict(admission=True, admit_min_tokens=64, admit_retry_s=0.5, admit_max_wait_s=5.0, engine_id="fake-vllm")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_hard_claim_larger_than_the_pool_holds_the_request(engine, sidecar_target, prompts):
    side, worker = engine(tenant="team-gate", **GATE)
    clock = Clock()
    side.admit_gate.clock = clock
    s = FakeScheduler(side, worker, pool=(1000, 900))
    with SyncSidecarClient(sidecar_target, tenant="team-gate") as c:
        ident = CacheIdentity(model_id="resident-pool", kv_layout="any", rope_fingerprint="any")
        d = c.claim("system-prompt", identity=ident, mode="hard_protected", tokens=prompts.msg(40),
                    footprint_blocks=1_000_000, duration_s=600)
        assert d.claim.state == "accepted", d
        tokens = prompts.msg(200)
        s.add_request(Request("r", tokens, max_tokens=16))

        s.step()  # refused: held (vLLM's "ask again"), nothing scheduled
        assert s.steps[-1][0] == [] and s.waiting[0].request_id == "r"
        assert side.counters["admission_refused"] == 1
        hold = side.admit_gate.holds["r"]
        assert hold.decision == "refused" and "system-prompt" in hold.blocking and hold.retry_at == clock.now + 0.5
        s.step()  # before the retry time: held again without asking
        assert side.counters["admission_refused"] == 1 and s.steps[-1][0] == []
        clock.now += 1.0
        s.step()  # asked again: still refused, still within admit_max_wait_s
        assert side.counters["admission_refused"] == 2 and s.steps[-1][0] == []
        clock.now += 5.0
        s.step()  # waited 6 s >= 5 s: served anyway (and counted)
        assert [x.request.request_id for x in s.steps[-1][0]] == ["r"]
        adm = s.outputs["r"]["sidecar"]["admission"]
        assert adm["decision"] == "refused" and adm["overridden"] is True and adm["waited_s"] == 6.0, adm
        assert "system-prompt" in adm["blocking_claim_ids"] and adm["blocks"] == -(-(len(tokens) + 16) // 16)
        assert side.counters["admission_overridden"] == 1 and side.admit_gate.holds == {}

        assert c.release_claim("system-prompt").state == "released"
    s.add_request(Request("after", prompts.msg(200)))
    s.add_request(Request("short", prompts.msg(20)))  # under admit_min_tokens: not asked
    s.step()
    adm = s.outputs["after"]["sidecar"]["admission"]
    assert adm["decision"] == "admitted" and adm["waited_s"] == 0 and not adm["blocking_claim_ids"], adm
    assert "admission" not in s.outputs["short"]["sidecar"]
    assert side.counters["admission_admitted"] == 1


def test_a_sidecar_that_does_not_answer_admits(engine, closed_target, prompts):
    """Admission never holds a request because the sidecar is down."""
    side, worker = engine(sidecar=closed_target, timeout_s=1.0, **GATE)
    s = FakeScheduler(side, worker)
    s.add_request(Request("r", prompts.msg(100)))
    s.step()
    assert s.outputs["r"]["sidecar"]["admission"] == {"decision": "unanswered", "blocks": -(-(101 + 1) // 16)}
    assert side.counters["admission_unanswered"] == 1


def test_without_the_scheduler_plug_in_no_pool_is_reported(engine, sidecar_target, prompts):
    """The pool comes from the scheduler plug-in: without it the gate still asks ``AdmitActive``
    but sends no ``ReportPool``."""
    side, worker = engine(tenant="team-nopool", **GATE)
    s = FakeScheduler(side, worker, bind=False)
    calls: list[str] = []
    real = side.link.call
    side.link.call = lambda what, tenant, fn: (calls.append(what), real(what, tenant, fn))[1]
    s.add_request(Request("r", prompts.msg(100)))
    s.step()
    assert calls[:1] == ["admit_active"] and "report_pool" not in calls
    assert s.outputs["r"]["sidecar"]["admission"]["decision"] == "admitted"
