"""The claim table: per-tenant claims, per-chunk references, guards, expiry, lifecycle events.

Owned by the server's event loop (like the registry). Every chunk a live claim names holds one
reference per claim (two tenants claiming one shared chunk hold two); the chunk's guard in the
tiers is the strongest mode among its live references, and chunks guarded ``NO_DROP`` or more
are also skipped by the registry's LRU. Hot paths pay one dict membership test per chunk the
data plane touches (``watched``); nothing here runs on Lookup.

Materialization is re-evaluated only for claims whose chunks changed (``on_keys``): a claim is
materialized while a leading prefix of at least ``min_tokens`` tokens is held in some tier.
Losing it while the claim is live is ``claim_harmed`` for modes with an obligation (never
silent), a demotion for soft_priority / best_effort.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from sidecar.claims.arbitration import AdmissionVerdict, Admit, PoolReport, arbitrate, protected_claims
from sidecar.claims.config import ClaimsConfig
from sidecar.claims.events import EventLog
from sidecar.claims.model import (
    CapacityProof,
    Claim,
    ClaimId,
    Conformance,
    Decision,
    ProtectionMode,
    State,
    classify_lowering,
)
from sidecar.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from sidecar.registry.entry import EntryState
from sidecar.tiers import CapacityError, Guard, Tier, chunk_key

if TYPE_CHECKING:  # neither the store (torch, LMCache) nor the registry (numba) is imported by the SDK
    from sidecar.registry.registry import InMemoryRegistry
    from sidecar.tiers import TieredStore

logger = logging.getLogger(__name__)


class ClaimBlocked(ResourceExhausted):
    """Refused because accepted claims hold the capacity: names them and carries the proof.
    The server sends both in the status message and as trailing metadata (docs/claims.md)."""

    def __init__(self, message: str, blocking: tuple[str, ...], others: int, proof: CapacityProof) -> None:
        super().__init__(message)
        self.blocking_claim_ids = blocking
        self.blocking_other_tenants = others
        self.proof = proof
        self.capacity_proof = proof.as_dict()


class ClaimLedger:
    def __init__(
        self, config: ClaimsConfig, registry: InMemoryRegistry, store: TieredStore,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.registry = registry
        self.store = store
        self.clock = clock
        self.events = EventLog(config.event_buffer)
        self.pool: PoolReport | None = None
        self._claims: dict[tuple[str, str], Claim] = {}
        self._live: dict[str, int] = {}  # tenant -> live claims
        self._bytes: dict[str, int] = {}  # tenant -> claimed bytes of live claims
        #: chunk key -> live claims referencing it (the data plane tests membership here).
        self.watched: dict[int, list[Claim]] = {}
        self._expiry: list[tuple[float, int, Claim]] = []
        # Ended claims (demoted, expired) stay readable by GetClaim until this many more end.
        self._ended: deque[Claim] = deque()
        self._seq = 0
        self.active_refusals = 0

    # ------------------------------------------------------------------ queries

    def get(self, tenant: str, claim_id: str) -> Claim:
        c = self._claims.get((tenant, claim_id))
        if c is None:
            raise NotFound(f"claim_id: no claim {claim_id!r}")
        return c

    def live_count(self, tenant: str | None = None) -> int:
        return sum(self._live.values()) if tenant is None else self._live.get(tenant, 0)

    def states(self) -> dict[str, int]:
        out = {s.value: 0 for s in State}
        for c in self._claims.values():
            out[c.state.value] += 1
        return out

    def expires_in(self, c: Claim) -> float:
        return c.expires_at - self.clock() if c.expires_at is not None and c.state.live else -1.0

    # ------------------------------------------------------------------ lifecycle

    def submit(
        self, tenant: str, claim_id: str, mode: ProtectionMode, keys: tuple[int, ...], chunk_tokens: tuple[int, ...],
        min_tokens: int, footprint_blocks: int, duration_s: float | None,
    ) -> tuple[Decision, str, Claim]:
        """Decide on a claim (validated by the caller). Idempotent for an identical live claim."""
        self.expire_due()
        cfg = self.config
        old = self._claims.get((tenant, claim_id))
        if old is not None and old.state.live:
            if old.mode is mode and old.keys == keys and old.min_tokens == min_tokens:
                return Decision.ACCEPTED if mode.obligates else Decision.CONDITIONALLY_ACCEPTED, "already held", old
            reason = (
                f"claim_id {claim_id!r} is live with mode {old.mode.value}; a claim is never changed in place "
                "(a soft priority is never accepted as a lowering of a protecting claim, C1): release it first"
            )
            return Decision.REJECTED, reason, self._refused(tenant, claim_id, mode, keys, chunk_tokens, min_tokens, reason)
        duration = cfg.default_duration_s if duration_s is None else duration_s
        pool = self.pool
        if pool is not None and not pool.hard_protection and mode.holds_pool:
            cls = classify_lowering(mode, ProtectionMode.SOFT_PRIORITY)
            if cls is Conformance.UNSOUND:
                reason = (f"C1: the engine pool {pool.engine_id or ''} offers soft priority only; soft priority is not "
                          f"a sound lowering of {mode.value} (submit soft_priority or offloadable instead)")
                return Decision.REJECTED, reason, self._refused(tenant, claim_id, mode, keys, chunk_tokens, min_tokens,
                                                               reason)
        if self._live.get(tenant, 0) + 1 > cfg.max_claims_per_tenant:
            raise ResourceExhausted(
                f"claims.max_claims_per_tenant: tenant {tenant!r} holds {self._live.get(tenant, 0)} live claims "
                f"(limit {cfg.max_claims_per_tenant})"
            )
        nbytes = self._footprint_bytes(keys, chunk_tokens)
        cap = cfg.max_claimed_bytes_per_tenant
        if cap is not None and self._bytes.get(tenant, 0) + nbytes > cap:
            raise ResourceExhausted(
                f"claims.max_claimed_bytes_per_tenant: tenant {tenant!r} holds {self._bytes.get(tenant, 0)} claimed "
                f"bytes; this claim adds {nbytes} (limit {cap})"
            )
        now = self.clock()
        self._seq += 1
        c = Claim(
            claim_id=ClaimId(claim_id), tenant=tenant, mode=mode, keys=keys, chunk_tokens=chunk_tokens,
            min_tokens=min_tokens, footprint_blocks=footprint_blocks, footprint_bytes=nbytes,
            expires_at=now + duration, created_at=time.time(), state=State.ACCEPTED, seq=self._seq,
        )
        self._claims[(tenant, claim_id)] = c
        self._live[tenant] = self._live.get(tenant, 0) + 1
        self._bytes[tenant] = self._bytes.get(tenant, 0) + nbytes
        for k in dict.fromkeys(keys):
            self.watched.setdefault(k, []).append(c)
        self._apply_guards(keys)
        heapq.heappush(self._expiry, (c.expires_at, c.seq, c))
        self._evaluate(c)
        if mode.obligates:
            decision = Decision.ACCEPTED if c.materialized else Decision.CONDITIONALLY_ACCEPTED
            reason = "accepted; materialized" if c.materialized else (
                f"accepted pending materialization: leading prefix {c.leading_tokens} of {min_tokens} tokens held"
            )
        else:
            decision = Decision.CONDITIONALLY_ACCEPTED
            reason = f"{mode.value}: influences eviction order only, no preservation obligation" \
                if mode is ProtectionMode.SOFT_PRIORITY else "best_effort: telemetry only, no preservation obligation"
        c.reason = reason
        self._emit("claim_accepted", c, reason=reason)
        if c.materialized:
            c.state = State.MATERIALIZED
            self._emit("claim_materialized", c)
        return decision, reason, c

    def _refused(self, tenant, claim_id, mode, keys, chunk_tokens, min_tokens, reason) -> Claim:
        c = Claim(claim_id=ClaimId(claim_id), tenant=tenant, mode=mode, keys=keys, chunk_tokens=chunk_tokens,
                  min_tokens=min_tokens, footprint_blocks=0, footprint_bytes=0, expires_at=None,
                  created_at=time.time(), state=State.REFUSED, reason=reason)
        self._emit("claim_refused", c, reason=reason)
        return c

    def release(self, tenant: str, claim_id: str) -> Claim:
        """End a claim (idempotent per live claim; NOT_FOUND once gone or for another tenant's id)."""
        self.expire_due()
        c = self.get(tenant, claim_id)
        del self._claims[(tenant, claim_id)]
        if c.state.live:
            self._end(c, State.RELEASED, "claim_released", "released by its owner")
        return c

    def demote(self, tenant: str, claim_id: str, reason: str = "") -> Claim:
        self.expire_due()
        c = self.get(tenant, claim_id)
        if not c.state.live:
            raise FailedPrecondition(f"claim_id: claim {claim_id!r} is {c.state.value}, not live")
        self._end(c, State.DEMOTED, "claim_demoted", reason or "demoted by its owner")
        return c

    def expire_due(self) -> int:
        now = self.clock()
        n = 0
        while self._expiry and self._expiry[0][0] <= now:
            _, _, c = heapq.heappop(self._expiry)
            if c.state.live:
                self._end(c, State.EXPIRED, "claim_expired", "duration ended")
                n += 1
        return n

    def _end(self, c: Claim, state: State, event: str, reason: str) -> None:
        """Drop ``c``'s responsibility: the event is emitted BEFORE its guards go, so any loss
        that follows is ordinary eviction, never harm (seed L4/L5)."""
        c.state = state
        c.reason = reason
        self._live[c.tenant] -= 1
        self._bytes[c.tenant] -= c.footprint_bytes
        self._emit(event, c, reason=reason)
        if state is not State.RELEASED:
            self._ended.append(c)
            if len(self._ended) > self.config.event_buffer:
                old = self._ended.popleft()
                if self._claims.get((old.tenant, old.claim_id)) is old:
                    del self._claims[(old.tenant, old.claim_id)]
        for k in dict.fromkeys(c.keys):
            refs = self.watched.get(k)
            if refs is not None:
                refs.remove(c)
                if not refs:
                    del self.watched[k]
        self._apply_guards(c.keys)

    # ------------------------------------------------------------------ guards and materialization

    def _apply_guards(self, keys: Iterable[int]) -> None:
        guards = {}
        protected = self.registry.protected
        for k in dict.fromkeys(keys):
            refs = self.watched.get(k)
            g = max((c.mode.guard for c in refs), default=Guard.NONE) if refs else Guard.NONE
            guards[chunk_key(k)] = g
            if g >= Guard.NO_DROP:
                protected.add(k)
            else:
                protected.discard(k)
        if guards:
            self.store.set_guards(guards)

    def _footprint_bytes(self, keys: tuple[int, ...], chunk_tokens: tuple[int, ...]) -> int:
        """Payload bytes of the claimed chunks held now, extrapolated per token to the others."""
        held_bytes = held_tokens = 0
        for k, n in zip(keys, chunk_tokens):
            meta = self.store.meta(chunk_key(k))
            if meta is not None:
                held_bytes += meta.payload_nbytes
                held_tokens += n
        if not held_tokens:
            return 0
        return math.ceil(held_bytes / held_tokens * sum(chunk_tokens))

    def _evaluate(self, c: Claim) -> None:
        peek = self.registry.peek
        leading = surviving = 0
        prefix = True
        for k, n in zip(c.keys, c.chunk_tokens):
            e = peek(k)
            if e is not None and e.state is EntryState.RESIDENT:
                surviving += 1
                if prefix:
                    leading += n
            else:
                prefix = False
        c.leading_tokens, c.surviving = leading, surviving
        c.materialized = leading >= c.min_tokens

    def on_keys(self, keys: Iterable[int]) -> None:
        """Chunks changed (stored, evicted, lost): re-evaluate the live claims naming them."""
        seen: dict[int, Claim] = {}
        for k in keys:
            for c in self.watched.get(k, ()):
                seen[id(c)] = c
        for c in seen.values():
            was = c.materialized
            self._evaluate(c)
            if c.materialized and not was:
                c.state = State.MATERIALIZED
                self._emit("claim_materialized", c)
            elif was and not c.materialized and c.state.live:
                if c.mode.obligates:
                    c.state = State.HARMED
                    c.reason = (f"predicate lost without prior demotion or expiry: leading prefix {c.leading_tokens} "
                                f"< {c.min_tokens} tokens")
                    self._emit("claim_harmed", c, reason=c.reason)
                    logger.error("claim %s of tenant %s harmed: %s", c.claim_id, c.tenant, c.reason)
                else:
                    self._end(c, State.DEMOTED, "claim_demoted",
                              f"{c.mode.value}: predicate lost (no preservation obligation)")

    def obligated_holders(self, keys: Iterable[int]) -> list[Claim]:
        """Live claims with a tier guard of NO_DROP or more on any of ``keys`` (Evict/Delete)."""
        out: dict[int, Claim] = {}
        for k in keys:
            for c in self.watched.get(k, ()):
                if c.mode.guard >= Guard.NO_DROP:
                    out[id(c)] = c
        return list(out.values())

    # ------------------------------------------------------------------ arbitration

    def report_pool(self, pool: PoolReport) -> int:
        self.expire_due()
        self.pool = pool
        return sum(c.blocks(pool.block_size) for c in self._protected())

    def _protected(self) -> list[Claim]:
        live = [c for c in self._claims.values() if c.state.live]
        return protected_claims(live, lambda c: c.materialized)

    def admit(self, tenant: str, request_id: str, active_blocks: int) -> AdmissionVerdict:
        self.expire_due()
        pool = self.pool
        if pool is None:
            raise FailedPrecondition("pool: no engine pool reported yet (call ReportPool first)")
        adm = arbitrate(pool, active_blocks, self._protected())
        for c in adm.demote:
            self._end(c, State.DEMOTED, "claim_demoted", f"relaxed to admit active request {request_id!r}")
        own = tuple(c.claim_id for c in adm.blocking if c.tenant == tenant)
        if adm.decision is Admit.ADMITTED:
            self.events.emit("active_admitted", tenant, request_id=request_id, proof=adm.proof, reason=adm.reason)
        else:
            if adm.decision is Admit.REFUSED:
                self.active_refusals += 1
            self.events.emit(f"active_{adm.decision.value}", tenant, request_id=request_id, blocking_claim_ids=own,
                             proof=adm.proof, reason=adm.reason)
        return adm

    def check_store(self, tenant: str, need: int) -> None:
        """Raise ``ClaimBlocked`` when a Store of ``need`` bytes cannot fit the tiers without
        breaking accepted claims (after relaxing demotable claims, oldest first)."""
        room = self.store.room(need)
        if room is None:
            return
        cap, _, guarded = room
        if guarded + need <= cap:
            return
        holders = self._tier_holders(None)
        for c in sorted((c for c in holders if c.mode is ProtectionMode.DEMOTABLE), key=lambda c: c.seq):
            self._end(c, State.DEMOTED, "claim_demoted", f"relaxed for a Store of {need} bytes")
            room = self.store.room(need)
            if room is None or room[2] + need <= room[0]:
                return
        cap, _, guarded = room
        proof = CapacityProof(resident=guarded, active=need, usable=cap, unit="bytes")
        raise self._blocked(tenant, [c for c in holders if c.state.live], proof, "tiers")

    def _tier_holders(self, tier: Tier | None) -> list[Claim]:
        """Live claims whose chunks victim selection may not take (in ``tier``, or anywhere)."""
        last = self.store.tiers[-1] if self.store.tiers else None
        holders: dict[int, Claim] = {}
        for k, refs in self.watched.items():
            e = self.registry.peek(k)
            if e is None or e.state is not EntryState.RESIDENT or (tier is not None and e.tier != tier.value):
                continue
            for c in refs:
                g = c.mode.guard
                if g is Guard.HOLD or (g is Guard.NO_DROP and e.tier == (last.value if last else None)):
                    holders[id(c)] = c
        return sorted(holders.values(), key=lambda c: c.seq)

    def _blocked(self, tenant: str, holders: list[Claim], proof: CapacityProof, where: str) -> ClaimBlocked:
        own = tuple(c.claim_id for c in holders if c.tenant == tenant)
        others = len(holders) - len(own)
        self.active_refusals += 1
        self.events.emit("active_refused", tenant, request_id="store", blocking_claim_ids=own, proof=proof,
                         reason=f"Store refused in {where}: {proof.text()}")
        return ClaimBlocked(
            f"capacity: Store refused in {where}: accepted claims hold it ({proof.text()}); "
            f"blocking_claim_ids={list(own)}" + (f" (+{others} of other tenants)" if others else ""),
            own, others, proof,
        )

    def store_refusal(self, exc: CapacityError, tenant: str, active_bytes: int) -> bool | ClaimBlocked:
        """A put was refused by the tiers. True: demotable claims were relaxed, retry once.
        Otherwise the ``ClaimBlocked`` to raise, or False when claims are not what blocks it."""
        tier = exc.tier
        if tier is None or not exc.guarded_bytes:
            return False
        holders = self._tier_holders(tier)
        demotable = [c for c in holders if c.mode is ProtectionMode.DEMOTABLE]
        for c in demotable:
            self._end(c, State.DEMOTED, "claim_demoted", f"relaxed for a Store in {tier.value}")
        if demotable:
            return True
        proof = CapacityProof(resident=exc.guarded_bytes, active=max(active_bytes, exc.requested_bytes),
                              usable=exc.capacity_bytes, unit="bytes")
        return self._blocked(tenant, holders, proof, f"tier {tier.value}")

    # ------------------------------------------------------------------ events

    def _emit(self, event: str, c: Claim, **fields) -> None:
        self.events.emit(event, c.tenant, claim_id=c.claim_id, mode=c.mode.value, leading_tokens=c.leading_tokens,
                         predicate_min_tokens=c.min_tokens, **fields)


def check_tier(value: str) -> Tier:
    try:
        return Tier(value)
    except ValueError as exc:
        raise InvalidArgument(f"tier: unknown tier {value!r}") from exc
