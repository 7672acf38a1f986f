"""1,000 clients that go away mid-stream leave nothing behind.

100 client channels make 10 calls each over real gRPC: Store streams abandoned mid-payload
(cancelled, or the whole channel closed under them), Fetch streams cancelled after their first
frame, and FetchSession streams of a held session cancelled after their first frame. The
tests/claims/test_pin_leak.py test does the same for Fetch alone. Afterwards: no RPC in flight
(``kv_sidecar_inflight_requests``), no tier pin, no tenant stream slot, no handler coroutine (and
so no buffer it held) alive, the registry, tiers and quota exactly as before the abandoned Stores,
and the store's locks free: Store, Fetch, Evict and Delete all complete.
"""

from __future__ import annotations

import asyncio
import gc
import types

import grpc

from sidecar.api.kv import fetch_request
from sidecar.app import create_server
from sidecar.client import SidecarClient
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc
from tests.claims.helpers import BLOCK, IDENT, LAYOUT, blocks, config, store
from tests.dataplane.test_store_faults import header, parts, state

CHANNELS, CALLS = 100, 10
HANDLERS = ("Store", "Fetch", "FetchSession")


def _live_handlers() -> int:
    """Frames of the server's streaming handlers still alive (each would hold its buffers):
    Store is a coroutine, Fetch and FetchSession are async generators."""
    gc.collect()
    n = 0
    for o in gc.get_objects():
        t = type(o)  # not isinstance: it would touch lazy module attributes of every object
        if t is types.CoroutineType and o.cr_frame is not None and o.cr_code.co_name in HANDLERS:
            n += 1
        elif t is types.AsyncGeneratorType and o.ag_frame is not None and o.ag_code.co_name in HANDLERS:
            n += 1
    return n


async def _quiesce(server) -> None:
    gauges = [server.metrics.inflight.labels(m) for m in HANDLERS]
    for _ in range(800):  # bounded wait for cancelled handlers to finish (liveness, not timing)
        if all(g._value.get() == 0 for g in gauges):
            return
        await asyncio.sleep(0.025)
    raise AssertionError({m: g._value.get() for m, g in zip(HANDLERS, gauges)})


async def test_a_thousand_clients_vanishing_mid_stream_leave_nothing(tmp_path) -> None:
    server, port = await create_server(config(400))
    target = f"127.0.0.1:{port}"
    try:
        async with SidecarClient(target, tenant="default") as c:
            kept = blocks(16, 1000)
            await store(c, kept)
            plan = await c.lookup(kept, identity=IDENT)
            items = [(s.chunk_hash, s.start) for s in plan.hits()]
            fetch_req = fetch_request(IDENT, LAYOUT, None, items, True)
            sess = await c.open_session(kept, block_size=BLOCK, identity=IDENT, held=True)
        before = state(server)
        opened = {"store": 0, "fetch": 0, "session": 0}
        async with grpc.aio.insecure_channel(target) as ch:  # the probe sees a live handler
            call = pb_grpc.KVSidecarStub(ch).Store()
            await call.write(header(blocks(8, 5_000)))
            gauge = server.metrics.inflight.labels("Store")
            for _ in range(400):
                if gauge._value.get():
                    break
                await asyncio.sleep(0.025)
            assert _live_handlers() == 1
            call.cancel()

        async def one_channel(k: int) -> None:
            ch = grpc.aio.insecure_channel(target)
            stub = pb_grpc.KVSidecarStub(ch)
            fetch = ch.unary_stream("/sidecar.v1.KVSidecar/Fetch", request_serializer=pb.FetchRequest.SerializeToString,
                                    response_deserializer=pb.FetchResponse.FromString)
            try:
                for j in range(CALLS):
                    kind = (k + j) % 3
                    if kind == 0:  # Store abandoned after its header and some payload
                        call = stub.Store()
                        await call.write(header(blocks(8, 10_000 + 100 * k + j)))
                        for part in parts(8)[: 1 + j % 6]:
                            await call.write(part)
                        opened["store"] += 1
                        if j == CALLS - 1:
                            await ch.close(grace=None)  # the client vanishes with the stream open
                            return
                        call.cancel()
                    elif kind == 1:  # Fetch cancelled after its first frame
                        call = fetch(fetch_req)
                        await call.__aiter__().__anext__()
                        opened["fetch"] += 1
                        call.cancel()
                    else:  # FetchSession of the held session cancelled after its first frame
                        call = stub.FetchSession(pb.FetchSessionRequest(session_id=sess.session_id,
                                                                         layout=fetch_req.layout, raw=True))
                        await call.__aiter__().__anext__()
                        opened["session"] += 1
                        call.cancel()
            finally:
                await ch.close(grace=None)

        for batch in range(0, CHANNELS, 25):
            await asyncio.wait_for(asyncio.gather(*(one_channel(k) for k in range(batch, batch + 25))), 120)
        assert sum(opened.values()) == CHANNELS * CALLS and min(opened.values()) > 0

        await _quiesce(server)
        assert _live_handlers() == 0
        assert server.dataplane.store.pins_in_flight() == 0
        assert server.edge.limits._inflight.get("default", 0) == 0
        assert state(server) == before  # no abandoned Store registered or stored anything
        async with SidecarClient(target, tenant="default") as c:  # locks free, data intact
            fresh = blocks(4, 90_000)
            await asyncio.wait_for(store(c, fresh), 60)
            got = await asyncio.wait_for(c.fetch(items, identity=IDENT, layout=LAYOUT, raw=True), 60)
            assert all(f.ok for f in got) and len(got) == len(items)
            hashes = [s.chunk_hash for s in (await c.lookup(fresh, identity=IDENT)).hits()]
            assert await asyncio.wait_for(c.evict(hashes[:1]), 60) == 1
            assert await asyncio.wait_for(c.delete(hashes), 60) == len(hashes)
    finally:
        await server.stop(0.1)
