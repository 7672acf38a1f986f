"""What the SDK's calls return: frozen dataclasses, one per answer, never a protobuf message.

Field names mirror the proto's (``sidecar.proto``), so code written against the wire messages
reads the same; enums become the domain's (``Decision``, ``ProtectionMode``, ``Admit``), a
capacity proof becomes ``sidecar.claims.CapacityProof`` (with the server's ``shortfall`` as
sent, never recomputed), repeated fields become tuples. Each type with a wire form converts it with ``from_wire`` (the response
converter the RPC table in ``sidecar.sdk.rpcs`` names). The answers that are already domain
types (``LookupPlan``, ``SessionState``, ``OpPlan``) convert in ``sidecar.api``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

import sidecar.api.claims as claims_wire
import sidecar.api.kv as kv_wire
import sidecar.api.manifests as manifests_wire
from sidecar.api.claims import ADMIT_FROM_WIRE, DECISION_FROM_WIRE, MODE_FROM_WIRE, proof_from_wire
from sidecar.claims import Admit, CapacityProof, Decision, ProtectionMode
from sidecar.identity import CacheIdentity

_U32 = np.dtype("<u4")


# ------------------------------------------------------------------------------- KV data


@dataclass(frozen=True, slots=True)
class StoreResult:
    """``store``: what became of the sequence's chunks.

    ``chunks_total``: chunks of the whole sequence; ``chunks_registered``: newly registered;
    ``chunks_refreshed``: already registered, recency refreshed; ``chunks_observed``: before
    ``register_from`` (counted, not registered); ``chunks_stored``: payloads stored and verified
    by this call; ``chunk_bounds``: the chunk starts (token positions) of the sequence, the keys
    ``payloads`` of a later Store use."""

    chunks_total: int
    chunks_registered: int
    chunks_refreshed: int
    chunks_observed: int
    chunks_stored: int = 0
    chunk_bounds: tuple[int, ...] = ()

    @classmethod
    def from_wire(cls, msg: kv_wire.StoreResponse) -> StoreResult:
        return cls(msg.chunks_total, msg.chunks_registered, msg.chunks_refreshed, msg.chunks_observed,
                   msg.chunks_stored, tuple(np.frombuffer(msg.chunk_bounds, dtype=_U32).tolist()))


@dataclass(frozen=True, slots=True)
class FetchedKV:
    """One fetched chunk: ``data`` is its payload (``KVLayout`` order) for ``num_tokens``
    tokens; when ``rotated`` its rotary parts sit at ``target_pos``, else at ``source_pos``
    (rotate by ``delta`` yourself). ``ok`` is False for a miss: prefill those tokens.
    ``data`` is a writable memoryview the caller owns; the payloads of one call share 16 MiB
    blocks, or the call's shared-memory buffer, so keeping one alive keeps its block or buffer
    (copy what you keep for long)."""

    index: int
    chunk_hash: int
    ok: bool
    num_tokens: int = 0
    source_pos: int = 0
    delta: int = 0
    rotated: bool = False
    tier: str = ""
    data: memoryview = field(default_factory=lambda: memoryview(bytearray()))


@dataclass(frozen=True, slots=True)
class FetchedRun:
    """One run of a held session's KV (``fetch_session``): positions ``[target_pos,
    target_pos + num_tokens)`` of the session at ``version``, held as rows ``[chunk_offset,
    chunk_offset + num_tokens)`` of the stored chunk ``chunk_hash``, computed at
    ``source_pos ..``. ``data`` is the payload of those rows (``KVLayout`` order, ``num_tokens``
    tokens); when ``rotated`` its rotary parts sit at ``target_pos ..`` (rotated once by
    ``delta`` from the canonical copy), else at ``source_pos ..`` (raw: rotate by ``delta``)."""

    index: int
    target_pos: int
    num_tokens: int
    chunk_hash: int
    chunk_offset: int
    source_pos: int
    delta: int
    rotated: bool
    tier: str
    version: int
    data: memoryview = field(default_factory=lambda: memoryview(bytearray()))


# ---------------------------------------------------------------------------- operations


@dataclass(frozen=True, slots=True)
class RegistryCounters:
    """``stats().registry``: the caller's view of the chunk registry."""

    entries: int  # chunks registered
    bytes: int  # their payload bytes
    capacity_entries: int
    capacity_bytes: int
    evictions: int
    hits: int
    verify_failures: int  # fingerprint matched but tokens did not (collision or attack)

    @classmethod
    def from_wire(cls, msg: kv_wire.RegistryStats) -> RegistryCounters:
        return cls(msg.entries, msg.bytes, msg.capacity_entries, msg.capacity_bytes, msg.evictions, msg.hits,
                   msg.verify_failures)


