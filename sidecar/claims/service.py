"""Resident claims of one sidecar behind the RPCs: request validation, claim objects resolved to
chunk keys, AdmitActive, the event stream, the expiry sweeper (docs/claims.md).

``ClaimsService`` works in domain types; the server's handlers (``sidecar/server/claims.py``)
convert the wire around it. It validates a request completely before the ledger changes
anything (INVALID_ARGUMENT names the field), resolves the claim object to ordered chunk keys
and calls the ``ClaimLedger``. Claims are tenant-scoped: another tenant's claim id is NOT_FOUND,
exactly like an unknown one. What it counts is plain ints (``ClaimsCounters``); after each count
it calls ``on_count``, with which the server's edge drains them into its metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sidecar.claims.arbitration import AdmissionVerdict, PoolReport
from sidecar.claims.config import ClaimsConfig
from sidecar.claims.events import ClaimEvent
from sidecar.claims.ledger import ClaimLedger
from sidecar.claims.model import Claim, Decision, ProtectionMode
from sidecar.directives.service import SpliceService
from sidecar.errors import InvalidArgument
from sidecar.identity import SHARED_SCOPE, CacheIdentity
from sidecar.registry.chunk_index import ChunkIndex

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ClaimsCounters:
    """What a ``ClaimsService`` counted since the edge last took the counts (``take``)."""

    #: AdmitActive calls answered refused
    admit_refusals: int = 0
    #: WatchEvents streams ended with a gap (their cursor fell behind the event buffer)
    watchers_dropped: int = 0

    def take(self) -> ClaimsCounters:
        """The counts so far; they start again from zero here."""
        out = ClaimsCounters(self.admit_refusals, self.watchers_dropped)
        self.admit_refusals = self.watchers_dropped = 0
        return out


def _nothing() -> None:
    return None


class ClaimsService:
    """The claims ledger behind the RPCs: validation, object resolution, the expiry sweeper.

    ``ledger`` is shared with the data plane, which consults it on every Store and sync;
    ``sessions`` resolves claims on a session's tokens."""

    def __init__(self, config: ClaimsConfig, index: ChunkIndex, ledger: ClaimLedger, sessions: SpliceService) -> None:
        self.config = config
        self.index = index
        self.sessions = sessions
        self.ledger = ledger
        #: counts not yet drained by the edge
        self.counters = ClaimsCounters()
        #: called after every count (the edge drains ``counters`` into its metrics)
        self.on_count: Callable[[], None] = _nothing

    def claim(self, tenant: str, claim_id: str, *, mode: ProtectionMode, shared: bool, identity: CacheIdentity,
              duration_s: float | None, predicate_min_tokens: int, footprint_blocks: int,
              chunk_hashes: Sequence[int] = (), tokens: np.ndarray | None = None,
              session_id: str = "") -> tuple[Decision, str, Claim]:
        """Submit a claim on one object: ``chunk_hashes``, else ``tokens`` (uint32 ids), else the
        tokens of the session ``session_id``. Returns the ledger's decision, its reason and the claim."""
        cfg = self.config
        if duration_s is not None and not 0 < duration_s <= cfg.max_duration_s:
            raise InvalidArgument(f"duration_s: {duration_s} must be in (0, claims.max_duration_s={cfg.max_duration_s}]")
        if mode is ProtectionMode.EXPIRING and duration_s is None:
            raise InvalidArgument("duration_s: required for mode expiring")
        scope = SHARED_SCOPE if shared else tenant
        if chunk_hashes:
            keys, lengths = self._hash_object(tenant, list(chunk_hashes), shared)
        else:
            if tokens is not None:
                data = tokens.tobytes()
            else:
                info, _ = self.sessions.get(tenant, session_id)
                tokens = np.ascontiguousarray(info.layout.tokens, dtype="<u4")
                data = tokens.tobytes()
            keys, lengths = self._token_object(tokens, data, identity, scope, predicate_min_tokens)
        if len(keys) > cfg.max_chunks_per_claim:
            raise InvalidArgument(f"object: {len(keys)} chunks exceeds claims.max_chunks_per_claim {cfg.max_chunks_per_claim}")
        total = sum(lengths)
        if predicate_min_tokens > total:
            raise InvalidArgument(f"predicate_min_tokens: {predicate_min_tokens} exceeds the object's {total} tokens")
        min_tokens = predicate_min_tokens or total
        return self.ledger.submit(
            tenant, claim_id, mode, tuple(keys), tuple(lengths), min_tokens, footprint_blocks, duration_s,
        )

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

    def release(self, tenant: str, claim_id: str) -> Claim:
        return self.ledger.release(tenant, claim_id)

    def demote(self, tenant: str, claim_id: str, reason: str) -> Claim:
        return self.ledger.demote(tenant, claim_id, reason[:200])

    def get(self, tenant: str, claim_id: str) -> Claim:
        self.ledger.expire_due()
        return self.ledger.get(tenant, claim_id)

    def expires_in(self, c: Claim) -> float:
        """Seconds until ``c`` expires (what its answer reports)."""
        return self.ledger.expires_in(c)

    def report_pool(self, pool: PoolReport) -> int:
        """The protected resident blocks the pool must keep, after the report."""
        return self.ledger.report_pool(pool)

    def admit(self, tenant: str, request_id: str, active_live_blocks: int) -> AdmissionVerdict:
        if active_live_blocks <= 0:
            raise InvalidArgument("active_live_blocks: must be > 0")
        adm = self.ledger.admit(tenant, request_id, active_live_blocks)
        if adm.decision.value == "refused":
            self.counters.admit_refusals += 1
            self.on_count()
        return adm

    async def watch(self, tenant: str, since_seq: int, follow: bool) -> AsyncIterator[ClaimEvent | tuple[int, int]]:
        """Events of ``tenant`` from ``since_seq`` (0: the oldest retained). A watcher whose
        cursor falls behind the buffer gets ``(cursor, gap)`` once and the stream ends (it may
        resume with ``since_seq``: the gap is then reported again)."""
        log = self.ledger.events
        cursor = since_seq or log.oldest_seq
        while True:
            gap, evs = log.read(cursor)
            if gap:
                self.counters.watchers_dropped += 1
                self.on_count()
                log.watchers_dropped += 1
                yield cursor, gap
                return
            for ev in evs:
                cursor = ev.seq + 1
                if ev.tenant == tenant:
                    yield ev
            if not follow:
                return
            await log.wait(cursor)

    async def run_sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            try:
                self.ledger.expire_due()
            except Exception:  # noqa: BLE001 - the sweeper must survive a bad claim
                logger.exception("claim expiry sweep failed")
