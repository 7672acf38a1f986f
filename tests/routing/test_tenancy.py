"""Tenancy of Score: a tenant's scores count its own chunks and the ``shared`` scope only, and
neither a score nor the work done to compute it depends on another tenant's content.

Real sidecar processes and a real Redis (``tests/routing/conftest.py``). "The work" is read off
Redis itself (``INFO commandstats`` and ``INFO stats`` keyspace hits/misses around one Score);
the wall time of Score in both worlds is printed, never asserted.
"""

from __future__ import annotations

import time

import numpy as np

from tests.conftest import ANCHORS, message
from tests.routing.conftest import (
    IDENT,
    FleetProcs,
    calls_delta,
    command_calls,
    conversation,
    keyspace_reads,
    store_kv,
    wait_until,
)

#: the flusher's periodic GET of the shared scope's counter would show in INFO (a read)
NO_PROBE = {"shared_registry.probe_interval_s": 3600}
READS = ("get", "mget", "hmget", "hget", "hgetall", "exists", "smembers", "scan", "keys")
CANDS = ["r0", "r1"]


def prompt(rng) -> np.ndarray:
    return np.concatenate([message(rng, 49, ANCHORS[0]), *conversation(rng)])


def saved(client, tokens) -> list[tuple[str, int]]:
    res = client.score(tokens, IDENT, CANDS)
    assert res.absent == []
    return [(s.replica, s.saved_tokens) for s in res.scores]


def test_scores_count_the_own_scope_and_shared_only(fleet: FleetProcs, clients, rng):
    t = fleet.start_all(CANDS)
    alice = {r: clients(t[r], "alice") for r in CANDS}
    bob = {r: clients(t[r], "bob") for r in CANDS}
    ops = clients(t["r0"], "ops")
    pa, pb, ps = prompt(rng), prompt(rng), prompt(rng)
    store_kv(alice["r0"], pa, seed=1)
    store_kv(bob["r1"], pb, seed=2)
    store_kv(ops, ps, seed=3, shared=True)  # auth.shared_writers: [ops]
    wait_until(lambda: saved(alice["r1"], pa) == [("r0", len(pa)), ("r1", 0)], "alice's chunks seen by r1")
    wait_until(lambda: saved(bob["r0"], pb) == [("r0", 0), ("r1", len(pb))], "bob's chunks seen by r0")
    wait_until(lambda: saved(bob["r1"], ps) == [("r0", len(ps)), ("r1", 0)], "the shared chunks seen by r1")
    for via in CANDS:
        # each tenant: its own chunks, wherever they are
        assert saved(alice[via], pa) == [("r0", len(pa)), ("r1", 0)]
        assert saved(bob[via], pb) == [("r0", 0), ("r1", len(pb))]
        # ... never the other's, even with the exact content in hand
        assert saved(bob[via], pa) == [("r0", 0), ("r1", 0)]
        assert saved(alice[via], pb) == [("r0", 0), ("r1", 0)]
        # shared chunks count for every tenant
        for who in (alice, bob):
            s = {x.replica: x for x in who[via].score(ps, IDENT, CANDS).scores}
            assert (s["r0"].prefix_tokens, s["r0"].tier_tokens, s["r1"].saved_tokens) == (len(ps), {"cpu": len(ps)}, 0)
        # a prompt that starts with the shared text and goes on with alice's messages
        mixed = np.concatenate([ps[:50], pa[50:]])
        a = {x.replica: x.saved_tokens for x in alice[via].score(mixed, IDENT, CANDS).scores}
        b = {x.replica: x.saved_tokens for x in bob[via].score(mixed, IDENT, CANDS).scores}
        assert a["r0"] > b["r0"] > 0 and a["r1"] == b["r1"] == 0, (a, b)


def test_score_work_does_not_depend_on_another_tenants_content(fleet: FleetProcs, clients, rng, redis_client):
    """Bob scores prompt P in two worlds: nobody holds P, then alice holds P on both replicas
    (the scoring one and its peer). Same Redis commands of each kind, same keyspace hits and
    misses, identical answers; the median wall time of 200 Scores per world is printed."""
    t = fleet.start_all(CANDS, **NO_PROBE)
    bob = clients(t["r1"], "bob")
    ops = clients(t["r1"], "ops")
    # the shared scope is searched in both worlds (r1 holds shared chunks itself: without the
    # probe it would not know of shared chunks elsewhere)
    n_common = store_kv(ops, prompt(rng), seed=4, shared=True)

    def residency_fields() -> int:
        return sum(redis_client.hlen(k) for k in redis_client.keys(f"{fleet.prefix}:*:r:*"))

    # nothing left to publish before a measurement (records go out before the residency, in one flush)
    wait_until(lambda: residency_fields() == n_common, "the shared chunks published")
    p = prompt(rng)

    def work() -> tuple[dict[str, int], tuple[int, int], object]:
        calls, ks = command_calls(redis_client), keyspace_reads(redis_client)
        res = bob.score(p, IDENT, CANDS)
        delta = calls_delta(calls, command_calls(redis_client))
        ks2 = keyspace_reads(redis_client)
        return {k: v for k, v in delta.items() if k in READS}, (ks2[0] - ks[0], ks2[1] - ks[1]), res

    def timed(n: int = 200) -> float:
        bob.score(p, IDENT, CANDS)
        out = np.empty(n)
        for i in range(n):
            t0 = time.perf_counter()
            bob.score(p, IDENT, CANDS)
            out[i] = time.perf_counter() - t0
        return float(np.median(out))

    nobody = [work() for _ in range(3)]
    t_nobody = timed()
    n_p = sum(store_kv(clients(t[r], "alice"), p, seed=5 + i) for i, r in enumerate(CANDS))
    wait_until(lambda: residency_fields() == n_common + n_p, "alice's copies of P published")
    alice_r0 = clients(t["r0"], "alice")
    assert saved(alice_r0, p) == [("r0", len(p)), ("r1", len(p))]
    alice_has = [work() for _ in range(3)]
    t_alice = timed()

    nchunks = len(bob.lookup(p, identity=IDENT, dry_run=True).chunk_bounds) - 1
    reads, ks, res = nobody[0]
    assert reads.get("hmget") == 2 * nchunks and reads.get("get") == 1, reads  # own scope + shared; r0's beat
    assert [(s.replica, s.saved_tokens, s.prefill_tokens) for s in res.scores] == [("r0", 0, len(p)), ("r1", 0, len(p))]
    for w in nobody + alice_has:
        assert w[0] == reads, (w[0], reads)
        assert w[2] == res
    # keyspace hits and misses are the server's global counters: a peer sidecar's background read
    # (its heartbeat) may land inside one sample, never in all three of a world
    least = lambda world: min(w[1] for w in world)  # noqa: E731
    assert least(nobody) == least(alice_has), ([w[1] for w in nobody], [w[1] for w in alice_has])
    print(f"\nbob's Score of P ({len(p)} tokens, {nchunks} chunks), median of 200: nobody holds P "
          f"{t_nobody * 1e3:.3f} ms, alice holds P {t_alice * 1e3:.3f} ms; Redis reads per Score {reads}, "
          f"keyspace hits/misses {ks}")