@dataclass(frozen=True, slots=True)
class TierCounters:
    """``stats().tiers[i]``: one storage tier (``"cpu"``, ``"disk"``, ``"remote"``, ...)."""

    tier: str
    bytes: int  # payload bytes held
    objects: int  # chunks held
    capacity_bytes: int
    hits: int
    misses: int

    @classmethod
    def from_wire(cls, msg: kv_wire.TierStats) -> TierCounters:
        return cls(msg.tier, msg.bytes, msg.objects, msg.capacity_bytes, msg.hits, msg.misses)


@dataclass(frozen=True, slots=True)
class SidecarStats:
    """``stats()``: counters since the sidecar started, scoped to the caller's tenant where the
    server scopes them (an operator token sees every tenant). Token counts are tokens."""

    version: str  # the server's version
    registry: RegistryCounters
    lookups: int
    lookup_tokens: int
    recovered_prefix_tokens: int
    recovered_exact_tokens: int
    recovered_shifted_tokens: int
    prefill_tokens: int
    uptime_s: float
    tiers: tuple[TierCounters, ...]
    checksum_failures: int
    pins_in_flight: int  # tier read pins held now (0 when idle: no leak)
    claims_active: int  # claims of the caller's tenant not yet ended

    @classmethod
    def from_wire(cls, msg: kv_wire.StatsResponse) -> SidecarStats:
        return cls(
            version=msg.version, registry=RegistryCounters.from_wire(msg.registry), lookups=msg.lookups,
            lookup_tokens=msg.lookup_tokens, recovered_prefix_tokens=msg.recovered_prefix_tokens,
            recovered_exact_tokens=msg.recovered_exact_tokens, recovered_shifted_tokens=msg.recovered_shifted_tokens,
            prefill_tokens=msg.prefill_tokens, uptime_s=msg.uptime_s,
            tiers=tuple(TierCounters.from_wire(t) for t in msg.tiers), checksum_failures=msg.checksum_failures,
            pins_in_flight=msg.pins_in_flight, claims_active=msg.claims_active,
        )


# ----------------------------------------------------------------------------- manifests


@dataclass(frozen=True, slots=True)
class ImportResult:
    """``import_manifest``: lines read and what became of their entries (docs/manifests.md):
    KV ``prefetched`` from a shared tier, entries ``planned`` for warm-up, already ``present``,
    ``malformed`` lines, entries ``refused`` (quota, scope), and the sequences the warm-up
    plan now holds (``warmup_pending``)."""

    lines: int
    prefetched: int
    planned: int
    present: int
    malformed: int
    refused: int
    warmup_pending: int

    @classmethod
    def from_wire(cls, msg: manifests_wire.ImportManifestResponse) -> ImportResult:
        return cls(msg.lines, msg.prefetched, msg.planned, msg.present, msg.malformed, msg.refused,
                   msg.warmup_pending)


@dataclass(frozen=True, slots=True)
class WarmUpResult:
    """``warm_up``: plan sequences prefilled, their tokens, and chunks the engine Stored."""

    sequences: int
    tokens: int
    chunks_stored: int


class WarmUpEngine(Protocol):
    """What ``warm_up`` needs from an engine: its ``identity`` and ``warm(tokens, shared)``,
    which prefills ``tokens`` once from position 0 and Stores their chunks (into the shared
    scope when ``shared``), returning how many chunks it stored. The reference engine
    (``clients.transformers.Engine``) implements it."""

    identity: CacheIdentity

    def warm(self, tokens: np.ndarray, *, shared: bool = False) -> int: ...


# -------------------------------------------------------------------------------- claims


def _proof(msg: Any) -> CapacityProof | None:
    return proof_from_wire(msg.proof) if msg.HasField("proof") else None


