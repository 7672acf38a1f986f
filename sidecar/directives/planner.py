"""Splice planning: directives over a session mirror -> an ``OpPlan`` (pure; no I/O).

The edited sequence is cut into *regions* of kept tokens and *new* tokens::

    old:  [ region 0 ][ edit 1 ][ region 1 ][ edit 2 ][ region 2 ]
    new:  [ region 0 ][  r1  ][ region 1 ][    r2    ][ region 2 ]
                              shift d1 = |r1| - |e1|   shift d2 = d1 + |r2| - |e2|

Region 0 (the prefix) never changes. Every later region keeps its KV and is shifted by the
running sum of the deltas before it: ONE rotation by that cumulative delta per region,
never a chain per directive. A ``forget`` directive ends the kept regions: everything from
its start on is new (freed, then re-prefilled from the edited text), including what later
directives did.

Block rule (``B`` = block size). Position ``q`` lives at offset ``q % B`` of block
``table[q // B]``, so a kept token stays in its slot only if its shift ``d`` is a multiple
of ``B``. Per new block the planner picks at most one old block to reuse, the one that keeps
the most tokens in place:

* A region with ``d % B == 0`` keeps every block it covers entirely: only the block table
  changes (MOVE entries with ``src == dst``) plus its ROTATE. This is always the case for
  ``B == 1``, so token-granular pools never move data.
* A region with ``d % B != 0`` moves its tokens (MOVE with ``src != dst``; copying KV is far
  cheaper than recomputing it), plus its ROTATE. Kept tokens are never re-prefilled (except
  as REFRESH, below).
* A block at an edit boundary, partially covered by the region(s) on either side, is split:
  the new block is the old block of the side with the most tokens already in place (ties:
  the left side), and its other offsets are overwritten by MOVE (the other side's tokens,
  copied in) or PREFILL (new tokens), so no stale token stays visible. An old block wanted
  by two new blocks goes to the one with more tokens in place; the other gets a fresh block.
  An old block nobody reuses is freed; new blocks nobody can reuse are allocated. Example,
  B = 4, delete [5, 9)::

      old  blk0 [0 1 2 3]  blk1 [4 5 6 7]  blk2 [8 9 10 11]
      new  blk0 [0 1 2 3]  blk2 [4 9 10 11]     token 4 is copied into blk2 (1 slot moved),
                                                9..11 stay in place, blk1 is freed

  Reuse assumes the session owns its blocks exclusively (an engine that shares prefix
  blocks copies on write before applying a plan).

Refresh: a kept token whose slot was already rotated ``refresh_after`` times is not rotated
again; it gets a REFRESH entry instead (re-prefill, or re-fetch the canonical copy and rotate
it once), and its counters reset.

Cost: Python work per directive and per region; everything per token is numpy.
"""

from __future__ import annotations

import uuid
from typing import Sequence

import numpy as np

from sidecar.directives.directive import Directive, Edit, EditMode, validate_directives
from sidecar.directives.invariants import check_plan
from sidecar.directives.layout import Layout, arange, frozen
from sidecar.directives.mirror import SessionMirror
from sidecar.directives.op_plan import Op, OpKind, OpPlan, PlanId, PlanSummary

#: Rotations a slot may accumulate before a REFRESH is proposed instead of another one.
#: Chained rotations drift (slowly: Leyline App. F); the sidecar's own copies never chain.
DEFAULT_REFRESH_AFTER = 8


def plan_splice(
    session: SessionMirror,
    directives: Sequence[Directive],
    *,
    vocab_size: int | None = None,
    refresh_after: int | None = DEFAULT_REFRESH_AFTER,
    max_directives: int | None = None,
    plan_id: PlanId | None = None,
) -> OpPlan:
    """Validate ``directives`` against ``session`` and return the plan that applies them.

    All or nothing: invalid directives raise ``InvalidArgument`` (message names the directive
    index and field) before any work. The plan is checked by ``check_plan`` before it is
    returned; a failed check raises ``InvariantViolation``. Never mutates ``session``; the
    plan takes effect on ``session.commit(plan)``. ``refresh_after=None`` never refreshes.
    """
    if refresh_after is not None and refresh_after < 0:
        raise ValueError(f"refresh_after: {refresh_after} is negative")
    edits = validate_directives(directives, len(session.layout), vocab_size=vocab_size, max_directives=max_directives)
    plan = _build(session, edits, refresh_after, plan_id or PlanId(uuid.uuid4().hex))
    check_plan(session, plan)
    return plan


