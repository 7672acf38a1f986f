"""Resident claims (docs/architecture.md, "Resident claims"; docs/claims.md).

``model`` (modes, states, decisions, C1), ``ledger`` (the claim table, references, guards,
expiry, materialization), ``arbitration`` (engine-pool feasibility and the capacity proof),
``events`` (bounded buffer with per-watcher cursors), ``config`` (the ``claims:`` section).
"""

from sidecar.claims.arbitration import AdmissionVerdict, Admit, PoolReport, arbitrate
from sidecar.claims.config import ClaimsConfig
from sidecar.claims.events import EVENT_TYPES, ClaimEvent, EventLog
from sidecar.claims.ledger import ClaimBlocked, ClaimLedger
from sidecar.claims.model import CapacityProof, Claim, Conformance, Decision, ProtectionMode, State, classify_lowering

__all__ = [
    "AdmissionVerdict", "Admit", "CapacityProof", "Claim", "ClaimBlocked", "ClaimEvent", "ClaimLedger", "ClaimsConfig",
    "Conformance", "Decision", "EVENT_TYPES", "EventLog", "PoolReport", "ProtectionMode", "State", "arbitrate",
    "classify_lowering",
]
