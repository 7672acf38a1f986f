"""Error taxonomy and the one table that maps it to gRPC status codes.

Three tiers (docs/architecture.md, "Errors"): caller mistakes are ``ValueError``/``TypeError``
(or ``InvalidArgument``, which is both a ``ValueError`` and a ``SidecarError``) and become
INVALID_ARGUMENT at the edge; refusals are typed ``SidecarError`` subclasses carrying their
status; invariant violations are ``InvariantViolation`` (INTERNAL, with a bug id, counted). The
server maps exceptions with ``status_for``; the client maps statuses back with
``error_for_status``. Nothing else in the code base chooses a status code.
"""

from __future__ import annotations

import json
import linecache
import os
import sys
import uuid

import grpc

#: Trailing metadata of a RESOURCE_EXHAUSTED caused by resident claims (docs/claims.md): the
#: blocking claim ids (comma-separated, the caller's own) and the capacity proof (JSON object
#: with resident, active, usable, shortfall, unit, free). The status message says the same.
BLOCKING_CLAIMS_KEY = "kv-sidecar-blocking-claim-ids"
CAPACITY_PROOF_KEY = "kv-sidecar-capacity-proof"


class SidecarError(Exception):
    """Base of every error the sidecar reports with a specific gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    #: Clients may retry the call after a backoff.
    transient: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        #: Claim refusals (RESOURCE_EXHAUSTED): the caller's blocking claims and the proof.
        self.blocking_claim_ids: tuple[str, ...] = ()
        self.capacity_proof: dict | None = None

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """Structured details sent as trailing metadata (the message carries them too)."""
        if self.capacity_proof is None:
            return ()
        return (
            (BLOCKING_CLAIMS_KEY, ",".join(self.blocking_claim_ids)),
            (CAPACITY_PROOF_KEY, json.dumps(self.capacity_proof, sort_keys=True)),
        )


class InvalidArgument(SidecarError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(SidecarError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(SidecarError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(SidecarError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(SidecarError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(SidecarError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(SidecarError):
    code = grpc.StatusCode.UNAVAILABLE
    transient = True


class Unimplemented(SidecarError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(SidecarError):
    code = grpc.StatusCode.INTERNAL


class DeadlineExceeded(SidecarError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class InvariantViolation(Internal):
    """A broken internal invariant: never silently recovered (docs/architecture.md, "Errors")."""

    def __init__(self, message: str, bug_id: str | None = None) -> None:
        self.bug_id = bug_id or uuid.uuid4().hex[:12]
        super().__init__(f"{message} (bug id {self.bug_id})")


_BY_CODE: dict[grpc.StatusCode, type[SidecarError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        FailedPrecondition,
        NotFound,
        ResourceExhausted,
        Unauthenticated,
        PermissionDenied,
        Unavailable,
        Unimplemented,
        Internal,
        DeadlineExceeded,
    )
}


_PACKAGE = os.path.dirname(os.path.abspath(__file__))  # sidecar/, installed or not


def _raised_by_the_project(exc: BaseException) -> bool:
    """Whether ``exc`` left a ``raise`` statement of this project's own code (its validation),
    rather than a library (torch, numpy; also C code, whose errors surface at the calling line):
    a ValueError / TypeError from a library reaching the edge is a bug here, not the caller's."""
    tb = exc.__traceback__
    if tb is None:
        return True  # constructed and handed over, never raised through a library
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = os.path.abspath(tb.tb_frame.f_code.co_filename)
    if not path.startswith(_PACKAGE + os.sep):
        return False
    return linecache.getline(path, tb.tb_lineno).lstrip().startswith("raise")


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message for an exception raised by domain code.

    ``ValueError`` / ``TypeError`` raised by the project's own code are caller mistakes
    (INVALID_ARGUMENT); raised deep inside a library they are bugs (INTERNAL). The tiers'
    ``TierUnavailableError`` (a closed store, a failed backend) is UNAVAILABLE."""
    if isinstance(exc, SidecarError):
        return exc.code, exc.message
    tiers = sys.modules.get("sidecar.tiers.errors")  # loaded wherever the tiers run (the server)
    if tiers is not None and isinstance(exc, tiers.TierUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, f"tiers unavailable: {exc}"
    if isinstance(exc, (ValueError, TypeError)) and _raised_by_the_project(exc):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def error_for_status(code: grpc.StatusCode, message: str, trailers=()) -> SidecarError:
    """The typed client-side error for a status received from a server (``trailers``: its
    trailing metadata; claim refusals bring ``blocking_claim_ids`` and ``capacity_proof``)."""
    cls = _BY_CODE.get(code, SidecarError)
    if cls is SidecarError:
        err = SidecarError(f"{code.name}: {message}")
        err.code = code
    else:
        err = cls(message)
    for key, value in trailers or ():
        if key == BLOCKING_CLAIMS_KEY:
            err.blocking_claim_ids = tuple(x for x in str(value).split(",") if x)
        elif key == CAPACITY_PROOF_KEY:
            err.capacity_proof = json.loads(value)
    return err
