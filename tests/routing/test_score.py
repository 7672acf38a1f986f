"""Score (docs/routing.md): per candidate replica, what its own Lookup would serve of a prompt.

Real ``kv-sidecar serve`` processes (``tests/routing/conftest.py``: ``fleet``) share one real
Redis. Publication of residency and heartbeats is asynchronous (``publish_interval_s``), so a
test waits for what it expects with a bounded liveness loop (``wait_until``), never a timing
assertion; the few durations measured here are printed, not asserted.
"""

from __future__ import annotations

import dataclasses
import socket
import time
import urllib.request

import grpc
import numpy as np
import pytest
import redis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.app import REGISTRY_HEALTH_NAME
from sidecar.client import SyncSidecarClient
from sidecar.cuts import heads_layout
from sidecar.identity import CacheIdentity
from sidecar.registry.lookup_plan import SegmentKind
from sidecar.sdk.router import Router, RouterConfig, pick
from tests.conftest import ANCHORS, message
from tests.routing.conftest import (
    IDENT,
    LAYOUT,
    FleetProcs,
    calls_delta,
    command_calls,
    conversation,
    store_kv,
    wait_until,
)

MiB = 1 << 20
#: no hit extension into neighbour chunks and no seed hits: every hit is a whole prompt chunk
WHOLE_CHUNKS = {"registry.extend_hits": "false", "registry.seed_interval": 0}
#: the flusher's periodic GET of the shared scope's counter would show in INFO commandstats
NO_PROBE = {"shared_registry.probe_interval_s": 3600}


def served(s) -> tuple[int, int, int, int]:
    """A ReplicaScore as a Lookup (engine_prefix_len 0) summarises it: exact, shifted, prefill, chunks."""
    return s.prefix_tokens + s.exact_tokens, s.shifted_tokens, s.prefill_tokens, s.chunks_hit


def summary(plan) -> tuple[int, int, int, int]:
    m = plan.summary
    assert m.prefix_tokens == 0
    return m.exact_tokens, m.shifted_tokens, m.prefill_tokens, m.chunks_hit


def by_replica(res) -> dict:
    return {s.replica: s for s in res.scores}


def hit_segments(plan) -> list:
    return [s for s in plan.segments if s.kind is SegmentKind.CHUNK_HIT]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no metric {name}")


# ------------------------------------------------------------------------ scores == Lookups


