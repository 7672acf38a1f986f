"""Shared helpers for the directives tests: sessions, readable op lists, snapshots."""

from __future__ import annotations

import numpy as np

from sidecar.directives import Directive, EditMode, OpKind, OpPlan, SessionId, SessionMirror, ToyPool, apply_plan


def session(n: int | list[int], block_size: int = 1, *, base: int = 1000) -> SessionMirror:
    """A mirror holding tokens ``base, base+1, ...`` (or the given list), slots 0..n-1."""
    tokens = np.arange(base, base + n) if isinstance(n, int) else np.asarray(n)
    return SessionMirror.open(session_id=SessionId("s"), tenant="t", block_size=block_size, tokens=tokens)


def d(start: int, end: int, replacement=(), mode: EditMode = EditMode.AMORTIZE) -> Directive:
    return Directive(start=start, end=end, replacement=np.asarray(replacement, dtype=np.int64), mode=mode)


def ops(plan: OpPlan) -> list[tuple]:
    """Each op as a tuple of plain lists (only the fields its kind uses), for exact comparison."""
    out: list[tuple] = []
    for op in plan.ops:
        k = op.kind
        if k in (OpKind.ALLOCATE, OpKind.FREE):
            out.append((k.name, op.blocks.tolist()))
        elif k is OpKind.MOVE:
            out.append((k.name, op.src_slots.tolist(), op.slots.tolist(), op.positions.tolist()))
        elif k is OpKind.ROTATE:
            out.append((k.name, op.slots.tolist(), op.positions.tolist(), op.delta))
        else:
            out.append((k.name, op.slots.tolist(), op.positions.tolist(), op.tokens.tolist()))
    return out


def snapshot(s: SessionMirror) -> tuple:
    """Everything that makes up a session's state, comparable with ``==``."""
    lay = s.layout
    return (
        s.version,
        s.block_size,
        lay.tokens.tolist(),
        lay.slots.tolist(),
        lay.positions.tolist(),
        lay.rotations.tolist(),
        lay.cum_deltas.tolist(),
        s.allocator.state(),
    )


def apply_and_check(s: SessionMirror, plan: OpPlan, pool: ToyPool | None = None) -> ToyPool:
    """Apply ``plan`` to a toy pool of ``s`` (or the given pool), check it, commit it."""
    pool = pool if pool is not None else ToyPool.from_layout(s.layout)
    apply_plan(pool, plan)
    pool.check(plan.layout)
    s.commit(plan)
    return pool
