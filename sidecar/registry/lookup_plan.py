"""Lookup plans: the one result type a Lookup returns (domain side and client side alike).

A plan tiles the prompt ``[0, n)`` with segments, in order, without gaps or overlaps::

    0            engine_prefix_len                                           n
    | ENGINE_PREFIX | CHUNK_HIT h1 (delta -40) | PREFILL | CHUNK_HIT h2 (delta 0) |
                    ^ start                   ^ end

Segments are kept as one packed ``uint64`` table (a record of 7 fields per segment) because
that is how they travel on the wire (bytes, like tokens: microseconds to encode and decode) and
how an engine consumes them (index tensors); ``segments`` materialises row objects on demand.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from enum import Enum, IntEnum

import numpy as np

#: Positions below this are never served from a shifted chunk (attention sinks, Irminsul 7.1).
CARVE_OUT_TOKENS = 32


class AdmissionPolicy(str, Enum):
    EXACT = "exact"
    POSITION_INDEPENDENT = "position_independent"


class RepairScope(str, Enum):
    """Where boundary repair (``recompute_tokens`` k) re-prefills inside a hit segment that
    continues one stored sequence (``shaping``): at every stored chunk's first row, or once at
    the segment's start. Exact segments are never repaired."""

    CHUNK = "chunk"
    SEGMENT = "segment"


class SegmentKind(IntEnum):  # values match sidecar.v1.SegmentKind
    ENGINE_PREFIX = 1
    CHUNK_HIT = 2
    PREFILL = 3


class Fidelity(IntEnum):  # values match sidecar.v1.Fidelity
    NONE = 0  # not a chunk hit
    EXACT = 1  # identical left context: reproduces full-context KV
    APPROXIMATE = 2  # shifted or different left context


@dataclass(frozen=True, slots=True)
class Segment:
    kind: SegmentKind
    start: int
    end: int
    chunk_hash: int = 0
    chunk_offset: int = 0
    source_pos: int = 0
    delta: int = 0
    fidelity: Fidelity = Fidelity.NONE

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class FetchSpec:
    """One Fetch item. ``num_tokens`` 0: a whole chunk whose FIRST row goes to ``target_pos``
    (``(chunk_hash, target_pos)``, the original form). ``num_tokens`` > 0: a span (one hit
    segment): ``num_tokens`` rows from row ``row_offset`` of ``chunk_hash`` on through the
    chunks ``next_hashes``, the first served row at ``target_pos`` (``LookupPlan.fetch_spans``)."""

    chunk_hash: int
    target_pos: int
    num_tokens: int = 0
    row_offset: int = 0
    next_hashes: tuple[int, ...] = ()


@dataclass(slots=True)
class LookupSummary:
    total_tokens: int = 0
    prefix_tokens: int = 0
    exact_tokens: int = 0
    shifted_tokens: int = 0
    prefill_tokens: int = 0
    chunks_total: int = 0
    chunks_hit: int = 0

    @property
    def recovered_tokens(self) -> int:
        """Tokens the engine does not prefill (its own prefix + sidecar hits)."""
        return self.prefix_tokens + self.exact_tokens + self.shifted_tokens


#: Columns of the segment table (uint64 each; delta = start - source_pos).
SEG_KIND, SEG_START, SEG_END, SEG_HASH, SEG_OFFSET, SEG_SOURCE, SEG_FIDELITY = range(7)
SEGMENT_FIELDS = 7
_EMPTY_TABLE = np.zeros((0, SEGMENT_FIELDS), dtype=np.uint64)
_EMPTY_BOUNDS = np.zeros(0, dtype=np.uint32)


