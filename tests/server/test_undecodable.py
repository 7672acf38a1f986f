"""Request bytes that are not valid protobuf: INVALID_ARGUMENT naming the message type, no ERROR
log record, nothing changed. Raw bytes go over real gRPC (no client-side encoding)."""

from __future__ import annotations

import logging

import grpc
import numpy as np
import pytest

from sidecar.api.kv import identity_to_wire
from sidecar.client import SidecarClient
from sidecar.v1 import sidecar_pb2 as pb
from tests.conftest import ANCHORS, message

SERVICE = "/sidecar.v1.KVSidecar/"
GARBAGE = [
    b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",  # a varint tag that never ends
    b"\x0a\xff\xff\xff\x0f",  # field 1, length-delimited, length far past the end
    b"\x0b",  # a start-group tag with no end
]


def _truncated_lookup(identity) -> bytes:
    from sidecar.api.kv import identity_to_wire

    tokens = np.arange(64, dtype="<u4").tobytes()
    full = pb.LookupRequest(tokens=tokens, identity=identity_to_wire(identity)).SerializeToString()
    return full[: len(full) // 2]


@pytest.mark.parametrize("method", ["Lookup", "Stats", "Evict", "Splice", "Claim"])
async def test_unary_garbage_is_invalid_argument(sidecar, identity, method, caplog) -> None:
    _, target = sidecar
    async with grpc.aio.insecure_channel(target) as ch:
        call = ch.unary_unary(SERVICE + method)
        for raw in [*GARBAGE, _truncated_lookup(identity)]:
            with caplog.at_level(logging.ERROR):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(raw, timeout=5)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (raw, err.value.details())
            assert err.value.details().startswith("request: not a valid sidecar.v1.")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_fetch_and_store_garbage_change_nothing(sidecar, identity, rng, caplog) -> None:
    server, target = sidecar
    tokens = np.concatenate([message(rng, 300, ANCHORS[0]), message(rng, 200, ANCHORS[1])])
    async with SidecarClient(target, tenant="t") as c:
        await c.store(tokens, identity=identity)
        before = (await c.lookup(tokens, identity=identity)).summary
        entries = len(server.index.registry)
    async with grpc.aio.insecure_channel(target) as ch:
        with caplog.at_level(logging.ERROR):
            fetch = ch.unary_stream(SERVICE + "Fetch")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in fetch(GARBAGE[1], timeout=5):
                    pass
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            store = ch.stream_unary(SERVICE + "Store")
            # a valid header (Store checks it as it arrives), then garbage
            good_header = pb.StoreRequest(header=pb.StoreHeader(tokens=tokens.astype("<u4").tobytes(),
                                                                identity=identity_to_wire(identity)))
            for stream in ([GARBAGE[0]], [good_header.SerializeToString(), GARBAGE[2]]):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await store(iter(stream), timeout=5)
                assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
                assert "sidecar.v1.StoreRequest" in err.value.details()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(server.index.registry) == entries
    async with SidecarClient(target, tenant="t") as c:
        assert (await c.lookup(tokens, identity=identity)).summary == before
    rejected = server.metrics.registry.get_sample_value(
        "kv_sidecar_requests_total", {"method": "Store", "code": "INVALID_ARGUMENT"})
    assert rejected and rejected >= 2
