"""The commit is a Store stream's last message (docs/architecture.md, "Visibility and the data
plane"): anything after it refuses the whole Store (INVALID_ARGUMENT naming ``commit``) and
nothing of that stream is stored or registered, not even as metadata. A cancel that arrives
after a commit that was the stream's last message still stores it whole.

Real gRPC over loopback with the raw stubs, so the client can send what the SDK never would.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from sidecar.api.kv import identity_to_wire
from sidecar.app import create_server
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc
from tests.claims.helpers import IDENT, blocks, config, held_blocks
from tests.dataplane.test_store_faults import PER_CHUNK, header, parts, quiesce, state

CHUNKS = 3


@pytest.fixture
async def served():
    server, port = await create_server(config(64))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield server, pb_grpc.KVSidecarStub(ch)
    await server.stop(0.1)


def _commit(chunks: int) -> pb.StoreRequest:
    return pb.StoreRequest(commit=pb.StoreCommit(chunks=chunks, payload_bytes=chunks * PER_CHUNK))


async def _hits(stub, tokens: np.ndarray, dry_run: bool) -> int:
    """Chunks of ``tokens`` a Lookup finds: RESIDENT ones, or with ``dry_run`` also OBSERVED ones."""
    plan = await stub.Lookup(pb.LookupRequest(
        tokens=tokens.astype("<u4").tobytes(), identity=identity_to_wire(IDENT), dry_run=dry_run))
    return plan.summary.chunks_hit


def _stats(s: pb.StatsResponse) -> pb.StatsResponse:
    s.ClearField("uptime_s")
    return s


@pytest.mark.parametrize("after", ["payloads", "commit", "header"])
async def test_messages_after_the_commit_refuse_the_whole_store(served, after):
    """3 chunks, the commit after the first: refused naming ``commit``; none of the 3 chunks is
    RESIDENT or OBSERVED, Stats and the tiers are exactly as before."""
    server, stub = served
    tokens = blocks(CHUNKS, 0)
    first, rest = parts(CHUNKS, split=1)[:1], parts(CHUNKS, split=1)[1:]
    trailing = {"payloads": rest, "commit": [_commit(CHUNKS)], "header": [header(tokens)]}[after]
    msgs = [header(tokens), *first, _commit(1), *trailing]
    before_stats = _stats(await stub.Stats(pb.StatsRequest()))
    before = state(server)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Store(iter(msgs))

    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("commit:"), err.value.details()
    await quiesce(server)
    assert state(server) == before
    assert held_blocks(server, tokens, scope="default") == (0, 0)
    assert _stats(await stub.Stats(pb.StatsRequest())) == before_stats
    assert await _hits(stub, tokens, dry_run=True) == 0  # not even OBSERVED
    assert await _hits(stub, tokens, dry_run=False) == 0
    # the same chunks, committed last, are stored whole
    ok = await stub.Store(iter([header(tokens), *first, *rest, _commit(CHUNKS)]))
    assert (ok.chunks_stored, ok.chunks_observed) == (CHUNKS, 0)
    assert await _hits(stub, tokens, dry_run=False) == CHUNKS


async def test_a_commit_alone_after_the_header_may_not_be_followed_either(served):
    """A header-only Store (metadata) with a payload after its commit registers nothing."""
    server, stub = served
    tokens = blocks(CHUNKS, 5_000)
    msgs = [header(tokens), pb.StoreRequest(commit=pb.StoreCommit()), *parts(CHUNKS, split=1)[:1]]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Store(iter(msgs))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("commit:"), err.value.details()
    await quiesce(server)
    assert len(server.index.registry) == 0
    assert await _hits(stub, tokens, dry_run=True) == 0


async def test_a_cancel_after_the_last_commit_still_stores_whole(served):
    """The client writes its whole stream, commit last, and cancels without half-closing: the
    server waits for the stream's end after the commit, the cancel ends it, and the Store is
    stored whole (a commit that was the last message is the client's decision)."""
    server, stub = served
    tokens = blocks(CHUNKS, 9_000)
    call = stub.Store()
    for m in [header(tokens), *parts(CHUNKS, split=1), _commit(CHUNKS)]:
        await call.write(m)
    # bounded wait until the server has read the commit: it waits for the stream's end
    for _ in range(400):
        if server.kv.awaiting_close:
            break
        await asyncio.sleep(0.025)
    assert server.kv.awaiting_close == 1
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await quiesce(server)
    await server.kv.drain()
    assert held_blocks(server, tokens, scope="default") == (CHUNKS, CHUNKS)
    assert state(server)[:2] == (CHUNKS, CHUNKS)
    assert server.metrics.store_chunks.labels("stored")._value.get() == CHUNKS


async def test_a_shutdown_while_waiting_after_the_commit_stores_whole():
    """The server stops while a committed Store waits for its stream's end: the handler is
    cancelled in that wait, and the Store is still stored whole before shutdown completes."""
    server, port = await create_server(config(64))
    tokens = blocks(CHUNKS, 13_000)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = pb_grpc.KVSidecarStub(ch).Store()
        for m in [header(tokens), *parts(CHUNKS, split=1), _commit(CHUNKS)]:
            await call.write(m)
        for _ in range(400):  # bounded wait until the server has read the commit
            if server.kv.awaiting_close:
                break
            await asyncio.sleep(0.025)
        assert server.kv.awaiting_close == 1
        await server.stop(0)
        with pytest.raises(grpc.aio.AioRpcError):
            await call
    assert server.kv.awaiting_close == 0
    assert held_blocks(server, tokens, scope="default") == (CHUNKS, CHUNKS)
    assert server.metrics.store_chunks.labels("stored")._value.get() == CHUNKS
