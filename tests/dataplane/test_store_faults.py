"""A Store that is cancelled or fails part-way changes nothing: no registry entry, no
object in the tiers, the tenant's byte quota as before; and Store checks every payload part as
it arrives (chunk boundary, size) and bounds what it buffers by what the header allows."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from sidecar.api.kv import identity_to_wire, layout_to_wire
from sidecar.app import create_server
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc
from tests.claims.helpers import BLOCK, IDENT, LAYOUT, blocks, config

PER_CHUNK = LAYOUT.bytes_per_token * BLOCK  # 4 KiB
N = 8  # chunks in the stream


@pytest.fixture
async def served():
    server, port = await create_server(config(200))
    yield server, f"127.0.0.1:{port}"
    await server.stop(0.1)


def header(tokens: np.ndarray) -> pb.StoreRequest:
    return pb.StoreRequest(header=pb.StoreHeader(
        tokens=tokens.astype("<u4").tobytes(), identity=identity_to_wire(IDENT), layout=layout_to_wire(LAYOUT)))


def parts(n: int = N, split: int = 2) -> list[pb.StoreRequest]:
    """``split`` parts per chunk of ``n`` chunks."""
    step = PER_CHUNK // split
    return [
        pb.StoreRequest(payload=pb.PayloadPart(chunk_start=c * BLOCK, data=bytes([c % 251]) * step, last=k == split - 1))
        for c in range(n) for k in range(split)
    ]


def committed(msgs: list[pb.StoreRequest]) -> list[pb.StoreRequest]:
    """``msgs`` ended by the commit that matches their payload parts."""
    chunks = {m.payload.chunk_start for m in msgs if m.WhichOneof("msg") == "payload"}
    nbytes = sum(len(m.payload.data) for m in msgs if m.WhichOneof("msg") == "payload")
    return [*msgs, pb.StoreRequest(commit=pb.StoreCommit(chunks=len(chunks), payload_bytes=nbytes))]


async def quiesce(server) -> None:
    """Wait (bounded) until no Store handler runs on the server."""
    gauge = server.metrics.inflight.labels("Store")
    for _ in range(400):
        if gauge._value.get() == 0:
            break
        await asyncio.sleep(0.025)
    assert gauge._value.get() == 0


def state(server) -> tuple[int, int, dict]:
    store = server.dataplane.store
    return len(server.index.registry), len(store.list_chunks()), store.tenant_tier_usage("default")


async def test_cancel_after_header_registers_nothing(served):
    server, target = served
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.KVSidecarStub(ch)
        before = state(server)
        call = stub.Store()
        await call.write(header(blocks(N, 0)))
        await asyncio.sleep(0.2)  # the server has read the header
        call.cancel()
        await quiesce(server)
        assert state(server) == before == (0, 0, before[2])


@pytest.mark.parametrize("how", ["cancel", "raise", "deadline", "disconnect"])
async def test_store_failing_mid_payload_changes_nothing(served, how):
    server, target = served
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.KVSidecarStub(ch)
        # Something already stored: the failed Store must leave it (and its quota) exactly so.
        ok = committed([header(blocks(2, 50_000)), *parts(2)])
        await stub.Store(iter(ok))
        before = state(server)
        assert before[:2] == (2, 2)
        msgs = [header(blocks(N, 0)), *parts(N)[: N + 3]]  # most parts, some chunks complete

        async def gen():
            for m in msgs:
                yield m
            if how == "raise":
                raise RuntimeError("client failed mid-payload")
            await asyncio.sleep(30)

        if how in ("cancel", "disconnect"):
            call = stub.Store(gen())
            await asyncio.sleep(0.3)
            if how == "cancel":
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
            else:
                async with grpc.aio.insecure_channel(target) as other:
                    await ch.close()  # the client goes away mid-stream
                    stub = pb_grpc.KVSidecarStub(other)
                    await quiesce(server)
                    assert state(server) == before
                    await stub.Ping(pb.PingRequest())
                return
        else:
            timeout = 0.3 if how == "deadline" else None
            with pytest.raises((grpc.aio.AioRpcError, RuntimeError, asyncio.CancelledError)):
                await stub.Store(gen(), timeout=timeout)
        await quiesce(server)
        assert state(server) == before
        await stub.Ping(pb.PingRequest())


@pytest.mark.parametrize("field,part", [
    ("payload.chunk_start", pb.PayloadPart(chunk_start=BLOCK + 1, data=b"\1" * 64)),  # not a boundary
    ("payload.chunk_start", pb.PayloadPart(chunk_start=N * BLOCK, data=b"\1" * 64)),  # past the last chunk
    ("payload.data", pb.PayloadPart(chunk_start=BLOCK, data=b"\1" * (PER_CHUNK + 1))),  # more than layout x tokens
    ("payload.data", pb.PayloadPart(chunk_start=0, data=b"\1" * (PER_CHUNK - 1), last=True)),  # short
])
async def test_bad_part_refused_as_it_arrives(served, field, part):
    """The refusal comes while the client still holds its stream open: the server does not
    wait for (or buffer) the rest of the stream before checking a part."""
    server, target = served
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.KVSidecarStub(ch)
        before = state(server)
        sent = 0

        async def gen():
            nonlocal sent
            yield header(blocks(N, 0))
            yield pb.StoreRequest(payload=part)
            sent = 2
            await asyncio.Event().wait()  # never half-closes

        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await asyncio.wait_for(stub.Store(gen()), 10)
        assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.details().startswith(field), ei.value.details()
        await quiesce(server)
        assert state(server) == before


async def test_store_buffers_at_most_what_the_header_allows(served):
    """Parts past a chunk's size are refused, whichever start they name: the server never holds
    more than the header's chunks need (sum of layout x tokens)."""
    server, target = served
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.KVSidecarStub(ch)
        step = PER_CHUNK // 4
        msgs = [header(blocks(2, 0))]
        # chunk 0 exactly, then chunk 1 over by one part
        msgs += [pb.StoreRequest(payload=pb.PayloadPart(chunk_start=0, data=b"\2" * step, last=k == 3)) for k in range(4)]
        good = msgs + [pb.StoreRequest(payload=pb.PayloadPart(chunk_start=BLOCK, data=b"\2" * step, last=k == 3))
                       for k in range(4)]
        msgs += [pb.StoreRequest(payload=pb.PayloadPart(chunk_start=BLOCK, data=b"\2" * step)) for _ in range(5)]
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Store(iter(msgs))
        assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.details().startswith("payload.data") and f"{PER_CHUNK} bytes" in ei.value.details()
        assert state(server)[:2] == (0, 0)
        # the same without the extra part is stored whole
        r = await stub.Store(iter(committed(good)))
        assert r.chunks_stored == 2 and state(server)[:2] == (2, 2)
