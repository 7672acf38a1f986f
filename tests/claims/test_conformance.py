"""The seed's resident-claim conformance suite (003, section 5.4) over a real sidecar.

One block = one 16-token chunk = one 8 KiB slot of the sidecar's only tier; the engine pool
is the one the engine reports (``ReportPool``). Canonical case: 60 resident + 70 active > 80."""

from __future__ import annotations

import pytest

from sidecar.claims import Admit, Conformance, Decision, ProtectionMode, classify_lowering
from sidecar.client import SidecarClient
from sidecar.errors import ResourceExhausted
from tests.claims.helpers import BLOCK, IDENT, SLOT, blocks, events, held_blocks, start, store

RESIDENT = blocks(60, 1_000)
ACTIVE = blocks(70, 50_000)


async def _run(fn, usable=80, **kw):
    server, target = await start(usable, **kw)
    try:
        async with SidecarClient(target, tenant="t1") as c:
            return await fn(server, c)
    finally:
        await server.stop(0.1)


async def test_l1_no_accepted_claim_no_harm():
    async def body(server, c):
        await store(c, RESIDENT)
        assert held_blocks(server, RESIDENT) == (60, 60)
        await store(c, ACTIVE)  # native eviction: active is served by evicting residents
        leading, held = held_blocks(server, RESIDENT)
        assert (leading, held) == (0, 10)  # 50 resident victims, LRU first: the leading prefix is gone
        assert held_blocks(server, ACTIVE) == (70, 70)
        evs = await events(c)
        assert evs == []  # no claim was accepted: ordinary eviction, no claim_harmed
    await _run(body)


async def test_l2_write_no_admit_does_not_protect_residents():
    async def body(server, c):
        await store(c, RESIDENT)
        res = await store(c, ACTIVE)  # the active KV occupies the pool while it is served ...
        assert res.chunks_stored == 70
        await c.delete([h for h in (await c.lookup(ACTIVE, identity=IDENT, dry_run=True)).hits()
                        for h in [h.chunk_hash]])  # ... and is not admitted for future reuse
        assert held_blocks(server, ACTIVE) == (0, 0)  # future reuse denied
        assert held_blocks(server, RESIDENT) == (0, 10)  # residents still lost (50 victims)
        assert [e.event for e in await events(c)] == []
    await _run(body)


async def test_l3_hard_claim_infeasibility_refuses_active_with_attribution():
    async def body(server, c):
        await store(c, RESIDENT)
        d = await c.claim("claim:resident", identity=IDENT, mode="hard_protected", tokens=RESIDENT)
        assert d.decision == Decision.ACCEPTED and d.claim.state == "materialized"
        assert d.claim.leading_tokens == 60 * BLOCK
        # Engine pool: 80 usable blocks, nothing running.
        await c.report_pool(usable_blocks=80, free_blocks=80, block_size=BLOCK, hard_protection=True)
        adm = await c.admit_active("active", 70)
        assert adm.decision == Admit.REFUSED
        assert list(adm.blocking_claim_ids) == ["claim:resident"]
        p = adm.proof
        assert (p.resident, p.active, p.usable, p.shortfall, p.unit) == (60, 70, 80, 50, "blocks")
        # The sidecar's own tier: a Store of the 70 active blocks cannot fit either.
        with pytest.raises(ResourceExhausted) as err:
            await store(c, ACTIVE)
        assert err.value.blocking_claim_ids == ("claim:resident",)
        proof = err.value.capacity_proof
        assert proof == {"resident": 60 * SLOT, "active": 70 * SLOT, "usable": 80 * SLOT, "shortfall": 50 * SLOT,
                         "unit": "bytes", "free": 0}
        assert "claim:resident" in str(err.value) and "shortfall" in str(err.value)
        assert held_blocks(server, RESIDENT) == (60, 60)  # resident preserved
        assert held_blocks(server, ACTIVE) == (0, 0)  # the refused Store left nothing behind
        info = await c.get_claim("claim:resident")
        assert info.state == "materialized" and info.materialized
        assert "claim_harmed" not in [e.event for e in await events(c)]
    await _run(body)


@pytest.mark.parametrize("relax", ["demote", "expire"])
async def test_l4_l5_loss_after_demotion_or_expiry_is_not_harm(relax):
    async def body(server, c):
        await store(c, RESIDENT)
        mode = "expiring" if relax == "expire" else "hard_protected"
        now = [1000.0]
        server.claims.ledger.clock = lambda: now[0]
        await c.claim("claim:resident", identity=IDENT, mode=mode, tokens=RESIDENT, duration_s=30.0)
        if relax == "demote":
            info = await c.demote_claim("claim:resident", "operator relaxed it")
            assert info.state == "demoted"
        else:
            now[0] += 31.0
            info = await c.get_claim("claim:resident")
            assert info.state == "expired"
        res = await store(c, ACTIVE)  # now the Store may evict the residents
        assert res.chunks_stored == 70
        assert held_blocks(server, RESIDENT) == (0, 10)
        evs = [e.event for e in await events(c)]
        ended = "claim_demoted" if relax == "demote" else "claim_expired"
        assert evs == ["claim_accepted", "claim_materialized", ended]  # the release preceded the loss
        assert (await c.get_claim("claim:resident")).state == ("demoted" if relax == "demote" else "expired")
    await _run(body)


