"""Active/resident arbitration over the engine's reported pool (the resident-claims conformance
contract, section 3.4).

    protected_resident + active_live <= usable        (blocks of the engine's KV pool)

* infeasible in ``usable``: relax demotable claims (oldest first) if that makes it fit,
  otherwise REFUSED with the blocking claims and the capacity proof;
* feasible in ``usable`` but not in what running requests leave free: DEFERRED (retry);
* otherwise ADMITTED.

Pure functions over a ``PoolReport`` and the live claims: no I/O, testable alone.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from sidecar.claims.model import CapacityProof, Claim, ProtectionMode


class Admit(enum.Enum):
    ADMITTED = "admitted"
    DEFERRED = "deferred"
    REFUSED = "refused"


@dataclass(frozen=True, kw_only=True, slots=True)
class PoolReport:
    """What an engine reported: ``usable_blocks`` of ``block_size`` tokens, ``free_blocks`` not
    held by running requests (cached, unreferenced blocks count as free), and whether it can
    exclude claimed blocks from its victims (``hard_protection``, check C1)."""

    usable_blocks: int
    free_blocks: int
    block_size: int
    hard_protection: bool
    engine_id: str = ""
    at: float = 0.0

    def __post_init__(self) -> None:
        if self.usable_blocks <= 0:
            raise ValueError("usable_blocks: must be > 0")
        if self.free_blocks > self.usable_blocks:
            raise ValueError(f"free_blocks: {self.free_blocks} exceeds usable_blocks {self.usable_blocks}")
        if self.block_size <= 0:
            raise ValueError("block_size: must be > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class AdmissionVerdict:
    """The verdict on one active request against the protected residents (``arbitrate``):
    ``decision``, the capacity ``proof``, the claims ``blocking`` it (REFUSED / DEFERRED), the
    demotable claims to ``demote`` so it fits (ADMITTED), and a human-readable ``reason``."""

    decision: Admit
    proof: CapacityProof
    blocking: tuple[Claim, ...] = ()
    demote: tuple[Claim, ...] = ()
    reason: str = ""


def protected_claims(claims, restorable) -> list[tuple[Claim, int]]:
    """Claims whose blocks the pool must keep: modes that hold the pool, plus offloadable claims
    whose predicate is NOT restorable from the sidecar's tiers (``restorable(claim)``)."""
    return [c for c in claims if c.mode.holds_pool or (c.mode is ProtectionMode.OFFLOADABLE and not restorable(c))]


def arbitrate(pool: PoolReport, active_blocks: int, protected: list[Claim]) -> AdmissionVerdict:
    bs = pool.block_size
    sized = [(c, c.blocks(bs)) for c in protected]
    resident = sum(b for _, b in sized)
    usable, free = pool.usable_blocks, pool.free_blocks
    proof = CapacityProof(resident=resident, active=active_blocks, usable=usable, unit="blocks", free=free)
    if resident + active_blocks > usable:
        # Relax demotable claims, oldest first, if that alone makes the request fit.
        demotable = sorted((x for x in sized if x[0].mode is ProtectionMode.DEMOTABLE), key=lambda x: x[0].seq)
        need = resident + active_blocks - usable
        chosen, freed = [], 0
        for c, b in demotable:
            if freed >= need:
                break
            chosen.append(c)
            freed += b
        if chosen and freed >= need and active_blocks <= free - (resident - freed):
            return AdmissionVerdict(decision=Admit.ADMITTED, proof=proof, demote=tuple(chosen),
                             reason=f"demotable claims relaxed to fit: {proof.text()}")
        blocking = tuple(c for c, b in sized if b > 0)
        return AdmissionVerdict(decision=Admit.REFUSED, proof=proof, blocking=blocking,
                         reason=f"infeasible_preserve_resident_and_active: {proof.text()}")
    if active_blocks > free - resident:
        short = active_blocks - (free - resident)
        return AdmissionVerdict(
            decision=Admit.DEFERRED, proof=proof, blocking=tuple(c for c, b in sized if b > 0),
            reason=f"fits the pool once running requests free {short} blocks (free {free}, protected {resident})",
        )
    return AdmissionVerdict(decision=Admit.ADMITTED, proof=proof, reason="feasible")


def report(usable: int, free: int, block_size: int, hard: bool, engine_id: str = "") -> PoolReport:
    return PoolReport(usable_blocks=usable, free_blocks=free, block_size=block_size, hard_protection=hard,
                      engine_id=engine_id, at=time.time())
