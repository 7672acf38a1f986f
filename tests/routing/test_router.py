"""The reference router's rule (sidecar/sdk/router.py, docs/routing.md "Reference router") on the
scores of a real fleet: ``kv-sidecar serve`` processes sharing one real Redis.

A conversation lives where its own KV is: the chunks computed after exactly its own left
context (a Score's prefix and exact tokens). Content it shares with other conversations, such
as a system prompt, is found shifted on every replica that served one of them; that is prefill
saved where the conversation lands, never a reason to move it off the replica holding its own
history (moving writes that history onto another conversation's replica and strands its copy).
"""

from __future__ import annotations

import numpy as np

from sidecar.registry.lookup_plan import SegmentKind
from sidecar.routing.score import ReplicaScore
from sidecar.sdk.router import Router, RouterConfig, pick
from tests.conftest import ANCHORS, message
from tests.routing.conftest import IDENT, FleetProcs, conversation, store_kv, wait_until

KW = {"load_slack": 2, "min_saved_tokens": 64}


def by_replica(res) -> dict[str, ReplicaScore]:
    return {s.replica: s for s in res.scores}


def test_the_conversations_own_kv_outranks_a_shared_prompt(fleet: FleetProcs, clients, rng):
    """Agent X's history is on A, whose copy of the shared system prompt S was evicted; agent Y
    (another header, the same S) ran on B. X's next call saves more prefill on B (all of S,
    shifted) than on A (X's header and history, exact), and the rule sends it to A, where its
    conversation is; only past the load bound does it go to B."""
    t = fleet.start_all(("A", "B"))
    a, b = clients(t["A"]), clients(t["B"])
    system = message(rng, 1200, ANCHORS[1])
    x_head, y_head = message(rng, 80, ANCHORS[0]), message(rng, 130, ANCHORS[0])
    x_prev = np.concatenate([x_head, system, *conversation(rng, sizes=(150, 170))])
    x_next = np.concatenate([x_prev, *conversation(rng, sizes=(120,))])
    store_kv(b, np.concatenate([y_head, system, *conversation(rng)]), seed=1)
    store_kv(a, x_prev, seed=2)
    lo, hi = len(x_head), len(x_head) + len(system)  # S's chunks on A: evicted
    evicted = [s.chunk_hash for s in a.lookup(x_prev, identity=IDENT).segments
               if s.kind is SegmentKind.CHUNK_HIT and lo <= s.start < hi]
    assert evicted and a.evict(evicted, tier="cpu") == len(evicted)

    own_a = len(x_prev) - len(system)  # X's header (the leading run) and history (exact)

    def published(via) -> dict[str, ReplicaScore] | None:
        sc = by_replica(via.score(x_next, IDENT, ["A", "B"]))
        a_, b_ = sc["A"], sc["B"]
        ok = ((a_.prefix_tokens, a_.exact_tokens, a_.shifted_tokens) == (len(x_head), own_a - len(x_head), 0)
              and b_.prefix_tokens == b_.exact_tokens == 0 and b_.shifted_tokens > 0)
        return sc if ok else None

    wait_until(lambda: published(a), "A's and B's residency seen by A")
    scores = wait_until(lambda: published(b), "A's and B's residency seen by B")
    # S shifted on B (less its boundary repair) saves more prefill than X's own KV on A
    assert scores["B"].saved_tokens > scores["A"].saved_tokens == own_a

    router = Router(b, ["A", "B"], RouterConfig(**KW))
    for _ in range(3):
        route = router.route(x_next, IDENT)
        assert (route.replica, route.saved_tokens) == ("A", own_a)
    # the load bound still rules: A three requests ahead, B's shared prompt is what is left
    with router.request(x_next, IDENT), router.request(x_next, IDENT), router.request(x_next, IDENT):
        assert router.load == {"A": 3, "B": 0}
        route = router.route(x_next, IDENT)
        assert (route.replica, route.saved_tokens) == ("B", scores["B"].saved_tokens)
    # a new conversation with the same system prompt: B holds the most of it, A none of it
    z = np.concatenate([message(rng, 90, ANCHORS[0]), system, *conversation(rng, sizes=(100,))])
    assert router.route(z, IDENT).replica == "B"
    # ... but the first call of a conversation named by its session goes by load alone: where it
    # lands, it will live (shared content there is no reason); its next calls go by their scores
    with router.request(z, IDENT) as busy:
        assert (busy.replica, router.load) == ("B", {"A": 0, "B": 1})
        first, later = (router.route(z, IDENT, session="z") for _ in range(2))
    assert (first.replica, later.replica) == ("A", "B")


