"""Plan invariants, checked on every plan before Splice returns it (docs/splice.md).

``check_plan`` derives what the session must look like from the edits alone (kept ranges
with their shifts, computed ranges) and checks the ops against that:

* the plan belongs to this session, block size and version; ops come in the documented
  order (op_plan.py); PREFILL/REFRESH ops run left to right;
* the post-commit arrays are parallel, positions are ``0..n-1``, tokens equal
  ``apply_edits`` (the plain definition of the edit), slots follow the paged shape;
* blocks: ALLOCATE takes blocks neither the session nor its allocator holds, FREE releases
  live blocks only, and the live blocks after the plan are exactly the new block table: no
  slot is referenced twice, after it was freed, or leaked;
* every write (MOVE destination, ROTATE, PREFILL, REFRESH) lands on the slot of the position
  it names; no position is written twice or rotated twice (no chained rotation);
* every kept token ends up holding its own old KV (in place, or moved from its old slot:
  MOVE runs first and reads before it writes) rotated by exactly its shift, or is
  REFRESHed; every new token is PREFILLed with the right id. So replaying the plan on the
  pre-turn pool yields the edited tokens, with keys encoding their new positions;
* the layout's rotation counts / cumulative deltas follow from the old ones and the ops;
  the summary matches the ops.

How: op positions are cut into contiguous runs (one ``np.diff`` for MOVE; other planner ops
are windows of the layout's positions, recognised without reading them), runs are matched
against the edit's ranges in Python (per run, never per token), and run contents are
compared with the layout and the old session by slices. A violation raises
``InvariantViolation`` (INTERNAL with a bug id at the edge); it is never repaired.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING

import numpy as np

from sidecar.directives.directive import Edit, EditMode, apply_edits
from sidecar.directives.layout import arange
from sidecar.directives.op_plan import OpKind, OpPlan
from sidecar.errors import InvariantViolation

if TYPE_CHECKING:
    from sidecar.directives.mirror import SessionMirror

#: Op arrays at least this long are first tested for being a window of the layout.
_WINDOW_MIN = 1024
_ORDER = {OpKind.ALLOCATE: 0, OpKind.MOVE: 1, OpKind.FREE: 2, OpKind.ROTATE: 3, OpKind.PREFILL: 4, OpKind.REFRESH: 4}

#: A run of an op: positions ``[q0, q1)`` are the op's entries ``[i0, i0 + q1 - q0)``.
Run = tuple[int, int, int]


class _Broken(Exception):
    pass


def _require(cond: object, what: str) -> None:
    if not cond:
        raise _Broken(what)


def check_plan(session: "SessionMirror", plan: OpPlan) -> None:
    """Raise ``InvariantViolation`` unless ``plan`` is correct for ``session`` as it is now.

    Pure and idempotent. Assumes the session itself is consistent (positions ``0..n-1``,
    its allocator's live blocks = its block table), which ``append`` and ``commit`` keep.
    """
    try:
        _check(session, plan)
    except _Broken as exc:
        raise InvariantViolation(
            f"splice plan {plan.plan_id} for session {session.session_id}: {exc}; this indicates a bug "
            "in the splice planner (sidecar/directives/planner.py)"
        ) from None


def kept_ranges(edits: tuple[Edit, ...], n: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """What the edit means for the cache: kept ranges ``(new start, new end, shift)`` and
    computed ranges ``(new start, new end)``, together tiling the edited sequence.

    Amortize keeps everything outside the spans; a forget computes everything from its start.
    """
    kept: list[tuple[int, int, int]] = []
    computed: list[tuple[int, int]] = []
    prev = shift = 0
    for e in edits:
        if e.start > prev:
            kept.append((prev + shift, e.start + shift, shift))
        if e.mode is EditMode.FORGET:
            total = n + sum(x.delta for x in edits)
            if total > e.start + shift:
                computed.append((e.start + shift, total))
            return kept, computed
        if len(e.replacement):
            computed.append((e.start + shift, e.start + shift + len(e.replacement)))
        shift += e.delta
        prev = e.end
    if n > prev:
        kept.append((prev + shift, n + shift, shift))
    return kept, computed


def _eq(a: np.ndarray, b: np.ndarray) -> bool:
    """Same length and elementwise equal (``np.array_equal`` without its generic overhead)."""
    return len(a) == len(b) and bool((a == b).all())


def _window(arr: np.ndarray, source: np.ndarray, source_ptr: int | None = None) -> int | None:
    """``q0`` when ``arr`` *is* ``source[q0 : q0 + len(arr)]`` (the same memory), else None.

    Layout positions and most planner op arrays are windows of the layout's arrays (or of
    one shared ``arange``); such a window equals the source there without being read.
    ``source_ptr`` (``source.ctypes.data``) may be passed in to save the lookup.
    """
    size = arr.dtype.itemsize
    if arr.dtype != source.dtype or arr.ndim != 1 or source.strides != (size,):
        return None
    if len(arr) > 1 and arr.strides != (size,):
        return None
    off = arr.ctypes.data - (source.ctypes.data if source_ptr is None else source_ptr)
    if off % size or not 0 <= off // size <= len(source) - len(arr):
        return None
    return off // size


def _runs(pos: np.ndarray, post_positions: np.ndarray, ptr: int, what: str) -> list[Run]:
    """``pos`` cut into maximal runs of consecutive positions, each within ``[0, n)``."""
    if len(pos) == 0:
        return []
    q0 = _window(pos, post_positions, ptr)  # post positions are 0..n-1 (checked before)
    if q0 is not None:
        return [(q0, q0 + len(pos), 0)]
    edges = (np.flatnonzero(np.diff(pos) != 1) + 1).tolist()
    starts, ends = [0, *edges], [*edges, len(pos)]
    runs = [(q, q + e - i, i) for q, i, e in zip(pos[starts].tolist(), starts, ends)]
    _require(all(q0 >= 0 and q1 <= len(post_positions) for q0, q1, _ in runs), f"{what} position out of range")
    return runs


def _matches(runs: list[Run], source: np.ndarray, values: np.ndarray, source_ptr: int | None = None) -> bool:
    """``values`` equals ``source`` at the runs' positions."""
    if len(runs) == 1 and len(values) >= _WINDOW_MIN and _window(values, source, source_ptr) == runs[0][0]:
        return True
    return all(_eq(source[q0:q1], values[i0 : i0 + q1 - q0]) for q0, q1, i0 in runs)


