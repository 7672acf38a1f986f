"""Property tests: random sessions, block sizes and directive sets against three references.

* the toy pool (``ToyPool``/``apply_plan``): every slot of the new layout holds the edited
  token, with keys encoding its new position; no free slot is read or written;
* ``_reference_edit``: the edited token list, built with Python list slicing;
* the region structure of the directives: one ROTATE per downstream region, by its
  cumulative shift.
Invalid sets are rejected with the session unchanged.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.directives import Directive, EditMode, OpKind, SessionId, SessionMirror, ToyPool, apply_plan, plan_splice
from sidecar.errors import InvalidArgument

from .helpers import snapshot

BLOCK_SIZES = [1, 2, 4, 16, 32]
VOCAB = 1000
# No example database: the suite must not write into the working tree.
SETTINGS = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def directive_sets(draw, n: int, b: int = 1, max_directives: int = 8) -> list[Directive]:
    """1..8 non-overlapping directives over [0, n), mixed modes, in random order.

    Spans and shifts are often multiples of ``b`` (so whole blocks are kept and boundary
    blocks are contested), otherwise anything.
    """
    k = draw(st.integers(1, max_directives))
    out: list[Directive] = []
    pos, last_insert = 0, -1
    for _ in range(k):
        s = pos + draw(st.integers(0, max(1, n // k)))
        if s > n:
            break
        aligned = b > 1 and draw(st.booleans())
        span = b * draw(st.integers(0, 3)) if aligned else draw(st.integers(0, 12))
        e = min(n, s + span)
        length = max(0, (e - s) + b * draw(st.integers(-2, 2))) if aligned else draw(st.integers(0, 12))
        if s == e:
            if s == last_insert:
                continue  # a second insertion at the same position is ambiguous (rejected)
            length = max(length, 1)
            last_insert = s
        mode = draw(st.sampled_from([EditMode.AMORTIZE] * 4 + [EditMode.FORGET]))
        tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=length, max_size=length))
        out.append(Directive(start=s, end=e, replacement=np.array(tokens, dtype=np.uint32), mode=mode))
        pos = e
    if not out:
        out.append(Directive(start=n, end=n, replacement=np.array([1], dtype=np.uint32)))
    return draw(st.permutations(out))


@st.composite
def scenarios(draw):
    b = draw(st.sampled_from(BLOCK_SIZES))
    n = draw(st.integers(0, 150))
    tokens = np.array(draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)), dtype=np.uint32)
    return b, tokens, draw(directive_sets(n, b))


def _mirror(b: int, tokens: np.ndarray) -> SessionMirror:
    return SessionMirror.open(session_id=SessionId("p"), tenant="t", block_size=b, tokens=tokens)


def _reference_edit(tokens: list[int], directives: list[Directive]) -> list[int]:
    out = list(tokens)
    for dr in sorted(directives, key=lambda x: (x.start, x.end), reverse=True):
        out[dr.start : dr.end] = [int(t) for t in dr.replacement]
    return out


def _downstream_shifts(directives: list[Directive], n: int) -> list[int]:
    """Cumulative shift of each non-empty kept region after an edit, up to the first forget."""
    shifts = []
    ordered = sorted(directives, key=lambda x: (x.start, x.end))
    shift = 0
    for i, dr in enumerate(ordered):
        if dr.mode is EditMode.FORGET:
            break
        shift += len(dr.replacement) - (dr.end - dr.start)
        nxt = ordered[i + 1].start if i + 1 < len(ordered) else n
        if nxt > dr.end and shift != 0:
            shifts.append(shift)
    return shifts


def _check_plan_properties(mirror: SessionMirror, directives: list[Directive], plan, pool: ToyPool) -> None:
    before = mirror.layout
    b = mirror.block_size
    expected = _reference_edit(before.tokens.tolist(), directives)
    lay = plan.layout
    assert lay.tokens.tolist() == expected
    assert lay.positions.tolist() == list(range(len(expected)))
    assert len(set(lay.slots.tolist())) == len(expected)
    apply_plan(pool, plan)
    pool.check(lay)  # tokens, encoded positions, no leaked block
    rotated = [s for op in plan.ops_of(OpKind.ROTATE) for s in op.slots.tolist()]
    assert len(rotated) == len(set(rotated)), "a slot rotated twice in one plan"
    if b == 1:
        assert plan.summary.slots_moved == 0, "a token pool never moves data"


@SETTINGS
@given(scenarios())
def test_plan_applied_to_the_pool_yields_the_edit(case):
    b, tokens, directives = case
    mirror = _mirror(b, tokens)
    pool = ToyPool.from_layout(mirror.layout)
    plan = plan_splice(mirror, directives, vocab_size=VOCAB)
    _check_plan_properties(mirror, directives, plan, pool)
    # One rotation per downstream region, by its cumulative shift (fresh session: no refresh).
    assert [op.delta for op in plan.ops_of(OpKind.ROTATE)] == _downstream_shifts(directives, len(tokens))
    # Block-table rewrites are preferred: a region whose shift is a multiple of B moves at most
    # the tokens of its two boundary blocks.
    if b > 1:
        shifts = [op.delta for op in plan.ops_of(OpKind.ROTATE)]
        rot_sizes = [len(op) for op in plan.ops_of(OpKind.ROTATE)]
        bound = sum(size if sh % b else 2 * b for sh, size in zip(shifts, rot_sizes)) + b  # + prefix edge
        assert plan.summary.slots_moved <= bound
    mirror.commit(plan)
    assert mirror.version == 1
    assert mirror.allocator.live_count == len(mirror.layout.block_table)


@SETTINGS
@given(
    st.sampled_from(BLOCK_SIZES),
    st.integers(0, 60),
    st.sampled_from([None, 0, 1, 2]),
    st.data(),
)
def test_turn_after_turn_on_one_pool(b, n, refresh_after, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    mirror = _mirror(b, rng.integers(0, VOCAB, n).astype(np.uint32))
    pool = ToyPool.from_layout(mirror.layout)
    for turn in range(data.draw(st.integers(1, 5))):
        if data.draw(st.booleans()):
            start = len(mirror)
            mirror.append(rng.integers(0, VOCAB, data.draw(st.integers(1, 20))))
            pool.append(mirror.layout, start)
        directives = data.draw(directive_sets(len(mirror), b, 4))
        plan = plan_splice(mirror, directives, vocab_size=VOCAB, refresh_after=refresh_after)
        _check_plan_properties(mirror, directives, plan, pool)
        if refresh_after is not None:
            assert int(plan.layout.rotations.max(initial=0)) <= max(refresh_after, 1)
            assert len(plan.ops_of(OpKind.ROTATE)) <= len(_downstream_shifts(directives, len(mirror)))
        mirror.commit(plan)
        assert mirror.version == turn + 1
    # Every slot's keys still encode its position: computed_at + summed rotation.
    for q, slot in enumerate(mirror.layout.slots.tolist()):
        st_ = pool.read(slot)
        assert st_.computed_at == q - int(mirror.layout.cum_deltas[q])
        assert st_.rotations == int(mirror.layout.rotations[q])


@st.composite
def invalid_cases(draw):
    b, tokens, directives = draw(scenarios())
    n = len(tokens)
    directives = list(directives)
    i = draw(st.integers(0, len(directives) - 1))
    kind = draw(st.sampled_from(["range", "overlap", "empty", "vocab", "negative"]))
    dr = directives[i]
    if kind == "range":
        bad = Directive(start=dr.start, end=n + draw(st.integers(1, 5)), replacement=dr.replacement, mode=dr.mode)
        field = "end"
    elif kind == "overlap":
        wide = [x for x in directives if x.end > x.start]
        if not wide:
            kind = "empty"
        else:
            w = draw(st.sampled_from(wide))
            mid = draw(st.integers(w.start, w.end - 1))
            end = min(n, mid + draw(st.integers(1, 3)))
            directives.append(Directive(start=mid, end=end, replacement=dr.replacement))
            return b, tokens, draw(st.permutations(directives)), "overlaps"
    if kind == "empty":
        bad = Directive(start=dr.start, end=dr.start)
        field = "empty edit"
    elif kind == "vocab":
        bad = Directive(start=dr.start, end=dr.end, replacement=np.array([1, VOCAB + draw(st.integers(0, 9))]))
        field = "replacement[1]"
    elif kind == "negative":
        bad = Directive(start=-draw(st.integers(1, 5)), end=dr.end, replacement=dr.replacement)
        field = "start"
    directives[i] = bad
    return b, tokens, directives, f"directives[{i}]" + ("" if field == "empty edit" else f".{field}")


@SETTINGS
@given(invalid_cases())
def test_invalid_sets_are_rejected_with_the_session_unchanged(case):
    b, tokens, directives, message = case
    mirror = _mirror(b, tokens)
    before = snapshot(mirror)
    try:
        plan_splice(mirror, directives, vocab_size=VOCAB)
    except InvalidArgument as exc:
        if message == "overlaps":
            assert "overlaps" in str(exc) or "collides" in str(exc), str(exc)
        else:
            assert message in str(exc), (message, str(exc))
    else:
        raise AssertionError("invalid directives were accepted")
    assert snapshot(mirror) == before
