"""Lookup plans: the one result type a Lookup returns (domain side and client side alike).

A plan tiles the prompt ``[0, n)`` with segments, in order, without gaps or overlaps::

    0            engine_prefix_len                                           n
    | ENGINE_PREFIX | CHUNK_HIT h1 (delta -40) | PREFILL | CHUNK_HIT h2 (delta 0) |
                    ^ start                   ^ end

Segments are kept column-wise (parallel lists, struct of arrays) because that is how they
travel on the wire (packed repeated fields, one ``extend`` per column) and how an engine
consumes them (index tensors); ``segments`` materialises row objects on demand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, IntEnum

#: Positions below this are never served from a shifted chunk (attention sinks, Irminsul 7.1).
CARVE_OUT_TOKENS = 32


class AdmissionPolicy(str, Enum):
    EXACT = "exact"
    POSITION_INDEPENDENT = "position_independent"


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


#: One segment as a row: (kind, start, end, chunk_hash, chunk_offset, source_pos, delta, fidelity).
SegmentRow = tuple[int, int, int, int, int, int, int, int]
COLUMNS = ("kind", "start", "end", "chunk_hash", "chunk_offset", "source_pos", "delta", "fidelity")


@dataclass(slots=True)
class LookupPlan:
    """Segments as plain tuples (``SegmentRow``, cheap to build per chunk) plus summary counts.

    ``columns()`` transposes them into the wire's parallel arrays; ``segments`` gives typed rows.
    """

    rows: list[SegmentRow] = field(default_factory=list)
    summary: LookupSummary = field(default_factory=LookupSummary)
    dry_run: bool = False

    def __len__(self) -> int:
        return len(self.rows)

    def columns(self) -> list[tuple[int, ...]]:
        """Eight parallel tuples in ``COLUMNS`` order (empty tuples for an empty plan)."""
        return list(zip(*self.rows)) if self.rows else [()] * len(COLUMNS)

    @property
    def segments(self) -> list[Segment]:
        return [Segment(SegmentKind(r[0]), r[1], r[2], r[3], r[4], r[5], r[6], Fidelity(r[7])) for r in self.rows]

    def hits(self) -> list[Segment]:
        return [s for s in self.segments if s.kind is SegmentKind.CHUNK_HIT]

    def check_tiling(self, n: int) -> None:
        """Raise AssertionError unless the segments tile [0, n) in order."""
        pos = 0
        for r in self.rows:
            assert r[1] == pos and r[2] > r[1], f"plan segments do not tile: segment [{r[1]}, {r[2]}) after position {pos}"
            pos = r[2]
        assert pos == n, f"plan segments end at {pos}, prompt has {n} tokens"
