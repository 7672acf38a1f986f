"""Error taxonomy: the typed errors the domain raises, free of any transport.

Three tiers (docs/architecture.md, "Errors"): caller mistakes are ``ValueError``/``TypeError``
(or ``InvalidArgument``, which is both a ``ValueError`` and a ``SidecarError``) and become
INVALID_ARGUMENT at the edge; refusals are typed ``SidecarError`` subclasses, one per status;
invariant violations are ``InvariantViolation`` (INTERNAL, with a bug id, counted).

Which status each class is on the wire is the transport's business: ``sidecar.api.status``
holds that one map (``status_for`` on the server, ``error_for_status`` in the SDK) and binds
each class's gRPC status code as its ``code`` attribute when it loads. Nothing here imports it.
"""

from __future__ import annotations

import uuid
from typing import Any


class SidecarError(Exception):
    """Base of every error the sidecar reports with a specific status."""

    #: The gRPC status code, bound by ``sidecar.api.status`` (the server and the SDK load it).
    code: Any
    #: Clients may retry the call after a backoff.
    transient: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        #: Claim refusals (RESOURCE_EXHAUSTED): the caller's blocking claims and the proof.
        self.blocking_claim_ids: tuple[str, ...] = ()
        self.capacity_proof: dict | None = None


class InvalidArgument(SidecarError, ValueError):
    """A caller mistake: a malformed request; the message starts with the field name."""


class FailedPrecondition(SidecarError):
    """The request is well formed but the state refuses it (identity mismatch, stale version, ...)."""


class NotFound(SidecarError):
    """An unknown (or another tenant's) session, plan or claim."""


class ResourceExhausted(SidecarError):
    """Capacity, limits, claim refusals (with the capacity proof)."""


class Unauthenticated(SidecarError):
    """A missing or wrong credential."""


class PermissionDenied(SidecarError):
    """A tenant the credential does not grant."""


class Unavailable(SidecarError):
    """A required backend is down; the one transient error."""

    transient = True


class Unimplemented(SidecarError):
    """The server does not offer the call (an older server, say)."""


class Internal(SidecarError):
    """A bug of the sidecar's."""


class DeadlineExceeded(SidecarError):
    """The call ran past its deadline (a status the client receives)."""


class InvariantViolation(Internal):
    """A broken internal invariant: never silently recovered (docs/architecture.md, "Errors")."""

    def __init__(self, message: str, bug_id: str | None = None) -> None:
        self.bug_id = bug_id or uuid.uuid4().hex[:12]
        super().__init__(f"{message} (bug id {self.bug_id})")
