"""Op plans: the one result type a Splice returns.

An ``OpPlan`` is an ordered list of batch ops over the session's slot map plus the layout the
session has once the plan is committed. Every op carries index arrays, so an engine applies it
as one call (one gather, one rotation kernel launch, one prefill forward)::

    ALLOCATE  blocks                       bind fresh block ids (the engine maps them to its own)
    MOVE      src_slots -> slots, positions  block-table rewrite; copy KV where src != dst
    FREE      blocks                       release blocks nothing refers to any more
    ROTATE    slots, positions, delta      rotate the rotary key part by ``delta`` (one region)
    PREFILL   slots, positions, tokens     compute K/V of new tokens at these positions
    REFRESH   slots, positions, tokens     recompute (or re-fetch the canonical copy of) slots
                                           rotated too often, instead of rotating them again

Application order and semantics (what ``check_plan`` and the simulator verify):

* Ops apply in list order. A plan always lists them as ALLOCATE, MOVE, FREE, the ROTATEs
  (one per downstream region, left to right), then PREFILL/REFRESH in increasing position
  order, so each computed token attends to a prefix that is already in its final state.
* MOVE has copy semantics: all sources are read before any destination is written
  (``pool[dst] = pool[src]`` as one gather). Entries with ``src == dst`` move no data; they
  only change the token's position (a block-table / ``req_to_token`` rewrite).
* FREE comes right after MOVE: nothing after it reads old data, and the freed blocks are never
  touched again by this plan.
* ROTATE acts on destination slots (after MOVE). ``cum_deltas`` is each slot's total shift
  since its KV was computed, after this rotation: a holder of the canonical source-position
  copy rotates that copy by ``cum_deltas`` once instead of chaining rotations.
* A slot is rotated at most once per plan and written (MOVE destination, PREFILL, REFRESH) at
  most once per plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import NewType

import numpy as np

from sidecar.directives.directive import Edit
from sidecar.directives.layout import EMPTY_I64, EMPTY_U32, Layout

SessionId = NewType("SessionId", str)
PlanId = NewType("PlanId", str)


class OpKind(IntEnum):  # wire values: keep stable
    FREE = 1
    ALLOCATE = 2
    PREFILL = 3
    ROTATE = 4
    MOVE = 5  # a.k.a. REINDEX: block-table rewrite, with data movement only where src != dst
    REFRESH = 6


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Op:
    """One batch op. Arrays are read-only; unused fields are empty.

    slots (int64): MOVE destinations / rotated / written slots. positions (int64): new
    positions, parallel to ``slots``. src_slots (int64, MOVE): sources parallel to ``slots``.
    tokens (uint32, PREFILL/REFRESH): token ids parallel to ``slots``. blocks (int64,
    ALLOCATE/FREE): block ids. delta (ROTATE): the region's rotation, in positions.
    cum_deltas (int64, ROTATE): per-slot total shift since computed, after this op.
    """

    kind: OpKind
    slots: np.ndarray = field(default_factory=lambda: EMPTY_I64)
    positions: np.ndarray = field(default_factory=lambda: EMPTY_I64)
    src_slots: np.ndarray = field(default_factory=lambda: EMPTY_I64)
    tokens: np.ndarray = field(default_factory=lambda: EMPTY_U32)
    blocks: np.ndarray = field(default_factory=lambda: EMPTY_I64)
    delta: int = 0
    cum_deltas: np.ndarray = field(default_factory=lambda: EMPTY_I64)

    def __len__(self) -> int:
        """Entries: blocks for ALLOCATE/FREE, slots otherwise."""
        return len(self.blocks) if self.kind in (OpKind.ALLOCATE, OpKind.FREE) else len(self.slots)

    @property
    def moved(self) -> int:
        """MOVE only: slots whose data is copied (``src != dst``)."""
        return int(np.count_nonzero(self.src_slots != self.slots)) if self.kind is OpKind.MOVE else 0

    def block_slots(self, block_size: int) -> np.ndarray:
        """ALLOCATE/FREE: every slot of ``blocks`` (int64, block-major)."""
        return (self.blocks[:, None] * block_size + np.arange(block_size)).reshape(-1)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanSummary:
    """Counts an operator (and the bench) reads off a plan; all in tokens/slots/blocks."""

    tokens_before: int
    tokens_after: int
    tokens_kept: int  # tokens whose KV survives (moved, reindexed, rotated or untouched)
    tokens_prefilled: int  # PREFILL entries
    slots_reindexed: int  # MOVE entries (position and/or slot change)
    slots_moved: int  # MOVE entries whose KV is copied
    slots_rotated: int  # ROTATE entries
    rotations: int  # ROTATE ops (one per downstream region with a nonzero shift)
    blocks_freed: int
    blocks_allocated: int
    refresh_proposals: int  # REFRESH entries


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class OpPlan:
    """A Splice answer: apply ``ops`` in order, then ``CommitSplice(plan_id)``.

    ``layout`` is the session once committed (tokens, slots, positions ``0..n-1``, rotation
    bookkeeping); an engine may rewrite its block table from it directly. ``edits`` are the
    validated directives, sorted by start.
    """

    plan_id: PlanId
    session_id: SessionId
    base_version: int
    next_version: int
    block_size: int
    ops: tuple[Op, ...]
    layout: Layout
    edits: tuple[Edit, ...]
    summary: PlanSummary

    def ops_of(self, kind: OpKind) -> list[Op]:
        return [op for op in self.ops if op.kind is kind]

    @property
    def kinds(self) -> tuple[OpKind, ...]:
        return tuple(op.kind for op in self.ops)

    @property
    def allocated_blocks(self) -> np.ndarray:
        ops = self.ops_of(OpKind.ALLOCATE)
        return ops[0].blocks if ops else EMPTY_I64

    @property
    def freed_blocks(self) -> np.ndarray:
        ops = self.ops_of(OpKind.FREE)
        return ops[0].blocks if ops else EMPTY_I64