@pytest.mark.parametrize("whole_chunks", [False, True], ids=["default", "no-extension-no-seeds"])
def test_scores_match_what_each_replica_serves(fleet: FleetProcs, clients, rng, whole_chunks):
    """Every candidate's score, from any scoring sidecar, against that replica's own Lookup.

    r0 holds conversation X after header h1, r1 holds X after a longer header (its copies sit at
    other positions), r2 an unrelated conversation. Prompts: a new header + X (shifted for r0
    and r1), r0's own prompt (a prefix hit for r0), and two that end or change inside a stored
    chunk, where a Lookup extends hits into the stored neighbour chunk or finds it by a seed.

    A score counts chunk hits, for every candidate alike, the scoring sidecar's own replica
    included (sidecar/routing/score.py): equal to the Lookup when every hit is a whole prompt
    chunk, else the same chunk hits and never more tokens. With ``registry.extend_hits`` false
    and seeds off (``registry.seed_interval`` 0) the Lookup serves chunk hits only: equal always.
    (``extend_hits`` false alone is not enough: seed hits still extend the Lookup.)"""
    extra = WHOLE_CHUNKS if whole_chunks else {}
    names = ("r0", "r1", "r2")
    t = fleet.start_all(names, **extra)
    c = {r: clients(t[r]) for r in names}
    X = conversation(rng)
    p0 = np.concatenate([message(rng, 49, ANCHORS[0]), *X])
    p1 = np.concatenate([message(rng, 120, ANCHORS[0]), *X])
    py = np.concatenate([message(rng, 60, ANCHORS[0]), *conversation(rng)])
    store_kv(c["r0"], p0, seed=1)
    store_kv(c["r1"], p1, seed=2)
    store_kv(c["r2"], py, seed=3)
    q_new = np.concatenate([message(rng, 80, ANCHORS[0]), *X])
    q_edit = p0.copy()
    q_edit[700] = 7  # one token changed inside a stored chunk
    queries = {"new header": q_new, "r0's prompt": p0, "edited": q_edit, "truncated": p0[:700]}

    # publication: r0's and r1's copies of X visible to a peer scorer
    want = {r: summary(c[r].lookup(q_new, identity=IDENT)) for r in names}
    assert want["r0"][1] > 0 and want["r1"][1] > 0 and want["r2"] == (0, 0, len(q_new), 0)
    wait_until(lambda: all(served(s) == want[s.replica] for s in c["r2"].score(q_new, IDENT, names).scores),
               "r0's and r1's residency visible to r2")

    short = []
    for qname, q in queries.items():
        look = {r: summary(c[r].lookup(q, identity=IDENT)) for r in names}
        seen: dict[str, set] = {r: set() for r in names}
        for via in names:
            res = c[via].score(q, IDENT, names)
            assert res.total_tokens == len(q) and res.absent == []
            assert [s.replica for s in res.scores] == list(names)
            for s in res.scores:
                got, exp = served(s), look[s.replica]
                seen[s.replica].add(got)
                where = f"{qname!r}: {s.replica} scored via {via}: score {got}, its Lookup {exp}"
                assert sum(s.tier_tokens.values()) == s.saved_tokens == got[0] + got[1], where
                assert set(s.tier_tokens) <= {"cpu"}, where
                if whole_chunks or qname in ("new header", "r0's prompt"):
                    assert got == exp, where  # every hit a whole prompt chunk
                else:
                    # short by the extension into neighbour chunks and by seed hits, at most
                    assert got[3] == exp[3], where  # the same chunk hits
                    assert got[0] <= exp[0] and got[1] <= exp[1] and got[2] >= exp[2], where
                    if got != exp:
                        short.append(where)
        # the same estimate whichever sidecar scores (its own replica included): a fair comparison
        assert all(len(v) == 1 for v in seen.values()), (qname, seen)
    print(f"\n[{'no-extension-no-seeds' if whole_chunks else 'default'}] scores short of the Lookup: "
          f"{len(short)}" + "".join("\n  " + w for w in short))
    # r0's prompt: a prefix hit for r0 (every token), shifted for r1 (the header differs)
    s = by_replica(c["r2"].score(p0, IDENT, names))
    assert (s["r0"].prefix_tokens, s["r0"].prefill_tokens) == (len(p0), 0)
    assert s["r1"].prefix_tokens == 0 and s["r1"].shifted_tokens > 0
    assert s["r2"].saved_tokens == 0


# ------------------------------------------------------------------------------------ tiers


