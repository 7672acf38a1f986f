"""A small reference router: send each request to the replica that can serve most of it from cache,
among the replicas whose load is within a bound (docs/routing.md, "Reference router").

    router = Router(SyncSidecarClient("sidecar:50051", tenant="team-a"), ["pod-a", "pod-b", "pod-c"])
    with router.request(tokens, identity, session=agent_id) as route:   # Score, pick, count it
        forward(route.replica, prompt)                   # the engine behind that replica
    # leaving the block counts it out

``pick`` is the rule, transport-free (an asyncio proxy calls it with ``SidecarClient.score``'s
answer and its own load figures):

    eligible = replicas whose load <= the least loaded one's + load_slack, where a replica's load
               is its requests in flight through this router, or, with load_window_s, the
               requests it routed there in the last load_window_s seconds
    first    = the first call of a conversation (a ``session`` the router has not seen): the
               least loaded replica
    home     = else, among the eligible replicas holding at least min_saved_tokens of the
               conversation's own KV (a Score's prefix + exact tokens), the one saving the most
    else     = the eligible replica saving the most prefill (``ReplicaScore.saved_tokens``), when
               that is at least min_saved_tokens; replicas within min_saved_tokens of it count
               as equal: the least loaded of them. None saving min_saved_tokens: the least
               loaded. Last ties: round-robin order

Why the conversation's own KV first: content a conversation shares with others (a system
prompt, tool schemas) is found, shifted, on every replica that served one of them. It saves
prefill wherever the call lands, but it is no reason to move the conversation off the replica
holding its own history: that writes the history again onto another conversation's replica,
under cache pressure evicting that conversation's, and strands the first copy. Own KV is what
was computed after exactly this prompt's left context, by an earlier call of the conversation;
after its header changed (a timestamp) its history is all shifted and the most saved prefill
finds it. For the same reason a conversation's first call, which can only reuse shared content,
is placed by load: where it lands is where it will live, and placing the agents of one system
prompt together (while the load bound allows) leaves replicas without them, so the load bound
later pushes agents onto replicas that hold nothing of theirs. Without ``session`` every call is
routed by its scores.

``load_slack`` trades reuse for balance: 0 is pure least-loaded with cache as the tie-break; a
large value is pure cache affinity. Requests in flight balance concurrency; agents that think
between calls keep few in flight, so ``load_window_s`` (a recent request count) is what keeps
their request rates balanced. A Score that fails (sidecar unreachable) routes by load.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
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
         min_saved_tokens: int, start: int = 0, own: Mapping[str, int] | None = None, first: bool = False) -> str:
    """The replica ``Router`` chooses (module docstring). ``order``: the replicas, ``start``: the
    round-robin offset breaking the last ties; ``saved``: each one's saved prefill tokens,
    ``own``: how many of them are the conversation's own KV (a Score's prefix + exact tokens;
    ``saved`` when not given); replicas missing from either count 0. ``first``: the first call
    of a conversation, placed by load."""
    if not order:
        raise ValueError("router: no replicas to choose from")
    own = saved if own is None else own
    floor = min(load.get(r, 0) for r in order)
    n = len(order)
    ranked = [order[(start + i) % n] for i in range(n)]
    eligible = [r for r in ranked if load.get(r, 0) <= floor + load_slack]
    least = max(1, min_saved_tokens)

    def worth(r: str) -> int:
        s = saved.get(r, 0)
        return s if s >= least else 0

    if first:  # by load alone (min keeps the first of equals: round-robin order)
        return min(eligible, key=lambda r: load.get(r, 0))
    # where the conversation's own KV is (max keeps the first of equals: round-robin order)
    homes = [r for r in eligible if own.get(r, 0) >= least]
    if homes:
        return max(homes, key=lambda r: (saved.get(r, 0), own.get(r, 0), -load.get(r, 0)))
    # else the most saved; replicas saving within min_saved_tokens of the most save the same
    top = max(worth(r) for r in eligible)
    if top:
        eligible = [r for r in eligible if worth(r) > top - least]
    return min(eligible, key=lambda r: (load.get(r, 0), -worth(r)))


#: the most conversations a router remembers having seen (least recently seen forgotten first)
SESSIONS = 1 << 16


class Router:
    """The reference router over a ``SyncSidecarClient`` (any sidecar of the fleet answers Score
    for all of them). Thread-safe: its load figures are the requests in flight through it."""

    def __init__(self, client: Any, replicas: Sequence[str], config: RouterConfig = RouterConfig(), *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not replicas or len(set(replicas)) != len(replicas):
            raise ValueError("router: replicas must be a non-empty list of distinct ids")
        self.client = client
        self.replicas = list(replicas)
        self.config = config
        self._load = dict.fromkeys(self.replicas, 0)
        self._recent: deque[tuple[float, str]] = deque()
        self._lock = threading.Lock()
        self._turn = itertools.count()
        self._clock = clock  # seconds, for load_window_s (a replay passes its own)
        self._sessions: OrderedDict[str, None] = OrderedDict()  # the conversations seen, least recent first

    @property
    def load(self) -> dict[str, int]:
        """Each replica's load as ``pick`` sees it (``RouterConfig.load_window_s``)."""
        window = self.config.load_window_s
        with self._lock:
            if not window:
                return dict(self._load)
            recent = self._recent
            horizon = self._clock() - window
            while recent and recent[0][0] < horizon:
                recent.popleft()
            out = dict.fromkeys(self.replicas, 0)
            for _, r in recent:
                out[r] += 1
            return out

    def route(self, tokens: Any, identity: CacheIdentity, *, session: str | None = None, **guards: Any) -> Route:
        """Score ``tokens`` on every replica and pick one (not counted in flight: ``request``).
        ``session``: the caller's id of the conversation (an agent's session); its first call
        is placed by load."""
        cfg = self.config
        first = False
        if session is not None:
            with self._lock:
                first = session not in self._sessions
                self._sessions[session] = None
                self._sessions.move_to_end(session)
                if len(self._sessions) > SESSIONS:
                    self._sessions.popitem(last=False)
        try:
            res = self.client.score(tokens, identity, self.replicas, **guards)
            scores = {s.replica: s for s in res.scores}
        except SidecarError:
            scores = {}
        saved = {r: s.saved_tokens for r, s in scores.items()}
        own = {r: s.prefix_tokens + s.exact_tokens for r, s in scores.items()}
        load = self.load
        # absent replicas (no live heartbeat) are only chosen when nothing else is left
        order = [r for r in self.replicas if not scores or r in scores] or self.replicas
        replica = pick(order, saved, load, load_slack=cfg.load_slack, min_saved_tokens=cfg.min_saved_tokens,
                       start=next(self._turn), own=own, first=first)
        got = saved.get(replica, 0)
        return Route(replica=replica, saved_tokens=got if got >= cfg.min_saved_tokens else 0, scores=scores)

    @contextmanager
    def request(self, tokens: Any, identity: CacheIdentity, *, session: str | None = None,
                **guards: Any) -> Iterator[Route]:
        """``route``, with the request counted in flight on its replica until the block ends."""
        route = self.route(tokens, identity, session=session, **guards)
        with self._lock:
            self._load[route.replica] += 1
            if self.config.load_window_s:
                self._recent.append((self._clock(), route.replica))
        try:
            yield route
        finally:
            with self._lock:
                self._load[route.replica] -= 1
