"""Exact-state plans: the op list a hand-worked splice must produce, op by op."""

from __future__ import annotations

import numpy as np

from sidecar.directives import EditMode, OpKind, ToyPool, plan_splice

from .helpers import apply_and_check, d, ops, session


def test_amortize_delete_token_pool_keeps_every_slot():
    # B=1: downstream tokens keep their slots; only their positions change (REINDEX) and their
    # keys rotate by -2. The deleted span's slots are freed. No data moves.
    s = session(10)
    plan = plan_splice(s, [d(3, 5)])
    assert ops(plan) == [
        ("MOVE", [5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [3, 4, 5, 6, 7]),
        ("FREE", [3, 4]),
        ("ROTATE", [5, 6, 7, 8, 9], [3, 4, 5, 6, 7], -2),
    ]
    lay = plan.layout
    assert lay.tokens.tolist() == [1000, 1001, 1002, 1005, 1006, 1007, 1008, 1009]
    assert lay.slots.tolist() == [0, 1, 2, 5, 6, 7, 8, 9]
    assert lay.positions.tolist() == list(range(8))
    assert lay.rotations.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert lay.cum_deltas.tolist() == [0, 0, 0, -2, -2, -2, -2, -2]
    sm = plan.summary
    assert (sm.slots_moved, sm.slots_reindexed, sm.slots_rotated, sm.rotations) == (0, 5, 5, 1)
    assert (sm.blocks_freed, sm.blocks_allocated, sm.tokens_prefilled, sm.tokens_kept) == (2, 0, 0, 8)
    assert (plan.base_version, plan.next_version) == (0, 1)
    apply_and_check(s, plan)
    assert s.version == 1 and s.allocator.live_count == 8


def test_amortize_delete_of_a_whole_block_is_a_block_table_rewrite():
    # B=16, delete exactly block 1: the shift (-16) is a multiple of B, so block 2 becomes the
    # session's second block in place: zero data movement, one rotation.
    #   before: [blk0: 0..15][blk1: 16..31][blk2: 32..39]   after: [blk0: 0..15][blk2: 16..23]
    s = session(40, 16)
    plan = plan_splice(s, [d(16, 32)])
    assert ops(plan) == [
        ("MOVE", list(range(32, 40)), list(range(32, 40)), list(range(16, 24))),
        ("FREE", [1]),
        ("ROTATE", list(range(32, 40)), list(range(16, 24)), -16),
    ]
    assert plan.layout.block_table.tolist() == [0, 2]
    assert plan.summary.slots_moved == 0
    apply_and_check(s, plan)


def test_amortize_delete_misaligned_moves_downstream_slots():
    # B=16, delete [10, 13): shift -3 is not a multiple of 16, so downstream tokens change
    # their offset in a block and must move: the boundary block 0 keeps tokens 0..9 and takes
    # old 13..18 at offsets 10..15; the rest goes to two fresh blocks; blocks 1, 2 are freed.
    s = session(40, 16)
    plan = plan_splice(s, [d(10, 13)])
    dst = list(range(10, 16)) + list(range(48, 69))
    assert ops(plan) == [
        ("ALLOCATE", [3, 4]),
        ("MOVE", list(range(13, 40)), dst, list(range(10, 37))),
        ("FREE", [1, 2]),
        ("ROTATE", dst, list(range(10, 37)), -3),
    ]
    assert plan.layout.block_table.tolist() == [0, 3, 4]
    assert (plan.summary.slots_moved, plan.summary.tokens_prefilled) == (27, 0)
    apply_and_check(s, plan)
    assert s.allocator.live_count == 3


def test_insert_token_pool():
    s = session(5)
    plan = plan_splice(s, [d(2, 2, [7, 8])])
    assert ops(plan) == [
        ("ALLOCATE", [5, 6]),
        ("MOVE", [2, 3, 4], [2, 3, 4], [4, 5, 6]),
        ("ROTATE", [2, 3, 4], [4, 5, 6], 2),
        ("PREFILL", [5, 6], [2, 3], [7, 8]),
    ]
    assert plan.layout.tokens.tolist() == [1000, 1001, 7, 8, 1002, 1003, 1004]
    apply_and_check(s, plan)


def test_insert_mid_block_splits_the_boundary_block():
    # B=4, insert 2 tokens at 2: block 0 keeps tokens 0, 1 in place and receives the two new
    # tokens at offsets 2, 3 (its old tokens 2, 3 move out first: MOVE precedes PREFILL).
    s = session(8, 4)
    plan = plan_splice(s, [d(2, 2, [98, 99])])
    assert ops(plan) == [
        ("ALLOCATE", [2, 3]),
        ("MOVE", [2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13], [4, 5, 6, 7, 8, 9]),
        ("FREE", [1]),
        ("ROTATE", [8, 9, 10, 11, 12, 13], [4, 5, 6, 7, 8, 9], 2),
        ("PREFILL", [2, 3], [2, 3], [98, 99]),
    ]
    assert plan.layout.slots.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13]
    apply_and_check(s, plan)


