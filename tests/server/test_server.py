"""End-to-end over real gRPC on loopback: Lookup, Store, Stats, health, reflection, metrics."""

from __future__ import annotations

import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sidecar.app import SERVICE_NAME, ServerThread, create_server
from sidecar.client import SidecarClient, SyncSidecarClient
from sidecar.config import DEFAULT_RECOMPUTE_TOKENS
from sidecar.registry.lookup_plan import Fidelity, SegmentKind
from tests.conftest import ANCHORS, make_config, message


def prompt(rng, header: int, body: np.ndarray) -> np.ndarray:
    return np.concatenate([message(rng, header, ANCHORS[0]), body]).astype(np.uint32)


async def test_lookup_store_roundtrip(client, identity, rng):
    body = np.concatenate([message(rng, 1500, ANCHORS[1]), message(rng, 600, ANCHORS[2])])
    first = prompt(rng, 50, body)
    plan = await client.lookup(first, identity=identity, dry_run=True)
    plan.check_tiling(len(first))
    assert plan.summary.prefill_tokens == len(first)

    res = await client.store(first, identity=identity)
    assert res.chunks_registered == res.chunks_total > 0

    second = prompt(rng, 1000, body)  # a different agent header shifts the whole body
    plan = await client.lookup(second, identity=identity, dry_run=True, engine_prefix_len=1, recompute_tokens=0)
    plan.check_tiling(len(second))
    s = plan.summary
    assert s.prefix_tokens == 1 and s.shifted_tokens == len(body) and s.prefill_tokens == 1000
    assert s.prefix_tokens + s.exact_tokens + s.shifted_tokens + s.prefill_tokens == len(second)
    hits = plan.hits()
    assert all(h.delta == 950 and h.fidelity is Fidelity.APPROXIMATE for h in hits)
    assert plan.segments[0].kind is SegmentKind.ENGINE_PREFIX

    # Unset guards take the server's defaults (default_recompute_tokens, default_repair_scope):
    # the first k tokens of every shifted stored chunk are re-prefilled, so the body (one stored
    # sequence) comes back as one hit segment per chunk; an explicit 0 turns the guard off (above).
    k = DEFAULT_RECOMPUTE_TOKENS
    default = await client.lookup(second, identity=identity, dry_run=True, engine_prefix_len=1)
    assert default.hit_segments().tolist() == [[h.start + k, h.end] for h in hits]
    assert all(h.chunk_offset == k for h in default.hits())
    assert default.summary.shifted_tokens == len(body) - k * len(hits)
    # repair_scope "segment": once, at the segment's start
    seg = await client.lookup(second, identity=identity, dry_run=True, engine_prefix_len=1, repair_scope="segment")
    assert seg.hit_segments().tolist() == [[hits[0].start + k, hits[-1].end]]
    assert seg.hits()[0].chunk_offset == k and all(h.chunk_offset == 0 for h in seg.hits()[1:])
    assert seg.summary.shifted_tokens == len(body) - k

    # Observed (metadata-only) chunks are counted in observer mode but never served.
    served = await client.lookup(second, identity=identity)
    assert served.summary.chunks_hit == 0 and not served.dry_run

    again = await client.store(first, identity=identity)
    assert again.chunks_registered == 0 and again.chunks_refreshed == res.chunks_total

    stats = await client.stats()
    assert stats.registry.entries == res.chunks_total
    # five Lookups; the shifted tokens counted are those of the three dry runs that found hits
    assert stats.lookups == 5
    assert stats.recovered_shifted_tokens == len(body) + default.summary.shifted_tokens + seg.summary.shifted_tokens


async def test_accepts_lists_numpy_and_bytes(client, identity, rng):
    toks = message(rng, 300)
    await client.store(toks.astype(np.int64), identity=identity)
    for form in (toks.tolist(), toks.astype(np.int32), toks.astype("<u4").tobytes()):
        plan = await client.lookup(form, identity=identity, dry_run=True)
        assert plan.summary.exact_tokens == len(toks)


async def test_tenants_are_isolated(sidecar, identity, rng):
    _, target = sidecar
    toks = message(rng, 800)
    async with SidecarClient(target, tenant="team-a") as a, SidecarClient(target, tenant="team-b") as b:
        await a.store(toks, identity=identity)
        assert (await a.lookup(toks, identity=identity, dry_run=True)).summary.exact_tokens == len(toks)
        assert (await b.lookup(toks, identity=identity, dry_run=True)).summary.chunks_hit == 0


