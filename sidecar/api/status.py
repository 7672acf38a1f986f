"""The one map between the error taxonomy (``sidecar.errors``) and gRPC statuses.

The domain raises the typed errors of ``sidecar.errors`` and knows nothing of the transport;
this module is where each of them meets its status (docs/architecture.md, "Errors"):

* ``CODES``: each error class's gRPC status code, bound onto the class as its ``code``
  attribute when this module loads (the server edge and the SDK both import it, so every error
  that crosses the wire, either way, carries its code; subclasses inherit their parent's);
* ``status_for``: the status and message the server edge ends a call with, for any exception;
* ``trailers_for``: the structured details of a refusal, sent as trailing metadata;
* ``error_for_status``: the typed error the SDK raises for a status received from a server.

Nothing else in the code base chooses a status code for a domain error.
"""

from __future__ import annotations

import json
import linecache
import os
import sys

import grpc

from sidecar.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SidecarError,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)

#: Trailing metadata of a RESOURCE_EXHAUSTED caused by resident claims (docs/claims.md): the
#: blocking claim ids (comma-separated, the caller's own) and the capacity proof (JSON object
#: with resident, active, usable, shortfall, unit, free). The status message says the same.
BLOCKING_CLAIMS_KEY = "kv-sidecar-blocking-claim-ids"
CAPACITY_PROOF_KEY = "kv-sidecar-capacity-proof"

#: Each error class's status; a class not named here has its nearest named parent's.
CODES: dict[type[SidecarError], grpc.StatusCode] = {
    SidecarError: grpc.StatusCode.UNKNOWN,
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    NotFound: grpc.StatusCode.NOT_FOUND,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
    Internal: grpc.StatusCode.INTERNAL,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}

for _cls, _code in CODES.items():
    _cls.code = _code  # the class's status, read as ``err.code``

_BY_CODE: dict[grpc.StatusCode, type[SidecarError]] = {
    code: cls for cls, code in CODES.items() if cls is not SidecarError
}

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # sidecar/, installed or not


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


def trailers_for(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """Structured details of ``exc`` sent as trailing metadata (the message carries them too):
    a claim refusal's blocking claims and capacity proof; nothing for any other error."""
    if not isinstance(exc, SidecarError) or exc.capacity_proof is None:
        return ()
    return (
        (BLOCKING_CLAIMS_KEY, ",".join(exc.blocking_claim_ids)),
        (CAPACITY_PROOF_KEY, json.dumps(exc.capacity_proof, sort_keys=True)),
    )


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