def test_same_length_replacement_overwrites_in_place():
    # B=4, replace token 2 by one token: shift 0, nothing moves or rotates; the new token
    # overwrites the dead one's slot in the kept block (no stale token stays visible).
    s = session(8, 4)
    plan = plan_splice(s, [d(2, 3, [50])])
    assert ops(plan) == [("PREFILL", [2], [2], [50])]
    apply_and_check(s, plan)


def test_boundary_block_goes_to_the_side_with_more_tokens_in_place():
    # B=4, delete [5, 9): new block 1 = old token 4 (prefix, in old block 1) + old 9..11 (in
    # old block 2, same offsets). Block 2 keeps 3 tokens in place against block 1's one, so
    # block 2 is reused and prefix token 4 moves (a copy, no rotation); block 1 is freed.
    s = session(12, 4)
    plan = plan_splice(s, [d(5, 9)])
    assert ops(plan) == [
        ("MOVE", [4, 9, 10, 11], [8, 9, 10, 11], [4, 5, 6, 7]),
        ("FREE", [1]),
        ("ROTATE", [9, 10, 11], [5, 6, 7], -4),
    ]
    assert plan.layout.block_table.tolist() == [0, 2]
    assert plan.layout.rotations.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert plan.summary.slots_moved == 1
    apply_and_check(s, plan)


def test_truncating_the_tail_needs_no_data_ops():
    s = session(8, 4)
    plan = plan_splice(s, [d(6, 8)])
    assert ops(plan) == []  # block 1 keeps tokens 4, 5; offsets 2, 3 are past the end
    assert plan.layout.tokens.tolist() == [1000 + i for i in range(6)]
    apply_and_check(s, plan)
    s1 = session(8)
    plan = plan_splice(s1, [d(6, 8)])
    assert ops(plan) == [("FREE", [6, 7])]


def test_forget_reprefills_everything_from_its_start():
    s = session(10)
    plan = plan_splice(s, [d(3, 5, [99], EditMode.FORGET)])
    assert ops(plan) == [
        ("ALLOCATE", [10, 11, 12, 13, 14, 15]),
        ("FREE", [3, 4, 5, 6, 7, 8, 9]),
        ("PREFILL", [10, 11, 12, 13, 14, 15], [3, 4, 5, 6, 7, 8], [99, 1005, 1006, 1007, 1008, 1009]),
    ]
    assert plan.summary.tokens_prefilled == 6 and plan.summary.rotations == 0
    apply_and_check(s, plan)


def test_forget_subsumes_later_directives_and_follows_earlier_ones():
    s = session(10)
    plan = plan_splice(s, [d(6, 8, [77]), d(1, 2), d(4, 5, [], EditMode.FORGET)])
    # amortize delete [1, 2): region [2, 4) rotates by -1; the forget re-prefills from new
    # position 3 on, with the later amortize edit already applied to the text.
    assert plan.layout.tokens.tolist() == [1000, 1002, 1003, 1005, 77, 1008, 1009]
    assert ops(plan) == [
        ("ALLOCATE", [10, 11, 12, 13]),
        ("MOVE", [2, 3], [2, 3], [1, 2]),
        ("FREE", [1, 4, 5, 6, 7, 8, 9]),
        ("ROTATE", [2, 3], [1, 2], -1),
        ("PREFILL", [10, 11, 12, 13], [3, 4, 5, 6], [1005, 77, 1008, 1009]),
    ]
    apply_and_check(s, plan)


def test_two_directives_compose_with_one_rotation_per_region():
    # delete [2, 4) then insert 3 tokens at 8: region [4, 8) shifts by -2, region [8, 12) by
    # -2 + 3 = +1: one rotation each by the cumulative delta, never -2 then +3.
    s = session(12)
    plan = plan_splice(s, [d(8, 8, [100, 101, 102]), d(2, 4)])  # unsorted on purpose
    assert ops(plan) == [
        ("ALLOCATE", [12, 13, 14]),
        ("MOVE", [4, 5, 6, 7, 8, 9, 10, 11], [4, 5, 6, 7, 8, 9, 10, 11], [2, 3, 4, 5, 9, 10, 11, 12]),
        ("FREE", [2, 3]),
        ("ROTATE", [4, 5, 6, 7], [2, 3, 4, 5], -2),
        ("ROTATE", [8, 9, 10, 11], [9, 10, 11, 12], 1),
        ("PREFILL", [12, 13, 14], [6, 7, 8], [100, 101, 102]),
    ]
    assert plan.layout.cum_deltas.tolist() == [0, 0, -2, -2, -2, -2, 0, 0, 0, 1, 1, 1, 1]
    apply_and_check(s, plan)


