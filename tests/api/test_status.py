"""The one map between the error taxonomy and gRPC statuses (sidecar.api.status): every error
class has its status and comes back as itself, a claim refusal's proof survives the trailing
metadata, and the taxonomy itself loads without the transport."""

from __future__ import annotations

import subprocess
import sys

import grpc

from sidecar.api.status import BLOCKING_CLAIMS_KEY, CAPACITY_PROOF_KEY, error_for_status, status_for, trailers_for
from sidecar.claims import CapacityProof, ClaimBlocked
from sidecar.errors import (
    Internal,
    InvalidArgument,
    InvariantViolation,
    NotFound,
    ResourceExhausted,
    SidecarError,
    Unavailable,
)


def _all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_all_subclasses(sub)]
    return out


def test_every_error_class_has_its_status_and_comes_back_as_itself_or_its_parent() -> None:
    assert SidecarError.code is grpc.StatusCode.UNKNOWN
    assert InvariantViolation.code is grpc.StatusCode.INTERNAL and ClaimBlocked.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    for cls in _all_subclasses(SidecarError):
        if cls in (InvariantViolation, ClaimBlocked):
            continue  # constructed with more than a message; checked below
        code, message = status_for(cls("field: broken"))
        assert code is cls.code and code is not grpc.StatusCode.UNKNOWN, cls
        back = error_for_status(code, message)
        assert type(back) is cls and back.message == "field: broken" and back.code is code, cls
    code, message = status_for(InvariantViolation("broken", bug_id="b1"))
    assert (code, message) == (grpc.StatusCode.INTERNAL, "broken (bug id b1)")
    assert type(error_for_status(code, message)) is Internal


def test_an_unknown_status_keeps_its_code_on_the_error() -> None:
    err = error_for_status(grpc.StatusCode.ABORTED, "raced")
    assert type(err) is SidecarError and err.code is grpc.StatusCode.ABORTED and err.message == "ABORTED: raced"
    assert SidecarError.code is grpc.StatusCode.UNKNOWN  # the instance's, not the class's
    assert status_for(err) == (grpc.StatusCode.ABORTED, "ABORTED: raced")


def test_a_claim_refusal_carries_its_blocking_claims_and_proof_through_the_trailers() -> None:
    proof = CapacityProof(resident=30, active=20, usable=40, unit="blocks", free=3)
    refused = ClaimBlocked("active: refused", blocking=("sys", "tools"), others=1, proof=proof)
    trailers = trailers_for(refused)
    assert dict(trailers) == {
        BLOCKING_CLAIMS_KEY: "sys,tools",
        CAPACITY_PROOF_KEY: '{"active": 20, "free": 3, "resident": 30, "shortfall": 10, "unit": "blocks", "usable": 40}',
    }
    back = error_for_status(*status_for(refused), trailers)
    assert type(back) is ResourceExhausted and back.message == "active: refused"
    assert back.blocking_claim_ids == ("sys", "tools") and back.capacity_proof == proof.as_dict()


def test_errors_without_a_proof_send_no_trailers() -> None:
    for exc in (ResourceExhausted("limits: full"), InvalidArgument("x: bad"), NotFound("plan_id: gone"),
                ValueError("x: y"), Unavailable("down")):
        assert trailers_for(exc) == ()
    assert error_for_status(grpc.StatusCode.NOT_FOUND, "plan_id: gone", ()).capacity_proof is None


def test_the_taxonomy_loads_without_the_transport() -> None:
    """What the domain imports of the errors runs no gRPC (a fresh interpreter, so that nothing
    else has loaded it)."""
    probe = ("import sys, sidecar.errors; "
             "print(sorted(m for m in sys.modules if m.split('.')[0].startswith('grpc') or m.startswith('sidecar.api')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
