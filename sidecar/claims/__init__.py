"""Resident claims (docs/architecture.md, "Resident claims"; docs/claims.md).

``model`` (modes, states, decisions, C1), ``ledger`` (the claim table, references, guards,
expiry, materialization), ``arbitration`` (engine-pool feasibility and the capacity proof),
``events`` (bounded buffer with per-watcher cursors), ``config`` (the ``claims:`` section),
``service`` (``ClaimsService``: claim requests checked and resolved to chunks, behind the RPCs).

Deprecated: ``Mode`` (now ``ProtectionMode``) and ``Admission`` / ``ActiveAdmission`` (now
``AdmissionVerdict``) still resolve, with a ``DeprecationWarning``, for one release.
"""

from sidecar.claims.arbitration import AdmissionVerdict, Admit, PoolReport, arbitrate
from sidecar.claims.config import ClaimsConfig
from sidecar.claims.events import EVENT_TYPES, ClaimEvent, EventLog
from sidecar.claims.ledger import ClaimBlocked, ClaimLedger
from sidecar.claims.model import CapacityProof, Claim, Conformance, Decision, ProtectionMode, State, classify_lowering
from sidecar.deprecation import renamed_attributes

__all__ = [
    "AdmissionVerdict", "Admit", "CapacityProof", "Claim", "ClaimBlocked", "ClaimEvent", "ClaimLedger", "ClaimsConfig",
    "Conformance", "Decision", "EVENT_TYPES", "EventLog", "PoolReport", "ProtectionMode", "State", "arbitrate",
    "classify_lowering",
]

#: old public name -> its new name in this package (each removed one release after its rename)
__getattr__ = renamed_attributes(
    __name__, globals(), {"Mode": "ProtectionMode", "Admission": "AdmissionVerdict", "ActiveAdmission": "AdmissionVerdict"}
)
