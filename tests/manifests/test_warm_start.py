"""A fresh sidecar importing a manifest serves its first request with the recovery of the
long-running sidecar that produced it: through a shared (Redis remote) tier (prefetch), and
through the warm-up plan (the reference engine prefills and Stores), plus the Redis stream."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import redis

from clients.transformers import INVARIANT_ATTENTION, Engine, build_model, llama_config
from sidecar.app import ServerThread
from sidecar.client import SyncSidecarClient
from sidecar.config import AuthConfig
from sidecar.manifests import merge, read_lines, stream
from sidecar.manifests.config import ManifestsConfig
from sidecar.tiers import StoreConfig
from tests.conftest import ANCHOR_BASE, make_config

TENANT = "tenant-a"
OPERATOR = "operator"
_MODEL = None


def model():
    global _MODEL
    if _MODEL is None:
        _MODEL = build_model(llama_config(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2), seed=1,
                             attn_implementation=INVARIANT_ATTENTION)
    return _MODEL


def _msg(rng, n: int, anchor: int = ANCHOR_BASE) -> np.ndarray:
    return np.concatenate([[anchor], rng.integers(0, 5000, n)]).astype(np.uint32)


def workload(seed: int = 3) -> tuple[list[np.ndarray], np.ndarray]:
    """Prompts a long-running sidecar served, and a probe that reuses them (an exact prefix and
    an article at a shifted position)."""
    rng = np.random.default_rng(seed)
    system, art1, art2, q1, q2, q3 = (_msg(rng, n) for n in (120, 300, 260, 40, 40, 40))
    served = [np.concatenate([system, art1, q1]), np.concatenate([system, art2, q2])]
    probe = np.concatenate([system, art2, art1, q3])  # prefix exact; art1 shifted
    return served, probe


def _unique(path: Path) -> int:
    """Chunks in a manifest (count updates are later lines for the same key)."""
    return len(merge(e for e in read_lines(path.read_bytes().splitlines()) if e is not None))


def _summary(plan) -> tuple:
    s = plan.summary
    return (s.exact_tokens, s.shifted_tokens, s.prefill_tokens, tuple((g.kind, g.start, g.end) for g in plan.segments))


def _serve(target: str, tenant: str, ns: str, prompts, *, shared: bool = False) -> Engine:
    client = SyncSidecarClient(target, tenant=tenant)
    engine = Engine(model(), sidecar=client, namespace=ns)
    for p in prompts:
        engine.warm(p, shared=shared) if shared else engine.prefill(p)
    return engine


def _reference(tmp_path: Path, store: StoreConfig, ns: str, *, tenant: str = TENANT, shared: bool = False):
    """Run the workload on a long-running sidecar; return its manifest and the probe's plan there."""
    served, probe = workload()
    path = tmp_path / f"{uuid.uuid4().hex[:6]}.jsonl"
    cfg = make_config(store=store, manifests=ManifestsConfig(path=str(path)), auth=AuthConfig(shared_writers=(OPERATOR,)))
    with ServerThread(cfg) as st:
        engine = _serve(st.target, tenant, ns, served, shared=shared)
        plan = engine.sidecar.lookup(probe, identity=engine.identity)
        engine.sidecar.close()
    # stop() closed the producer: every line is on disk
    return path, probe, plan


