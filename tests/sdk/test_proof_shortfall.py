"""A capacity proof's ``shortfall`` reaches the SDK's user as the server sent it, never
recomputed on the client side from the other fields."""

from __future__ import annotations

import grpc

from sidecar.api.claims import proof_from_wire
from sidecar.claims import Admit, CapacityProof
from sidecar.client import SidecarClient
from sidecar.sdk.results import AdmitActiveResult, WatchedEvent
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc
from tests.claims.helpers import BLOCK, IDENT, blocks, start, store

# 1 + 2 - 2 = 1 by the formula; the server says 7 (a server that counts differently wins)
ODD = pb.CapacityProof(resident=1, active=2, usable=2, shortfall=7, unit="blocks", free=3)


def test_the_servers_shortfall_is_kept_when_it_differs_from_the_recomputation():
    adm = AdmitActiveResult.from_wire(pb.AdmitActiveResponse(decision=pb.ADMIT_DECISION_REFUSED, proof=ODD))
    ev = WatchedEvent.from_wire(pb.ClaimEvent(seq=1, event="active_refused", proof=ODD))
    for p in (adm.proof, ev.proof, proof_from_wire(ODD)):
        assert (p.resident, p.active, p.usable, p.shortfall, p.unit, p.free) == (1, 2, 2, 7, "blocks", 3)
        assert p.as_dict()["shortfall"] == 7
        assert "(shortfall 7)" in p.text()
    assert proof_from_wire(pb.CapacityProof(resident=5, active=1, usable=9, unit="bytes")).shortfall == 0


def test_a_proof_built_on_the_server_derives_its_shortfall():
    assert CapacityProof(resident=60, active=70, usable=80, unit="blocks").shortfall == 50
    assert CapacityProof(resident=6, active=7, usable=80, unit="blocks").shortfall == 0


async def test_the_sdk_shows_the_shortfall_a_real_server_answers():
    """AdmitActive and the active_refused event it emits, read through the SDK and through the
    raw stubs from one real server: the same proofs, shortfall included."""
    server, target = await start(80)
    resident = blocks(60, 1_000)
    try:
        async with SidecarClient(target, tenant="t1") as c, grpc.aio.insecure_channel(target) as ch:
            await store(c, resident)
            await c.claim("claim:resident", identity=IDENT, mode="hard_protected", tokens=resident)
            await c.report_pool(usable_blocks=80, free_blocks=80, block_size=BLOCK, hard_protection=True)
            adm = await c.admit_active("active", 70)
            raw = pb_grpc.KVSidecarStub(ch)
            md = (("x-tenant-id", "t1"),)
            wire = await raw.AdmitActive(pb.AdmitActiveRequest(request_id="active", active_live_blocks=70), metadata=md)
            assert adm.decision is Admit.REFUSED and wire.decision == pb.ADMIT_DECISION_REFUSED
            assert wire.proof.shortfall == 50
            assert (adm.proof.resident, adm.proof.active, adm.proof.usable, adm.proof.shortfall) == (
                wire.proof.resident, wire.proof.active, wire.proof.usable, wire.proof.shortfall)
            sdk_events = [e async for e in c.watch_events()]
            wire_events = [e async for e in raw.WatchEvents(pb.WatchEventsRequest(), metadata=md)]
            refused = [(e.seq, e.proof.shortfall) for e in sdk_events if e.event == "active_refused"]
            assert refused == [(e.seq, e.proof.shortfall) for e in wire_events if e.event == "active_refused"]
            assert [s for _, s in refused] == [50, 50]
    finally:
        await server.stop(0.1)
