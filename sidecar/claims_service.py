"""Resident claims behind the gRPC servicer: wire <-> domain, validation, expiry sweeper.

The servicer's claim handlers are one line each; this module validates a request completely
before the ledger changes anything (INVALID_ARGUMENT names the field), resolves the claim
object to ordered chunk keys, and converts ``Claim`` / ``Admission`` / ``ClaimEvent`` to the
wire. Claims are tenant-scoped: another tenant's claim id is NOT_FOUND, exactly like an
unknown one. See docs/claims.md.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator

import numpy as np

from sidecar.claims import Admission, ClaimEvent, ClaimLedger, ClaimsConfig, Decision, Mode, PoolReport
from sidecar.claims.model import CapacityProof, Claim
from sidecar.errors import InvalidArgument
from sidecar.identity import SHARED_SCOPE, CacheIdentity
from sidecar.registry.index import ChunkIndex
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.wire import tokens_from_wire

logger = logging.getLogger(__name__)

_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
_MODES = {
    pb.CLAIM_MODE_SOFT_PRIORITY: Mode.SOFT_PRIORITY,
    pb.CLAIM_MODE_HARD_PROTECTED: Mode.HARD_PROTECTED,
    pb.CLAIM_MODE_DEMOTABLE: Mode.DEMOTABLE,
    pb.CLAIM_MODE_OFFLOADABLE: Mode.OFFLOADABLE,
    pb.CLAIM_MODE_EXPIRING: Mode.EXPIRING,
    pb.CLAIM_MODE_BEST_EFFORT: Mode.BEST_EFFORT,
}
_MODE_WIRE = {m: w for w, m in _MODES.items()}
_DECISIONS = {
    Decision.ACCEPTED: pb.CLAIM_DECISION_ACCEPTED,
    Decision.REJECTED: pb.CLAIM_DECISION_REJECTED,
    Decision.CONDITIONALLY_ACCEPTED: pb.CLAIM_DECISION_CONDITIONALLY_ACCEPTED,
}
_ADMIT = {"admitted": pb.ADMIT_DECISION_ADMITTED, "deferred": pb.ADMIT_DECISION_DEFERRED,
          "refused": pb.ADMIT_DECISION_REFUSED}


def claim_id_from_wire(value: str, name: str = "claim_id") -> str:
    if not _ID.match(value):
        raise InvalidArgument(f"{name}: required, 1..128 characters of [A-Za-z0-9_.:-], got {value[:40]!r}")
    return value


def proof_to_wire(p: CapacityProof | None) -> pb.CapacityProof | None:
    if p is None:
        return None
    return pb.CapacityProof(resident=p.resident, active=p.active, usable=p.usable, shortfall=p.shortfall,
                            unit=p.unit, free=p.free)


class ClaimsService:
    def __init__(self, config: ClaimsConfig, index: ChunkIndex, store, sessions, metrics) -> None:
        self.config = config
        self.index = index
        self.sessions = sessions
        self.metrics = metrics
        self.ledger = ClaimLedger(config, index.registry, store)

    # ------------------------------------------------------------------ requests

    def claim(self, tenant: str, req: pb.ClaimRequest, identity: CacheIdentity | None, max_tokens: int) -> pb.ClaimDecision:
        cid = claim_id_from_wire(req.claim_id)
        if identity is None:
            raise InvalidArgument("identity: required (chunk keys are salted with it)")
        mode = _MODES.get(req.mode)
        if mode is None:
            raise InvalidArgument(f"mode: required, one of {sorted(m.value for m in Mode)}")
        cfg = self.config
        duration = req.duration_s if req.HasField("duration_s") else None
        if duration is not None and not 0 < duration <= cfg.max_duration_s:
            raise InvalidArgument(f"duration_s: {duration} must be in (0, claims.max_duration_s={cfg.max_duration_s}]")
        if mode is Mode.EXPIRING and duration is None:
            raise InvalidArgument("duration_s: required for mode expiring")
        given = [n for n, ok in (("chunk_hashes", len(req.chunk_hashes)), ("tokens", req.tokens),
                                 ("session_id", req.session_id)) if ok]
        if len(given) != 1:
            raise InvalidArgument(f"chunk_hashes | tokens | session_id: exactly one object is required, got {given or 'none'}")
        scope = SHARED_SCOPE if req.shared else tenant
        if req.chunk_hashes:
            keys, lengths = self._hash_object(tenant, list(req.chunk_hashes), req.shared)
        else:
            if req.tokens:
                tokens = tokens_from_wire(req.tokens, "tokens", max_tokens)
                data = req.tokens
            else:
                info, _ = self.sessions.get(tenant, req.session_id)
                tokens = np.ascontiguousarray(info.layout.tokens, dtype="<u4")
                data = tokens.tobytes()
            keys, lengths = self._token_object(tokens, data, identity, scope, req.predicate_min_tokens)
        if len(keys) > cfg.max_chunks_per_claim:
            raise InvalidArgument(f"object: {len(keys)} chunks exceeds claims.max_chunks_per_claim {cfg.max_chunks_per_claim}")
        total = sum(lengths)
        if req.predicate_min_tokens > total:
            raise InvalidArgument(f"predicate_min_tokens: {req.predicate_min_tokens} exceeds the object's {total} tokens")
        min_tokens = req.predicate_min_tokens or total
        decision, reason, c = self.ledger.submit(
            tenant, cid, mode, tuple(keys), tuple(lengths), min_tokens, req.footprint_blocks, duration,
        )
        return pb.ClaimDecision(decision=_DECISIONS[decision], reason=reason, claim=self.info(c))

    def _hash_object(self, tenant: str, hashes: list[int], shared: bool) -> tuple[list[int], list[int]]:
        if len(hashes) > self.config.max_chunks_per_claim:
            raise InvalidArgument(
                f"chunk_hashes: {len(hashes)} exceeds claims.max_chunks_per_claim {self.config.max_chunks_per_claim}"
            )
        reg = self.index.registry
        scopes = (SHARED_SCOPE,) if shared else (tenant, SHARED_SCOPE)
        lengths = []
        for i, h in enumerate(hashes):
            e = reg.peek(h)
            if e is None or e.scope not in scopes:  # another tenant's chunk reads as unknown
                raise InvalidArgument(f"chunk_hashes[{i}]: unknown chunk {h:016x}")
            lengths.append(e.num_tokens)
        if len(set(hashes)) != len(hashes):
            raise InvalidArgument("chunk_hashes: a chunk is named twice")
        return hashes, lengths

    def _token_object(self, tokens, data, identity, scope, min_tokens) -> tuple[list[int], list[int]]:
        """The chunks of ``tokens`` (as Store cuts them) covering the first ``min_tokens``
        tokens (all of them when 0)."""
        if not len(tokens):
            raise InvalidArgument("tokens: empty object")
        entries, _ = self.index.entries(tokens, bytes(data), identity, scope, register_from=0)
        keys, lengths, covered = [], [], 0
        for e in entries:
            keys.append(int(e.key))
            lengths.append(e.num_tokens)
            covered += e.num_tokens
            if min_tokens and covered >= min_tokens:
                break
        return keys, lengths

    def release(self, tenant: str, claim_id: str) -> pb.ClaimInfo:
        return self.info(self.ledger.release(tenant, claim_id_from_wire(claim_id)))

    def demote(self, tenant: str, claim_id: str, reason: str) -> pb.ClaimInfo:
        return self.info(self.ledger.demote(tenant, claim_id_from_wire(claim_id), reason[:200]))

    def get(self, tenant: str, claim_id: str) -> pb.ClaimInfo:
        self.ledger.expire_due()
        return self.info(self.ledger.get(tenant, claim_id_from_wire(claim_id)))

    def report_pool(self, req: pb.ReportPoolRequest) -> pb.ReportPoolResponse:
        pool = PoolReport(usable_blocks=req.usable_blocks, free_blocks=req.free_blocks, block_size=req.block_size,
                          hard_protection=req.hard_protection, engine_id=req.engine_id[:128])
        return pb.ReportPoolResponse(protected_resident_blocks=self.ledger.report_pool(pool))

    def admit(self, tenant: str, req: pb.AdmitActiveRequest) -> pb.AdmitActiveResponse:
        rid = claim_id_from_wire(req.request_id, "request_id")
        if req.active_live_blocks <= 0:
            raise InvalidArgument("active_live_blocks: must be > 0")
        adm: Admission = self.ledger.admit(tenant, rid, req.active_live_blocks)
        if adm.decision.value == "refused":
            self.metrics.active_refusals.inc()
        own = [c.claim_id for c in adm.blocking if c.tenant == tenant]
        return pb.AdmitActiveResponse(
            decision=_ADMIT[adm.decision.value], blocking_claim_ids=own,
            blocking_other_tenants=len(adm.blocking) - len(own), proof=proof_to_wire(adm.proof),
            demoted_claim_ids=[c.claim_id for c in adm.demote if c.tenant == tenant], reason=adm.reason,
            retry_after_s=self.config.defer_retry_s if adm.decision.value == "deferred" else 0.0,
        )

    async def watch(self, tenant: str, req: pb.WatchEventsRequest) -> AsyncIterator[pb.ClaimEvent]:
        """Events of ``tenant`` from ``since_seq`` (0: the oldest retained). A watcher whose
        cursor falls behind the buffer gets one ``watcher_dropped`` event with the gap and the
        stream ends (it may resume with ``since_seq``: the gap is then reported again)."""
        log = self.ledger.events
        cursor = req.since_seq or log.oldest_seq
        while True:
            gap, evs = log.read(cursor)
            if gap:
                self.metrics.event_watchers_dropped.inc()
                log.watchers_dropped += 1
                yield pb.ClaimEvent(seq=cursor, event="watcher_dropped", gap=gap,
                                    reason=f"watcher fell {gap} events behind the buffer of {log.capacity}")
                return
            for ev in evs:
                cursor = ev.seq + 1
                if ev.tenant == tenant:
                    yield event_to_wire(ev)
            if not req.follow:
                return
            await log.wait(cursor)

    # ------------------------------------------------------------------ wire

    def info(self, c: Claim) -> pb.ClaimInfo:
        return pb.ClaimInfo(
            claim_id=c.claim_id, mode=_MODE_WIRE[c.mode], state=c.state.value, footprint_blocks=c.footprint_blocks,
            footprint_bytes=c.footprint_bytes, predicate_min_tokens=c.min_tokens, leading_tokens=c.leading_tokens,
            surviving_chunks=c.surviving, total_chunks=len(c.keys), materialized=c.materialized,
            expires_in_s=self.ledger.expires_in(c), reason=c.reason, chunk_hashes=list(c.keys),
        )

    async def run_sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            try:
                self.ledger.expire_due()
            except Exception:  # noqa: BLE001 - the sweeper must survive a bad claim
                logger.exception("claim expiry sweep failed")


def event_to_wire(ev: ClaimEvent) -> pb.ClaimEvent:
    return pb.ClaimEvent(
        seq=ev.seq, event=ev.event, claim_id=ev.claim_id, request_id=ev.request_id, time=ev.time,
        blocking_claim_ids=list(ev.blocking_claim_ids), proof=proof_to_wire(ev.proof),
        leading_tokens=ev.leading_tokens, predicate_min_tokens=ev.predicate_min_tokens, reason=ev.reason,
        mode=_MODE_WIRE[Mode(ev.mode)] if ev.mode else pb.CLAIM_MODE_UNSPECIFIED,
    )
