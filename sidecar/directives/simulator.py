"""A toy engine pool that applies op plans slot by slot: the reference the tests trust.

Written independently of the planner and of ``check_plan`` (plain dicts, one slot at a
time, no numpy tricks) so that the three agree only if the plan is right. It is a test and
reference tool, not a hot path: use it for sessions of a few thousand tokens.

Per slot it stores the token id, the position its KV was computed at, and the summed
rotation applied since; a slot's keys encode ``computed_at + rotation``. A plan is correct
when every token of the new layout reads back with the right id and
``computed_at + rotation == its new position``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sidecar.directives.layout import Layout
from sidecar.directives.op_plan import OpKind, OpPlan


class PoolError(AssertionError):
    """The plan did something an engine pool cannot do (read a free slot, double free, ...)."""


@dataclass(slots=True)
class SlotState:
    token: int
    computed_at: int
    rotation: int = 0  # summed delta since computed
    rotations: int = 0  # how many rotations

    @property
    def encoded_position(self) -> int:
        return self.computed_at + self.rotation


class ToyPool:
    """Live blocks and per-slot KV stand-ins for one session."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.live_blocks: set[int] = set()
        self.slots: dict[int, SlotState] = {}

    @classmethod
    def from_layout(cls, layout: Layout) -> "ToyPool":
        """The pool an engine holds for ``layout`` (each slot computed at its source position)."""
        pool = cls(layout.block_size)
        for slot, tok, pos, cum, rots in zip(
            layout.slots.tolist(),
            layout.tokens.tolist(),
            layout.positions.tolist(),
            layout.cum_deltas.tolist(),
            layout.rotations.tolist(),
        ):
            pool.live_blocks.add(slot // pool.block_size)
            pool.slots[slot] = SlotState(tok, pos - cum, cum, rots)
        return pool

    def append(self, layout: Layout, start: int) -> None:
        """The engine computed ``layout``'s tokens from ``start`` on (mirrors ``SessionMirror.append``)."""
        for slot, tok, pos in zip(
            layout.slots[start:].tolist(), layout.tokens[start:].tolist(), layout.positions[start:].tolist()
        ):
            self.live_blocks.add(slot // self.block_size)
            self.slots[slot] = SlotState(tok, pos)

    def read(self, slot: int) -> SlotState:
        if slot // self.block_size not in self.live_blocks:
            raise PoolError(f"read of slot {slot} outside a live block")
        if slot not in self.slots:
            raise PoolError(f"read of slot {slot}, which holds no KV")
        return self.slots[slot]

    def _writable(self, slot: int) -> None:
        if slot // self.block_size not in self.live_blocks:
            raise PoolError(f"write to slot {slot} outside a live block")

    def check(self, layout: Layout) -> None:
        """Raise ``PoolError`` unless the pool holds exactly ``layout``'s tokens at their positions."""
        for q, (slot, tok) in enumerate(zip(layout.slots.tolist(), layout.tokens.tolist())):
            st = self.read(slot)
            if st.token != tok:
                raise PoolError(f"position {q}: slot {slot} holds token {st.token}, expected {tok}")
            if st.encoded_position != q:
                raise PoolError(f"position {q}: slot {slot} encodes position {st.encoded_position}")
        used = {s // self.block_size for s in layout.slots.tolist()}
        if used != self.live_blocks:
            raise PoolError(f"live blocks {sorted(self.live_blocks - used)} are not in the layout (leak)")


def apply_plan(pool: ToyPool, plan: OpPlan) -> ToyPool:
    """Apply ``plan.ops`` in order to ``pool`` (mutated and returned), slot by slot."""
    b = pool.block_size
    if plan.block_size != b:
        raise PoolError(f"plan for block size {plan.block_size} applied to a pool of block size {b}")
    for op in plan.ops:
        kind = op.kind
        if kind is OpKind.ALLOCATE:
            for blk in op.blocks.tolist():
                if blk in pool.live_blocks:
                    raise PoolError(f"ALLOCATE of live block {blk}")
                pool.live_blocks.add(blk)
        elif kind is OpKind.FREE:
            for blk in op.blocks.tolist():
                if blk not in pool.live_blocks:
                    raise PoolError(f"FREE of block {blk}, which is not live")
                pool.live_blocks.discard(blk)
                for s in range(blk * b, blk * b + b):
                    pool.slots.pop(s, None)
        elif kind is OpKind.MOVE:
            # An engine gathers all sources first, then scatters.
            staged = [dataclasses.replace(pool.read(s)) for s in op.src_slots.tolist()]
            for dst, st in zip(op.slots.tolist(), staged):
                pool._writable(dst)
                pool.slots[dst] = st
        elif kind is OpKind.ROTATE:
            for s in op.slots.tolist():
                st = pool.read(s)
                st.rotation += op.delta
                st.rotations += 1
        elif kind in (OpKind.PREFILL, OpKind.REFRESH):
            for s, tok, pos in zip(op.slots.tolist(), op.tokens.tolist(), op.positions.tolist()):
                pool._writable(s)
                pool.slots[s] = SlotState(tok, pos)
        else:
            raise PoolError(f"unknown op kind {kind!r}")
    return pool