def test_tier_tokens_follow_demotion_and_delete(fleet: FleetProcs, clients, rng, tmp_path):
    """r0 keeps a disk tier below its CPU tier: an operator Evict demotes chunks to disk, and
    every scorer reports them as disk tokens; after a Delete r0 scores 0 everywhere."""
    t = fleet.start_each({"r0": {"store.disk_path": str(tmp_path / "disk"), "store.disk_bytes": 64 * MiB}, "r1": {}})
    c0, c1 = clients(t["r0"]), clients(t["r1"])
    p = np.concatenate([message(rng, 49, ANCHORS[0]), *conversation(rng)])
    store_kv(c0, p, seed=4)
    segs = hit_segments(c0.lookup(p, identity=IDENT))
    assert sum(len(s) for s in segs) == len(p)
    cands = ["r0", "r1"]

    def r0_tiers(client):
        return by_replica(client.score(p, IDENT, cands))["r0"].tier_tokens

    wait_until(lambda: r0_tiers(c1) == {"cpu": len(p)}, "r0's chunks in cpu, seen by r1")
    assert r0_tiers(c0) == {"cpu": len(p)}

    demoted = segs[: len(segs) // 2]
    assert c0.evict([s.chunk_hash for s in demoted], tier="cpu") == len(demoted)
    on_disk = sum(len(s) for s in demoted)
    want = {"cpu": len(p) - on_disk, "disk": on_disk}
    assert r0_tiers(c0) == want  # its own registry: at once
    wait_until(lambda: r0_tiers(c1) == want, "the demotion published")
    s = by_replica(c1.score(p, IDENT, cands))["r0"]
    assert (s.prefix_tokens, s.prefill_tokens) == (len(p), 0)  # demoted, still a hit

    assert c0.delete([s.chunk_hash for s in segs]) == len(segs)
    assert by_replica(c0.score(p, IDENT, cands))["r0"].saved_tokens == 0
    wait_until(lambda: by_replica(c1.score(p, IDENT, cands))["r0"].saved_tokens == 0, "the delete published")
    s = by_replica(c1.score(p, IDENT, cands))["r0"]
    assert (s.prefill_tokens, s.chunks_hit, s.tier_tokens) == (len(p), 0, {})


# -------------------------------------------------------------------------------- liveness


def test_killed_and_stopped_replicas_leave_the_scores(fleet: FleetProcs, clients, rng):
    """routing.heartbeat_ttl_s 1: a SIGKILLed replica leaves the scores once its heartbeat
    expires; a cleanly stopped one deletes its heartbeat. (Elapsed times printed.)"""
    t = fleet.start_all(("r0", "r1", "r2"))
    c0, c1 = clients(t["r0"]), clients(t["r1"])
    p = np.concatenate([message(rng, 49, ANCHORS[0]), *conversation(rng)])
    store_kv(c1, p, seed=5)
    cands = ["r0", "r1", "r2"]
    wait_until(lambda: by_replica(c0.score(p, IDENT, cands))["r1"].prefix_tokens == len(p), "r1's chunks seen by r0")
    assert c0.score(p, IDENT, cands).absent == []

    def gone(replica: str) -> float:
        t0 = time.monotonic()
        wait_until(lambda: replica in c0.score(p, IDENT, cands).absent, f"{replica} absent")
        return time.monotonic() - t0

    t0 = time.monotonic()
    fleet.kill("r1")
    killed = time.monotonic() - t0 + gone("r1")
    res = c0.score(p, IDENT, cands)
    assert res.absent == ["r1"] and [s.replica for s in res.scores] == ["r0", "r2"]
    assert all(s.saved_tokens == 0 for s in res.scores)
    t0 = time.monotonic()
    fleet.stop("r2")
    stopped = time.monotonic() - t0 + gone("r2")
    assert c0.score(p, IDENT, cands).absent == ["r1", "r2"]
    print(f"\nkill -> absent: {killed:.2f} s (heartbeat_ttl_s 1); clean stop -> absent: {stopped:.2f} s "
          f"(including the sidecar's shutdown)")


# ----------------------------------------------------------------------- one Redis round trip


def test_one_redis_round_trip_per_score(fleet: FleetProcs, clients, rng, redis_client):
    """INFO commandstats around one Score: one HMGET per chunk key (and scope), one GET per
    peer heartbeat, at most one MGET of records; the round-trip counter moves by one."""
    port = free_port()
    t = fleet.start_each({"r0": NO_PROBE, "r1": NO_PROBE}, {"r1": ("--metrics-port", str(port))})
    c0, c1 = clients(t["r0"]), clients(t["r1"])
    p = np.concatenate([message(rng, 49, ANCHORS[0]), *conversation(rng)])
    store_kv(c0, p, seed=6)
    nchunks = len(c1.lookup(p, identity=IDENT, dry_run=True).chunk_bounds) - 1
    cands = ["r0", "r1", "r9"]  # r9 never ran: a GET that finds nothing
    wait_until(lambda: by_replica(c1.score(p, IDENT, cands))["r0"].prefix_tokens == len(p), "r0's chunks seen by r1")

    def one_score(candidates) -> tuple[dict[str, int], float]:
        trips = metric(port, "kv_sidecar_routing_round_trips_total")
        before = command_calls(redis_client)
        c1.score(p, IDENT, candidates)
        delta = calls_delta(before, command_calls(redis_client))
        return delta, metric(port, "kv_sidecar_routing_round_trips_total") - trips

    def reads(delta: dict[str, int]) -> dict[str, int]:
        # the flushers' heartbeats (SET, SADD) may land in between: only reads are counted
        return {k: v for k, v in delta.items() if k in ("hmget", "get", "mget", "exists", "smembers")}

    delta, trips = one_score(cands)
    assert reads(delta) in ({"hmget": nchunks, "get": 2}, {"hmget": nchunks, "get": 2, "mget": 1}), delta
    assert trips == 1
    # the own replica alone: no Redis at all
    delta, trips = one_score(["r1"])
    assert reads(delta) == {} and trips == 0

    # once the shared scope has chunks, every chunk key is read in both scopes (still one trip)
    with SyncSidecarClient(fleet.targets["r1"], tenant="ops") as ops:
        store_kv(ops, np.concatenate([message(rng, 30, ANCHORS[0]), *conversation(rng)]), seed=7, shared=True)
    delta, trips = one_score(cands)
    assert reads(delta) in ({"hmget": 2 * nchunks, "get": 2}, {"hmget": 2 * nchunks, "get": 2, "mget": 1}), delta
    assert trips == 1


# --------------------------------------------------------------------------------- Redis down

#: Redis down and back: how long a peer's residency may take to be in the scores again
#: (republished within a flush of the peer noticing; a liveness bound, not a timing assertion)
RECOVERY_S = 5.0
FAST_RECONNECT = {"shared_registry.backoff_initial_s": 0.05, "shared_registry.backoff_max_s": 0.5}


def registry_health(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=REGISTRY_HEALTH_NAME), timeout=5).status


