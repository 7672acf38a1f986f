"""Typed results: each converter reads every field of its wire message (proto names, domain
enums, tuples for repeated fields, no proof where none was sent)."""

from __future__ import annotations

import dataclasses

import pytest

from sidecar.claims import Admit, CapacityProof, Decision, ProtectionMode
from sidecar.sdk.results import (
    AdmitActiveResult,
    ClaimDecision,
    ClaimInfo,
    ImportResult,
    ReportPoolResult,
    SidecarStats,
    StoreResult,
    WatchedEvent,
)
from sidecar.v1 import sidecar_pb2 as pb


def _info_msg() -> pb.ClaimInfo:
    return pb.ClaimInfo(
        claim_id="c1", mode=pb.CLAIM_MODE_DEMOTABLE, state="materialized", footprint_blocks=4, footprint_bytes=4096,
        predicate_min_tokens=48, leading_tokens=64, surviving_chunks=3, total_chunks=4, materialized=True,
        expires_in_s=-1.0, reason="", chunk_hashes=[7, 8, 9, 10],
    )


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_every_wire_field_has_a_typed_field():
    for cls, msg in [(ClaimInfo, pb.ClaimInfo), (ClaimDecision, pb.ClaimDecision), (AdmitActiveResult, pb.AdmitActiveResponse),
                     (WatchedEvent, pb.ClaimEvent), (ReportPoolResult, pb.ReportPoolResponse),
                     (SidecarStats, pb.StatsResponse), (ImportResult, pb.ImportManifestResponse),
                     (StoreResult, pb.StoreResponse)]:
        assert _fields(cls) == {f.name for f in msg.DESCRIPTOR.fields}, cls.__name__


def test_claim_info_and_decision():
    info = ClaimInfo.from_wire(_info_msg())
    assert info == ClaimInfo(
        claim_id="c1", mode=ProtectionMode.DEMOTABLE, state="materialized", footprint_blocks=4, footprint_bytes=4096,
        predicate_min_tokens=48, leading_tokens=64, surviving_chunks=3, total_chunks=4, materialized=True,
        expires_in_s=-1.0, reason="", chunk_hashes=(7, 8, 9, 10),
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.state = "released"  # type: ignore[misc]
    for wire, want in [(pb.CLAIM_DECISION_ACCEPTED, Decision.ACCEPTED), (pb.CLAIM_DECISION_REJECTED, Decision.REJECTED),
                       (pb.CLAIM_DECISION_CONDITIONALLY_ACCEPTED, Decision.CONDITIONALLY_ACCEPTED)]:
        d = ClaimDecision.from_wire(pb.ClaimDecision(decision=wire, reason="C1", claim=_info_msg()))
        assert (d.decision, d.reason, d.claim) == (want, "C1", info)


def test_admission_with_and_without_proof():
    msg = pb.AdmitActiveResponse(
        decision=pb.ADMIT_DECISION_DEFERRED, blocking_claim_ids=["a", "b"], blocking_other_tenants=2,
        proof=pb.CapacityProof(resident=60, active=70, usable=80, shortfall=50, unit="blocks", free=5),
        demoted_claim_ids=["d"], reason="wait", retry_after_s=0.5,
    )
    adm = AdmitActiveResult.from_wire(msg)
    assert adm == AdmitActiveResult(
        decision=Admit.DEFERRED, blocking_claim_ids=("a", "b"), blocking_other_tenants=2,
        proof=CapacityProof(resident=60, active=70, usable=80, unit="blocks", free=5), demoted_claim_ids=("d",),
        reason="wait", retry_after_s=0.5,
    )
    assert adm.proof.shortfall == 50
    bare = AdmitActiveResult.from_wire(pb.AdmitActiveResponse(decision=pb.ADMIT_DECISION_ADMITTED))
    assert (bare.decision, bare.proof, bare.blocking_claim_ids) == (Admit.ADMITTED, None, ())


def test_watched_event():
    ev = WatchedEvent.from_wire(pb.ClaimEvent(
        seq=9, event="active_refused", request_id="r", time=1.5, blocking_claim_ids=["c"],
        proof=pb.CapacityProof(resident=1, active=2, usable=2, shortfall=1, unit="blocks"), reason="x",
        mode=pb.CLAIM_MODE_UNSPECIFIED,
    ))
    assert (ev.seq, ev.event, ev.request_id, ev.time, ev.blocking_claim_ids, ev.mode) == (
        9, "active_refused", "r", 1.5, ("c",), None)
    assert (ev.proof.resident, ev.proof.active, ev.proof.usable, ev.proof.shortfall) == (1, 2, 2, 1)
    dropped = WatchedEvent.from_wire(pb.ClaimEvent(seq=3, event="watcher_dropped", gap=6))
    assert (dropped.gap, dropped.proof) == (6, None)


def test_stats():
    msg = pb.StatsResponse(
        version="1.2", registry=pb.RegistryStats(entries=5, bytes=50, capacity_entries=10, capacity_bytes=100,
                                                 evictions=1, hits=2, verify_failures=0),
        lookups=3, lookup_tokens=30, recovered_prefix_tokens=1, recovered_exact_tokens=2, recovered_shifted_tokens=3,
        prefill_tokens=4, uptime_s=9.5, checksum_failures=0, pins_in_flight=0, claims_active=2,
        tiers=[pb.TierStats(tier="cpu", bytes=50, objects=5, capacity_bytes=100, hits=2, misses=1),
               pb.TierStats(tier="disk")],
    )
    st = SidecarStats.from_wire(msg)
    assert (st.version, st.registry.entries, st.registry.evictions, st.lookups, st.uptime_s, st.claims_active) == (
        "1.2", 5, 1, 3, 9.5, 2)
    assert [(t.tier, t.objects, t.hits, t.misses) for t in st.tiers] == [("cpu", 5, 2, 1), ("disk", 0, 0, 0)]
    for cls, m in [(type(st.registry), pb.RegistryStats), (type(st.tiers[0]), pb.TierStats)]:
        assert _fields(cls) == {f.name for f in m.DESCRIPTOR.fields}


def test_store_and_import_results():
    import numpy as np

    s = StoreResult.from_wire(pb.StoreResponse(chunks_total=3, chunks_registered=2, chunks_refreshed=1,
                                               chunks_observed=0, chunks_stored=2,
                                               chunk_bounds=np.array([0, 16, 40], "<u4").tobytes()))
    assert s == StoreResult(3, 2, 1, 0, 2, (0, 16, 40))
    r = ImportResult.from_wire(pb.ImportManifestResponse(lines=5, prefetched=1, planned=2, present=1, malformed=1,
                                                         refused=0, warmup_pending=2))
    assert r == ImportResult(5, 1, 2, 1, 1, 0, 2)
    assert ReportPoolResult.from_wire(pb.ReportPoolResponse(protected_resident_blocks=7)).protected_resident_blocks == 7