async def test_l6_surviving_blocks_failing_the_leading_prefix_predicate():
    async def body(server, c):
        await store(c, RESIDENT[BLOCK:])  # blocks 1..59 survive; block 0 does not
        d = await c.claim("claim:resident", identity=IDENT, mode="hard_protected", tokens=RESIDENT,
                          predicate_min_tokens=60 * BLOCK)
        assert d.decision == Decision.CONDITIONALLY_ACCEPTED
        info = d.claim
        # Chunk keys include the prefix digest? No: content chunks of a fixed grid, so the 59
        # Stored blocks are the claim's blocks 1..59.
        assert (info.surviving_chunks, info.leading_tokens, info.predicate_min_tokens, info.materialized) == (
            59, 0, 60 * BLOCK, False)
        assert info.state == "accepted"
        assert [e.event for e in await events(c)] == ["claim_accepted"]  # accepted, never materialized
        await store(c, RESIDENT)  # block 0 arrives: the predicate holds now
        info = await c.get_claim("claim:resident")
        assert info.materialized and info.state == "materialized" and info.leading_tokens == 60 * BLOCK
    await _run(body)


async def test_l7_trace_reconstruction_from_events_alone():
    async def body(server, c):
        await store(c, RESIDENT)
        await c.claim("claim:resident", identity=IDENT, mode="hard_protected", tokens=RESIDENT)
        await c.report_pool(usable_blocks=80, free_blocks=80, block_size=BLOCK, hard_protection=True)
        await c.admit_active("active", 70)
        # An observer with nothing but the event stream:
        trace = await events(c)
        accepted = {e.claim_id for e in trace if e.event == "claim_accepted"}
        materialized = {e.claim_id for e in trace if e.event == "claim_materialized"}
        conflicts = [e for e in trace if e.event in ("active_refused", "active_deferred")]
        harmed = [e for e in trace if e.event == "claim_harmed"]
        assert accepted == {"claim:resident"} and materialized == {"claim:resident"}
        assert len(conflicts) == 1 and conflicts[0].event == "active_refused"
        conflict = conflicts[0]
        assert conflict.request_id == "active" and list(conflict.blocking_claim_ids) == ["claim:resident"]
        p = conflict.proof
        assert (p.resident, p.active, p.resident + p.active, p.usable, p.shortfall) == (60, 70, 130, 80, 50)
        assert "infeasible_preserve_resident_and_active" in conflict.reason
        assert harmed == []  # outcome: resident preserved, active refused
        assert [e.seq for e in trace] == sorted(e.seq for e in trace)
    await _run(body)


def test_c1_capability_classification():
    assert classify_lowering(ProtectionMode.HARD_PROTECTED, ProtectionMode.SOFT_PRIORITY) is Conformance.UNSOUND
    assert classify_lowering(ProtectionMode.DEMOTABLE, ProtectionMode.SOFT_PRIORITY) is Conformance.UNSOUND
    assert classify_lowering(ProtectionMode.SOFT_PRIORITY, ProtectionMode.SOFT_PRIORITY) is Conformance.APPROXIMATE
    assert classify_lowering(ProtectionMode.HARD_PROTECTED, ProtectionMode.HARD_PROTECTED) is Conformance.SOUND


async def test_c1_soft_priority_is_never_accepted_as_a_lowering_of_a_hard_claim():
    async def body(server, c):
        await store(c, RESIDENT)
        # An engine pool that can only rank victims: a hard claim is rejected, not downgraded.
        await c.report_pool(usable_blocks=80, free_blocks=80, block_size=BLOCK, hard_protection=False)
        d = await c.claim("h", identity=IDENT, mode="hard_protected", tokens=RESIDENT)
        assert d.decision == Decision.REJECTED and "C1" in d.reason
        with pytest.raises(Exception):
            await c.get_claim("h")  # a rejected claim holds nothing
        soft = await c.claim("s", identity=IDENT, mode="soft_priority", tokens=RESIDENT)
        assert soft.decision == Decision.CONDITIONALLY_ACCEPTED
        # With victim exclusion available: a live hard claim is never lowered by resubmitting it soft.
        await c.report_pool(usable_blocks=80, free_blocks=80, block_size=BLOCK, hard_protection=True)
        assert (await c.claim("h", identity=IDENT, mode="hard_protected", tokens=RESIDENT)).decision == \
            Decision.ACCEPTED
        again = await c.claim("h", identity=IDENT, mode="soft_priority", tokens=RESIDENT)
        assert again.decision == Decision.REJECTED and "C1" in again.reason
        assert (await c.get_claim("h")).mode == ProtectionMode.HARD_PROTECTED
        # A soft claim on the same chunks does not weaken the hard one: the Store is still refused.
        with pytest.raises(ResourceExhausted):
            await store(c, ACTIVE)
        assert held_blocks(server, RESIDENT) == (60, 60)
    await _run(body)
