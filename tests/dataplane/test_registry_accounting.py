"""Registry entries change only through registry methods, so its byte count stays the sum of
its entries' (a regression: a chunk registered without KV at one position, then Stored with KV at
another, left ``nbytes`` short by the grown left context)."""

from __future__ import annotations

import numpy as np

from sidecar.client import SidecarClient
from sidecar.registry.entry import ChunkEntry, ChunkHash, EntryState
from sidecar.registry.registry import InMemoryRegistry, RegistryConfig
from tests.conftest import ANCHORS, message
from tests.dataplane.test_dataplane import IDENT, LAYOUT, payloads_for, start


def consistent(reg: InMemoryRegistry) -> bool:
    return reg.nbytes == sum(e.nbytes for e in reg.entries())


async def test_nbytes_is_the_sum_after_observed_then_stored_elsewhere(rng):
    server, target = await start()
    try:
        reg = server.index.registry
        async with SidecarClient(target, tenant="a") as c:
            for round_ in range(3):
                body = np.concatenate([message(rng, 200, ANCHORS[1]), message(rng, 150, ANCHORS[2])]).astype(np.uint32)
                # metadata only, at position 0: short (empty) left contexts
                await c.store(body, identity=IDENT)
                assert consistent(reg)
                # the same chunks with KV after a header: longer left contexts, another position
                full = np.concatenate([message(rng, 300 + round_), body]).astype(np.uint32)
                meta = await c.store(full, identity=IDENT)
                res = await c.store(full, identity=IDENT, layout=LAYOUT, payloads=payloads_for(meta.chunk_bounds))
                assert res.chunks_stored >= 3
                assert consistent(reg), (reg.nbytes, sum(e.nbytes for e in reg.entries()))
            moved = [e for e in reg.entries() if e.state is EntryState.RESIDENT and e.source_pos > 300]
            assert moved and all(len(e.left_context) == 4 * reg.config.left_context_tokens for e in moved)
    finally:
        await server.stop(0.1)


def test_update_adjusts_the_byte_count():
    reg = InMemoryRegistry(RegistryConfig(left_context_tokens=8))
    e = ChunkEntry(key=ChunkHash(1), scope="s", tokens=b"\1\0\0\0" * 4, source_pos=0, prefix_digest=0, left_context=b"")
    assert reg.insert(e)
    before = reg.nbytes
    reg.update(e, source_pos=40, prefix_digest=7, left_context=b"\2\0\0\0" * 8)
    assert (e.source_pos, e.prefix_digest) == (40, 7) and reg.nbytes == before + 32 and consistent(reg)
    reg.update(e, source_pos=0, prefix_digest=0, left_context=b"")
    assert reg.nbytes == before and consistent(reg)
    loose = ChunkEntry(key=ChunkHash(2), scope="s", tokens=b"\1\0\0\0", source_pos=0, prefix_digest=0, left_context=b"")
    reg.update(loose, source_pos=4, prefix_digest=1, left_context=b"\3\0\0\0")  # not registered: nothing counted
    assert reg.nbytes == before and loose.left_context == b"\3\0\0\0"
