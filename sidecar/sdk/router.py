"""A small reference router: send each request to the replica that can serve most of it from cache,
among the replicas whose load is within a bound (docs/routing.md, "Reference router").

    router = Router(SyncSidecarClient("sidecar:50051", tenant="team-a"), ["pod-a", "pod-b", "pod-c"])
    with router.request(tokens, identity) as route:      # Score, pick, count the request in flight
        forward(route.replica, prompt)                   # the engine behind that replica
    # leaving the block counts it out

``pick`` is the rule, transport-free (an asyncio proxy calls it with ``SidecarClient.score``'s
answer and its own load figures):

    eligible = replicas whose load <= the least loaded one's + load_slack, where a replica's load
               is its requests in flight through this router, or, with load_window_s, the
               requests it routed there in the last load_window_s seconds
    choose   = the eligible replica with the most saved prefill tokens (``ReplicaScore``), when
               that is at least min_saved_tokens; else, or on a tie, the least loaded one; then
               round-robin order

``load_slack`` trades reuse for balance: 0 is pure least-loaded with cache as the tie-break; a
large value is pure cache affinity. Requests in flight balance concurrency; agents that think
between calls keep few in flight, so ``load_window_s`` (a recent request count) is what keeps
their request rates balanced. A Score that fails (sidecar unreachable) routes by load.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sidecar.errors import SidecarError
from sidecar.identity import CacheIdentity
from sidecar.routing.score import ReplicaScore


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """``load_slack``: how much more load than the least loaded replica an eligible replica may
    have. ``load_window_s``: 0 counts a replica's requests in flight as its load; > 0 counts the
    requests routed to it in that many last seconds. ``min_saved_tokens``: a best score below
    this routes by load alone. (The Score call's deadline is the client's ``timeout_s``: give the
    router's client a short one.)"""

    load_slack: int = 2
    load_window_s: float = 0.0
    min_saved_tokens: int = 64

    def __post_init__(self) -> None:
        if self.load_slack < 0 or self.min_saved_tokens < 0 or self.load_window_s < 0:
            raise ValueError("router: load_slack, load_window_s and min_saved_tokens must be >= 0")


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes, and why: ``saved_tokens`` the chosen replica's score (0 when routed
    by load), ``scores`` every candidate's (empty when Score failed)."""

    replica: str
    saved_tokens: int
    scores: Mapping[str, ReplicaScore] = field(default_factory=dict)


def pick(order: Sequence[str], saved: Mapping[str, int], load: Mapping[str, int], *, load_slack: int,
         min_saved_tokens: int, start: int = 0) -> str:
    """The replica ``Router`` chooses (module docstring). ``order``: the replicas, ``start``: the
    round-robin offset breaking the last ties; replicas missing from ``saved`` score 0."""
    if not order:
        raise ValueError("router: no replicas to choose from")
    floor = min(load.get(r, 0) for r in order)
    n = len(order)
    ranked = [order[(start + i) % n] for i in range(n)]
    eligible = [r for r in ranked if load.get(r, 0) <= floor + load_slack]
    best = max(eligible, key=lambda r: saved.get(r, 0))
    if saved.get(best, 0) >= max(1, min_saved_tokens):
        top = saved[best]
        return min((r for r in eligible if saved.get(r, 0) == top), key=lambda r: load.get(r, 0))
    return min(ranked, key=lambda r: load.get(r, 0))


class Router:
    """The reference router over a ``SyncSidecarClient`` (any sidecar of the fleet answers Score
    for all of them). Thread-safe: its load figures are the requests in flight through it."""

    def __init__(self, client: Any, replicas: Sequence[str], config: RouterConfig = RouterConfig()) -> None:
        if not replicas or len(set(replicas)) != len(replicas):
            raise ValueError("router: replicas must be a non-empty list of distinct ids")
        self.client = client
        self.replicas = list(replicas)
        self.config = config
        self._load = dict.fromkeys(self.replicas, 0)
        self._recent: deque[tuple[float, str]] = deque()
        self._lock = threading.Lock()
        self._turn = itertools.count()

    @property
    def load(self) -> dict[str, int]:
        """Each replica's load as ``pick`` sees it (``RouterConfig.load_window_s``)."""
        window = self.config.load_window_s
        with self._lock:
            if not window:
                return dict(self._load)
            recent = self._recent
            horizon = time.monotonic() - window
            while recent and recent[0][0] < horizon:
                recent.popleft()
            out = dict.fromkeys(self.replicas, 0)
            for _, r in recent:
                out[r] += 1
            return out

    def route(self, tokens: Any, identity: CacheIdentity, **guards: Any) -> Route:
        """Score ``tokens`` on every replica and pick one (not counted in flight: ``request``)."""
        cfg = self.config
        try:
            res = self.client.score(tokens, identity, self.replicas, **guards)
            scores = {s.replica: s for s in res.scores}
        except SidecarError:
            scores = {}
        saved = {r: s.saved_tokens for r, s in scores.items()}
        load = self.load
        # absent replicas (no live heartbeat) are only chosen when nothing else is left
        order = [r for r in self.replicas if not scores or r in scores] or self.replicas
        replica = pick(order, saved, load, load_slack=cfg.load_slack, min_saved_tokens=cfg.min_saved_tokens,
                       start=next(self._turn))
        got = saved.get(replica, 0)
        return Route(replica=replica, saved_tokens=got if got >= cfg.min_saved_tokens else 0, scores=scores)

    @contextmanager
    def request(self, tokens: Any, identity: CacheIdentity, **guards: Any) -> Iterator[Route]:
        """``route``, with the request counted in flight on its replica until the block ends."""
        route = self.route(tokens, identity, **guards)
        with self._lock:
            self._load[route.replica] += 1
            if self.config.load_window_s:
                self._recent.append((time.monotonic(), route.replica))
        try:
            yield route
        finally:
            with self._lock:
                self._load[route.replica] -= 1