def saved(client: SyncSidecarClient, tokens: np.ndarray, cands: list[str]) -> list[tuple[str, int]]:
    return [(s.replica, s.saved_tokens) for s in client.score(tokens, IDENT, cands).scores]


def test_redis_down_scores_the_own_replica(restartable_redis, prefix, clients, rng):
    """Redis stopped: Score still answers, the own replica scored from the local registry, the
    peers absent (no error). Redis back, empty: the peer, which noticed the outage, publishes
    its residency again and is back in the scores."""
    fleet = FleetProcs(prefix, restartable_redis.url)
    try:
        t = fleet.start_all(("r0", "r1"), **FAST_RECONNECT)
        c0, c1 = clients(t["r0"]), clients(t["r1"])
        a = np.concatenate([message(rng, 49, ANCHORS[0]), *conversation(rng)])
        only_r1 = np.concatenate([message(rng, 49, ANCHORS[0]), *conversation(rng)])
        store_kv(c0, a, seed=8)
        store_kv(c1, a, seed=8)
        store_kv(c1, only_r1, seed=9)  # never scored before the outage
        cands = ["r0", "r1"]
        wait_until(lambda: saved(c0, a, cands) == [("r0", len(a)), ("r1", len(a))], "r1's chunks of a seen by r0")

        restartable_redis.stop()
        for _ in range(3):  # the first read fails (Redis then counts as down), the next are skipped
            res = c0.score(a, IDENT, cands)
            assert res.absent == ["r1"]
            assert [(s.replica, s.prefix_tokens, s.prefill_tokens) for s in res.scores] == [("r0", len(a), 0)]
            res = c0.score(only_r1, IDENT, cands)
            assert res.absent == ["r1"] and saved(c0, only_r1, ["r0"]) == [("r0", 0)]
        assert c0.lookup(a, identity=IDENT).summary.exact_tokens == len(a)
        # r1's own heartbeat failed: it knows Redis went away
        wait_until(lambda: registry_health(fleet.targets["r1"]) == health_pb2.HealthCheckResponse.NOT_SERVING,
                   "r1's registry health NOT_SERVING")

        restartable_redis.start()  # same port, empty (no persistence)
        wait_until(lambda: saved(c0, a, cands) == [("r0", len(a)), ("r1", len(a))], "r1 back in the scores of a")
        # ... with the records of its chunks, so a scorer that never read them before scores them too
        wait_until(lambda: saved(c0, only_r1, cands) == [("r0", 0), ("r1", len(only_r1))],
                   "r1 back in the scores of a prompt only r1 holds", RECOVERY_S)
    finally:
        fleet.close()