@dataclass(slots=True)
class LookupPlan:
    """Segments as one ``uint64 [n_segments, 7]`` table (see ``SEG_*``) plus summary counts.

    The table is what travels on the wire (packed, like tokens) and what an engine turns into
    index tensors; ``segments`` gives typed rows for readability. ``chunk_bounds`` (uint32) are
    the chunk boundaries from the first chunk past the engine prefix to ``n``.
    """

    table: np.ndarray = field(default_factory=lambda: _EMPTY_TABLE)
    summary: LookupSummary = field(default_factory=LookupSummary)
    dry_run: bool = False
    chunk_bounds: np.ndarray = field(default_factory=lambda: _EMPTY_BOUNDS)
    #: Server side only (not on the wire): the length of every hit segment the planner built.
    hit_segment_tokens: list[int] = field(default_factory=list)
    #: Server side only: of the shifted tokens, those found through seeds (``registry.seeds``).
    seed_tokens: int = 0
    #: The hits are chunks another tensor-parallel cut of the model stored: that cut's rank-0
    #: shard (``sidecar.dataplane.cuts``); None: the Lookup identity's own chunks.
    plan_shard: str | None = None

    @classmethod
    def from_flat(cls, flat: list[int], **kwargs) -> "LookupPlan":
        """Build from a flat list of 7-field records (how the planner emits them)."""
        table = np.frombuffer(array("Q", flat), dtype=np.uint64).reshape(-1, SEGMENT_FIELDS) if flat else _EMPTY_TABLE
        return cls(table=table, **kwargs)

    def __len__(self) -> int:
        return len(self.table)

    @property
    def deltas(self) -> np.ndarray:
        """int64 rotation per segment (start - source_pos); 0 for non-hits."""
        t = self.table.astype(np.int64)
        return np.where(t[:, SEG_KIND] == SegmentKind.CHUNK_HIT, t[:, SEG_START] - t[:, SEG_SOURCE], 0)

    @property
    def segments(self) -> list[Segment]:
        out = []
        for k, s, e, h, o, p, f in self.table.tolist():
            hit = k == SegmentKind.CHUNK_HIT
            out.append(Segment(SegmentKind(k), s, e, h, o, p, s - p if hit else 0, Fidelity(f)))
        return out

    def hit_segments(self) -> np.ndarray:
        """``int64 [n, 2]``: ``[start, end)`` of every hit segment: a maximal run of CHUNK_HIT
        rows with contiguous positions and one delta (the planner coalesces hits that continue
        one stored sequence into such runs; the rows stay one per chunk)."""
        t = self.table
        hit = t[:, SEG_KIND] == SegmentKind.CHUNK_HIT
        if not hit.any():
            return np.zeros((0, 2), dtype=np.int64)
        h = t[hit].astype(np.int64)
        start, end = h[:, SEG_START], h[:, SEG_END]
        delta = start - h[:, SEG_SOURCE]
        new = np.ones(len(h), dtype=bool)
        new[1:] = (start[1:] != end[:-1]) | (delta[1:] != delta[:-1])
        first = np.flatnonzero(new)
        last = np.append(first[1:], len(h)) - 1
        return np.stack([start[first], end[last]], axis=1)

    def fetch_spans(self) -> list[FetchSpec]:
        """One Fetch item per hit segment (``hit_segments``): its first row's chunk and offset,
        the segment's start and length, the other rows' chunks. The answer to item ``i`` is the
        KV of segment ``i``'s tokens, rows in position order."""
        t = self.table
        h = t[t[:, SEG_KIND] == SegmentKind.CHUNK_HIT].astype(np.int64)
        out: list[FetchSpec] = []
        if not len(h):
            return out
        start, end = h[:, SEG_START], h[:, SEG_END]
        delta = start - h[:, SEG_SOURCE]
        new = np.ones(len(h), dtype=bool)
        new[1:] = (start[1:] != end[:-1]) | (delta[1:] != delta[:-1])
        first = np.flatnonzero(new).tolist()
        hashes = t[t[:, SEG_KIND] == SegmentKind.CHUNK_HIT][:, SEG_HASH].tolist()  # uint64, exact
        bounds = first + [len(h)]
        for a, b in zip(bounds, bounds[1:]):
            out.append(FetchSpec(hashes[a], int(start[a]), int(end[b - 1] - start[a]), int(h[a, SEG_OFFSET]),
                                 tuple(hashes[a + 1 : b])))
        return out

    def hits(self) -> list[Segment]:
        return [s for s in self.segments if s.kind is SegmentKind.CHUNK_HIT]

    def check_tiling(self, n: int) -> None:
        """Raise AssertionError unless the segments tile [0, n) in order."""
        pos = 0
        for s, e in self.table[:, SEG_START : SEG_END + 1].tolist():
            assert s == pos and e > s, f"plan segments do not tile: segment [{s}, {e}) after position {pos}"
            pos = e
        assert pos == n, f"plan segments end at {pos}, prompt has {n} tokens"
