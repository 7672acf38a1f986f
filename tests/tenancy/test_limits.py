"""Per-tenant limits over real gRPC: each refused with RESOURCE_EXHAUSTED naming the limit,
state unchanged; stream slots released on every path; forget_by_default."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sidecar.app import create_server
from sidecar.client import SidecarClient
from sidecar.config import DirectivesConfig, SidecarConfig
from sidecar.directives import EditMode
from sidecar.errors import InvalidArgument, ResourceExhausted
from sidecar.limits import LimitsConfig, TenantLimits
from sidecar.tiers import StoreConfig
from sidecar.v1 import sidecar_pb2 as pb
from tests.conftest import make_config
from tests.dataplane.test_dataplane import IDENT, LAYOUT, conversation, payloads_for

MiB = 1 << 20


async def serve(**kw):
    server, port = await create_server(make_config(**kw))
    return server, f"127.0.0.1:{port}"


async def test_tokens_per_request(rng):
    limits = LimitsConfig(max_tokens_per_request=2000, tenants={"a": TenantLimits(max_tokens_per_request=100)})
    server, target = await serve(limits=limits)
    toks = np.arange(1, 151, dtype=np.uint32)
    try:
        async with SidecarClient(target, tenant="a") as a, SidecarClient(target, tenant="b") as b:
            msg = "limits.max_tokens_per_request: 150 > 100 for tenant 'a'"
            with pytest.raises(ResourceExhausted, match=msg):
                await a.lookup(toks, identity=IDENT)
            with pytest.raises(ResourceExhausted, match=msg):
                await a.store(toks, identity=IDENT)
            with pytest.raises(ResourceExhausted, match=msg):
                await a.open_session(toks, block_size=1)
            s = await a.open_session(toks[:50], block_size=1)
            with pytest.raises(ResourceExhausted, match=msg):
                await a.append_session(s.session_id, toks)
            assert (await a.get_session(s.session_id)).length == 50
            stats = await a.stats()
            assert stats.registry.entries == 0 and stats.lookups == 0  # nothing stored, nothing counted
            assert (await b.store(toks, identity=IDENT)).chunks_registered > 0  # the default is 2000
    finally:
        await server.stop(0.1)


async def test_concurrent_streams_released_after_errors_and_cancellation():
    server, target = await serve(limits=LimitsConfig(max_concurrent_streams=1))
    limiter = server.edge.limits
    toks = np.arange(1, 101, dtype=np.uint32)
    gate = asyncio.Event()

    async def held_store():  # a Store stream left open holds its tenant's slot
        yield pb.StoreRequest(header=pb.StoreHeader(tokens=toks.tobytes(), identity=pb.CacheIdentity(model_id="m")))
        await gate.wait()

    try:
        async with SidecarClient(target, tenant="a") as a, SidecarClient(target, tenant="b") as b:
            for _ in range(3):  # refusals release their slot
                with pytest.raises(InvalidArgument, match="engine_prefix_len"):
                    await a.lookup(toks, identity=IDENT, engine_prefix_len=1000)
            assert limiter.inflight("a") == 0
            call = a.stub.Store(held_store(), metadata=a.metadata)
            await asyncio.wait_for(_until(lambda: limiter.inflight("a") == 1), 30)
            with pytest.raises(ResourceExhausted, match="limits.max_concurrent_streams: 1 calls in flight for tenant 'a'"):
                await a.lookup(toks, identity=IDENT)
            with pytest.raises(ResourceExhausted, match="max_concurrent_streams"):
                await a.fetch([(1, 0)], identity=IDENT, layout=LAYOUT)
            await b.lookup(toks, identity=IDENT)  # another tenant's slots are its own
            call.cancel()
            await asyncio.wait_for(limiter.wait_idle("a"), 30)
            assert limiter.inflight("a") == 0
            await a.lookup(toks, identity=IDENT)
            sample = server.metrics.registry.get_sample_value
            assert sample("kv_sidecar_inflight_requests", {"method": "Store"}) == 0
            assert sample("kv_sidecar_inflight_requests", {"method": "Lookup"}) == 0
    finally:
        gate.set()
        await server.stop(0.1)


async def _until(cond):
    """Yield to the loop until ``cond()`` (the server runs on this loop)."""
    while not cond():
        await asyncio.sleep(0)


async def test_sessions_per_tenant_override():
    limits = LimitsConfig(tenants={"small": TenantLimits(max_sessions=1), "big": TenantLimits(max_sessions=3)})
    server, target = await serve(limits=limits, directives=DirectivesConfig(max_sessions_per_tenant=2))
    toks = np.arange(1, 20, dtype=np.uint32)
    try:
        async with SidecarClient(target, tenant="small") as small, SidecarClient(target, tenant="big") as big, \
                SidecarClient(target, tenant="other") as other:
            await small.open_session(toks, block_size=1)
            with pytest.raises(ResourceExhausted, match="limits.max_sessions: tenant 'small' has 1 open sessions, the limit is 1"):
                await small.open_session(toks, block_size=1)
            for _ in range(3):  # above directives.max_sessions_per_tenant: the override rules
                await big.open_session(toks, block_size=1)
            with pytest.raises(ResourceExhausted, match="limits.max_sessions: tenant 'big' has 3"):
                await big.open_session(toks, block_size=1)
            for _ in range(2):
                await other.open_session(toks, block_size=1)
            with pytest.raises(ResourceExhausted, match="limits.max_sessions: tenant 'other' has 2 .* the limit is 2"):
                await other.open_session(toks, block_size=1)
            assert len(server.sessions.table) == 6
    finally:
        await server.stop(0.1)


async def test_max_bytes_refused_and_nothing_stored(rng):
    limits = LimitsConfig(tenants={"small": TenantLimits(max_bytes=4096)})
    server, target = await serve(limits=limits, store=StoreConfig(cpu_bytes=64 * MiB))
    toks, _ = conversation(rng, 60)
    try:
        async with SidecarClient(target, tenant="small") as small, SidecarClient(target, tenant="a") as a:
            bounds = (await small.store(toks, identity=IDENT)).chunk_bounds
            before = await small.stats()
            with pytest.raises(ResourceExhausted, match="limits.max_bytes .*'small'"):
                await small.store(toks, identity=IDENT, layout=LAYOUT, payloads=payloads_for(bounds))
            after = await small.stats()
            assert after.registry.entries == before.registry.entries
            assert all(t.objects == 0 for t in after.tiers)
            assert (await small.lookup(toks, identity=IDENT)).summary.chunks_hit == 0
            await a.store(toks, identity=IDENT)
            assert (await a.store(toks, identity=IDENT, layout=LAYOUT, payloads=payloads_for(bounds))).chunks_stored
    finally:
        await server.stop(0.1)


def test_byte_limits_become_store_quotas_and_bad_limits_name_the_field():
    cfg = make_config(limits=LimitsConfig(max_bytes=10 * MiB, max_bytes_per_tier={"cpu": MiB},
                                          tenants={"a": TenantLimits(max_bytes_per_tier={"cpu": 2 * MiB})}))
    store = cfg.limits.store_config(cfg.store)
    assert store.quota_for("a").max_bytes == 10 * MiB and store.quota_for("a").max_bytes_per_tier["cpu"] == 2 * MiB
    assert store.quota_for("zz").max_bytes_per_tier["cpu"] == MiB
    for kw, match in (
        (dict(max_tokens_per_request=0), "limits.max_tokens_per_request must be >= 1"),
        (dict(max_bytes_per_tier={"ssd": 1}), "limits.max_bytes_per_tier: unknown tier 'ssd'"),
        (dict(max_concurrent_streams=-1), "limits.max_concurrent_streams"),
    ):
        with pytest.raises(ValueError, match=match):
            LimitsConfig(**kw)
    with pytest.raises(ValueError, match="limits.tenants.<id>.max_sessions"):
        TenantLimits(max_sessions=0)
    with pytest.raises(ValueError, match="contradicts directives.forget_tenants"):
        make_config(directives=DirectivesConfig(forget_tenants=("bank",)),
                    limits=LimitsConfig(tenants={"bank": TenantLimits(forget_by_default=False)}))


async def test_forget_by_default_applies_to_amortize_directives():
    limits = LimitsConfig(tenants={"clinic": TenantLimits(forget_by_default=True)})
    server, target = await serve(limits=limits, directives=DirectivesConfig(forget_tenants=("bank",)))
    toks = np.arange(1, 65, dtype=np.uint32)
    directives = [(10, 12, [5]), (40, 41, [6, 6, 6])]
    try:
        modes = {}
        for tenant in ("clinic", "bank", "shop"):
            async with SidecarClient(target, tenant=tenant) as c:
                s = await c.open_session(toks, block_size=1)
                plan = await c.splice(s.session_id, 0, directives)
                modes[tenant] = {e.mode for e in plan.edits}
        assert modes == {"clinic": {EditMode.FORGET}, "bank": {EditMode.FORGET}, "shop": {EditMode.AMORTIZE}}
    finally:
        await server.stop(0.1)


def test_limits_from_yaml_keys():
    from sidecar.config import load_config

    cfg = load_config(env={}, overrides={
        "limits.max_concurrent_streams": 8, "limits.tenants.clinic.forget_by_default": True,
        "limits.tenants.clinic.max_bytes_per_tier": {"cpu": 1024},
    })
    assert isinstance(cfg, SidecarConfig)
    assert cfg.limits.tenants["clinic"].forget_by_default is True
    assert cfg.limits.tenants["clinic"].max_bytes_per_tier == {"cpu": 1024}
