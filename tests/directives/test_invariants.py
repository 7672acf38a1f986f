"""Deliberately corrupted plans must trip check_plan with InvariantViolation (bug id)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sidecar.directives import Op, OpKind, OpPlan, check_plan, plan_splice
from sidecar.directives import planner as planner_module
from sidecar.errors import InvariantViolation

from .helpers import d, session


def _frozen(values, dtype=np.int64) -> np.ndarray:
    arr = np.array(values, dtype=dtype)
    arr.flags.writeable = False
    return arr


def _swap_op(plan: OpPlan, kind: OpKind, **changes) -> OpPlan:
    ops = tuple(dataclasses.replace(op, **changes) if op.kind is kind else op for op in plan.ops)
    return dataclasses.replace(plan, ops=ops)


def _layout(plan: OpPlan, **changes) -> OpPlan:
    return dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, **changes))


@pytest.fixture
def good():
    s = session(12, 4)
    plan = plan_splice(s, [d(2, 2, [98, 99]), d(8, 10)])
    check_plan(s, plan)  # the uncorrupted plan passes
    return s, plan


def _corruptions(plan: OpPlan):
    rot = plan.ops_of(OpKind.ROTATE)[0]
    move = plan.ops_of(OpKind.MOVE)[0]
    pre = plan.ops_of(OpKind.PREFILL)[0]
    tokens = plan.layout.tokens.copy()
    tokens[-1] += 1
    yield "layout tokens differ", _layout(plan, tokens=_frozen(tokens, np.uint32))
    yield "positions after commit", _layout(plan, positions=_frozen(np.arange(len(tokens))[::-1]))
    yield "not parallel", _layout(plan, rotations=_frozen(plan.layout.rotations[:-1], np.int32))
    bumped = tuple(dataclasses.replace(op, delta=op.delta + 1) if op is rot else op for op in plan.ops)
    yield "rotated by exactly its shift", dataclasses.replace(plan, ops=bumped)
    i = plan.ops.index(rot)
    yield "rotated twice", dataclasses.replace(plan, ops=plan.ops[: i + 1] + (rot,) + plan.ops[i + 1 :])
    src = move.src_slots.copy()
    src[0], src[1] = src[1], src[0]
    yield "MOVE copies another token's KV", _swap_op(plan, OpKind.MOVE, src_slots=_frozen(src))
    yield "not its position's slot", _swap_op(plan, OpKind.PREFILL, slots=_frozen(pre.slots[::-1]))
    yield "computes the wrong tokens", _swap_op(plan, OpKind.PREFILL, tokens=_frozen(pre.tokens + 1, np.uint32))
    yield "blocks leak", dataclasses.replace(plan, ops=tuple(op for op in plan.ops if op.kind is not OpKind.FREE))
    used = plan.layout.block_table[:1]
    yield "use after free", _swap_op(plan, OpKind.FREE, blocks=_frozen(np.concatenate((plan.freed_blocks, used))))
    yield "ALLOCATE of a block the session holds", _swap_op(plan, OpKind.ALLOCATE, blocks=_frozen([0, 1]))
    yield "do not follow session version", dataclasses.replace(plan, next_version=plan.next_version + 1)
    yield "not prefilled", dataclasses.replace(plan, ops=tuple(op for op in plan.ops if op.kind is not OpKind.PREFILL))
    yield "ops are not in", dataclasses.replace(plan, ops=plan.ops[::-1])
    yield "summary counts", dataclasses.replace(plan, summary=dataclasses.replace(plan.summary, slots_moved=0))


def test_every_corruption_is_caught(good):
    s, plan = good
    for expected, bad in _corruptions(plan):
        with pytest.raises(InvariantViolation) as exc:
            check_plan(s, bad)
        assert expected in str(exc.value), (expected, str(exc.value))
        assert exc.value.bug_id and f"(bug id {exc.value.bug_id})" in str(exc.value)
        assert "bug in the splice planner" in str(exc.value)


def test_a_stale_slot_left_in_a_boundary_block_is_caught():
    # The PREFILL of the new token is dropped and its slot handed back as if it held it: the
    # position would read whatever the old block held there.
    s = session(8, 4)
    plan = plan_splice(s, [d(2, 3, [50])])
    bad = dataclasses.replace(plan, ops=())
    with pytest.raises(InvariantViolation, match="PREFILL of a kept token|not prefilled"):
        check_plan(s, bad)


def test_plan_splice_never_returns_a_broken_plan(monkeypatch):
    real = planner_module._build

    def broken(*args, **kwargs):
        plan = real(*args, **kwargs)
        extra = Op(kind=OpKind.ROTATE, slots=plan.layout.slots[-1:], positions=plan.layout.positions[-1:], delta=1,
                   cum_deltas=plan.layout.cum_deltas[-1:])
        return dataclasses.replace(plan, ops=plan.ops + (extra,))

    monkeypatch.setattr(planner_module, "_build", broken)
    s = session(10)
    with pytest.raises(InvariantViolation):
        plan_splice(s, [d(1, 2)])
    assert s.version == 0