def test_redis_restarted_between_heartbeats(restartable_redis, prefix, clients, rng):
    """Redis restarts (empty) between two of r1's heartbeats, and r1 sends nothing meanwhile, so it
    sees no error (redis-py reconnects a dead connection quietly): its next heartbeat finds its
    previous one gone, and it publishes what it holds again."""
    fleet = FleetProcs(prefix, restartable_redis.url)
    r = redis.Redis.from_url(restartable_redis.url)
    try:
        # r1 beats every 2 s, no probe of the shared scope in between: r1 sends nothing else
        t = fleet.start_each({"r0": FAST_RECONNECT,
                              "r1": {**FAST_RECONNECT, **NO_PROBE, "routing.heartbeat_ttl_s": 6}})
        c0, c1 = clients(t["r0"]), clients(t["r1"])
        a = np.concatenate([message(rng, 49, ANCHORS[0]), *conversation(rng)])
        store_kv(c0, a, seed=10)
        store_kv(c1, a, seed=10)
        cands = ["r0", "r1"]
        wait_until(lambda: saved(c0, a, cands) == [("r0", len(a)), ("r1", len(a))], "r1's chunks of a seen by r0")
        beat = f"{prefix}:{{replicas}}:r1"
        wait_until(lambda: r.pttl(beat) > 5500, "r1's heartbeat just written")  # its next one >= 1.5 s away
        restartable_redis.stop()
        restartable_redis.start()
        wait_until(lambda: "r1" not in c0.score(a, IDENT, cands).absent, "r1's next heartbeat")
        wait_until(lambda: saved(c0, a, cands) == [("r0", len(a)), ("r1", len(a))],
                   "r1 back in the scores of a", RECOVERY_S)
    finally:
        r.close()
        fleet.close()


# -------------------------------------------------------------------------- reference router


def test_pick_rule():
    kw = {"load_slack": 2, "min_saved_tokens": 64}
    abc = ["a", "b", "c"]
    # the best score wins
    assert pick(abc, {"a": 100, "b": 500, "c": 0}, {}, **kw) == "b"
    # ... unless it is past the load bound (least loaded + load_slack)
    assert pick(abc, {"b": 500}, {"a": 0, "b": 3, "c": 0}, **kw) == "a"
    assert pick(abc, {"b": 500}, {"a": 0, "b": 2, "c": 0}, **kw) == "b"
    assert pick(abc, {"a": 100, "b": 500}, {"a": 0, "b": 3, "c": 0}, **kw) == "a"
    assert pick(abc, {"b": 500}, {"a": 1, "b": 3, "c": 1}, load_slack=1, min_saved_tokens=64, start=1) == "c"
    assert pick(abc, {"b": 500}, {"a": 0, "b": 3, "c": 0}, load_slack=3, min_saved_tokens=64) == "b"
    # ties on the score: the least loaded, then round-robin order from ``start``
    tie = {"a": 500, "b": 500, "c": 500}
    assert pick(abc, tie, {"a": 1, "b": 0, "c": 0}, **kw) == "b"
    assert pick(abc, tie, {"a": 1, "b": 0, "c": 0}, **kw, start=2) == "c"
    assert [pick(abc, tie, {}, **kw, start=i) for i in range(4)] == ["a", "b", "c", "a"]
    # below min_saved_tokens: by load alone, then round-robin order
    assert pick(["a", "b"], {"a": 63}, {"a": 1, "b": 0}, **kw) == "b"
    assert pick(["a", "b"], {"a": 64}, {"a": 1, "b": 0}, **kw) == "a"
    assert pick(["a", "b"], {"a": 63}, {"a": 1, "b": 0}, load_slack=2, min_saved_tokens=63) == "a"
    assert [pick(abc, {}, {}, **kw, start=i) for i in range(3)] == ["a", "b", "c"]
    assert pick(abc, {"a": 0, "b": 0}, {"a": 2, "b": 1, "c": 1}, load_slack=2, min_saved_tokens=0) == "b"
    with pytest.raises(ValueError):
        pick([], {}, {}, **kw)
    with pytest.raises(ValueError):
        RouterConfig(load_slack=-1)
    with pytest.raises(ValueError):
        Router(object(), ["a", "a"])


