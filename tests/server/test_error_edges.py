"""Error edges and promises the code keeps: library ValueErrors are INTERNAL, a closed
store is UNAVAILABLE, Evict is never retried, registry evictions are counted, and a tier event
buffer that overflowed makes the registry resync from the store."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from sidecar.api.status import status_for
from sidecar.app import create_server
from sidecar.client import RetryPolicy, SidecarClient
from sidecar.errors import InvalidArgument
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.registry.entry import EntryState
from sidecar.registry.registry import RegistryConfig
from sidecar.tiers import StoreConfig
from sidecar.tiers.errors import TierUnavailableError
from tests.conftest import ANCHORS, make_config, message

LAYOUT = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")
IDENT = CacheIdentity(model_id="edges", kv_layout=LAYOUT.fingerprint())


def test_status_for_tells_caller_mistakes_from_library_bugs() -> None:
    with pytest.raises(ValueError) as ours:
        RegistryConfig(capacity_entries=0)  # the sidecar's own validation
    assert status_for(ours.value)[0] is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ValueError) as deep:
        np.zeros(-1)  # raised inside numpy: a bug of ours if it ever reaches the edge
    assert status_for(deep.value)[0] is grpc.StatusCode.INTERNAL
    with pytest.raises(RuntimeError) as deep_torch:
        torch.zeros(2, 3) @ torch.zeros(2, 3)
    assert status_for(deep_torch.value)[0] is grpc.StatusCode.INTERNAL
    assert status_for(InvalidArgument("x: bad"))[0] is grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(TierUnavailableError("closed"))[0] is grpc.StatusCode.UNAVAILABLE


def _payloads(bounds, seed: int = 0) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per = LAYOUT.bytes_per_token // 4
    return {a: torch.randn((b - a) * per, generator=g) for a, b in zip(bounds[:-1], bounds[1:])}


async def test_closed_store_is_unavailable_and_evict_is_not_retried(rng) -> None:
    server, port = await create_server(make_config(store=StoreConfig(cpu_bytes=16 << 20)))
    try:
        tokens = np.concatenate([message(rng, 200, ANCHORS[0]), message(rng, 150, ANCHORS[1])])
        async with SidecarClient(f"127.0.0.1:{port}", tenant="t", retry=RetryPolicy(attempts=4)) as c:
            bounds = (await c.store(tokens, identity=IDENT)).chunk_bounds
            await c.store(tokens, identity=IDENT, layout=LAYOUT, payloads=_payloads(bounds))
            keys = [s.chunk_hash for s in (await c.lookup(tokens, identity=IDENT)).hits()]
            server.dataplane.store.close()
            with pytest.raises(Exception) as err:
                await c.evict(keys)
            assert getattr(err.value, "code", None) is grpc.StatusCode.UNAVAILABLE, err.value
        calls = server.metrics.registry.get_sample_value(
            "kv_sidecar_requests_total", {"method": "Evict", "code": "UNAVAILABLE"})
        assert calls == 1  # UNAVAILABLE is transient, but Evict is not idempotent: one call only
    finally:
        await server.stop(0.2)


async def test_registry_evictions_are_counted(rng) -> None:
    server, port = await create_server(make_config(registry=RegistryConfig(capacity_entries=4, scope_share=1.0)))
    try:
        async with SidecarClient(f"127.0.0.1:{port}", tenant="t") as c:
            for i in range(4):
                tokens = np.concatenate([message(rng, 200, ANCHORS[0]), message(rng, 150, ANCHORS[1])])
                await c.store(tokens, identity=IDENT)
        assert len(server.index.registry) == 4
        n = server.metrics.registry.get_sample_value(
            "kv_sidecar_registry_evictions_total", {"reason": "capacity_entries"})
        assert n is not None and n >= 4
    finally:
        await server.stop(0.2)


async def test_event_overflow_resyncs_the_registry(rng) -> None:
    """A CPU tier that holds ~2 conversations and an event buffer of 1: Stores evict earlier
    chunks, most eviction events are dropped, and the registry still ends up exactly matching
    the store (no entry claims KV the tiers no longer hold)."""
    per_conv = 350 * LAYOUT.bytes_per_token
    server, port = await create_server(make_config(store=StoreConfig(cpu_bytes=2 * per_conv + 4096, max_events=1)))
    try:
        async with SidecarClient(f"127.0.0.1:{port}", tenant="t") as c:
            for i in range(6):
                tokens = np.concatenate([message(rng, 200, ANCHORS[0]), message(rng, 150, ANCHORS[1])])
                bounds = (await c.store(tokens, identity=IDENT)).chunk_bounds
                await c.store(tokens, identity=IDENT, layout=LAYOUT, payloads=_payloads(bounds, i))
        dp = server.dataplane
        assert dp.store.stats().events_dropped > 0
        assert dp.counters.events.get("resync", 0) >= 1
        for e in server.index.registry.entries():
            held = dp.store.locate(e.key.to_bytes(8, "big")) is not None
            assert (e.state is EntryState.RESIDENT) == held, (e.key, e.state, held)
    finally:
        await server.stop(0.2)


async def test_stats_show_a_tenant_only_its_own_share(rng) -> None:
    """Tenant b's Stats do not move when tenant a works (entries, lookups, tier bytes); an
    operator (``auth.operators``) sees the whole server."""
    from sidecar.config import AuthConfig

    server, port = await create_server(make_config(store=StoreConfig(cpu_bytes=16 << 20),
                                                   auth=AuthConfig(operators=("ops",))))
    target = f"127.0.0.1:{port}"
    try:
        async with SidecarClient(target, tenant="a") as a, SidecarClient(target, tenant="b") as b, \
                SidecarClient(target, tenant="ops") as ops:
            before = await b.stats()
            tokens = np.concatenate([message(rng, 200, ANCHORS[0]), message(rng, 150, ANCHORS[1])])
            bounds = (await a.store(tokens, identity=IDENT)).chunk_bounds
            await a.store(tokens, identity=IDENT, layout=LAYOUT, payloads=_payloads(bounds))
            for _ in range(3):
                await a.lookup(tokens, identity=IDENT)
            after, mine, everything = await b.stats(), await a.stats(), await ops.stats()
        fields = lambda st: (st.registry.entries, st.lookups, st.lookup_tokens, st.recovered_exact_tokens,  # noqa: E731
                             sorted((t.tier, t.bytes, t.objects, t.hits) for t in st.tiers))
        assert fields(after) == fields(before)
        assert after.registry.entries == 0 and after.lookups == 0
        assert mine.lookups == 3 and mine.registry.entries == len(bounds) - 1
        assert {t.tier: t.objects for t in mine.tiers}["cpu"] == len(bounds) - 1  # its own objects
        own_cpu = {t.tier: t.bytes for t in mine.tiers}["cpu"]
        assert own_cpu >= len(tokens) * LAYOUT.bytes_per_token  # payloads plus object headers
        assert own_cpu == {t.tier: t.bytes for t in everything.tiers}["cpu"]  # a is the only tenant holding KV
        assert everything.lookups == 3 and everything.registry.entries == mine.registry.entries
        assert {t.tier: t.objects for t in everything.tiers}["cpu"] == len(bounds) - 1
    finally:
        await server.stop(0.2)


async def test_a_flooding_tenant_evicts_only_its_own_entries(rng) -> None:
    """Registry fair share (``registry.scope_share``): tenant b holds a few entries; tenant a
    registers far more metadata-only chunks than the registry holds; b keeps every entry (and
    its KV), a pays with its own least recently used ones."""
    server, port = await create_server(make_config(registry=RegistryConfig(capacity_entries=40, scope_share=0.5),
                                                   store=StoreConfig(cpu_bytes=16 << 20)))
    target = f"127.0.0.1:{port}"
    try:
        async with SidecarClient(target, tenant="a") as a, SidecarClient(target, tenant="b") as b:
            mine = np.concatenate([message(rng, 200, ANCHORS[0]), message(rng, 150, ANCHORS[1])])
            bounds = (await b.store(mine, identity=IDENT)).chunk_bounds
            await b.store(mine, identity=IDENT, layout=LAYOUT, payloads=_payloads(bounds))
            held = len((await b.lookup(mine, identity=IDENT)).hits())
            assert held == len(bounds) - 1
            for _ in range(30):  # ~60 chunks per call: many times the registry's capacity
                flood = np.concatenate([message(rng, 120, ANCHORS[2 + i % 2]) for i in range(8)])
                await a.store(flood, identity=IDENT)
            after = await b.lookup(mine, identity=IDENT)
            assert len(after.hits()) == held
            got = await b.fetch([(s.chunk_hash, s.start) for s in after.hits()], identity=IDENT, layout=LAYOUT)
            assert all(kv.ok for kv in got)
        reg = server.index.registry
        assert reg.scope_entries("b") == held and len(reg) <= 40
        share = server.metrics.registry.get_sample_value(
            "kv_sidecar_registry_evictions_total", {"reason": "scope_share"})
        assert share and share > 0
    finally:
        await server.stop(0.2)
