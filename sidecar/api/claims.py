"""Resident claims on the wire: requests -> domain values, ``Claim`` / ``AdmissionVerdict`` /
``ClaimEvent`` -> messages (docs/claims.md).

Every function here validates what it reads and names the field in the ``InvalidArgument`` it
raises; none of them changes anything.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sidecar.api.kv import identity_to_wire, tokens_to_wire
from sidecar.claims import Admit, ClaimEvent, Decision, ProtectionMode
from sidecar.claims.model import CapacityProof, Claim
from sidecar.errors import InvalidArgument
from sidecar.identity import CacheIdentity
from sidecar.v1 import sidecar_pb2 as pb

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "ClaimObject", "MODE_FROM_WIRE", "MODE_TO_WIRE", "admission_to_wire", "claim_id_from_wire", "claim_object_from_wire",
    "claim_to_wire", "decision_to_wire", "event_to_wire", "mode_from_wire", "proof_to_wire",
]

_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
MODE_FROM_WIRE = {
    pb.CLAIM_MODE_SOFT_PRIORITY: ProtectionMode.SOFT_PRIORITY,
    pb.CLAIM_MODE_HARD_PROTECTED: ProtectionMode.HARD_PROTECTED,
    pb.CLAIM_MODE_DEMOTABLE: ProtectionMode.DEMOTABLE,
    pb.CLAIM_MODE_OFFLOADABLE: ProtectionMode.OFFLOADABLE,
    pb.CLAIM_MODE_EXPIRING: ProtectionMode.EXPIRING,
    pb.CLAIM_MODE_BEST_EFFORT: ProtectionMode.BEST_EFFORT,
}
MODE_TO_WIRE = {m: w for w, m in MODE_FROM_WIRE.items()}
_DECISIONS = {
    Decision.ACCEPTED: pb.CLAIM_DECISION_ACCEPTED,
    Decision.REJECTED: pb.CLAIM_DECISION_REJECTED,
    Decision.CONDITIONALLY_ACCEPTED: pb.CLAIM_DECISION_CONDITIONALLY_ACCEPTED,
}
_ADMIT = {"admitted": pb.ADMIT_DECISION_ADMITTED, "deferred": pb.ADMIT_DECISION_DEFERRED,
          "refused": pb.ADMIT_DECISION_REFUSED}


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimObject:
    """What a ClaimRequest names: exactly one of ``chunk_hashes``, ``tokens`` (packed bytes, not
    yet decoded: the caller applies its token limit) or ``session_id``."""

    chunk_hashes: tuple[int, ...] = ()
    tokens: bytes = b""
    session_id: str = ""


def claim_id_from_wire(value: str, name: str = "claim_id") -> str:
    if not _ID.match(value):
        raise InvalidArgument(f"{name}: required, 1..128 characters of [A-Za-z0-9_.:-], got {value[:40]!r}")
    return value


def mode_from_wire(value: int) -> ProtectionMode:
    mode = MODE_FROM_WIRE.get(value)
    if mode is None:
        raise InvalidArgument(f"mode: required, one of {sorted(m.value for m in ProtectionMode)}")
    return mode


def claim_object_from_wire(req: pb.ClaimRequest) -> ClaimObject:
    given = [n for n, ok in (("chunk_hashes", len(req.chunk_hashes)), ("tokens", req.tokens),
                             ("session_id", req.session_id)) if ok]
    if len(given) != 1:
        raise InvalidArgument(f"chunk_hashes | tokens | session_id: exactly one object is required, got {given or 'none'}")
    return ClaimObject(chunk_hashes=tuple(req.chunk_hashes), tokens=req.tokens, session_id=req.session_id)


def proof_to_wire(p: CapacityProof | None) -> pb.CapacityProof | None:
    if p is None:
        return None
    return pb.CapacityProof(resident=p.resident, active=p.active, usable=p.usable, shortfall=p.shortfall,
                            unit=p.unit, free=p.free)


def claim_to_wire(c: Claim, expires_in_s: float) -> pb.ClaimInfo:
    return pb.ClaimInfo(
        claim_id=c.claim_id, mode=MODE_TO_WIRE[c.mode], state=c.state.value, footprint_blocks=c.footprint_blocks,
        footprint_bytes=c.footprint_bytes, predicate_min_tokens=c.min_tokens, leading_tokens=c.leading_tokens,
        surviving_chunks=c.surviving, total_chunks=len(c.keys), materialized=c.materialized,
        expires_in_s=expires_in_s, reason=c.reason, chunk_hashes=list(c.keys),
    )


def decision_to_wire(decision: Decision, reason: str, info: pb.ClaimInfo) -> pb.ClaimDecision:
    return pb.ClaimDecision(decision=_DECISIONS[decision], reason=reason, claim=info)


def admission_to_wire(adm, tenant: str, retry_after_s: float) -> pb.AdmitActiveResponse:
    """An ``AdmissionVerdict`` as ``tenant`` may see it: its own blocking and demoted claims by
    id, other tenants' only as a count."""
    own = [c.claim_id for c in adm.blocking if c.tenant == tenant]
    return pb.AdmitActiveResponse(
        decision=_ADMIT[adm.decision.value], blocking_claim_ids=own,
        blocking_other_tenants=len(adm.blocking) - len(own), proof=proof_to_wire(adm.proof),
        demoted_claim_ids=[c.claim_id for c in adm.demote if c.tenant == tenant], reason=adm.reason,
        retry_after_s=retry_after_s if adm.decision.value == "deferred" else 0.0,
    )


