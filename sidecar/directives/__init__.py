"""Span directives -> op plans over a mirrored session layout; Splice transactions.

The pure domain core of Splice (docs/architecture.md, "The edit path"): no gRPC, no I/O.

Public API:

* ``EditMode`` (AMORTIZE, FORGET) and ``Directive(start, end, replacement, mode)``: replace tokens
  ``[start, end)`` of the session's current sequence; ``Edit`` is a validated directive;
  ``validate_directives``, ``apply_edits`` (the reference definition of the edited sequence).
* ``Layout``: tokens, slots, positions, per-slot rotation count and cumulative delta.
* ``SessionMirror``: one engine session (layout, block allocator, version); ``append``,
  ``commit``. ``SessionInfo`` is its immutable snapshot. ``BlockAllocator``: its block ids.
* ``plan_splice(session, directives, *, vocab_size, refresh_after, max_directives) -> OpPlan``.
* ``OpPlan`` (plan id, versions, ordered ``Op``s, post-commit ``layout``, ``PlanSummary``),
  ``Op``, ``OpKind`` (FREE, ALLOCATE, PREFILL, ROTATE, MOVE, REFRESH).
* ``check_plan(session, plan)``: the invariants; raises ``InvariantViolation``.
* ``SessionTable`` / ``SessionConfig`` / ``ExpiryReport``: open, get, append, close, splice,
  commit, abort, expire; per-tenant limits; pending-plan and idle expiry; ``held_span`` for
  held sessions.
* Held sessions (``held.py``): ``HeldKV`` (per-token canonical-copy references, permuted by
  every commit), ``HeldRuns`` / ``HeldSpan`` (what FetchSession serves), ``kept_sources``,
  the ``Resolver`` the data plane provides.
* ``ToyPool`` / ``apply_plan``: an independent slot-by-slot pool simulator (tests, reference).
* ``service.SpliceService``: sessions and Splice transactions behind the RPCs, their outcomes
  counted in plain ints (``SpliceCounters``) that the server drains into its metrics.

Domain errors come from ``sidecar.errors`` (InvalidArgument, FailedPrecondition, NotFound,
ResourceExhausted, InvariantViolation); the server maps them to statuses.

Deprecated: ``Mode``, the former name of ``EditMode``, still resolves (with a
``DeprecationWarning``) for one release.
"""

from sidecar.deprecation import renamed_attributes
from sidecar.directives.allocator import BlockAllocator
from sidecar.directives.directive import Directive, Edit, EditMode, apply_edits, validate_directives
from sidecar.directives.held import HeldKV, HeldRuns, HeldSpan, Resolver, kept_sources
from sidecar.directives.invariants import check_plan
from sidecar.directives.layout import Layout
from sidecar.directives.mirror import SessionInfo, SessionMirror
from sidecar.directives.op_plan import Op, OpKind, OpPlan, PlanId, PlanSummary, SessionId
from sidecar.directives.planner import DEFAULT_REFRESH_AFTER, plan_splice
from sidecar.directives.sessions import ExpiryReport, SessionConfig, SessionTable
from sidecar.directives.simulator import ToyPool, apply_plan

__all__ = [
    "DEFAULT_REFRESH_AFTER",
    "BlockAllocator",
    "Directive",
    "Edit",
    "EditMode",
    "ExpiryReport",
    "HeldKV",
    "HeldRuns",
    "HeldSpan",
    "Layout",
    "Op",
    "OpKind",
    "OpPlan",
    "PlanId",
    "PlanSummary",
    "Resolver",
    "SessionConfig",
    "SessionId",
    "SessionInfo",
    "SessionMirror",
    "SessionTable",
    "ToyPool",
    "apply_edits",
    "apply_plan",
    "check_plan",
    "kept_sources",
    "plan_splice",
    "validate_directives",
]

#: old public name -> its new name in this package (each removed one release after its rename)
__getattr__ = renamed_attributes(__name__, globals(), {"Mode": "EditMode"})