def test_prefetch_from_the_shared_tier(tmp_path: Path, redis_url: str, namespace: str) -> None:
    ns = uuid.uuid4().hex
    remote_only = StoreConfig(namespace=namespace, cpu_bytes=0, remote_url=redis_url, remote_bytes=64 << 20)
    path, probe, ref = _reference(tmp_path, remote_only, ns)
    assert ref.summary.exact_tokens and ref.summary.shifted_tokens  # the probe reuses both ways

    fresh = StoreConfig(namespace=namespace, cpu_bytes=32 << 20, remote_url=redis_url, remote_bytes=64 << 20)
    cfg = make_config(store=fresh, manifests=ManifestsConfig(import_paths=(str(path),)),
                      auth=AuthConfig(operators=(TENANT,)))  # Stats of the whole server (tier objects)
    with ServerThread(cfg) as st:
        n = _unique(path)
        m = st.server.metrics.registry.get_sample_value
        assert m("kv_sidecar_manifest_entries_total", {"outcome": "prefetched"}) == n
        with SyncSidecarClient(st.target, tenant=TENANT) as c:
            assert {t.tier: t.objects for t in c.stats().tiers}["cpu"] == n  # read into the local tier
            engine = Engine(model(), sidecar=c, namespace=ns)
            assert c.warm_up_plan(engine.identity) == []  # nothing left to recompute
            first = engine.prefill(probe)  # the fresh sidecar's first request
        assert _summary(first.plan) == _summary(ref)
        assert first.fetch_misses == 0
        assert first.exact_tokens == ref.summary.exact_tokens and first.shifted_tokens == ref.summary.shifted_tokens


def test_warm_up_plan_through_the_reference_engine(tmp_path: Path) -> None:
    ns = uuid.uuid4().hex
    path, probe, ref = _reference(tmp_path, StoreConfig(cpu_bytes=32 << 20), ns)
    with ServerThread(make_config(store=StoreConfig(cpu_bytes=32 << 20))) as st:
        with SyncSidecarClient(st.target, tenant=TENANT) as c:
            r = c.import_manifest(path.read_bytes())
            assert (r.planned, r.prefetched, r.malformed) == (_unique(path), 0, 0)  # count updates repeat keys
            warm = Engine(model(), sidecar=c, namespace=ns)
            done = c.warm_up(warm)
            # every planned chunk stored (a chunk straddling the engine's own prefix may be stored twice)
            assert done.sequences == 2 and done.chunks_stored >= r.planned
            assert c.warm_up_plan(warm.identity) == []  # every planned chunk is served now
            engine = Engine(model(), sidecar=c, namespace=ns)  # a fresh engine: empty own prefix cache
            first = engine.prefill(probe)
        assert _summary(first.plan) == _summary(ref)
        assert first.exact_tokens == ref.summary.exact_tokens and first.shifted_tokens == ref.summary.shifted_tokens


def test_redis_stream_publish_and_startup_import(tmp_path: Path, redis_url: str, capsys) -> None:
    from sidecar import cli

    ns = uuid.uuid4().hex
    path, probe, ref = _reference(tmp_path, StoreConfig(cpu_bytes=32 << 20), ns, tenant=OPERATOR, shared=True)
    key = f"manifest-{uuid.uuid4().hex[:8]}"
    assert cli.main(["manifest", "publish", str(path), "--redis", redis_url, "--stream", key, "--batch", "3",
                     "--quiet"]) == 0
    lines = len(path.read_bytes().splitlines())
    n = _unique(path)
    client = redis.Redis.from_url(redis_url)
    assert client.xlen(key) == lines
    assert sum(len(b) for b in stream.read(client, key, batch=4)) == lines
    client.close()
    cfg = make_config(store=StoreConfig(cpu_bytes=32 << 20), auth=AuthConfig(shared_writers=(OPERATOR,)),
                      manifests=ManifestsConfig(import_redis_url=redis_url, import_redis_stream=key, import_batch=4))
    with ServerThread(cfg) as st:
        assert st.server.manifests.plan.pending_in_scope("shared") == n
        with SyncSidecarClient(st.target, tenant=OPERATOR) as op:
            warm = Engine(model(), sidecar=op, namespace=ns)
            assert op.warm_up(warm, shared=True).chunks_stored >= n
            assert op.warm_up_plan(warm.identity, shared=True) == []
        # a tenant's first request hits the operator's shared chunks
        with SyncSidecarClient(st.target, tenant="tenant-z") as c:
            first = Engine(model(), sidecar=c, namespace=ns).prefill(probe)
        assert _summary(first.plan) == _summary(ref)