def test_router_routes_to_the_replica_holding_the_prompt(fleet: FleetProcs, clients, rng):
    t = fleet.start_all(("r0", "r1"))
    c0, c1 = clients(t["r0"]), clients(t["r1"])
    p = np.concatenate([message(rng, 49, ANCHORS[0]), *conversation(rng)])
    store_kv(c1, p, seed=10)
    wait_until(lambda: by_replica(c0.score(p, IDENT, ["r1"]))["r1"].prefix_tokens == len(p), "r1's chunks seen by r0")
    router = Router(c0, ["r0", "r1", "r9"], RouterConfig(load_slack=2, min_saved_tokens=64))
    for _ in range(3):
        route = router.route(p, IDENT)
        assert (route.replica, route.saved_tokens) == ("r1", len(p))
        assert set(route.scores) == {"r0", "r1"}  # r9: absent, never chosen while others are live
    # a prompt nobody holds: by load, in turn, never the absent r9
    other = np.concatenate([message(rng, 49, ANCHORS[0]), *conversation(rng)])
    assert {router.route(other, IDENT).replica for _ in range(4)} == {"r0", "r1"}
    # r1 past the load bound: the request goes to r0 although r1 holds it
    with router.request(p, IDENT) as a, router.request(p, IDENT) as b, router.request(p, IDENT) as c:
        assert [a.replica, b.replica, c.replica] == ["r1", "r1", "r1"]
        assert router.load == {"r0": 0, "r1": 3, "r9": 0}
        route = router.route(p, IDENT)
        assert (route.replica, route.saved_tokens) == ("r0", 0)
    assert router.load == {"r0": 0, "r1": 0, "r9": 0}
    # another model's identity: nothing cached anywhere
    other_model = CacheIdentity(model_id="other", kv_layout=IDENT.kv_layout)
    assert router.route(p, other_model).saved_tokens == 0


# ------------------------------------------------------------------------ tensor-parallel sizes


def store_as(client: SyncSidecarClient, tokens: np.ndarray, identity: CacheIdentity, layout) -> None:
    meta = client.store(tokens, identity=identity)
    b = meta.chunk_bounds
    per_tok = layout.bytes_per_token // 4
    pl = {a: torch.randn((e - a) * per_tok) for a, e in zip(b[:-1], b[1:])}
    assert client.store(tokens, identity=identity, layout=layout, payloads=pl).chunks_stored == len(pl)


def test_a_chunk_counts_for_every_tensor_parallel_size_it_can_serve(fleet: FleetProcs, clients, rng):
    """r0's engine stored a prompt at TP 1, r1's at TP 2 (each rank its head): scored under
    either size, both replicas hold all of it (docs/vllm.md, "Re-sharding"); an unrelated
    replica nothing."""
    names = ("r0", "r1", "r2")
    t = fleet.start_all(names, **WHOLE_CHUNKS)
    c = {r: clients(t[r]) for r in names}
    p = np.concatenate(conversation(rng))
    store_kv(c["r0"], p)  # TP 1: IDENT is unsharded
    half = heads_layout(LAYOUT, LAYOUT.parts[0].shape[0] // 2)
    tp2 = [dataclasses.replace(IDENT, kv_layout=half.fingerprint(), shard=f"tp{r}of2") for r in range(2)]
    for ident in tp2:
        store_as(c["r1"], p, ident, half)
    store_kv(c["r2"], np.concatenate(conversation(rng)))
    for ident, via in ((tp2[0], "r2"), (IDENT, "r2"), (tp2[0], "r0"), (IDENT, "r1")):
        wait_until(lambda: [(s.replica, s.saved_tokens) for s in c[via].score(p, ident, names).scores]
                   == [("r0", len(p)), ("r1", len(p)), ("r2", 0)],
                   f"scored via {via} under shard {ident.shard!r}: r0 and r1 hold the prompt")
