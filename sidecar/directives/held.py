"""Held sessions: per-token references to the canonical stored copy of a session's KV.

A *held* session is one whose KV the sidecar also holds in its own tiers: the engine Stored
the session's chunks (the normal Store RPC), and the sidecar keeps, for every token of the
session's current layout, where the token's **canonical copy** lives: the stored chunk
(``chunk_hash``), the row inside it (``row``) and the position that copy was computed at
(``source_pos``, the chunk's source position + row). Tokens with no stored copy yet are
*unbacked*::

    session   q:   0   1   2   3 |  4   5   6 |  7   8        (current positions)
    chunk_hash     A   A   A   A |  B   B   B |  -   -        (- : unbacked)
    row            0   1   2   3 | 10  11  12 |
    source_pos     0   1   2   3 | 14  15  16 |
                                  ^ delta 4 - 14 = -10: one rotation, whatever chained before

Plans never touch the copies: a committed plan only permutes the references along its layout
(``after``). A kept token keeps its reference whatever MOVE / ROTATE did to its slot in the
engine, so the sidecar always rotates from the canonical copy, once, by ``position -
source_pos`` (never a chain). New tokens (PREFILL, including everything a FORGET directive
re-prefills) are unbacked until the engine Stores them; REFRESH tokens keep their reference
(for a held copy a refresh is just that one rotation). Appends add unbacked tokens.

Tokens a FORGET directive re-prefilled are marked ``exact``: the content before them changed
and must not leak back through an old copy, so only a chunk computed with exactly their current
left context (same position, same prefix digest) may back them; other unbacked tokens take any
verified stored copy of their content, as Lookup serves it.

References are filled by a ``Resolver`` (the data plane chunks the session's tokens exactly
as Store and Lookup do and finds the stored chunks in the tenant's scope or the shared scope);
this module stays pure: numpy only, no registry, no I/O. Every object here is immutable (its
arrays are read-only), so snapshots are safe to share across an ``await``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from sidecar.directives.directive import EditMode
from sidecar.directives.layout import frozen
from sidecar.directives.op_plan import OpKind, OpPlan, SessionId
from sidecar.errors import InvariantViolation

if TYPE_CHECKING:
    from sidecar.identity import CacheIdentity

_EMPTY_U64 = frozen(np.zeros(0, dtype=np.uint64))
_EMPTY_I32 = frozen(np.zeros(0, dtype=np.int32))
_EMPTY_I64 = frozen(np.zeros(0, dtype=np.int64))
_EMPTY_BOOL = frozen(np.zeros(0, dtype=bool))


def forget_start(plan: OpPlan) -> int | None:
    """The new position from which ``plan`` re-prefills everything (its first FORGET
    directive's start, shifted by the directives before it), or None."""
    shift = 0
    for e in plan.edits:
        if e.mode is EditMode.FORGET:
            return e.start + shift
        shift += e.delta
    return None


def kept_sources(plan: OpPlan, n_old: int) -> np.ndarray:
    """int64 ``[n_new]``: for each position of ``plan.layout``, the old index of the token (and
    KV) it keeps, or -1 for a token the plan computes anew (PREFILL).

    Kept tokens keep their relative order, so the k-th kept new position holds the k-th old
    token outside every edited span (and before a FORGET directive's start, from which on
    everything is re-prefilled). REFRESH tokens count as kept.
    """
    n_new = len(plan.layout)
    marks = np.zeros(n_old + 1, dtype=np.int64)
    starts: list[int] = []
    ends: list[int] = []
    for e in plan.edits:  # sorted by start; per directive, never per token
        starts.append(e.start)
        if e.mode is EditMode.FORGET:
            ends.append(n_old)
            break
        ends.append(e.end)
    np.add.at(marks, np.asarray(starts, dtype=np.int64), 1)
    np.add.at(marks, np.asarray(ends, dtype=np.int64), -1)
    old_kept = np.flatnonzero(np.cumsum(marks[:-1]) == 0)
    fresh = np.zeros(n_new, dtype=bool)
    for op in plan.ops:
        if op.kind is OpKind.PREFILL:
            fresh[op.positions] = True
    new_kept = np.flatnonzero(~fresh)
    if len(old_kept) != len(new_kept):
        raise InvariantViolation(
            f"plan {plan.plan_id}: keeps {len(new_kept)} positions but its edits leave {len(old_kept)} old tokens; "
            "this indicates a bug in the planner (sidecar/directives/planner.py) or in kept_sources "
            "(sidecar/directives/held.py)"
        )
    src = np.full(n_new, -1, dtype=np.int64)
    src[new_kept] = old_kept
    return src


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class HeldRuns:
    """Maximal runs of consecutive positions held by consecutive rows of one stored chunk.

    Parallel read-only arrays, one entry per run, in position order: ``target_pos`` (int64,
    the run's first session position), ``num_tokens`` (int64), ``chunk_hash`` (uint64),
    ``row`` (int64, the first row in the chunk), ``source_pos`` (int64, the canonical source
    position of the first row). Rows of a run are consecutive, so one ``delta`` per run
    (``target_pos - source_pos``) re-positions all of them.
    """

    target_pos: np.ndarray
    num_tokens: np.ndarray
    chunk_hash: np.ndarray
    row: np.ndarray
    source_pos: np.ndarray

    def __len__(self) -> int:
        return len(self.target_pos)

    @property
    def delta(self) -> np.ndarray:
        """int64 rotation per run, in positions."""
        return self.target_pos - self.source_pos


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class HeldKV:
    """Canonical-copy references of a held session, one entry per token of its layout.

    ``chunk_hash`` uint64, ``row`` int32, ``source_pos`` int64 (``chunk source_pos + row``),
    ``backed`` bool (False: no stored copy known; the other fields are then 0), ``exact`` bool
    (only a copy computed with exactly the token's current left context may back it: tokens a
    FORGET directive re-prefilled). Read-only arrays; every update returns a new object.
    """

    chunk_hash: np.ndarray = field(default_factory=lambda: _EMPTY_U64)
    row: np.ndarray = field(default_factory=lambda: _EMPTY_I32)
    source_pos: np.ndarray = field(default_factory=lambda: _EMPTY_I64)
    backed: np.ndarray = field(default_factory=lambda: _EMPTY_BOOL)
    exact: np.ndarray = field(default_factory=lambda: _EMPTY_BOOL)

    @classmethod
    def unbacked(cls, n: int) -> "HeldKV":
        """``n`` tokens with no stored copy yet."""
        if n == 0:
            return cls()
        return cls(
            chunk_hash=frozen(np.zeros(n, dtype=np.uint64)),
            row=frozen(np.zeros(n, dtype=np.int32)),
            source_pos=frozen(np.zeros(n, dtype=np.int64)),
            backed=frozen(np.zeros(n, dtype=bool)),
            exact=frozen(np.zeros(n, dtype=bool)),
        )

    def __len__(self) -> int:
        return len(self.backed)

    @property
    def backed_count(self) -> int:
        return int(np.count_nonzero(self.backed))

    # ------------------------------------------------------------------------ session changes

    def extended(self, k: int) -> "HeldKV":
        """``k`` unbacked tokens appended (the engine computed them; it has not Stored them)."""
        if k == 0:
            return self
        more = HeldKV.unbacked(k)
        return HeldKV(
            chunk_hash=frozen(np.concatenate((self.chunk_hash, more.chunk_hash))),
            row=frozen(np.concatenate((self.row, more.row))),
            source_pos=frozen(np.concatenate((self.source_pos, more.source_pos))),
            backed=frozen(np.concatenate((self.backed, more.backed))),
            exact=frozen(np.concatenate((self.exact, more.exact))),
        )

    def after(self, plan: OpPlan) -> "HeldKV":
        """The references once ``plan`` is committed: kept tokens (moved, rotated, refreshed or
        untouched) keep their canonical copy; new tokens are unbacked, and ``exact`` from a
        FORGET directive's start on. See ``kept_sources``."""
        src = kept_sources(plan, len(self))
        kept = src >= 0
        forget_at = forget_start(plan)
        if len(self) == 0:  # nothing kept: every gather below would index an empty array
            out = HeldKV.unbacked(len(src))
            exact = np.zeros(len(src), dtype=bool)
        else:
            s = np.where(kept, src, 0)
            out = HeldKV(
                chunk_hash=np.where(kept, self.chunk_hash[s], np.uint64(0)),
                row=np.where(kept, self.row[s], 0).astype(np.int32, copy=False),
                source_pos=np.where(kept, self.source_pos[s], 0),
                backed=kept & self.backed[s],
            )
            exact = kept & self.exact[s]
        if forget_at is not None:
            exact[forget_at:] = True
        return HeldKV(
            chunk_hash=frozen(out.chunk_hash), row=frozen(out.row), source_pos=frozen(out.source_pos),
            backed=frozen(out.backed), exact=frozen(exact),
        )

    # ------------------------------------------------------------------------ resolution

    def filled(
        self, positions: np.ndarray, chunk_hash: np.ndarray, row: np.ndarray, source_pos: np.ndarray
    ) -> "HeldKV":
        """``positions`` (int64, distinct) now reference the given copies (parallel arrays)."""
        if len(positions) == 0:
            return self
        h, r, p, b = (a.copy() for a in (self.chunk_hash, self.row, self.source_pos, self.backed))
        h[positions] = chunk_hash
        r[positions] = row
        p[positions] = source_pos
        b[positions] = True
        return HeldKV(chunk_hash=frozen(h), row=frozen(r), source_pos=frozen(p), backed=frozen(b), exact=self.exact)

    def dropped(self, positions: np.ndarray) -> "HeldKV":
        """``positions`` lose their reference (their stored copy is gone): unbacked again."""
        if len(positions) == 0:
            return self
        h, r, p, b = (a.copy() for a in (self.chunk_hash, self.row, self.source_pos, self.backed))
        h[positions] = 0
        r[positions] = 0
        p[positions] = 0
        b[positions] = False
        return HeldKV(chunk_hash=frozen(h), row=frozen(r), source_pos=frozen(p), backed=frozen(b), exact=self.exact)

    # ------------------------------------------------------------------------ reads

    def gap(self, start: int, end: int) -> tuple[int, int] | None:
        """``(first unbacked position, unbacked count)`` in ``[start, end)``, or None."""
        miss = ~self.backed[start:end]
        count = int(np.count_nonzero(miss))
        if not count:
            return None
        return start + int(np.argmax(miss)), count

    def unbacked_exact(self, start: int, end: int) -> int:
        """Unbacked tokens in ``[start, end)`` that only an exact copy may back."""
        return int(np.count_nonzero(~self.backed[start:end] & self.exact[start:end]))

    def runs(self, start: int, end: int) -> HeldRuns:
        """The backed range ``[start, end)`` cut into runs (``HeldRuns``); a run breaks where
        the chunk changes or its rows stop being consecutive. The caller checked ``gap``."""
        h = self.chunk_hash[start:end]
        r = self.row[start:end].astype(np.int64)
        n = len(h)
        if n == 0:
            return HeldRuns(target_pos=_EMPTY_I64, num_tokens=_EMPTY_I64, chunk_hash=_EMPTY_U64, row=_EMPTY_I64,
                            source_pos=_EMPTY_I64)
        first = np.flatnonzero(np.concatenate(([True], (h[1:] != h[:-1]) | (r[1:] != r[:-1] + 1))))
        lengths = np.diff(np.append(first, n))
        return HeldRuns(
            target_pos=frozen(first + start),
            num_tokens=frozen(lengths),
            chunk_hash=frozen(h[first].copy()),
            row=frozen(r[first]),
            source_pos=frozen(self.source_pos[start:end][first].copy()),
        )


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class HeldSpan:
    """What FetchSession serves: runs tiling ``[start, end)`` of ``session_id``'s layout at
    ``version`` (the committed one), every position backed, under the session's identity."""

    session_id: SessionId
    tenant: str
    version: int
    identity: "CacheIdentity"
    start: int
    end: int
    runs: HeldRuns


#: ``resolver(tenant, identity, tokens, refs, start, end) -> refs``: fill (and refresh) the
#: references of ``[start, end)`` of a held session whose current tokens are ``tokens``
#: (uint32), from the chunks the sidecar stores in the tenant's scope or the shared scope.
#: Must not change the reference of a backed token whose copy is still stored. Synchronous
#: (runs on the event loop that owns the registry).
Resolver = Callable[[str, "CacheIdentity", np.ndarray, HeldKV, int, int], HeldKV]
