"""Client SDK: typed errors at the boundary, retries only for transient errors."""

from __future__ import annotations

import socket

import grpc
import pytest

from sidecar.api.status import error_for_status, status_for
from sidecar.client import RetryPolicy, SidecarClient, SyncSidecarClient
from sidecar.errors import InvalidArgument, SidecarError, Unavailable
from tests.conftest import message


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CountingRetry(RetryPolicy):
    def __init__(self, attempts: int) -> None:
        super().__init__(attempts=attempts, base_s=0.001, cap_s=0.002)
        object.__setattr__(self, "calls", [])

    def backoff(self, attempt: int) -> float:
        self.calls.append(attempt)
        return super().backoff(attempt)


async def test_retries_transient_errors(identity, rng):
    retry = CountingRetry(attempts=3)
    async with SidecarClient(f"127.0.0.1:{free_port()}", retry=retry, timeout_s=5) as c:
        with pytest.raises(Unavailable):
            await c.lookup(message(rng, 10), identity=identity)
    assert retry.calls == [0, 1]  # three attempts, two backoffs


async def test_does_not_retry_caller_errors(client, identity):
    retry = CountingRetry(attempts=5)
    client._retry = retry
    with pytest.raises(InvalidArgument, match="identity.model_id"):
        await client.lookup([1, 2, 3], identity=_no_model(identity))
    assert retry.calls == []


def _no_model(identity):
    # A CacheIdentity cannot be built without model_id; blank it after construction so the
    # server's validation is what refuses it.
    import dataclasses

    ident = dataclasses.replace(identity)
    object.__setattr__(ident, "model_id", "")
    return ident


def test_sync_client_retries(identity, rng):
    retry = CountingRetry(attempts=2)
    with SyncSidecarClient(f"127.0.0.1:{free_port()}", retry=retry, timeout_s=5) as c:
        with pytest.raises(Unavailable):
            c.ping()
    assert retry.calls == [0]


def test_status_mapping_round_trip():
    for cls in SidecarError.__subclasses__():
        if cls.code is grpc.StatusCode.UNKNOWN:
            continue
        err = cls("field: broken")
        code, msg = status_for(err)
        back = error_for_status(code, msg)
        assert type(back).code is cls.code and back.message == "field: broken"
    assert status_for(ValueError("x: y"))[0] is grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(KeyError("boom"))[0] is grpc.StatusCode.INTERNAL
    assert error_for_status(grpc.StatusCode.UNAVAILABLE, "down").transient


def test_parse_fetch_frame_matches_protobuf():
    from sidecar.api.frames import parse_fetch_frame
    from sidecar.v1 import sidecar_pb2 as pb

    for delta in (0, 1, -1, 250, -100_000, 2**40):
        msg = pb.FetchResponse(index=7, status=pb.CHUNK_STATUS_OK, num_tokens=128, source_pos=99, delta=delta,
                               rotated=True, tier="disk", data=bytes(range(200)) * 3, last=True)
        f = parse_fetch_frame(msg.SerializeToString())
        assert (f.index, f.status, f.num_tokens, f.source_pos, f.delta, f.rotated, f.tier, f.last) == (
            7, pb.CHUNK_STATUS_OK, 128, 99, delta, True, "disk", True)
        assert bytes(f.data) == msg.data
    empty = parse_fetch_frame(pb.FetchResponse(index=2, status=pb.CHUNK_STATUS_MISS, last=True).SerializeToString())
    assert (empty.index, empty.status, empty.last, len(empty.data)) == (2, pb.CHUNK_STATUS_MISS, True, 0)