@dataclass(frozen=True, kw_only=True, slots=True)
class ClaimInfo:
    """A claim as the sidecar holds it now (docs/claims.md, "Lifecycle")."""

    claim_id: str
    #: What the sidecar promises (``ProtectionMode``); None only for a claim the server knows
    #: under a mode this client does not.
    mode: ProtectionMode | None
    #: Lifecycle state, the domain ``State`` value: ``submitted`` | ``accepted`` |
    #: ``materialized`` | ``demoted`` | ``expired`` | ``refused`` | ``harmed`` | ``released``.
    state: str
    footprint_blocks: int  # engine-pool blocks the claim protects (declared or derived)
    footprint_bytes: int  # tier bytes of the claim's chunks
    predicate_min_tokens: int  # materialized when a leading prefix of at least this many tokens is held
    leading_tokens: int  # the leading prefix held in the sidecar's tiers now, in tokens
    surviving_chunks: int  # the claim's chunks some tier holds now
    total_chunks: int  # the claim's chunks
    materialized: bool  # the predicate holds now
    expires_in_s: float  # seconds until expiry; < 0: no expiry
    reason: str  # why the last transition happened (refusal, demotion, harm), "" otherwise
    chunk_hashes: tuple[int, ...]  # the claim's chunks, position order

    @classmethod
    def from_wire(cls, msg: claims_wire.ClaimInfo) -> ClaimInfo:
        return cls(
            claim_id=msg.claim_id, mode=MODE_FROM_WIRE.get(msg.mode), state=msg.state,
            footprint_blocks=msg.footprint_blocks, footprint_bytes=msg.footprint_bytes,
            predicate_min_tokens=msg.predicate_min_tokens, leading_tokens=msg.leading_tokens,
            surviving_chunks=msg.surviving_chunks, total_chunks=msg.total_chunks, materialized=msg.materialized,
            expires_in_s=msg.expires_in_s, reason=msg.reason, chunk_hashes=tuple(msg.chunk_hashes),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ClaimDecision:
    """``claim``: the sidecar's decision and the claim it now holds (on rejection: the claim as
    submitted, state ``refused``)."""

    decision: Decision  # ACCEPTED | REJECTED | CONDITIONALLY_ACCEPTED (no obligation, or not yet materialized)
    reason: str  # why, when not plainly accepted (names the failed check, e.g. "C1")
    claim: ClaimInfo

    @classmethod
    def from_wire(cls, msg: claims_wire.ClaimDecision) -> ClaimDecision:
        return cls(decision=DECISION_FROM_WIRE[msg.decision], reason=msg.reason, claim=ClaimInfo.from_wire(msg.claim))


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportPoolResult:
    """``report_pool``: the engine-pool blocks the caller's live claims protect now."""

    protected_resident_blocks: int

    @classmethod
    def from_wire(cls, msg: claims_wire.ReportPoolResponse) -> ReportPoolResult:
        return cls(protected_resident_blocks=msg.protected_resident_blocks)


@dataclass(frozen=True, kw_only=True, slots=True)
class AdmitActiveResult:
    """``admit_active``: may a request holding ``active_live_blocks`` at its peak run now?"""

    decision: Admit  # ADMITTED | DEFERRED (retry after ``retry_after_s``) | REFUSED
    blocking_claim_ids: tuple[str, ...]  # the caller's own claims in the way
    blocking_other_tenants: int  # claims of other tenants in the way (ids not shown)
    proof: CapacityProof | None  # resident + active <= usable, in engine-pool blocks
    demoted_claim_ids: tuple[str, ...]  # demotable claims relaxed to admit this request
    reason: str
    retry_after_s: float  # DEFERRED: a hint, seconds; 0 otherwise

    @classmethod
    def from_wire(cls, msg: claims_wire.AdmitActiveResponse) -> AdmitActiveResult:
        return cls(
            decision=ADMIT_FROM_WIRE[msg.decision], blocking_claim_ids=tuple(msg.blocking_claim_ids),
            blocking_other_tenants=msg.blocking_other_tenants, proof=_proof(msg),
            demoted_claim_ids=tuple(msg.demoted_claim_ids), reason=msg.reason, retry_after_s=msg.retry_after_s,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class WatchedEvent:
    """One claim or arbitration event from ``watch_events``, in ``seq`` order."""

    seq: int  # global event number (resume a watch with ``since_seq=seq + 1``)
    #: ``claim_accepted`` | ``claim_materialized`` | ``claim_demoted`` | ``claim_expired`` |
    #: ``claim_harmed`` | ``claim_released`` | ``claim_refused`` | ``active_admitted`` |
    #: ``active_deferred`` | ``active_refused`` | ``watcher_dropped`` (the last of its stream)
    event: str
    claim_id: str  # claim events
    request_id: str  # active_* events
    time: float  # unix seconds
    blocking_claim_ids: tuple[str, ...]
    proof: CapacityProof | None  # arbitration events
    leading_tokens: int
    predicate_min_tokens: int
    reason: str
    gap: int  # watcher_dropped / a resume past the buffer: events missed
    mode: ProtectionMode | None  # claim events: the claim's mode

    @classmethod
    def from_wire(cls, msg: claims_wire.ClaimEventMsg) -> WatchedEvent:
        return cls(
            seq=msg.seq, event=msg.event, claim_id=msg.claim_id, request_id=msg.request_id, time=msg.time,
            blocking_claim_ids=tuple(msg.blocking_claim_ids), proof=_proof(msg), leading_tokens=msg.leading_tokens,
            predicate_min_tokens=msg.predicate_min_tokens, reason=msg.reason, gap=msg.gap,
            mode=MODE_FROM_WIRE.get(msg.mode),
        )


__all__ = [
    "AdmitActiveResult", "ClaimDecision", "ClaimInfo", "FetchedKV", "FetchedRun", "ImportResult", "RegistryCounters",
    "ReportPoolResult", "SidecarStats", "StoreResult", "TierCounters", "WarmUpEngine", "WarmUpResult",
    "WatchedEvent",
]
