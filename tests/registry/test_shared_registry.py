"""Sidecars sharing one registry through a real Redis (docs/operations.md, "Shared registry").

Peers are real ``kv-sidecar serve`` processes (``sidecar.process.sidecar_process``); the sidecar
whose Redis is stopped runs in-process (``ServerThread``) so its health and metrics can be read.
Waiting for a peer to see a chunk is bounded by a generous deadline (liveness, not a timing
assertion): publication is asynchronous by design, within ``publish_interval_s``.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import redis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest

from sidecar.app import REGISTRY_HEALTH_NAME, ServerThread
from sidecar.client import SyncSidecarClient
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.process import sidecar_process
from sidecar.registry.lookup_plan import SegmentKind
from sidecar.registry.shared_keys import SharedRecord, SharedRegistryConfig
from sidecar.tiers import StoreConfig
from tests.conftest import ANCHORS, make_config, message

MiB = 1 << 20
LAYOUT = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32")
IDENT = CacheIdentity(model_id="tiny", kv_layout=LAYOUT.fingerprint())
DEADLINE_S = 20.0


def flags(prefix: str, registry_url: str, remote_url: str, **extra) -> list[str]:
    sets = {
        "chunker.anchor_tokens": "[" + ",".join(map(str, ANCHORS)) + "]",
        "shared_registry.redis_url": registry_url,
        "shared_registry.key_prefix": prefix,
        "shared_registry.publish_interval_s": 0.02,
        "store.namespace": prefix,
        "store.cpu_bytes": 64 * MiB,
        "store.remote_url": remote_url,
        "store.remote_bytes": 256 * MiB,
        "auth.shared_writers": "[ops]",
        **extra,
    }
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


def conversation(rng: np.random.Generator) -> np.ndarray:
    return np.concatenate([message(rng, 400, ANCHORS[1]), message(rng, 300, ANCHORS[2])]).astype(np.uint32)


def store_kv(client: SyncSidecarClient, tokens: np.ndarray, seed: int, shared: bool = False) -> dict[int, bytes]:
    """Register ``tokens``, then Store a random payload for every chunk; returns the payloads."""
    meta = client.store(tokens, identity=IDENT, shared=shared)
    g = torch.Generator().manual_seed(seed)
    b = meta.chunk_bounds
    per_tok = LAYOUT.bytes_per_token // 4
    pl = {a: torch.randn((e - a) * per_tok, generator=g) for a, e in zip(b[:-1], b[1:])}
    res = client.store(tokens, identity=IDENT, layout=LAYOUT, payloads=pl, shared=shared)
    assert res.chunks_stored == len(pl)
    return {a: t.numpy().tobytes() for a, t in pl.items()}


def hits(plan) -> list:
    return [s for s in plan.segments if s.kind is SegmentKind.CHUNK_HIT]


def wait_for_hits(client: SyncSidecarClient, tokens: np.ndarray, n: int):
    deadline = time.monotonic() + DEADLINE_S
    while True:
        plan = client.lookup(tokens, identity=IDENT)
        if len(hits(plan)) >= n or time.monotonic() > deadline:
            return plan
        time.sleep(0.02)


def resident_records(r: redis.Redis, prefix: str) -> int:
    keys = [k for k in r.keys(f"{prefix}:*") if not k.endswith(b":n")]
    recs = [SharedRecord.decode(v) for v in r.mget(keys)] if keys else []
    return sum(1 for rec in recs if rec is not None and rec.resident and rec.shared_tier)


def mget_calls(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_mget", {}).get("calls", 0))


def test_chunk_stored_on_a_is_found_and_fetched_on_b(redis_url, redis_client, prefix, rng):
    tokens = conversation(rng)
    with sidecar_process(*flags(prefix, redis_url, redis_url)) as a, sidecar_process(
        *flags(prefix, redis_url, redis_url)
    ) as b, SyncSidecarClient(a, tenant="alice") as ca, SyncSidecarClient(b, tenant="alice") as cb:
        payloads = store_kv(ca, tokens, seed=1)
        nchunks = len(payloads)
        # every record published with its location (the flusher's batch lands within publish_interval_s)
        _wait(lambda: resident_records(redis_client, prefix) == nchunks, "A's records in Redis")
        before = mget_calls(redis_client)
        plan = cb.lookup(tokens, identity=IDENT)
        assert mget_calls(redis_client) - before == 1  # one round trip for the whole prompt
        got = hits(plan)
        assert len(got) == nchunks and plan.summary.exact_tokens == len(tokens)
        fetched = cb.fetch([(s.chunk_hash, s.start) for s in got], identity=IDENT, layout=LAYOUT)
        assert all(kv.ok for kv in fetched)
        assert [kv.tier for kv in fetched] == ["remote"] * nchunks  # read through the shared tier
        assert {kv.source_pos: bytes(kv.data) for kv in fetched} == payloads  # bytes identical
        # warm near cache: the next Lookup on B needs no Redis at all
        before = mget_calls(redis_client)
        assert len(hits(cb.lookup(tokens, identity=IDENT))) == nchunks
        assert mget_calls(redis_client) == before
        # B's own copy is local now (promoted on Fetch)
        again = cb.fetch([(s.chunk_hash, s.start) for s in got], identity=IDENT, layout=LAYOUT)
        assert {kv.source_pos: bytes(kv.data) for kv in again} == payloads
        assert {kv.tier for kv in again} == {"cpu"}


def test_tenants_stay_isolated_across_sidecars(redis_url, prefix, rng):
    private, common = conversation(rng), conversation(rng)
    with sidecar_process(*flags(prefix, redis_url, redis_url)) as a, sidecar_process(
        *flags(prefix, redis_url, redis_url)
    ) as b:
        with SyncSidecarClient(a, tenant="alice") as alice_a, SyncSidecarClient(a, tenant="ops") as ops_a:
            store_kv(alice_a, private, seed=2)
            shared_payloads = store_kv(ops_a, common, seed=3, shared=True)
            alice_plan = alice_a.lookup(private, identity=IDENT)
        alice_hashes = [s.chunk_hash for s in hits(alice_plan)]
        assert alice_hashes
        with SyncSidecarClient(b, tenant="alice") as alice_b, SyncSidecarClient(b, tenant="bob") as bob_b:
            # shared chunks reach both tenants on B; alice's own chunks reach alice on B
            for client in (alice_b, bob_b):
                plan = wait_for_hits(client, common, len(shared_payloads))
                assert len(hits(plan)) == len(shared_payloads)
                got = client.fetch([(s.chunk_hash, s.start) for s in hits(plan)], identity=IDENT, layout=LAYOUT)
                assert {kv.source_pos: bytes(kv.data) for kv in got} == shared_payloads
            assert len(hits(wait_for_hits(alice_b, private, len(alice_hashes)))) == len(alice_hashes)
            # bob: no hit, no bytes, for alice's private chunks, even with her chunk hashes in hand
            assert hits(bob_b.lookup(private, identity=IDENT)) == []
            fetched = bob_b.fetch([(h, 0) for h in alice_hashes], identity=IDENT, layout=LAYOUT)
            assert not any(kv.ok for kv in fetched)
            assert bob_b.delete(alice_hashes) == 0
            # ... and alice still has them
            assert len(hits(alice_b.lookup(private, identity=IDENT))) == len(alice_hashes)


def _health(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=REGISTRY_HEALTH_NAME), timeout=5).status


def _metric(st: ServerThread, line_start: str) -> float:
    for line in generate_latest(st.server.metrics.registry).decode().splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no metric {line_start}")


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_redis_stopped_and_restarted(redis_url, restartable_redis, prefix, rng):
    """Registry on a Redis the test stops and restarts (same port); the remote tier on another."""
    sr = SharedRegistryConfig(redis_url=restartable_redis.url, key_prefix=prefix, publish_interval_s=0.02,
                              backoff_initial_s=0.05, backoff_max_s=0.5, probe_interval_s=0.1)
    store = StoreConfig(namespace=prefix, cpu_bytes=64 * MiB, remote_url=redis_url, remote_bytes=256 * MiB)
    before, during, after = conversation(rng), conversation(rng), conversation(rng)
    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    with ServerThread(make_config(shared_registry=sr, store=store)) as st, sidecar_process(
        *flags(prefix, restartable_redis.url, redis_url)
    ) as b, SyncSidecarClient(st.target, tenant="alice") as ca, SyncSidecarClient(b, tenant="alice") as cb:
        assert _health(st.target) == SERVING
        assert _metric(st, "kv_sidecar_shared_registry_up") == 1
        p_before = store_kv(ca, before, seed=4)
        assert len(hits(wait_for_hits(cb, before, len(p_before)))) == len(p_before)
        local_before = ca.lookup(before, identity=IDENT)

        restartable_redis.stop()
        # A keeps serving from its local registry; a miss asks Redis, which marks it down
        plan = ca.lookup(before, identity=IDENT)
        assert plan.segments == local_before.segments
        p_during = store_kv(ca, during, seed=5)  # registered locally, publish queued
        assert len(hits(ca.lookup(during, identity=IDENT))) == len(p_during)
        ca.lookup(conversation(rng), identity=IDENT)  # misses -> one failed read (or skipped)
        _wait(lambda: _health(st.target) == NOT_SERVING, "registry health NOT_SERVING")
        assert _metric(st, "kv_sidecar_shared_registry_up") == 0
        assert _metric(st, 'kv_sidecar_shared_registry_errors_total{op="read"}') + _metric(
            st, 'kv_sidecar_shared_registry_errors_total{op="publish"}') >= 1
        assert ca.ping() is None and ca.stats().registry.entries >= len(p_before) + len(p_during)
        assert ca.lookup(before, identity=IDENT).segments == local_before.segments  # local entries intact

        restartable_redis.start()  # same port, empty (no persistence)
        _wait(lambda: _health(st.target) == SERVING, "registry health SERVING again")
        assert _metric(st, "kv_sidecar_shared_registry_up") == 1
        # what A queued while Redis was down is published after it came back ...
        assert len(hits(wait_for_hits(cb, during, len(p_during)))) == len(p_during)
        # ... and so is what A stores now
        p_after = store_kv(ca, after, seed=6)
        plan = wait_for_hits(cb, after, len(p_after))
        got = cb.fetch([(s.chunk_hash, s.start) for s in hits(plan)], identity=IDENT, layout=LAYOUT)
        assert {kv.source_pos: bytes(kv.data) for kv in got} == p_after
        assert _metric(st, "kv_sidecar_shared_registry_dropped_total") == 0
