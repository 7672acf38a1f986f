"""Validation first, all or nothing: each bad directive set names the index and field."""

from __future__ import annotations

import numpy as np
import pytest

from sidecar.directives import Directive, EditMode, plan_splice
from sidecar.errors import InvalidArgument

from .helpers import d, session, snapshot


@pytest.mark.parametrize(
    ("directives", "message"),
    [
        ([], "directives: at least one directive is required"),
        ([d(0, 1), d(5, 90)], "directives[1].end: 90 exceeds the session length 80"),
        ([d(-1, 2)], "directives[0].start: -1 is negative"),
        ([d(4, 4, [1]), d(9, 3)], "directives[1].end: 3 is before start 9"),
        ([d(1, 2), d(7, 7)], "directives[1]: empty edit (start == end == 7 and no replacement tokens)"),
        ([d(10, 20), d(0, 5), d(15, 25)], "directives[2].start: span [15, 25) overlaps directives[0] span [10, 20)"),
        ([d(30, 40), d(35, 35, [1])], "directives[1].start: span [35, 35) overlaps directives[0] span [30, 40)"),
        ([d(3, 3, [1]), d(3, 3, [2])], "directives[1].start: insertion at 3 collides with directives[0]"),
        (
            [d(0, 1), d(2, 3, [5, 32000])],
            "directives[1].replacement[1]: token id 32000 is outside the vocabulary (vocab_size 32000)",
        ),
        ([d(2, 3, [5, -4])], "directives[0].replacement[1]: token id -4 is negative"),
        ([Directive(start=2, end=3, replacement=np.array([[1, 2]]))], "directives[0].replacement: must be a 1-D"),
        ([Directive(start=2, end=3, replacement=np.array([1.5]))], "directives[0].replacement: token ids must be"),
        ([Directive(start="2", end=3)], "directives[0].start: must be an integer, got str"),
        ([Directive(start=2, end=True)], "directives[0].end: must be an integer, got bool"),
        ([d(0, 1), Directive(start=2, end=3, mode="erase")], "directives[1].mode: 'erase' is not one of"),
        ([d(0, 1), (2, 3)], "directives[1]: expected a Directive, got tuple"),
    ],
)
def test_invalid_directives_name_index_and_field_and_change_nothing(directives, message):
    s = session(80, 16)
    before = snapshot(s)
    with pytest.raises(InvalidArgument) as exc:
        plan_splice(s, directives, vocab_size=32000)
    assert message in str(exc.value)
    assert snapshot(s) == before


def test_adjacent_spans_and_insert_before_a_replacement_are_accepted():
    s = session(10)
    plan = plan_splice(s, [d(2, 4, [7]), d(4, 6), d(6, 6, [8]), d(6, 8, [9])])
    # An insertion at 6 lands before the replacement of [6, 8).
    assert plan.layout.tokens.tolist() == [1000, 1001, 7, 8, 9, 1008, 1009]


def test_string_mode_and_plain_lists_are_accepted():
    s = session(10)
    plan = plan_splice(s, [Directive(start=1, end=2, replacement=[5, 6], mode="forget")])
    assert plan.edits[0].mode is EditMode.FORGET
    assert plan.edits[0].replacement.dtype == np.uint32


def test_replacement_is_copied():
    s = session(10)
    r = np.array([5, 6], dtype=np.uint32)
    plan = plan_splice(s, [Directive(start=1, end=2, replacement=r)])
    r[0] = 99
    assert plan.layout.tokens.tolist()[1:3] == [5, 6]


def test_max_directives():
    s = session(10)
    with pytest.raises(InvalidArgument, match=r"directives: 3 directives exceed the limit of 2"):
        plan_splice(s, [d(0, 1), d(2, 3), d(4, 5)], max_directives=2)


def test_edits_on_an_empty_session():
    s = session(0)
    with pytest.raises(InvalidArgument, match=r"directives\[0\].end: 1 exceeds the session length 0"):
        plan_splice(s, [d(0, 1)])
    plan = plan_splice(s, [d(0, 0, [4, 5])])
    assert plan.layout.tokens.tolist() == [4, 5]
