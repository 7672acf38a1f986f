"""The shared registry on a real Redis Cluster (three ``redis-server`` nodes in cluster mode).

The registry lives on the cluster (``shared_registry.cluster=true``); the chunks' bytes live in
the remote tier on the single test Redis (a deployment may keep the two apart). Two sidecar
processes: a chunk stored through A is found by B's Lookup and fetched with identical bytes, and
every record of one scope sits on one slot (the hash tag), so a Lookup is one pipelined MGET
per slot it touches.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from sidecar.client import SyncSidecarClient
from sidecar.process import sidecar_process
from tests.redis_server import RedisProcess, free_cluster_port
from tests.registry.test_shared_registry import IDENT, LAYOUT, conversation, flags, hits, store_kv, wait_for_hits

SLOTS = 16384


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[list[RedisProcess]]:
    """Three masters, slots split in thirds, joined with CLUSTER MEET; waits for cluster_state:ok."""
    nodes: list[RedisProcess] = []
    try:
        for i in range(3):
            d = tmp_path / f"node{i}"
            d.mkdir()
            nodes.append(RedisProcess(d, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                      "--cluster-node-timeout", "2000", port=free_cluster_port()).start())
        clients = [redis.Redis(host="127.0.0.1", port=n.port) for n in nodes]
        third = SLOTS // 3
        for i, c in enumerate(clients):
            hi = SLOTS if i == 2 else (i + 1) * third
            c.execute_command("CLUSTER", "ADDSLOTS", *range(i * third, hi))
        for c in clients[1:]:
            c.execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port)
        deadline = time.monotonic() + 30
        while not all(c.cluster("info")["cluster_state"] == "ok" and len(c.cluster("nodes")) == 3 for c in clients):
            assert time.monotonic() < deadline, "the cluster did not converge"
            time.sleep(0.1)
        for c in clients:
            c.close()
        yield nodes
    finally:
        for n in nodes:
            n.stop()


def _mget_calls(nodes: list[RedisProcess]) -> list[int]:
    out = []
    for n in nodes:
        with redis.Redis(host="127.0.0.1", port=n.port) as r:
            out.append(int(r.info("commandstats").get("cmdstat_mget", {}).get("calls", 0)))
    return out


def test_cluster_registry_shares_chunks_one_slot_per_scope(redis_cluster, redis_url, prefix, rng):
    nodes = redis_cluster
    cluster_url = nodes[0].url
    tokens = conversation(rng)
    opts = {"shared_registry.cluster": "true"}
    with sidecar_process(*flags(prefix, cluster_url, redis_url, **opts)) as a, sidecar_process(
        *flags(prefix, cluster_url, redis_url, **opts)
    ) as b, SyncSidecarClient(a, tenant="alice") as ca, SyncSidecarClient(b, tenant="alice") as cb:
        payloads = store_kv(ca, tokens, seed=11)
        plan = wait_for_hits(cb, tokens, len(payloads))
        got = hits(plan)
        assert len(got) == len(payloads) and plan.summary.exact_tokens == len(tokens)
        fetched = cb.fetch([(s.chunk_hash, s.start) for s in got], identity=IDENT, layout=LAYOUT)
        assert {kv.source_pos: bytes(kv.data) for kv in fetched} == payloads  # bytes identical, via the tier

        # every record of alice's scope hashes to one slot, held by exactly one node
        rc = redis.RedisCluster(host="127.0.0.1", port=nodes[0].port)
        try:
            keys = [k for k in rc.scan_iter(match=f"{prefix}:*", target_nodes=redis.RedisCluster.ALL_NODES)
                    if not k.endswith(b":n")]
            assert len(keys) >= len(payloads)
            assert len({rc.keyslot(k) for k in keys}) == 1
        finally:
            rc.close()

        # a cold Lookup on a third sidecar: one MGET on the one node holding alice's slot
        with sidecar_process(*flags(prefix, cluster_url, redis_url, **opts)) as c, SyncSidecarClient(
            c, tenant="alice"
        ) as cc:
            before = _mget_calls(nodes)
            assert len(hits(cc.lookup(tokens, identity=IDENT))) == len(payloads)
            delta = [x - y for x, y in zip(_mget_calls(nodes), before)]
            assert sorted(delta) == [0, 0, 1], delta
