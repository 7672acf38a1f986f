"""A Store commits only when its client commits it.

Hundreds of concurrent Store streams over real gRPC end at message boundaries without their
commit message: cancelled, past their deadline, their channel closed under them, or half-closed
(some after every payload part was sent whole). Afterwards the registry, the tiers, the tenant's
quota, the Store metrics and the data plane's counters are exactly as before. Streams cancelled
right after their commit are each stored whole or not at all, never in part.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from sidecar.app import create_server
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc
from tests.claims.helpers import blocks, config, held_blocks
from tests.dataplane.test_store_faults import N, committed, header, parts, quiesce, state

STREAMS, AT_ONCE = 320, 16
ENDINGS = ("cancel", "deadline", "vanish", "half-close", "torn")


def _observed(server) -> tuple:
    """Everything a Store may change: state (registry, tier objects, quota), metrics, counters."""
    m = server.metrics
    counters = server.dataplane.counters
    return (
        state(server),
        tuple(m.store_chunks.labels(k)._value.get() for k in ("registered", "refreshed", "stored")),
        m.store_bytes._value.get(),
        counters.stored_chunks, counters.stored_bytes,
        server.edge.limits._inflight.get("default", 0),
    )


def _stream(i: int) -> list[pb.StoreRequest]:
    """A whole valid stream of N chunks (header, two parts per chunk), distinct tokens per i."""
    return [header(blocks(N, 1_000_000 + 1_000 * i)), *parts(N)]


async def _abandon(target: str, i: int, ending: str, rng: random.Random) -> None:
    msgs = _stream(i)
    if ending == "torn":  # the first half whole, then one part of a later chunk
        msgs = msgs[: 1 + N] + [msgs[1 + N + 2]]
    k = rng.randint(1, len(msgs))  # messages sent before the stream ends: a message boundary
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.KVSidecarStub(ch)
        timeout = rng.uniform(0.02, 0.2) if ending == "deadline" else None
        call = stub.Store(timeout=timeout)
        try:
            for m in msgs[:k]:
                await call.write(m)
            if ending == "cancel" or ending == "torn":
                await asyncio.sleep(rng.uniform(0, 0.01))
                call.cancel()
            elif ending == "vanish":
                await ch.close(grace=None)
            elif ending == "half-close":
                await call.done_writing()
            await call  # deadline: waits for it to expire
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            # what the client sees of its own cancel or deadline is grpc's business (a write
            # racing it may report INTERNAL); a half-close without a commit is refused by name
            if ending == "half-close":
                assert isinstance(exc, grpc.aio.AioRpcError), exc
                assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT, exc.details()
                assert exc.details().startswith(("commit:", "payload.last")), exc.details()
        else:
            raise AssertionError(f"{ending}: a Store without its commit succeeded")


async def _bounded(n: int, job) -> None:
    gate = asyncio.Semaphore(AT_ONCE)

    async def one(i: int) -> None:
        async with gate:
            await asyncio.wait_for(job(i), 60)

    await asyncio.gather(*(one(i) for i in range(n)))


@pytest.fixture
async def served():
    server, port = await create_server(config(N * 120))
    yield server, f"127.0.0.1:{port}"
    await server.stop(0.1)


async def test_streams_ending_without_a_commit_change_nothing(served):
    server, target = served
    async with grpc.aio.insecure_channel(target) as ch:  # something stored already: kept exactly so
        await pb_grpc.KVSidecarStub(ch).Store(iter(committed(_stream(-1))))
    before = _observed(server)
    rng = random.Random(7)
    endings = [ENDINGS[i % len(ENDINGS)] for i in range(STREAMS)]
    seeds = [rng.randrange(1 << 30) for _ in range(STREAMS)]
    await _bounded(STREAMS, lambda i: _abandon(target, i, endings[i], random.Random(seeds[i])))
    await quiesce(server)
    assert _observed(server) == before
    assert server.dataplane.store.pins_in_flight() == 0
    # the same streams, committed, are stored whole
    async with grpc.aio.insecure_channel(target) as ch:
        r = await pb_grpc.KVSidecarStub(ch).Store(iter(committed(_stream(3))))
        assert r.chunks_stored == N


async def test_a_commit_is_stored_whole_or_not_at_all_when_the_call_is_cancelled(served):
    """The commit is the client's decision: a cancel racing it may drop the commit message on
    the wire (nothing stored) or arrive after it (stored whole), never half of a Store."""
    server, target = served
    rng = random.Random(11)
    delays = [rng.uniform(0, 0.004) for _ in range(120)]

    async def commit_then_cancel(i: int) -> None:
        async with grpc.aio.insecure_channel(target) as ch:
            call = pb_grpc.KVSidecarStub(ch).Store()
            for m in committed(_stream(i)):
                await call.write(m)
            await asyncio.sleep(delays[i])
            call.cancel()
            try:
                await call
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass

    await _bounded(len(delays), commit_then_cancel)
    await quiesce(server)
    await server.kv.drain()
    held = [held_blocks(server, blocks(N, 1_000_000 + 1_000 * i), scope="default") for i in range(len(delays))]
    assert set(held) <= {(0, 0), (N, N)}, held
    stored = sum(h == (N, N) for h in held)
    registry, objects, _ = state(server)
    assert registry == objects == stored * N
    m = server.metrics
    assert m.store_chunks.labels("stored")._value.get() == stored * N
    assert server.dataplane.counters.stored_chunks == stored * N