def test_two_directives_equal_the_same_edits_one_at_a_time():
    a = session(40, 4)
    b = session(40, 4)
    plan = plan_splice(a, [d(5, 9, [1, 2]), d(20, 21, [3, 4, 5, 6, 7])])
    apply_and_check(a, plan)
    for directive in (d(20, 21, [3, 4, 5, 6, 7]), d(5, 9, [1, 2])):  # right one first: indices stay valid
        apply_and_check(b, plan_splice(b, [directive]))
    assert a.layout.tokens.tolist() == b.layout.tokens.tolist()
    # Same net shift for every original token; one at a time took two rotations (+4, -2)
    # where the turn took one (+2). The second replacement (new positions 18..22) was
    # prefilled, then rotated, one at a time; in one turn it is prefilled where it ends up.
    ca, cb = a.layout.cum_deltas.tolist(), b.layout.cum_deltas.tolist()
    assert ca[:18] + ca[23:] == cb[:18] + cb[23:]
    assert ca[18:23] == [0] * 5 and cb[18:23] == [-2] * 5
    assert a.layout.rotations.max() == 1 and b.layout.rotations.max() == 2


def test_refresh_replaces_a_rotation_past_the_limit():
    s = session(6)
    pool = ToyPool.from_layout(s.layout)
    for _ in range(2):  # each turn drops the first token: every survivor is rotated once more
        pool = apply_and_check(s, plan_splice(s, [d(0, 1)], refresh_after=2), pool)
    assert s.layout.rotations.tolist() == [2, 2, 2, 2]
    s.append([7, 8])  # fresh tokens, never rotated, in the slots freed earlier
    pool.append(s.layout, 4)
    assert s.layout.slots.tolist() == [2, 3, 4, 5, 0, 1]
    plan = plan_splice(s, [d(0, 1)], refresh_after=2)
    # Tokens rotated twice get a REFRESH instead of a third rotation; the fresh ones rotate.
    assert ops(plan) == [
        ("MOVE", [0, 1], [0, 1], [3, 4]),
        ("FREE", [2]),
        ("ROTATE", [0, 1], [3, 4], -1),
        ("REFRESH", [3, 4, 5], [0, 1, 2], [1003, 1004, 1005]),
    ]
    assert plan.summary.refresh_proposals == 3
    assert plan.layout.rotations.tolist() == [0, 0, 0, 1, 1]
    assert plan.layout.cum_deltas.tolist() == [0, 0, 0, -1, -1]
    apply_and_check(s, plan, pool)


def test_refresh_disabled_and_zero():
    s = session(4)
    for _ in range(3):
        apply_and_check(s, plan_splice(s, [d(0, 0, [5])], refresh_after=None))
    assert s.layout.rotations.tolist() == [0, 1, 2, 3, 3, 3, 3]  # each inserted token too
    plan = plan_splice(s, [d(0, 0, [5])], refresh_after=0)
    assert not plan.ops_of(OpKind.ROTATE) and plan.summary.refresh_proposals == 7


def test_plan_is_pure_and_commit_adopts_the_layout():
    s = session(20, 4)
    before = (s.layout, s.version, s.allocator.state())
    plan = plan_splice(s, [d(3, 9, [1])])
    assert (s.layout, s.version, s.allocator.state()) == before
    s.commit(plan)
    assert s.layout is plan.layout and s.version == 1
    assert s.allocator.live_count == len(plan.layout.block_table)


def test_append_fills_the_last_block_first():
    s = session(5, 4)
    assert s.layout.block_table.tolist() == [0, 1]
    s.append(np.array([1, 2, 3, 4]))
    assert s.layout.slots.tolist() == list(range(9))
    assert s.layout.positions.tolist() == list(range(9))
    assert s.layout.block_table.tolist() == [0, 1, 2] and s.allocator.live_count == 3


def test_ops_are_read_only():
    s = session(10)
    plan = plan_splice(s, [d(2, 3, [5, 6])])
    for op in plan.ops:
        for arr in (op.slots, op.positions, op.src_slots, op.tokens, op.blocks, op.cum_deltas):
            assert not arr.flags.writeable
    assert not plan.layout.tokens.flags.writeable and not s.layout.slots.flags.writeable
