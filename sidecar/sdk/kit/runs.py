"""From a ``LookupPlan`` to what an engine loads, and what it stores back.

An engine that keeps its own prefix cache loads external KV as **one run contiguous with its
own prefix hit** ``local``: vLLM's scheduler asks a connector for a count ``m`` of external
tokens at ``[local, local + m)`` (``get_num_new_matched_tokens``), SGLang's scheduler loads
``host_hit_length`` tokens after the device prefix (``init_load_back``). So only a run of hits
contiguous with ``local`` is loadable (``load_run``)::

    0          local                                  end     gap_start   gap_end        n
    | own prefix | CHUNK_HIT | PREFILL k | CHUNK_HIT ...  |  (cut)  | PREFILL | CHUNK_HIT ... |
                 |<------------- the run: items ----------->|
                             ^ bridged: the recompute guard's k tokens, served from the chunk

* a CHUNK_HIT covering ``local`` (an exact-prefix continuation, or a shifted chunk the local
  hit ends inside of), then every CHUNK_HIT that starts exactly where the run ends;
* a PREFILL segment ends the run, except (``bridge_recompute``) the recompute guard's gap: the
  first ``k`` tokens of a shifted chunk that the sidecar asks to re-prefill
  (``recompute_tokens``) are rows of the same fetched chunk, so the run goes on through them
  with the chunk's own (rotated) rows instead of stopping at every chunk;
* with ``compute_last`` the run ends at most at ``n - 1`` (an engine that samples from the last
  prompt token's logits must compute it), and it is cut to a whole number of ``block_size``
  blocks (a hit that ends mid-block would need a copy-on-write of the engine's partial block;
  the cut tokens are computed instead).

Everything after the first real gap (a changed header, an edited message, the new query) is
not loadable in the same step; ``gap_start`` / ``gap_end`` say where the next hits resume (vLLM's
gap-fill sub-requests use them: ``clients/vllm/gap_fill.py``).

``store_chunks`` is the other direction: the chunks of ``plan.chunk_bounds`` a request should
Store after computing its prompt. Pure functions of the plan: no RPC, no engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sidecar.registry.lookup_plan import CARVE_OUT_TOKENS, Fidelity, LookupPlan, Segment, SegmentKind


@dataclass(frozen=True, slots=True)
class LoadItem:
    """Rows ``[row, row + (end - start))`` of chunk ``chunk_hash`` (fetched rotated to
    ``target_pos``, its first token's position) go to positions ``[start, end)``.
    ``exact``: the rows were computed with this prompt's left context (``Fidelity.EXACT``)."""

    chunk_hash: int
    target_pos: int
    row: int
    start: int
    end: int
    exact: bool

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def fetch_item(self) -> tuple[int, int]:
        """The Fetch item that serves it: ``(chunk_hash, target_pos)``."""
        return self.chunk_hash, self.target_pos


@dataclass(slots=True)
class LoadRun:
    """The loadable run after ``local``: positions ``[local, end)`` served by ``items`` (in
    position order, back to back). Empty (``tokens == 0``, no items) when nothing is loadable."""

    local: int
    end: int
    items: list[LoadItem] = field(default_factory=list)
    #: tokens the plan serves from the sidecar beyond ``local`` (what an unconstrained engine would take)
    planned: int = 0
    #: the first position after the run that the plan does not serve (a gap), or n
    gap_start: int = 0
    #: end of that gap (start of the next hit run), or n when no hit follows
    gap_end: int = 0
    #: recompute-guard tokens served from their chunk instead of prefilled (``bridge_recompute``)
    bridged: int = 0

    @property
    def tokens(self) -> int:
        return self.end - self.local

    @property
    def approximate(self) -> list[tuple[int, int]]:
        """``[start, end)`` of the items holding shifted (not exact) rows."""
        return [(it.start, it.end) for it in self.items if not it.exact]

    def truncated(self, tokens: int) -> "LoadRun":
        """The run cut to its first ``tokens`` tokens (an engine that took fewer than offered).
        ``bridged`` is capped at ``tokens``, not recounted: an upper bound after a cut."""
        end = self.local + tokens
        items = [LoadItem(it.chunk_hash, it.target_pos, it.row, it.start, min(it.end, end), it.exact)
                 for it in self.items if it.start < end]
        return LoadRun(self.local, end, items, self.planned, self.gap_start, self.gap_end,
                       min(self.bridged, end - self.local))


def load_item(seg: Segment, start: int | None = None) -> LoadItem:
    """The load of a CHUNK_HIT segment's positions ``[start, seg.end)`` (default: all of it)."""
    pos = seg.start if start is None else start
    return LoadItem(seg.chunk_hash, seg.start - seg.chunk_offset, seg.chunk_offset + (pos - seg.start), pos, seg.end,
                    seg.fidelity is Fidelity.EXACT)


def load_run(
    plan: LookupPlan,
    *,
    local: int,
    n: int,
    block_size: int = 1,
    bridge_recompute: bool = True,
    min_tokens: int = 1,
    limit: int | None = None,
    compute_last: bool = True,
) -> LoadRun:
    """The block-aligned run of hits contiguous with ``local`` (see the module docstring).

    ``min_tokens``: a shorter run is not worth a Fetch (returns an empty run). ``limit``: serve
    nothing at or after this position (a ``forget`` edit); then no gap after it either.
    ``compute_last``: the run ends at most at ``n - 1``.
    """
    segs = [s for s in plan.segments if s.end > local]
    planned = sum(min(s.end, n) - max(s.start, local) for s in segs if s.kind is SegmentKind.CHUNK_HIT)
    pos = local
    items: list[LoadItem] = []
    bridged: list[tuple[int, int]] = []
    i = 0
    while i < len(segs):
        s = segs[i]
        if s.start > pos:
            break
        if s.kind is SegmentKind.ENGINE_PREFIX:
            break  # (segments end after local) the plan assumed more engine prefix than the engine holds
        elif s.kind is SegmentKind.CHUNK_HIT:
            items.append(load_item(s, pos))
            pos = s.end
        else:  # PREFILL
            nxt = segs[i + 1] if i + 1 < len(segs) else None
            gap = s.end - pos
            if (bridge_recompute and nxt is not None and nxt.kind is SegmentKind.CHUNK_HIT and nxt.start == s.end
                    and nxt.chunk_offset >= gap and pos >= CARVE_OUT_TOKENS):
                items.append(LoadItem(nxt.chunk_hash, nxt.start - nxt.chunk_offset, nxt.chunk_offset - gap, pos,
                                      nxt.end, False))
                bridged.append((pos, s.end))
                pos = nxt.end
                i += 2
                continue
            break
        i += 1
    gap_start = pos
    gap_end = n
    for s in segs:
        if s.kind is SegmentKind.CHUNK_HIT and s.start >= gap_start:
            gap_end = s.start
            break
    end = min(pos, n - 1) if compute_last else min(pos, n)
    if limit is not None:
        end = min(end, limit)
        if gap_end >= limit:
            gap_end = n
    end -= end % block_size
    if end - local < max(1, min_tokens):
        return LoadRun(local, local, [], planned, gap_start, gap_end, 0)
    out: list[LoadItem] = []
    for it in items:
        if it.start >= end:
            break
        if it.end > end:
            it = LoadItem(it.chunk_hash, it.target_pos, it.row, it.start, end, it.exact)
        out.append(it)
    nb = sum(max(0, min(b, end) - a) for a, b in bridged)
    return LoadRun(local, end, out, planned, gap_start, gap_end, nb)


def served_ranges(plan: LookupPlan) -> list[tuple[int, int]]:
    """The chunk ranges the sidecar serves for ``plan``: ``[start - chunk_offset, end)`` of each
    CHUNK_HIT (a hit serves its chunk from its first row; the head may be a recompute gap)."""
    return [(s.start - s.chunk_offset, s.end) for s in plan.segments if s.kind is SegmentKind.CHUNK_HIT]


def store_chunks(
    plan: LookupPlan,
    *,
    n: int,
    approximate: Iterable[tuple[int, int]] = (),
    served: Sequence[tuple[int, int]] | None = None,
    skip_tail: bool = False,
) -> list[tuple[int, int]]:
    """Chunks ``[a, b)`` of ``plan.chunk_bounds`` a request should Store after computing its
    prompt: not holding ``approximate`` (shifted) rows it loaded (a stored copy is always
    canonical), and not already served whole by the sidecar (``served``: default
    ``served_ranges(plan)``). ``skip_tail``: leave out a chunk that ends at ``n`` (a prefix cut
    at an arbitrary position, not a chunk boundary)."""
    bounds = plan.chunk_bounds.tolist()
    if len(bounds) < 2:
        return []
    approx = list(approximate)
    hits = served_ranges(plan) if served is None else served
    out = []
    for a, b in zip(bounds, bounds[1:]):
        if b > n or (skip_tail and b == n):
            continue
        if any(s < b and a < e for s, e in approx):
            continue
        if any(s <= a and b <= e for s, e in hits):
            continue
        out.append((a, b))
    return out
