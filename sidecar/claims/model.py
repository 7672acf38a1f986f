"""Resident claims: the vocabulary (docs/architecture.md, "Resident claims"; the resident-claims
conformance contract, Tables 2-4).

A claim asks the sidecar to keep an object (an ordered run of chunks: a prefix) resident for
future reuse. It has a mode (what the sidecar promises), a materialization predicate (a leading
prefix of at least ``min_tokens`` tokens held), a footprint and a lifecycle::

    submitted ──> accepted ──> materialized ──> released | demoted | expired
        │             │  ^          │
        └> refused    │  └──────────┤ (chunks stored again)
                      └─────────────┴──> harmed   (predicate lost with no demotion/expiry first)
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import NewType

from sidecar.tiers import Guard

ClaimId = NewType("ClaimId", str)


class ProtectionMode(enum.Enum):
    """What the sidecar promises to keep of a claimed object (docs/claims.md)."""

    SOFT_PRIORITY = "soft_priority"    # eviction order only (second chance); no obligation
    HARD_PROTECTED = "hard_protected"  # never evicted nor demoted; active work refused instead
    DEMOTABLE = "demotable"            # protected until the sidecar emits claim_demoted
    OFFLOADABLE = "offloadable"        # may move down a tier, never dropped: stays restorable
    EXPIRING = "expiring"              # protected until its duration ends (claim_expired)
    BEST_EFFORT = "best_effort"        # telemetry only

    @property
    def guard(self) -> Guard:
        return _GUARD[self]

    @property
    def obligates(self) -> bool:
        """Whether losing the predicate without demotion/expiry first is harm."""
        return self not in (ProtectionMode.SOFT_PRIORITY, ProtectionMode.BEST_EFFORT)

    @property
    def holds_pool(self) -> bool:
        """Whether the claim's blocks count as protected resident in the engine pool."""
        return self in (ProtectionMode.HARD_PROTECTED, ProtectionMode.DEMOTABLE, ProtectionMode.EXPIRING)


_GUARD = {
    ProtectionMode.SOFT_PRIORITY: Guard.SOFT,
    ProtectionMode.HARD_PROTECTED: Guard.HOLD,
    ProtectionMode.DEMOTABLE: Guard.HOLD,
    ProtectionMode.OFFLOADABLE: Guard.NO_DROP,
    ProtectionMode.EXPIRING: Guard.HOLD,
    ProtectionMode.BEST_EFFORT: Guard.NONE,
}


class State(enum.Enum):
    SUBMITTED = "submitted"
    ACCEPTED = "accepted"
    MATERIALIZED = "materialized"
    DEMOTED = "demoted"
    EXPIRED = "expired"
    REFUSED = "refused"
    HARMED = "harmed"
    RELEASED = "released"

    @property
    def live(self) -> bool:
        """The sidecar still holds responsibility (guards set, counted against caps)."""
        return self in (State.ACCEPTED, State.MATERIALIZED, State.HARMED)


class Decision(enum.Enum):
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    CONDITIONALLY_ACCEPTED = "conditionally_accepted"


class Conformance(enum.Enum):
    """Seed check C1: how sound it is to implement ``requested`` with a backend ``capability``."""

    SOUND = "sound"
    APPROXIMATE = "approximate"
    UNSOUND = "unsound"


def classify_lowering(requested: ProtectionMode, capability: ProtectionMode) -> Conformance:
    """C1: a soft priority is never a sound lowering of a protecting claim.

    ``capability`` is the strongest protection the backend offers (``HARD_PROTECTED`` for victim
    exclusion, ``SOFT_PRIORITY`` for ranking only). Soft priority itself, lowered to soft
    priority, is only approximate (it ranks victims, it promises nothing)."""
    if capability is ProtectionMode.HARD_PROTECTED or requested is ProtectionMode.BEST_EFFORT:
        return Conformance.SOUND
    if requested is ProtectionMode.SOFT_PRIORITY:
        return Conformance.APPROXIMATE
    return Conformance.UNSOUND


@dataclass(frozen=True, kw_only=True, slots=True)
class CapacityProof:
    """``resident + active <= usable`` failed (or held) by ``shortfall``, in ``unit``.

    ``shortfall`` left out is derived (``resident + active - usable``, 0 when feasible): the
    server builds its proofs so. A proof read from the wire names the server's value, which
    the client keeps as sent rather than recompute it."""

    resident: int
    active: int
    usable: int
    unit: str  # "blocks" | "bytes"
    free: int = 0
    shortfall: int = None  # type: ignore[assignment]  # always an int once constructed

    def __post_init__(self) -> None:
        if self.shortfall is None:
            object.__setattr__(self, "shortfall", max(0, self.resident + self.active - self.usable))

    def text(self) -> str:
        return (
            f"resident {self.resident} + active {self.active} = {self.resident + self.active} {self.unit} > usable "
            f"{self.usable} (shortfall {self.shortfall})"
        )

    def as_dict(self) -> dict[str, int | str]:
        return {"resident": self.resident, "active": self.active, "usable": self.usable,
                "shortfall": self.shortfall, "unit": self.unit, "free": self.free}


@dataclass(slots=True, eq=False)
class Claim:
    """One claim. ``keys`` are its chunks in position order, ``chunk_tokens`` their lengths;
    ``min_tokens`` the predicate. Owned by ``ClaimLedger`` (event-loop thread only)."""

    claim_id: ClaimId
    tenant: str
    mode: ProtectionMode
    keys: tuple[int, ...]
    chunk_tokens: tuple[int, ...]
    min_tokens: int
    footprint_blocks: int
    footprint_bytes: int
    expires_at: float | None
    created_at: float
    state: State = State.SUBMITTED
    reason: str = ""
    leading_tokens: int = 0
    surviving: int = 0
    materialized: bool = False
    seq: int = field(default=0)  # acceptance order (oldest demotable claims relax first)

    def blocks(self, block_size: int) -> int:
        """Engine-pool blocks the claim protects: declared, or its predicate's tokens."""
        if self.footprint_blocks:
            return self.footprint_blocks
        return math.ceil(self.min_tokens / block_size) if block_size else 0