def _build(session: SessionMirror, edits: tuple[Edit, ...], refresh_after: int | None, plan_id: PlanId) -> OpPlan:
    base = session.layout
    b = session.block_size
    n = len(base)
    old_tokens, old_slots = base.tokens, base.slots

    # 1. The new sequence, kept regions (old start, old end, shift) and new-token ranges.
    pieces: list[np.ndarray] = []
    regions: list[tuple[int, int, int]] = []
    prefills: list[tuple[int, int]] = []  # new-position ranges, left to right
    prev, shift, forget_at = 0, 0, -1
    for e in edits:
        pieces.append(old_tokens[prev : e.start])
        pieces.append(e.replacement)
        if forget_at < 0:
            regions.append((prev, e.start, shift))
            q = e.start + shift
            if e.mode is EditMode.FORGET:
                forget_at = q
            elif len(e.replacement):
                prefills.append((q, q + len(e.replacement)))
        shift += e.delta
        prev = e.end
    pieces.append(old_tokens[prev:])
    tokens = frozen(np.concatenate(pieces).astype(np.uint32, copy=False))
    n2 = len(tokens)
    if forget_at < 0:
        regions.append((prev, n, shift))
    elif forget_at < n2:
        prefills.append((forget_at, n2))
    regions = [r for r in regions if r[0] < r[1]]

    # 2. Block table: reuse old blocks where tokens stay in place, fresh blocks elsewhere.
    old_table = base.block_table
    new_table = np.full(-(-n2 // b), -1, dtype=np.int64)
    reused = np.zeros(len(old_table), dtype=bool)  # by old block-table index
    edge_claims: list[tuple[int, int, int]] = []  # (tokens in place, new block, old table index)
    for a, e_, d in regions:
        if d % b:
            continue
        sb = d // b
        qa, qb = a + d, e_ + d
        j0, j1 = -(-qa // b), qb // b  # new blocks the region covers entirely
        if j1 > j0:
            # Entirely covered on both sides, so no other region can want these blocks.
            new_table[j0:j1] = old_table[j0 - sb : j1 - sb]
            reused[j0 - sb : j1 - sb] = True
        head = qa % b != 0
        if head:
            j = qa // b
            edge_claims.append((min(qb, (j + 1) * b) - qa, j, j - sb))
        if qb % b and not (head and qa // b == qb // b):
            j = qb // b
            edge_claims.append((qb - j * b, j, j - sb))
    edge_claims.sort(key=lambda c: (-c[0], c[1]))
    for _, j, t in edge_claims:
        if new_table[j] < 0 and not reused[t]:
            new_table[j] = old_table[t]
            reused[t] = True
    holes = np.flatnonzero(new_table < 0)
    allocated = session.allocator.peek(len(holes))
    new_table[holes] = allocated
    freed = old_table[~reused]
    if b == 1:
        slots = new_table
    else:
        slots = (new_table[:, None] * b + arange(b)).reshape(-1)[:n2]
    frozen(slots)
    positions = arange(n2)

    # 3. Per region: reindex/move entries, one rotation, refresh proposals, bookkeeping.
    rotations = np.zeros(n2, dtype=np.int32)
    cum_deltas = np.zeros(n2, dtype=np.int64)
    move_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    rotate_ops: list[Op] = []
    compute_ops: list[tuple[int, Op]] = []  # (first position, op): PREFILL and REFRESH
    for a, e_, d in regions:
        qa, qb = a + d, e_ + d
        src, dst = old_slots[a:e_], slots[qa:qb]
        rot, cum = base.rotations[a:e_], base.cum_deltas[a:e_]
        if d == 0:
            # Not rotated; only tokens of a boundary block that another region won move.
            rotations[qa:qb] = rot
            cum_deltas[qa:qb] = cum
            if b > 1:
                for lo, hi in _edge_ranges(qa, qb, b):
                    moved = np.flatnonzero(src[lo - qa : hi - qa] != dst[lo - qa : hi - qa]) + lo
                    if len(moved):  # new position == old index here (no shift)
                        move_parts.append((old_slots[moved], slots[moved], positions[moved]))
            continue
        stale = rot >= refresh_after if refresh_after is not None else None
        if stale is not None and stale.any():
            keep = ~stale
            rotations[qa:qb] = np.where(keep, rot + 1, 0)
            cum_deltas[qa:qb] = np.where(keep, cum + d, 0)
            kept_pos = positions[qa:qb][keep]
            r_slots, r_pos, r_cum = dst[keep], kept_pos, cum_deltas[qa:qb][keep]
            move_parts.append((src[keep], r_slots, r_pos))
            compute_ops.append(
                (qa, Op(kind=OpKind.REFRESH, slots=frozen(dst[stale]), positions=frozen(positions[qa:qb][stale]),
                        tokens=frozen(tokens[qa:qb][stale])))
            )
        else:
            np.add(rot, 1, out=rotations[qa:qb])
            np.add(cum, d, out=cum_deltas[qa:qb])
            r_slots, r_pos, r_cum = dst, positions[qa:qb], cum_deltas[qa:qb]
            move_parts.append((src, dst, r_pos))
        if len(r_slots):
            rotate_ops.append(
                Op(kind=OpKind.ROTATE, slots=frozen(r_slots), positions=frozen(r_pos), delta=d,
                   cum_deltas=frozen(r_cum))
            )
    frozen(rotations)
    frozen(cum_deltas)
    for qa, qb in prefills:
        compute_ops.append(
            (qa, Op(kind=OpKind.PREFILL, slots=slots[qa:qb], positions=positions[qa:qb], tokens=tokens[qa:qb]))
        )
    compute_ops.sort(key=lambda c: c[0])

    # 4. Assemble in application order (op_plan.py): ALLOCATE, MOVE, FREE, ROTATEs, computes.
    ops: list[Op] = []
    if len(allocated):
        ops.append(Op(kind=OpKind.ALLOCATE, blocks=frozen(allocated)))
    move = None
    if move_parts:
        src_all, dst_all, pos_all = (frozen(np.concatenate(c)) for c in zip(*move_parts))
        move = Op(kind=OpKind.MOVE, src_slots=src_all, slots=dst_all, positions=pos_all)
        ops.append(move)
    if len(freed):
        ops.append(Op(kind=OpKind.FREE, blocks=frozen(freed)))
    ops.extend(rotate_ops)
    ops.extend(op for _, op in compute_ops)

    prefilled = sum(hi - lo for lo, hi in prefills)
    refreshed = sum(len(op) for _, op in compute_ops if op.kind is OpKind.REFRESH)
    summary = PlanSummary(
        tokens_before=n,
        tokens_after=n2,
        tokens_kept=n2 - prefilled - refreshed,
        tokens_prefilled=prefilled,
        slots_reindexed=len(move) if move is not None else 0,
        slots_moved=move.moved if move is not None else 0,
        slots_rotated=sum(len(op) for op in rotate_ops),
        rotations=len(rotate_ops),
        blocks_freed=len(freed),
        blocks_allocated=len(allocated),
        refresh_proposals=refreshed,
    )
    layout = Layout(
        block_size=b, tokens=tokens, slots=slots, positions=positions, rotations=rotations, cum_deltas=cum_deltas
    )
    return OpPlan(
        plan_id=plan_id,
        session_id=session.session_id,
        base_version=session.version,
        next_version=session.version + 1,
        block_size=b,
        ops=tuple(ops),
        layout=layout,
        edits=edits,
        summary=summary,
    )


def _edge_ranges(qa: int, qb: int, b: int) -> list[tuple[int, int]]:
    """New-position ranges of ``[qa, qb)`` that lie in blocks the region covers only partly."""
    j0, j1 = -(-qa // b), qb // b
    if j1 <= j0:
        return [(qa, qb)]
    out = []
    if qa < j0 * b:
        out.append((qa, j0 * b))
    if j1 * b < qb:
        out.append((j1 * b, qb))
    return out

