"""Routing on a real Redis Cluster (three ``redis-server`` nodes, ``shared_registry.cluster``):
residency and heartbeats are published through the cluster client, and a Score reads them in
one pipelined call that redis-py sends to each slot's node (the residency hashes of a scope
share its records' slot; the heartbeats share the ``{replicas}`` slot)."""

from __future__ import annotations

import numpy as np
import redis

from sidecar.client import SyncSidecarClient
from tests.conftest import ANCHORS, message
from tests.registry.test_shared_cluster import redis_cluster  # noqa: F401 - the fixture
from tests.routing.conftest import IDENT, FleetProcs, conversation, store_kv, wait_until


def _calls(nodes, cmd: str) -> list[int]:
    out = []
    for n in nodes:
        with redis.Redis(host="127.0.0.1", port=n.port) as r:
            out.append(int(r.info("commandstats").get(f"cmdstat_{cmd}", {}).get("calls", 0)))
    return out


def test_scores_on_a_redis_cluster(redis_cluster, prefix, rng):  # noqa: F811 - the fixture
    nodes = redis_cluster
    fleet = FleetProcs(prefix, nodes[0].url)
    try:
        opts = {"shared_registry.cluster": "true"}
        t = fleet.start_all(("r0", "r1"), **opts)
        with SyncSidecarClient(t["r0"], tenant="alice") as c0, SyncSidecarClient(t["r1"], tenant="alice") as c1:
            p = np.concatenate([message(rng, 49, ANCHORS[0]), *conversation(rng)])
            q = np.concatenate([message(rng, 77, ANCHORS[0]), *conversation(rng)[:1], p[50:]])
            store_kv(c1, p, seed=1)
            want = c1.lookup(q, identity=IDENT).summary
            assert want.shifted_tokens > 0

            def r1_score():
                return {s.replica: s for s in c0.score(q, IDENT, ["r0", "r1", "r9"]).scores}

            wait_until(lambda: r1_score()["r1"].shifted_tokens > 0, "r1's residency seen by r0 through the cluster")
            res = c0.score(q, IDENT, ["r0", "r1", "r9"])
            got = {s.replica: s for s in res.scores}
            assert res.absent == ["r9"]
            assert got["r0"].saved_tokens == 0
            assert got["r1"].chunks_hit == want.chunks_hit
            assert 0 < got["r1"].saved_tokens <= want.exact_tokens + want.shifted_tokens
            assert got["r1"].tier_tokens == {"cpu": got["r1"].saved_tokens}
            # one pipelined call: the HMGETs on the node holding alice's slot, the beats' GETs on
            # the node holding {replicas}
            before = _calls(nodes, "hmget")
            c0.score(q, IDENT, ["r1"])
            delta = [a - b for a, b in zip(_calls(nodes, "hmget"), before)]
            assert sorted(delta)[:2] == [0, 0] and max(delta) > 0, delta
    finally:
        fleet.close()