async def test_shared_scope_requires_grant(identity, rng):
    from sidecar.config import AuthConfig
    from sidecar.errors import PermissionDenied

    cfg = make_config(auth=AuthConfig(tokens={"op": ["ops"], "ta": ["team-a"]}, shared_writers=("ops",)))
    server, port = await create_server(cfg)
    try:
        toks = message(rng, 500)
        target = f"127.0.0.1:{port}"
        async with SidecarClient(target, token="ta") as a, SidecarClient(target, token="op") as op:
            with pytest.raises(PermissionDenied, match="shared"):
                await a.store(toks, identity=identity, shared=True)
            assert (await a.stats()).registry.entries == 0
            await op.store(toks, identity=identity, shared=True)
            assert (await a.lookup(toks, identity=identity, dry_run=True)).summary.exact_tokens == len(toks)
    finally:
        await server.stop(0.1)


async def test_auth(identity, rng):
    from sidecar.config import AuthConfig
    from sidecar.errors import InvalidArgument, PermissionDenied, Unauthenticated

    cfg = make_config(auth=AuthConfig(tokens={"t1": ["team-a"], "t2": ["team-a", "team-b"]}))
    server, port = await create_server(cfg)
    target = f"127.0.0.1:{port}"
    toks = message(rng, 100)
    try:
        async with SidecarClient(target) as anon:
            with pytest.raises(Unauthenticated, match="authorization"):
                await anon.lookup(toks, identity=identity)
        async with SidecarClient(target, token="nope") as bad:
            with pytest.raises(Unauthenticated, match="unknown bearer token"):
                await bad.lookup(toks, identity=identity)
        async with SidecarClient(target, token="t1", tenant="team-b") as wrong:
            with pytest.raises(PermissionDenied, match="team-b"):
                await wrong.lookup(toks, identity=identity)
        async with SidecarClient(target, token="t2") as ambiguous:
            with pytest.raises(InvalidArgument, match="x-tenant-id"):
                await ambiguous.lookup(toks, identity=identity)
        async with SidecarClient(target, token="t1") as ok:
            await ok.store(toks, identity=identity)
            assert (await ok.lookup(toks, identity=identity, dry_run=True)).summary.exact_tokens == len(toks)
    finally:
        await server.stop(0.1)


def test_binds_loopback_without_auth():
    from sidecar.config import AuthConfig, SidecarConfig

    assert SidecarConfig(host="0.0.0.0").bind_host == "127.0.0.1"
    assert SidecarConfig(host="0.0.0.0", auth=AuthConfig(tokens={"x": ["a"]})).bind_host == "0.0.0.0"


async def test_health_and_reflection(sidecar):
    server, target = sidecar
    async with grpc.aio.insecure_channel(target) as ch:
        hs = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE_NAME):
            resp = await hs.Check(health_pb2.HealthCheckRequest(service=name))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        rs = reflection_pb2_grpc.ServerReflectionStub(ch)
        call = rs.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        resp = await call.read()
        await call.done_writing()
        names = {s.name for s in resp.list_services_response.service}
        assert SERVICE_NAME in names and "grpc.health.v1.Health" in names


async def test_metrics_endpoint(sidecar, client, identity, rng):
    server, _ = sidecar
    toks = message(rng, 400)
    await client.store(toks, identity=identity)
    await client.lookup(toks, identity=identity, dry_run=True)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5) as r:
        body = r.read().decode()
    assert 'kv_sidecar_lookups_total{dry_run="true",policy="position_independent"} 1.0' in body
    assert f'kv_sidecar_lookup_tokens_total{{dry_run="true",kind="exact"}} {float(len(toks))}' in body
    assert 'kv_sidecar_requests_total{code="OK",method="Store"} 1.0' in body
    assert "kv_sidecar_registry_entries " in body and "kv_sidecar_lookup_seconds_bucket" in body
    assert "kv_sidecar_cache_invariant_violations_total 0.0" in body


async def test_graceful_stop_sets_not_serving(identity):
    server, port = await create_server(make_config())
    await server.stop(0.1)
    await server.stop(0.1)  # idempotent
    async with SidecarClient(f"127.0.0.1:{port}", retry=__import__("sidecar.client").client.RetryPolicy(attempts=1)) as c:
        from sidecar.errors import Unavailable

        with pytest.raises(Unavailable):
            await c.ping()


def test_sync_client_and_server_thread(identity, rng):
    toks = message(rng, 700)
    with ServerThread(make_config()) as st, SyncSidecarClient(st.target, tenant="sync") as c:
        c.ping()
        assert c.store(toks, identity=identity).chunks_registered > 0
        assert c.lookup(toks, identity=identity, dry_run=True).summary.exact_tokens == len(toks)
        assert c.stats().registry.entries > 0