def scores(**fields: tuple[int, int, int]) -> dict[str, ReplicaScore]:
    """ReplicaScores by replica from (prefix, exact, shifted) tokens."""
    return {r: ReplicaScore(replica=r, prefix_tokens=p, exact_tokens=e, shifted_tokens=s)
            for r, (p, e, s) in fields.items()}


def choose(order, sc: dict[str, ReplicaScore], load, **kw) -> str:
    own = {r: s.prefix_tokens + s.exact_tokens for r, s in sc.items()}
    return pick(order, {r: s.saved_tokens for r, s in sc.items()}, load, own=own, **{**KW, **kw})


def test_pick_own_kv_first():
    abc = ["a", "b", "c"]
    # the review's case: history on a, a shared system prompt (shifted) on b and c
    sc = scores(a=(80, 320, 0), b=(0, 0, 1200), c=(0, 0, 1200))
    assert choose(abc, sc, {}) == "a"
    # a past the load bound: the most saved prefill among the rest, then the least loaded
    assert choose(abc, sc, {"a": 3, "b": 1, "c": 0}) == "c"
    assert choose(abc, scores(a=(80, 320, 0), b=(0, 0, 1200), c=(0, 0, 900)), {"a": 3, "b": 1, "c": 0}) == "b"
    # the most own KV wins (the replica that served the conversation last holds the longest run)
    assert choose(abc, scores(a=(400, 0, 0), b=(900, 0, 300), c=(0, 0, 2000)), {}) == "b"
    # own KV below min_saved_tokens is no reason: the most saved prefill decides
    assert choose(abc, scores(a=(63, 0, 500), b=(0, 0, 900), c=(0, 0, 0)), {}) == "b"
    # nobody holds the conversation's own KV (its header changed): shifted hits decide, as before
    assert choose(abc, scores(a=(0, 0, 700), b=(0, 0, 2000), c=(0, 0, 0)), {}) == "b"
    # equal own KV: the most saved, then the least loaded
    assert choose(abc, scores(a=(500, 0, 100), b=(500, 0, 300), c=(0, 0, 0)), {}) == "b"
    assert choose(abc, scores(a=(500, 0, 0), b=(500, 0, 0), c=(0, 0, 0)), {"a": 1}) == "b"
    # without own figures (an exact-prefix scorer): the most saved, as before
    assert pick(abc, {"a": 100, "b": 500}, {}, **KW) == "b"
    # the first call of a conversation: the least loaded, whatever it saves elsewhere
    assert choose(abc, scores(a=(0, 0, 3000), b=(0, 0, 3000), c=(0, 0, 0)), {"a": 1, "b": 1}, first=True) == "c"
    assert choose(abc, sc, {"b": 1, "c": 1}, first=True) == "a"
    assert [choose(abc, sc, {}, first=True, start=i) for i in range(3)] == ["a", "b", "c"]
    # scores within min_saved_tokens of the most count as equal: the least loaded of them
    assert choose(abc, scores(a=(0, 0, 3000), b=(0, 0, 2950), c=(0, 0, 0)), {"a": 1}) == "b"
    assert choose(abc, scores(a=(0, 0, 3000), b=(0, 0, 2900), c=(0, 0, 0)), {"a": 1}) == "a"


def test_load_window_on_the_routers_clock(fleet: FleetProcs, clients, rng):
    """``load_window_s`` counts the requests routed in that many seconds of the router's clock
    (a replay passes a virtual one): a prompt nobody holds goes to the least loaded replica."""
    t = fleet.start_all(("A", "B"))
    now = [100.0]
    router = Router(clients(t["A"]), ["A", "B"], RouterConfig(load_slack=0, load_window_s=10), clock=lambda: now[0])
    p = np.concatenate([message(rng, 49, ANCHORS[0]), *conversation(rng)])
    routed = []
    for step in (0.0, 4.0, 4.0):
        now[0] += step
        with router.request(p, IDENT) as route:
            routed.append(route.replica)
    assert routed == ["A", "B", "A"]
    assert router.load == {"A": 2, "B": 1}
    now[0] += 6.5  # 14.5 s after the first request, 10.5 s after the second
    assert router.load == {"A": 1, "B": 0}
    assert router.route(p, IDENT).replica == "B"
    now[0] += 10.0
    assert router.load == {"A": 0, "B": 0}