def _split(runs: list[Run], bounds: list[int]) -> list[tuple[int, int, int, int]]:
    """Runs cut at range boundaries: ``(range index, q0, q1, i0)``."""
    out = []
    for q0, q1, i0 in runs:
        r = bisect_right(bounds, q0) - 1
        while q0 < q1:
            end = min(q1, bounds[r + 1])
            out.append((r, q0, end, i0))
            i0 += end - q0
            q0, r = end, r + 1
    return out


def _disjoint(intervals: list[tuple[int, int]]) -> bool:
    intervals = sorted(intervals)
    return all(a[1] <= c[0] for a, c in zip(intervals, intervals[1:]))


def _tiles(intervals: list[tuple[int, int]], q0: int, q1: int) -> bool:
    """The intervals cover ``[q0, q1)`` exactly once."""
    pos = q0
    for a, b in sorted(intervals):
        if a != pos:
            return False
        pos = b
    return pos == q1


def _gaps(intervals: list[tuple[int, int]], q0: int, q1: int) -> list[tuple[int, int]]:
    """``[q0, q1)`` minus the (disjoint) intervals."""
    out, pos = [], q0
    for a, b in sorted(intervals):
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < q1:
        out.append((pos, q1))
    return out


def _blocks(session: "SessionMirror", plan: OpPlan) -> None:
    """ALLOCATE/FREE accounting: live blocks after the plan == the new block table, each once."""
    old_table, table = session.layout.block_table, plan.layout.block_table
    allocated, freed = plan.allocated_blocks, plan.freed_blocks
    for name, ids in (("ALLOCATE", allocated), ("FREE", freed), ("layout", table)):
        _require(len(ids) == 0 or ids.min() >= 0, f"{name} names a negative block id")
    top = 1 + max(int(t.max()) if len(t) else -1 for t in (old_table, table, allocated, freed))
    live = np.zeros(top, dtype=bool)
    live[old_table] = True
    _require(not live[allocated].any(), "ALLOCATE of a block the session holds")
    _require(not session.allocator.is_live(allocated).any(), "ALLOCATE of a block live in the session allocator")
    live[allocated] = True
    _require(np.count_nonzero(live) == len(old_table) + len(allocated), "ALLOCATE names a block twice")
    _require(live[freed].all(), "FREE of a block that is not live")
    live[freed] = False
    _require(np.count_nonzero(live) == len(old_table) + len(allocated) - len(freed), "FREE names a block twice")
    used = np.zeros(top, dtype=bool)
    used[table] = True
    _require(np.count_nonzero(used) == len(table), "the new block table references a block twice")
    # Equal sets: nothing referenced after FREE or without ALLOCATE, nothing leaked.
    _require(not (used & ~live).any(), "the new layout references a freed or never allocated block (use after free)")
    _require(not (live & ~used).any(), "blocks leak: live after the plan but not in the new block table")


