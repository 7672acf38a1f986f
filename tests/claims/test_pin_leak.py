"""Pins taken for Fetch are released on every path: 1,000 Fetch calls cancelled by their
clients mid-stream (100 client channels x 10 calls, before the first frame or after it), plus
failing Fetches, leave zero tier pins and zero stream slots held."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc

from sidecar.api.kv import fetch_request
from sidecar.app import create_server
from sidecar.client import SidecarClient
from sidecar.config import AuthConfig
from sidecar.identity import KVLayout
from tests.claims.helpers import BLOCK, IDENT, LAYOUT, blocks, config, store

CLIENTS, CALLS = 100, 10


async def test_a_thousand_cancelled_fetches_leak_no_pins():
    # 8 frames per block; "ops" sees the whole server in Stats (auth.operators)
    cfg = dataclasses.replace(config(200), fetch_part_bytes=512, auth=AuthConfig(operators=("ops",)))
    server, port = await create_server(cfg)
    target = f"127.0.0.1:{port}"
    try:
        async with SidecarClient(target, tenant="t1") as c:
            r = blocks(32, 1000)
            await store(c, r)
            await c.claim("hot", identity=IDENT, mode="hard_protected", tokens=r)  # claims + Fetch together
            hashes = list((await c.get_claim("hot")).chunk_hashes)
            items = [(h, i * BLOCK) for i, h in enumerate(hashes)]
            req = fetch_request(IDENT, LAYOUT, None, items, True)
            bad = fetch_request(IDENT, KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16"),
                                 None, items, True)  # layout mismatch: FAILED_PRECONDITION
            frames_seen = 0

            async def one_client(k: int) -> None:
                nonlocal frames_seen
                async with SidecarClient(target, tenant="t1") as cl:
                    for j in range(CALLS):
                        call = cl._fetch(req, metadata=cl.metadata)
                        if (k + j) % 3:  # after some frames
                            it = call.__aiter__()
                            for _ in range(1 + (k + j) % 5):
                                await it.__anext__()
                                frames_seen += 1
                        call.cancel()
                    call = cl._fetch(bad, metadata=cl.metadata)
                    try:
                        async for _ in call:
                            pass
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() is grpc.StatusCode.FAILED_PRECONDITION

            for batch in range(0, CLIENTS, 25):
                await asyncio.wait_for(asyncio.gather(*(one_client(k) for k in range(batch, batch + 25))), 120)
            assert frames_seen > 0
            # Quiescence: cancelled handlers finish on the server's loop (bounded wait, no timing assert).
            gauge = server.metrics.inflight.labels("Fetch")
            for _ in range(400):
                if gauge._value.get() == 0:
                    break
                await asyncio.sleep(0.025)
            async with SidecarClient(target, tenant="ops") as op:
                st = await op.stats()
            assert st.pins_in_flight == 0
            assert server.dataplane.store.pins_in_flight() == 0
            assert gauge._value.get() == 0
            assert server.edge.limits._inflight.get("t1", 0) == 0
            # and the data is intact and servable
            full = await c.fetch(items, identity=IDENT, layout=LAYOUT, raw=True)
            assert all(f.ok for f in full) and len(full) == 32
            assert (await c.get_claim("hot")).state == "materialized"
    finally:
        await server.stop(0.1)
