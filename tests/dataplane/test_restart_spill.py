"""A graceful stop moves what only the memory tiers hold to the disk tier: after a
restart on the same disk every acknowledged chunk is served with its exact bytes."""

from __future__ import annotations

import logging

import numpy as np
import torch

from sidecar.app import create_server
from sidecar.client import SidecarClient
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.tiers import StoreConfig
from tests.conftest import ANCHORS, make_config, message

LAYOUT = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")
IDENT = CacheIdentity(model_id="spill", kv_layout=LAYOUT.fingerprint())


async def _store_all(target: str, rng, n: int) -> tuple[list[np.ndarray], dict[int, bytes]]:
    prompts, stored = [], {}
    async with SidecarClient(target, tenant="t") as c:
        for i in range(n):
            tokens = np.concatenate([message(rng, 200, ANCHORS[0]), message(rng, 150, ANCHORS[1])])
            bounds = (await c.store(tokens, identity=IDENT)).chunk_bounds
            g = torch.Generator().manual_seed(i)
            per = LAYOUT.bytes_per_token // 4
            pl = {a: torch.randn((b - a) * per, generator=g) for a, b in zip(bounds[:-1], bounds[1:])}
            res = await c.store(tokens, identity=IDENT, layout=LAYOUT, payloads=pl)
            assert res.chunks_stored == len(pl)
            prompts.append(tokens)
            for seg in (await c.lookup(tokens, identity=IDENT)).hits():
                stored[seg.chunk_hash] = pl[seg.start].numpy().tobytes()
    return prompts, stored


async def test_graceful_stop_spills_the_cpu_tier_to_disk(tmp_path, rng, caplog) -> None:
    store = StoreConfig(cpu_bytes=64 << 20, disk_path=str(tmp_path / "disk"), disk_bytes=64 << 20)
    server, port = await create_server(make_config(store=store))
    prompts, stored = await _store_all(f"127.0.0.1:{port}", rng, 4)
    assert {server.dataplane.store.locate(h.to_bytes(8, "big")).value for h in stored} == {"cpu"}
    with caplog.at_level(logging.INFO, logger="sidecar"):
        await server.stop(1.0)
    assert any(f"{len(stored)} chunks moved from memory to the disk tier, 0 left" in r.getMessage()
               for r in caplog.records)

    server, port = await create_server(make_config(store=store))
    try:
        async with SidecarClient(f"127.0.0.1:{port}", tenant="t") as c:
            for tokens in prompts:
                hits = (await c.lookup(tokens, identity=IDENT)).hits()
                assert hits and sum(s.end - s.start for s in hits) == len(tokens)
                got = await c.fetch([(s.chunk_hash, s.start) for s in hits], identity=IDENT, layout=LAYOUT)
                for s, kv in zip(hits, got):
                    assert kv.ok and bytes(kv.data) == stored[s.chunk_hash]
    finally:
        await server.stop(0.2)


async def test_without_a_disk_tier_the_stop_says_what_it_loses(rng, caplog) -> None:
    server, port = await create_server(make_config(store=StoreConfig(cpu_bytes=64 << 20)))
    _, stored = await _store_all(f"127.0.0.1:{port}", rng, 2)
    with caplog.at_level(logging.INFO, logger="sidecar"):
        await server.stop(0.2)
    assert any(f"0 chunks moved from memory to the disk tier, {len(stored)} left in memory (lost): no disk tier"
               in r.getMessage() for r in caplog.records)