def _check(session: "SessionMirror", plan: OpPlan) -> None:
    base, post = session.layout, plan.layout
    b = session.block_size
    n, n2 = len(base), len(post.tokens)
    _require(plan.session_id == session.session_id, "plan names another session")
    _require(plan.block_size == b == post.block_size, "block size differs from the session's")
    _require(
        plan.base_version == session.version and plan.next_version == session.version + 1,
        f"versions {plan.base_version}->{plan.next_version} do not follow session version {session.version}",
    )
    order = [_ORDER[op.kind] for op in plan.ops]
    _require(order == sorted(order), "ops are not in ALLOCATE, MOVE, FREE, ROTATE, PREFILL/REFRESH order")
    for kind in (OpKind.ALLOCATE, OpKind.MOVE, OpKind.FREE):
        _require(len(plan.ops_of(kind)) <= 1, f"more than one {kind.name} op")

    # The post-commit layout.
    for name in ("slots", "positions", "rotations", "cum_deltas"):
        _require(len(getattr(post, name)) == n2, f"layout.{name} is not parallel to layout.tokens")
    iota = arange(n2)
    _require(_window(post.positions, iota) == 0 or _eq(post.positions, iota), "positions after commit are not 0..n-1")
    _require(_eq(post.tokens, apply_edits(base.tokens, plan.edits)), "layout tokens differ from the edited sequence")
    table = post.block_table
    if b > 1 and n2:
        shaped = (table[:, None] * b + arange(b)).reshape(-1)[:n2]
        _require(_eq(post.slots, shaped), "slots do not follow the paged layout (offset = position % B)")
    _blocks(session, plan)

    # The edit's ranges (new positions), and each op's runs sorted into them.
    kept, computed = kept_ranges(plan.edits, n)
    ranges = sorted([(q0, q1, d) for q0, q1, d in kept] + [(q0, q1, None) for q0, q1 in computed])
    _require(_tiles([(q0, q1) for q0, q1, _ in ranges], 0, n2), "edit ranges do not tile the layout")
    bounds = [q0 for q0, _, _ in ranges] + [n2]
    moves: list[list[Run]] = [[] for _ in ranges]
    rotates: list[list[tuple[int, int, int]]] = [[] for _ in ranges]
    prefills: list[list[tuple[int, int]]] = [[] for _ in ranges]
    refreshes: list[list[tuple[int, int]]] = [[] for _ in ranges]
    written: list[tuple[int, int]] = []
    rotated: list[tuple[int, int]] = []
    move_src = plan.layout.slots  # replaced by the MOVE op's sources below
    positions_ptr, slots_ptr, cum_ptr = post.positions.ctypes.data, post.slots.ctypes.data, post.cum_deltas.ctypes.data
    last_computed = 0
    for op in plan.ops:
        k = op.kind
        if k in (OpKind.ALLOCATE, OpKind.FREE):
            continue
        name = k.name
        _require(len(op.positions) == len(op.slots), f"{name} positions are not parallel to slots")
        runs = _runs(op.positions, post.positions, positions_ptr, name)
        _require(_matches(runs, post.slots, op.slots, slots_ptr), f"{name} writes a slot not its position's slot")
        pieces = _split(runs, bounds)
        if k is OpKind.MOVE:
            _require(len(op.src_slots) == len(op.slots), "MOVE src_slots are not parallel to slots")
            move_src = op.src_slots
            written += [(q0, q1) for q0, q1, _ in runs]
            for r, q0, q1, i0 in pieces:
                moves[r].append((q0, q1, i0))
        elif k is OpKind.ROTATE:
            _require(op.delta != 0, "ROTATE by zero")
            _require(len(op.cum_deltas) == len(op.slots), "ROTATE cum_deltas are not parallel to slots")
            _require(_matches(runs, post.cum_deltas, op.cum_deltas, cum_ptr), "ROTATE cum_deltas disagree with layout")
            rotated += [(q0, q1) for q0, q1, _ in runs]
            for r, q0, q1, _ in pieces:
                rotates[r].append((q0, q1, op.delta))
        else:
            _require(len(op.tokens) == len(op.slots), f"{name} tokens are not parallel to slots")
            _require(_matches(runs, post.tokens, op.tokens), f"{name} computes the wrong tokens")
            for q0, q1, _ in runs:
                _require(q0 >= last_computed, f"{name} ops do not run in position order")
                last_computed = q1
            written += [(q0, q1) for q0, q1, _ in runs]
            for r, q0, q1, _ in pieces:
                (prefills if k is OpKind.PREFILL else refreshes)[r].append((q0, q1))
    _require(_disjoint(written), "a position is written twice")
    _require(_disjoint(rotated), "a slot is rotated twice in one plan (chained rotation)")

    # Each range against what the edit means for it.
    for r, (q0, q1, d) in enumerate(ranges):
        if d is None:  # new tokens: prefilled, nothing else
            _require(not moves[r] and not rotates[r] and not refreshes[r], "a new token is moved, rotated or refreshed")
            _require(_tiles(prefills[r], q0, q1), "a new token is not prefilled")
            _require(not post.rotations[q0:q1].any() and not post.cum_deltas[q0:q1].any(),
                     "a new token carries rotation bookkeeping")
            continue
        _require(not prefills[r], "PREFILL of a kept token")
        fresh = refreshes[r]
        if d == 0:
            _require(not rotates[r] and not fresh, "a token that did not shift is rotated or refreshed")
        else:
            _require(all(delta == d for _, _, delta in rotates[r]), "a kept slot is not rotated by exactly its shift")
            _require(_tiles([(a, c) for a, c, _ in rotates[r]] + fresh, q0, q1),
                     "a shifted slot is neither rotated nor refreshed (exactly once)")
        # Its own old KV: moved from its old slot, or still in its slot, unless recomputed.
        for a, c, i0 in moves[r]:
            _require(_eq(move_src[i0 : i0 + c - a], base.slots[a - d : c - d]), "MOVE copies another token's KV")
        for a, c in _gaps([(a, c) for a, c, _ in moves[r]] + fresh, q0, q1):
            _require(_eq(post.slots[a:c], base.slots[a - d : c - d]),
                     "a kept position does not hold its own old KV (stale or foreign slot)")
        for a, c in _gaps(fresh, q0, q1):
            rot, cum = base.rotations[a - d : c - d], base.cum_deltas[a - d : c - d]
            _require(_eq(post.rotations[a:c], rot + 1 if d else rot), "layout rotation counts disagree with the ops")
            _require(_eq(post.cum_deltas[a:c], cum + d if d else cum), "layout cumulative deltas disagree with the ops")
        for a, c in fresh:
            _require(not post.rotations[a:c].any() and not post.cum_deltas[a:c].any(),
                     "a refreshed slot keeps its rotation")
    _summary(plan, n, n2)


def _summary(plan: OpPlan, n: int, n2: int) -> None:
    s, ops = plan.summary, plan.ops

    def total(kind: OpKind) -> int:
        return sum(len(o) for o in ops if o.kind is kind)

    _require(
        s.tokens_before == n
        and s.tokens_after == n2
        and s.tokens_prefilled == total(OpKind.PREFILL)
        and s.refresh_proposals == total(OpKind.REFRESH)
        and s.tokens_kept == n2 - s.tokens_prefilled - s.refresh_proposals
        and s.slots_rotated == total(OpKind.ROTATE)
        and s.rotations == len(plan.ops_of(OpKind.ROTATE))
        and s.blocks_allocated == len(plan.allocated_blocks)
        and s.blocks_freed == len(plan.freed_blocks)
        and s.slots_reindexed == total(OpKind.MOVE)
        and s.slots_moved == sum(o.moved for o in ops if o.kind is OpKind.MOVE),
        "summary counts disagree with the ops",
    )