def event_to_wire(ev: ClaimEvent) -> pb.ClaimEvent:
    return pb.ClaimEvent(
        seq=ev.seq, event=ev.event, claim_id=ev.claim_id, request_id=ev.request_id, time=ev.time,
        blocking_claim_ids=list(ev.blocking_claim_ids), proof=proof_to_wire(ev.proof),
        leading_tokens=ev.leading_tokens, predicate_min_tokens=ev.predicate_min_tokens, reason=ev.reason,
        mode=MODE_TO_WIRE[ProtectionMode(ev.mode)] if ev.mode else pb.CLAIM_MODE_UNSPECIFIED,
    )


def dropped_to_wire(seq: int, gap: int, capacity: int) -> pb.ClaimEvent:
    """The one event a watcher that fell behind the buffer gets before its stream ends."""
    return pb.ClaimEvent(seq=seq, event="watcher_dropped", gap=gap,
                         reason=f"watcher fell {gap} events behind the buffer of {capacity}")


# ===================================================================================
# Client side (the SDK's): request builders and the answers' enums back to domain values.
# ===================================================================================

__all__ += [
    "ADMIT_FROM_WIRE", "DECISION_FROM_WIRE", "admit_active_request", "claim_request", "demote_claim_request",
    "get_claim_request", "proof_from_wire", "release_claim_request", "report_pool_request", "watch_events_request",
]

DECISION_FROM_WIRE = {w: d for d, w in _DECISIONS.items()}
ADMIT_FROM_WIRE = {w: Admit(v) for v, w in _ADMIT.items()}


def proof_from_wire(msg: pb.CapacityProof) -> CapacityProof:
    """The domain ``CapacityProof`` with the server's ``shortfall`` as sent (never recomputed)."""
    return CapacityProof(resident=msg.resident, active=msg.active, usable=msg.usable, unit=msg.unit, free=msg.free,
                         shortfall=msg.shortfall)


def claim_request(
    claim_id: str,
    identity: CacheIdentity,
    mode: ProtectionMode | str,
    *,
    chunk_hashes: Sequence[int] = (),
    tokens: np.ndarray | Sequence[int] | bytes | None = None,
    session_id: str = "",
    predicate_min_tokens: int = 0,
    duration_s: float | None = None,
    footprint_blocks: int = 0,
    shared: bool = False,
) -> pb.ClaimRequest:
    """A ``ClaimRequest``: ``chunk_hashes`` (position order), ``tokens`` or ``session_id``
    names the object; ``duration_s`` None leaves the server's default."""
    try:
        wire_mode = MODE_TO_WIRE[ProtectionMode(mode)]
    except ValueError:
        raise ValueError(f"mode: one of {sorted(m.value for m in ProtectionMode)}, got {mode!r}") from None
    req = pb.ClaimRequest(
        claim_id=claim_id, identity=identity_to_wire(identity), chunk_hashes=[int(h) for h in chunk_hashes],
        tokens=tokens_to_wire(tokens) if tokens is not None else b"", session_id=session_id,
        predicate_min_tokens=predicate_min_tokens, mode=wire_mode, footprint_blocks=footprint_blocks, shared=shared,
    )
    if duration_s is not None:
        req.duration_s = duration_s
    return req


def release_claim_request(claim_id: str) -> pb.ReleaseClaimRequest:
    return pb.ReleaseClaimRequest(claim_id=claim_id)


def demote_claim_request(claim_id: str, reason: str = "") -> pb.DemoteClaimRequest:
    return pb.DemoteClaimRequest(claim_id=claim_id, reason=reason)


def get_claim_request(claim_id: str) -> pb.GetClaimRequest:
    return pb.GetClaimRequest(claim_id=claim_id)


def report_pool_request(
    *, usable_blocks: int, free_blocks: int, block_size: int, hard_protection: bool, engine_id: str = ""
) -> pb.ReportPoolRequest:
    return pb.ReportPoolRequest(usable_blocks=usable_blocks, free_blocks=free_blocks, block_size=block_size,
                                hard_protection=hard_protection, engine_id=engine_id)


def admit_active_request(request_id: str, active_live_blocks: int) -> pb.AdmitActiveRequest:
    return pb.AdmitActiveRequest(request_id=request_id, active_live_blocks=active_live_blocks)


def watch_events_request(*, since_seq: int = 0, follow: bool = False) -> pb.WatchEventsRequest:
    return pb.WatchEventsRequest(since_seq=since_seq, follow=follow)


# The messages of this area's RPCs, for the server's handlers (which import no stubs).
AdmitActiveRequest = pb.AdmitActiveRequest
AdmitActiveResponse = pb.AdmitActiveResponse
ClaimDecision = pb.ClaimDecision
ClaimEventMsg = pb.ClaimEvent  # the domain type is ClaimEvent
ClaimInfo = pb.ClaimInfo
ClaimRequest = pb.ClaimRequest
DemoteClaimRequest = pb.DemoteClaimRequest
GetClaimRequest = pb.GetClaimRequest
ReleaseClaimRequest = pb.ReleaseClaimRequest
ReportPoolRequest = pb.ReportPoolRequest
ReportPoolResponse = pb.ReportPoolResponse
WatchEventsRequest = pb.WatchEventsRequest
