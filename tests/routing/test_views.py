"""One replica, one score: a replica scored by itself and by each of its peers gets the same answer.

docs/routing.md: every candidate is planned the same way. A sidecar plans its own replica over
its own registry and a peer over the peer's residency (where each copy was computed, and the
digest its successor has there) laid over the chunk records it read from Redis. Both views must
carry the same information, or consecutive shifted chunks coalesce into one hit segment in one
view and not in the other, and boundary repair or the carve-out below position 32 takes a few
tokens more in one of them.

Real ``kv-sidecar serve`` processes share one real Redis (``tests/routing/conftest.py``). The
test waits (bounded liveness loop) until the publications it depends on landed, then compares
every field of every score, for every (scorer, candidate) pair, over many prompts.
"""

from __future__ import annotations

import numpy as np
import torch

from tests.conftest import ANCHORS, message
from tests.routing.conftest import IDENT, LAYOUT, FleetProcs, conversation, store_kv, wait_until

NAMES = ("r0", "r1", "r2")
#: guards of the compared scores: the defaults, one repair per segment (coalescing decides how
#: many repairs), no repair (the carve-out alone)
POLICIES = (
    {},
    {"recompute_tokens": 4, "repair_scope": "segment"},
    {"recompute_tokens": 4, "repair_scope": "chunk"},
    {"recompute_tokens": 0},
    {"policy": "exact"},
)


def store_at_once(client, tokens: np.ndarray, seed: int) -> None:
    """One Store with a payload for every chunk (no metadata-only Store before it: the chunk
    bounds come from a dry-run Lookup, which registers nothing)."""
    b = client.lookup(tokens, identity=IDENT, dry_run=True).chunk_bounds.tolist()
    g = torch.Generator().manual_seed(seed)
    per_tok = LAYOUT.bytes_per_token // 4
    pl = {a: torch.randn((e - a) * per_tok, generator=g) for a, e in zip(b[:-1], b[1:])}
    assert client.store(tokens, identity=IDENT, layout=LAYOUT, payloads=pl).chunks_stored == len(pl)


def fields(s) -> tuple:
    return (s.prefix_tokens, s.exact_tokens, s.shifted_tokens, s.prefill_tokens, s.saved_tokens, s.chunks_hit,
            dict(sorted(s.tier_tokens.items())))


def views(clients_by: dict, q: np.ndarray, **guards) -> dict[str, dict[str, tuple]]:
    """candidate -> scorer -> every field of the candidate's score as that scorer computed it."""
    out: dict[str, dict[str, tuple]] = {r: {} for r in NAMES}
    for via in NAMES:
        res = clients_by[via].score(q, IDENT, list(NAMES), **guards)
        assert res.absent == [] and [s.replica for s in res.scores] == list(NAMES)
        for s in res.scores:
            out[s.replica][via] = fields(s)
    return out


def disagreements(v: dict[str, dict[str, tuple]]) -> list[str]:
    return [f"{cand} scored by itself {by[cand]}, by {via} {got}"
            for cand, by in v.items() for via, got in by.items() if got != by[cand]]


def test_every_replica_scores_a_replica_the_same_way(fleet: FleetProcs, clients, rng):
    """r0 stores X after a header; r2 first learns X's records from Redis (metadata only, without
    the digests that link each chunk to its successor), then stores the same prompt itself in one
    Store; r1 stores a history that repeats one message three times (its chunks held as several
    copies, one per left context: every scorer sees the whole history as r1's exact prefix). Prompts: X after headers of many lengths
    (shifted hits whose first chunks sit around the carve-out at 32: X opens with a short message), parts of X, X reordered,
    and r0's own prompt (exact), under five guard settings."""
    t = fleet.start_all(NAMES)
    c = {r: clients(t[r]) for r in NAMES}
    X = conversation(rng, sizes=(10, 200, 150, 260, 120))  # a short first message: chunks below 32
    p0 = np.concatenate([message(rng, 49, ANCHORS[0]), *X])
    store_kv(c["r0"], p0, seed=1)
    # r2 reads r0's records (a Score absorbs them as metadata) before it stores the prompt itself
    wait_until(lambda: {s.replica: s.prefix_tokens for s in c["r2"].score(p0, IDENT, list(NAMES)).scores}["r0"]
               == len(p0), "r0's residency seen by r2")
    store_at_once(c["r2"], p0, seed=2)
    m = message(rng, 150, ANCHORS[1])
    again = np.concatenate([message(rng, 30, ANCHORS[0]), m, message(rng, 50, ANCHORS[2]), m,
                            message(rng, 70, ANCHORS[3]), m, message(rng, 20, ANCHORS[2])]).astype(np.uint32)
    store_at_once(c["r1"], again, seed=3)

    def settled() -> bool:
        for via in NAMES:
            s = {x.replica: x for x in c[via].score(p0, IDENT, list(NAMES)).scores}
            if s["r0"].prefix_tokens != len(p0) or s["r2"].prefix_tokens != len(p0) or s["r1"].saved_tokens:
                return False
        return True

    wait_until(settled, "r0's and r2's residency published")

    # the repeated history: r1's exact prefix, every occurrence of m included, whoever scores
    def r1_exact(via: str) -> bool:
        s = {x.replica: x for x in c[via].score(again, IDENT, list(NAMES)).scores}["r1"]
        return (s.prefix_tokens, s.exact_tokens, s.shifted_tokens, s.prefill_tokens) == (len(again), 0, 0, 0)

    for via in NAMES:
        wait_until(lambda: r1_exact(via), f"r1's repeated history scored as its exact prefix by {via}")
    prompts = {f"header {n}": np.concatenate([message(rng, n, ANCHORS[0]), *X]) for n in (0, 5, 12, 17, 18, 19, 27, 40, 80)}
    prompts["no header"] = np.concatenate(X)
    prompts["reordered"] = np.concatenate([message(rng, 9, ANCHORS[0]), X[2], X[0], X[1], X[4], X[3]])
    prompts["middle"] = np.concatenate([message(rng, 16, ANCHORS[0]), X[1], X[2]])
    prompts["r0's prompt"] = p0
    prompts["r1's prompt"] = again
    prompts["r1's prompt, new header"] = np.concatenate([message(rng, 44, ANCHORS[0]), again[31:]])
    prompts["r1's prompt, cut"] = again[: len(again) - 25]
    bad: list[str] = []
    shifted = 0
    for name, q in prompts.items():
        for guards in POLICIES:
            v = views(c, q, **guards)
            shifted += sum(f[2] for f in v["r0"].values())
            bad += [f"{name!r} {guards}: {d}" for d in disagreements(v)]
    assert not bad, "\n".join(bad)
    assert shifted > 0  # the prompts do exercise shifted hits
