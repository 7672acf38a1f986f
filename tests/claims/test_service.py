"""ClaimsService (sidecar.claims.service) on real parts (registry, tiers, ledger, sessions):
claim objects resolved and checked before the ledger changes, AdmitActive refusals counted in
plain counters that the server's edge drains into its metrics."""

from __future__ import annotations

import pytest

from sidecar.app import build
from sidecar.claims import PoolReport, ProtectionMode
from sidecar.claims.service import ClaimsCounters, ClaimsService
from sidecar.errors import InvalidArgument, NotFound
from tests.claims.helpers import IDENT, blocks, config


def service() -> ClaimsService:
    parts = build(config(16))
    # the domain service alone, on the wired ledger, index and sessions: no server edge drains it
    return ClaimsService(parts.config.claims, parts.index, parts.claims.ledger, parts.sessions)


def claim(svc: ClaimsService, tenant: str, cid: str, **kw):
    args = dict(mode=ProtectionMode.DEMOTABLE, shared=False, identity=IDENT, duration_s=10.0,
                predicate_min_tokens=0, footprint_blocks=1)
    return svc.claim(tenant, cid, **(args | kw))


def test_admit_refusal_counted_in_plain_counters():
    svc = service()
    announced = []
    svc.on_count = lambda: announced.append(svc.counters.admit_refusals)
    svc.report_pool(PoolReport(usable_blocks=4, free_blocks=4, block_size=16, hard_protection=True))
    claim(svc, "t1", "hard", mode=ProtectionMode.HARD_PROTECTED, tokens=blocks(3, 0), footprint_blocks=3)
    assert svc.admit("t1", "r1", 1).decision.value == "admitted"
    assert svc.counters == ClaimsCounters() and announced == []
    with pytest.raises(InvalidArgument, match="^active_live_blocks"):
        svc.admit("t1", "r2", 0)
    assert svc.admit("t1", "r3", 2).decision.value == "refused"
    assert announced == [1]  # announced at once, so the edge drains it before the call returns
    assert svc.counters.take() == ClaimsCounters(admit_refusals=1)
    assert svc.counters == ClaimsCounters()


def test_claim_objects_tokens_session_and_hashes():
    svc = service()
    toks = blocks(2, 0)
    _, _, c = claim(svc, "t1", "c1", tokens=toks, footprint_blocks=2)
    assert len(c.keys) == 2 and c.min_tokens == 32
    info = svc.sessions.open("t1", toks, 16)
    _, _, c2 = claim(svc, "t1", "c2", session_id=info.session_id, predicate_min_tokens=16)
    assert c2.keys == c.keys[:1]
    with pytest.raises(InvalidArgument, match="^duration_s"):
        claim(svc, "t1", "c3", mode=ProtectionMode.EXPIRING, tokens=toks, duration_s=None)
    with pytest.raises(InvalidArgument, match="^tokens: empty object"):
        claim(svc, "t1", "c4", tokens=toks[:0])
    with pytest.raises(InvalidArgument, match=r"^chunk_hashes\[0\]"):  # another tenant's chunk reads as unknown
        claim(svc, "t2", "c5", chunk_hashes=(c.keys[0],))
    with pytest.raises(NotFound):
        svc.get("t2", "c1")  # and so does another tenant's claim
    got = svc.get("t1", "c1")
    assert 0 < svc.expires_in(got) <= 10.0
