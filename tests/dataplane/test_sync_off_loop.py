"""Tier deletes that follow registry evictions run off the event loop (a regression:
``DataPlane.sync`` called ``TieredStore.delete``, which waits for the writer lock held across
disk and Redis I/O, on the loop thread: every RPC stalled behind one slow disk write)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

from sidecar.app import create_server
from sidecar.client import SidecarClient
from sidecar.registry.registry import RegistryConfig
from tests.claims.helpers import IDENT, blocks, config, store


async def test_registry_eviction_deletes_do_not_block_the_loop():
    cfg = dataclasses.replace(config(200), registry=RegistryConfig(capacity_entries=4, scope_share=1.0))
    server, port = await create_server(cfg)
    tiers = server.dataplane.store
    try:
        async with SidecarClient(f"127.0.0.1:{port}", tenant="t1") as c:
            await store(c, blocks(4, 0))
            assert len(tiers.list_chunks()) == 4
            # A slow tier write in progress: the writer lock is held (released by the test, or
            # after 10 s so that a blocked loop fails the test instead of hanging it).
            acquired, release = threading.Event(), threading.Event()
            held = [False]

            def writer() -> None:
                with tiers._write_lock:
                    held[0] = True
                    acquired.set()
                    release.wait(10)
                    held[0] = False

            t = threading.Thread(target=writer)
            t.start()
            acquired.wait()
            # metadata-only Store of 4 new chunks: the registry evicts the 4 stored ones, whose
            # payloads must be deleted (behind the writer lock)
            pending = asyncio.ensure_future(c.store(blocks(4, 10_000), identity=IDENT))
            for _ in range(500):  # bounded wait for the Store to reach the registry
                await asyncio.sleep(0.01)
                if server.index.registry.stats.evictions >= 4:
                    break
            assert server.index.registry.stats.evictions >= 4
            await c.ping()  # the loop serves while the delete waits for the lock
            assert held[0] and not pending.done()
            release.set()
            res = await asyncio.wait_for(pending, 10)
            t.join()
            assert res.chunks_registered == 4
            assert tiers.list_chunks() == []  # the evicted entries' payloads went with them
    finally:
        await server.stop(0.1)
