"""The SDK's RPC table: every service method once, streaming kinds as the proto declares them,
both clients running the same entries, and the retry policy each entry states."""

from __future__ import annotations

import inspect
import socket

import pytest

from sidecar.client import RetryPolicy, SidecarClient, SyncSidecarClient
from sidecar.errors import Unavailable
from sidecar.sdk.rpcs import RPCS, Kind
from sidecar.v1 import sidecar_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["KVSidecar"]
#: Calls that change state on every attempt: a transient failure must not repeat them.
NOT_RETRIED = {
    "Evict", "Claim", "ReleaseClaim", "DemoteClaim", "AdmitActive", "OpenSession", "AppendSession", "GetSession",
    "CloseSession", "Splice", "CommitSplice", "AbortSplice", "WatchEvents",
    # the shared pool: a retried lease or reservation would take a second one
    "LeaseFetch", "ReleaseLease", "ReserveStore", "CommitStore", "AbortStore",
}


def test_every_service_method_is_one_entry():
    methods = [rpc.method for rpc in RPCS.values()]
    assert sorted(methods) == sorted(m.name for m in SERVICE.methods)
    assert len(set(methods)) == len(methods)


def test_kinds_match_the_proto_streaming():
    for name, rpc in RPCS.items():
        m = SERVICE.methods_by_name[rpc.method]
        want = {
            Kind.UNARY: (False, False), Kind.CLIENT_STREAM: (True, False), Kind.SERVER_STREAM: (False, True),
            Kind.FRAMES: (False, True), Kind.WATCH: (False, True),
        }[rpc.kind]
        assert (m.client_streaming, m.server_streaming) == want, name


def test_retry_policy_per_entry():
    retried = {rpc.method for rpc in RPCS.values() if rpc.idempotent and rpc.kind is not Kind.WATCH}
    assert retried == {m.name for m in SERVICE.methods} - NOT_RETRIED


@pytest.mark.parametrize("client_cls", [SidecarClient, SyncSidecarClient])
def test_both_clients_run_the_same_entries(client_cls):
    for name, rpc in RPCS.items():
        fn = getattr(client_cls, name)
        assert fn.rpc is rpc and fn.__name__ == name
        # The request builder's signature is the call's (after self).
        params = list(inspect.signature(fn).parameters.values())
        assert params[1:] == list(inspect.signature(rpc.request).parameters.values())
        assert f"``{rpc.method}`` RPC" in fn.__doc__


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CountingRetry(RetryPolicy):
    def __init__(self) -> None:
        super().__init__(attempts=3, base_s=0.001, cap_s=0.002)
        object.__setattr__(self, "calls", [])

    def backoff(self, attempt: int) -> float:
        self.calls.append(attempt)
        return super().backoff(attempt)


def test_sync_client_retries_only_idempotent_entries():
    retry = CountingRetry()
    with SyncSidecarClient(f"127.0.0.1:{_free_port()}", retry=retry, timeout_s=5) as c:
        with pytest.raises(Unavailable):
            c.evict([1, 2])  # not idempotent: one attempt
        assert retry.calls == []
        with pytest.raises(Unavailable):
            c.delete([1, 2])
        assert retry.calls == [0, 1]


async def test_async_client_retries_only_idempotent_entries():
    retry = CountingRetry()
    async with SidecarClient(f"127.0.0.1:{_free_port()}", retry=retry, timeout_s=5) as c:
        with pytest.raises(Unavailable):
            await c.admit_active("r", 4)
        assert retry.calls == []
        with pytest.raises(Unavailable):
            await c.get_claim("c")
        assert retry.calls == [0, 1]
        with pytest.raises(Unavailable):  # a stream: the typed error, no retry
            [e async for e in c.watch_events()]
        assert retry.calls == [0, 1]
