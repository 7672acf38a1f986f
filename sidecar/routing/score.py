"""Scores: per candidate replica, what the Lookup planner would serve it from cache.

A score is a Lookup plan, not a second planner: ``ChunkIndex.lookup_reference`` runs once per
candidate with the request's admission policy and guards (``LookupQuery``) over a *view* of the
entries, the chunks that candidate holds, and nothing is touched::

    candidate's view(key) = this sidecar's entry for the chunk (tokens, left context)
                            re-positioned where THAT replica's copy was computed (its residency
                            field: source_pos, prefix_digest, next_digest), or None when it
                            holds no copy; for the key of a chunk's copy computed after the
                            prompt's left context (``entry.variant_key``), that copy as the
                            replica's residency names it;
                            the scoring sidecar's own replica: its RESIDENT entries

    plan ──> prefix (the leading exact run from position 0), exact, shifted, prefill tokens;
             tokens by the tier each hit is served from

A score counts chunk hits, with boundary repair and the guards applied, and the same way for
every candidate, the scoring sidecar's own replica included, so candidates compare fairly. The
Lookup that follows can serve more, never less: it also extends hits token by token into their
stored neighbours and finds seed hits (text moved without a chunk cut of its own). Neither is
scored: a peer's neighbours are known here by digest only (records carry no tokens), so only
the own replica could be credited with them, and seeds cost a seed-map probe per 32 tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from sidecar.registry.entry import ChunkEntry, EntryState
from sidecar.registry.lookup_plan import (
    SEG_END,
    SEG_FIDELITY,
    SEG_HASH,
    SEG_KIND,
    SEG_START,
    Fidelity,
    LookupPlan,
    SegmentKind,
)
from sidecar.routing.residency import Holding
from sidecar.tiers import Tier

_HIT = int(SegmentKind.CHUNK_HIT)
_EXACT = int(Fidelity.EXACT)
_REMOTE = Tier.REMOTE.value


@dataclass(slots=True)
class ReplicaScore:
    """What one replica could serve of a prompt (tokens)."""

    replica: str
    prefix_tokens: int = 0
    exact_tokens: int = 0
    shifted_tokens: int = 0
    prefill_tokens: int = 0
    chunks_hit: int = 0
    tier_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def saved_tokens(self) -> int:
        """The prefill this replica would save: prefix + exact + shifted."""
        return self.prefix_tokens + self.exact_tokens + self.shifted_tokens


@dataclass(frozen=True, slots=True)
class ScoreResult:
    total_tokens: int
    scores: list[ReplicaScore]
    absent: list[str]


class Holdings:
    """One candidate's view for the planner: ``held`` (its residency: key -> its copy) plus the
    chunks of the shared remote tier it reads (``remote``), over this sidecar's entries.
    ``base_of``: the chunk key of each copy key in ``held`` (a replica's copy of a chunk computed
    after another left context is planned from this sidecar's entry for the chunk)."""

    def __init__(self, peek: Callable[[int], ChunkEntry | None], held: Mapping[int, Holding],
                 remote: frozenset[int] | set[int] = frozenset(), copies: dict | None = None,
                 base_of: Mapping[int, int] | None = None) -> None:
        self.peek = peek
        self.held = held
        self.remote = remote
        self.base_of = base_of or {}
        #: re-positioned copies, by (key, source_pos, prefix_digest, next_digest): shared across
        #: calls by the caller (bounded there)
        self._copies: dict[tuple[int, int, int, int], ChunkEntry] = {} if copies is None else copies

    def __bool__(self) -> bool:
        return bool(self.held) or bool(self.remote)

    def __call__(self, key: int) -> ChunkEntry | None:
        h = self.held.get(key)
        if h is None:
            return self.peek(key) if key in self.remote else None
        base = self.peek(key)
        if base is None and key in self.base_of:
            base = self.peek(self.base_of[key])  # the same tokens
        if base is None:
            return None  # no record of the chunk here (expired or not yet published): not plannable
        if (base.key == key and base.source_pos == h.source_pos and base.prefix_digest == h.prefix_digest
                and base.next_digest == h.next_digest):
            return base
        ck = (key, h.source_pos, h.prefix_digest, h.next_digest)
        copy = self._copies.get(ck)
        if copy is None or copy.num_tokens != base.num_tokens:
            # Plan with where THAT replica's copy was computed and the digest its successor has
            # there (what coalesces consecutive shifted chunks), as the replica itself does: this
            # sidecar's entry may sit elsewhere, or be a record without its successor's digest.
            # Its neighbours' keys are not needed (scores do not extend hits).
            copy = self._copies[ck] = ChunkEntry(
                key=key, scope=base.scope, tokens=base.tokens, source_pos=h.source_pos,
                prefix_digest=h.prefix_digest, left_context=base.left_context, state=base.state, tier=base.tier,
                num_tokens=base.num_tokens, digest=base.digest, next_digest=h.next_digest)
        elif not copy.tokens and base.tokens:
            copy.tokens = base.tokens
        return copy

    def tier(self, key: int) -> str:
        h = self.held.get(key)
        return h.tier if h is not None else _REMOTE


def own_view(peek: Callable[[int], ChunkEntry | None]) -> tuple[Callable[[int], ChunkEntry | None],
                                                                Callable[[int], str]]:
    """The scoring sidecar's own replica: its RESIDENT entries, at their tiers."""
    resident = EntryState.RESIDENT

    def view(key: int) -> ChunkEntry | None:
        e = peek(key)
        return e if e is not None and e.state is resident else None

    def tier(key: int) -> str:
        e = peek(key)
        return (e.tier or _REMOTE) if e is not None else _REMOTE

    return view, tier


def score_of(plan: LookupPlan, replica: str, tier_of: Callable[[int], str]) -> ReplicaScore:
    """Read a candidate's score off its plan (planned with ``engine_prefix_len`` 0)."""
    t = plan.table
    out = ReplicaScore(replica=replica, chunks_hit=plan.summary.chunks_hit)
    n = plan.summary.total_tokens
    if not len(t):
        out.prefill_tokens = n
        return out
    kind = t[:, SEG_KIND].astype(np.int64)
    start = t[:, SEG_START].astype(np.int64)
    end = t[:, SEG_END].astype(np.int64)
    hit = kind == _HIT
    exact = hit & (t[:, SEG_FIDELITY].astype(np.int64) == _EXACT)
    # the leading exact run: hits from position 0 on, each starting where the previous ended
    pos = 0
    for i in range(len(t)):
        if not exact[i] or start[i] != pos:
            break
        pos = int(end[i])
    lengths = end - start
    out.prefix_tokens = pos
    out.exact_tokens = int(lengths[exact].sum()) - pos
    out.shifted_tokens = int(lengths[hit & ~exact].sum())
    out.prefill_tokens = n - out.saved_tokens
    tiers = out.tier_tokens
    for key, length in zip(t[hit, SEG_HASH].tolist(), lengths[hit].tolist()):
        tier = tier_of(key)
        tiers[tier] = tiers.get(tier, 0) + length
    return out


def best_per_replica(results: Sequence[ScoreResult]) -> ScoreResult:
    """Per replica the score that saves the most of one prompt scored under several identities
    (the tensor-parallel sizes of one model: ``Fleet.score_any_cut``); absent where absent in all."""
    first = results[0]
    best = {s.replica: s for s in first.scores}
    for r in results[1:]:
        for s in r.scores:
            if s.replica not in best or s.saved_tokens > best[s.replica].saved_tokens:
                best[s.replica] = s
    order = [s.replica for s in first.scores] + [c for r in results[1:] for c in (s.replica for s in r.scores)]
    seen: set[str] = set()
    scores = [best[c] for c in order if not (c in seen or seen.add(c))]
    absent = [c for c in first.absent if c not in best]
    return ScoreResult(total_tokens=first.total_tokens, scores=scores, absent=absent)

