"""What vLLM lets the connector claim from a sidecar ``LookupPlan``.

vLLM's scheduler asks a connector for *external* tokens once per request admission: a count
``m`` such that positions ``[local, local + m)`` are loaded from outside, right after vLLM's own
prefix-cache hit ``local``; the engine then computes ``[local + m, n)``. So only a run of hits
**contiguous** with ``local`` can be claimed:

* a CHUNK_HIT covering ``local`` (an exact-prefix continuation, or a shifted chunk the local hit
  ends inside of), then every CHUNK_HIT that starts exactly where the run ends;
* a PREFILL segment ends the run, except (``bridge_recompute``) the recompute guard's gap: the
  first ``k`` tokens of a shifted chunk that the sidecar asks to re-prefill
  (``recompute_tokens``) are rows of the same fetched chunk, so the run goes on through them
  with the chunk's own (rotated) rows instead of stopping at every chunk;
* the run ends at most at ``n - 1`` (vLLM must compute the last prompt token to sample), and
  is cut to a whole number of blocks (a hit that ends mid-block would need a copy-on-write of
  the engine's partial block; the cut tokens are computed instead).

Everything after the first real gap (a changed header, an edited message, the new query) is
what ``GapFill`` (the scheduler plug-in) deals with: see ``clients/vllm/scheduler.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sidecar.registry.plan import CARVE_OUT_TOKENS, Fidelity, LookupPlan, SegmentKind


@dataclass(frozen=True, slots=True)
class LoadItem:
    """Rows ``[row, row + (end - start))`` of chunk ``chunk_hash`` (fetched rotated to
    ``target_pos``, its first token's position) go to positions ``[start, end)``."""

    chunk_hash: int
    target_pos: int
    row: int
    start: int
    end: int
    exact: bool

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class Claim:
    """The contiguous run claimed after ``local``: ``[local, end)`` served by ``items``."""

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
        return [(it.start, it.end) for it in self.items if not it.exact]


def claim(
    plan: LookupPlan,
    *,
    local: int,
    n: int,
    block_size: int,
    bridge_recompute: bool = True,
    min_tokens: int = 1,
    limit: int | None = None,
) -> Claim:
    """The block-aligned run of hits contiguous with ``local`` (see the module docstring).
    ``limit``: serve nothing at or after this position (a ``forget`` edit); no gap after it."""
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
            break  # (segments end after local) the plan assumed more engine prefix than vLLM holds
        elif s.kind is SegmentKind.CHUNK_HIT:
            items.append(LoadItem(s.chunk_hash, s.start - s.chunk_offset, s.chunk_offset + (pos - s.start), pos, s.end,
                                  s.fidelity is Fidelity.EXACT))
            pos = s.end
        else:  # PREFILL
            nxt = segs[i + 1] if i + 1 < len(segs) else None
            gap = s.end - pos
            if (bridge_recompute and nxt is not None and nxt.kind is SegmentKind.CHUNK_HIT and nxt.start == s.end
                    and nxt.chunk_offset >= gap and pos >= CARVE_OUT_TOKENS):
                items.append(LoadItem(nxt.chunk_hash, nxt.start - nxt.chunk_offset, nxt.chunk_offset - gap, pos, nxt.end,
                                      False))
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
    end = min(pos, n - 1)
    if limit is not None:
        end = min(end, limit)
        if gap_end >= limit:
            gap_end = n
    end -= end % block_size
    if end - local < max(1, min_tokens):
        return Claim(local, local, [], planned, gap_start, gap_end, 0)
    out: list[LoadItem] = []
    for it in items:
        if it.start >= end:
            break
        if it.end > end:
            it = LoadItem(it.chunk_hash, it.target_pos, it.row, it.start, end, it.exact)
        out.append(it)
    nb = sum(max(0, min(b, end) - a) for a, b in bridged)
    return Claim(local, end, out, planned, gap_start, gap_end, nb)


def store_chunks(
    plan: LookupPlan,
    claimed: Claim | None,
    *,
    n: int,
    skip_tail: bool = False,
) -> list[tuple[int, int]]:
    """Chunks ``[a, b)`` of ``plan.chunk_bounds`` this request should Store after its prefill:
    not holding approximate (shifted) rows it loaded, and not already served whole by the
    sidecar (any CHUNK_HIT of the plan covering it). ``skip_tail``: leave out a chunk that ends
    at ``n`` (a gap-fill prefix ends at an arbitrary cut, not a chunk boundary)."""
    bounds = plan.chunk_bounds.tolist()
    if len(bounds) < 2:
        return []
    approx = claimed.approximate if claimed is not None else []
    # a hit segment [start, end) serves its chunk from start - chunk_offset (the head may be a recompute gap)
    hits = [(s.start - s.chunk_offset, s.end) for s in plan.segments if s.kind is SegmentKind.CHUNK_HIT]
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
