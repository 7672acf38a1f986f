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


@dataclass(slots=True)
class LookupPlan:
    """Column-wise segments plus summary counts. ``kind[i]`` .. ``fidelity[i]`` is segment i."""

    kind: list[int] = field(default_factory=list)
    start: list[int] = field(default_factory=list)
    end: list[int] = field(default_factory=list)
    chunk_hash: list[int] = field(default_factory=list)
    chunk_offset: list[int] = field(default_factory=list)
    source_pos: list[int] = field(default_factory=list)
    delta: list[int] = field(default_factory=list)
    fidelity: list[int] = field(default_factory=list)
    summary: LookupSummary = field(default_factory=LookupSummary)
    dry_run: bool = False

    def __len__(self) -> int:
        return len(self.kind)

    def add(self, kind: int, start: int, end: int, chunk_hash: int = 0, chunk_offset: int = 0,
            source_pos: int = 0, delta: int = 0, fidelity: int = 0) -> None:
        # Adjacent PREFILL / ENGINE_PREFIX segments merge; chunk hits stay one per chunk.
        if kind != SegmentKind.CHUNK_HIT and self.kind and self.kind[-1] == kind and self.end[-1] == start:
            self.end[-1] = end
            return
        self.kind.append(kind)
        self.start.append(start)
        self.end.append(end)
        self.chunk_hash.append(chunk_hash)
        self.chunk_offset.append(chunk_offset)
        self.source_pos.append(source_pos)
        self.delta.append(delta)
        self.fidelity.append(fidelity)

    @property
    def segments(self) -> list[Segment]:
        return [
            Segment(SegmentKind(k), s, e, h, o, p, d, Fidelity(f))
            for k, s, e, h, o, p, d, f in zip(
                self.kind, self.start, self.end, self.chunk_hash, self.chunk_offset,
                self.source_pos, self.delta, self.fidelity,
            )
        ]

    def hits(self) -> list[Segment]:
        return [s for s in self.segments if s.kind is SegmentKind.CHUNK_HIT]

    def check_tiling(self, n: int) -> None:
        """Raise AssertionError unless the segments tile [0, n) in order."""
        pos = 0
        for s, e in zip(self.start, self.end):
            assert s == pos and e > s, f"plan segments do not tile: segment [{s}, {e}) after position {pos}"
            pos = e
        assert pos == n, f"plan segments end at {pos}, prompt has {n} tokens"
