"""Span directives: what a policy asks to change in a session's token sequence.

A directive ``(start, end, replacement, mode)`` replaces tokens ``[start, end)`` of the session's
*current* sequence with ``replacement``; ``start == end`` inserts before ``start``. Several
directives of one turn all address the same pre-turn sequence (not each other's results) and
must not overlap; adjacent spans are fine. Two edits with the same start apply in ``(start,
end)`` order, so an insertion at ``s`` lands before a replacement of ``[s, e)``; two insertions
at the same position are ambiguous and rejected.

``validate_directives`` is the one place a request's directives are checked; it returns
``Edit`` records (normalised, sorted, carrying the request index for messages).
``apply_edits`` is the plain definition of the edited sequence, used by the invariant checker
as the reference the planner's output must match.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from enum import Enum
from typing import Sequence

import numpy as np

from sidecar.errors import InvalidArgument

_EMPTY_TOKENS = np.zeros(0, dtype=np.uint32)
_EMPTY_TOKENS.flags.writeable = False
_UINT32_LIMIT = 1 << 32


class EditMode(str, Enum):
    """What the cache must remember of an edited span (docs/architecture.md, "The edit path")."""

    #: Keep downstream KV (V and latents untouched, rotary keys rotated): positional contract.
    AMORTIZE = "amortize"
    #: Re-prefill everything from the edit on: the removed content leaves the cache.
    FORGET = "forget"


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Directive:
    """Replace tokens ``[start, end)`` of the current sequence with ``replacement``.

    Nothing is checked here: ``plan_splice`` validates a whole request at once so its errors
    can name the directive's index. ``replacement`` is any 1-D sequence of token ids
    (a ``uint32`` array preferred).
    """

    start: int
    end: int
    replacement: np.ndarray | Sequence[int] = field(default_factory=lambda: _EMPTY_TOKENS)
    mode: EditMode = EditMode.AMORTIZE


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Edit:
    """A validated directive. ``index`` is its position in the request (for messages);
    ``replacement`` is a read-only ``uint32`` array."""

    index: int
    start: int
    end: int
    replacement: np.ndarray
    mode: EditMode

    @property
    def delta(self) -> int:
        """Shift this edit applies to every token after it: ``|r| - (end - start)``."""
        return len(self.replacement) - (self.end - self.start)


def _as_int(value: object, where: str) -> int:
    if isinstance(value, bool):
        raise InvalidArgument(f"{where}: must be an integer, got bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(f"{where}: must be an integer, got {type(value).__name__}") from None


def validate_tokens(tokens: object, where: str, *, vocab_size: int | None = None) -> np.ndarray:
    """Token ids as a read-only ``uint32`` array, or ``InvalidArgument`` naming ``where[j]``.

    Accepts any 1-D integer array-like; ids must lie in ``[0, vocab_size)`` (``[0, 2**32)``
    when no vocabulary size is given).
    """
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.uint32 and tokens.ndim == 1:
        arr = tokens
    else:
        arr = np.asarray(tokens)
        if arr.size == 0:
            return _EMPTY_TOKENS
        if arr.ndim != 1:
            raise InvalidArgument(f"{where}: must be a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise InvalidArgument(f"{where}: token ids must be integers, got dtype {arr.dtype}")
        if arr.dtype.kind == "i" and len(arr):
            j = int(np.argmin(arr))
            if arr[j] < 0:
                raise InvalidArgument(f"{where}[{j}]: token id {int(arr[j])} is negative")
    if len(arr) == 0:
        return _EMPTY_TOKENS
    limit = _UINT32_LIMIT if vocab_size is None else vocab_size
    j = int(np.argmax(arr))
    if int(arr[j]) >= limit:
        what = "does not fit uint32" if vocab_size is None else f"is outside the vocabulary (vocab_size {vocab_size})"
        raise InvalidArgument(f"{where}[{j}]: token id {int(arr[j])} {what}")
    out = np.array(arr, dtype=np.uint32)  # a private copy: the caller may mutate its own array
    out.flags.writeable = False
    return out


def validate_directives(
    directives: Sequence[Directive],
    n_tokens: int,
    *,
    vocab_size: int | None = None,
    max_directives: int | None = None,
) -> tuple[Edit, ...]:
    """Check a turn's directives against a sequence of ``n_tokens``; all or nothing.

    Returns the edits sorted by ``(start, end)``. Raises ``InvalidArgument`` whose message
    names the directive index and field (``"directives[2].end: 90 exceeds the session length
    80"``) for: no directives, too many, a non-integer or out-of-range span, an empty edit
    (``start == end`` and no replacement), a bad token id, an unknown mode, overlapping spans.
    Pure: nothing is mutated.
    """
    count = len(directives)
    if count == 0:
        raise InvalidArgument("directives: at least one directive is required")
    if max_directives is not None and count > max_directives:
        raise InvalidArgument(f"directives: {count} directives exceed the limit of {max_directives} per splice")
    edits: list[Edit] = []
    for i, d in enumerate(directives):
        where = f"directives[{i}]"
        if not isinstance(d, Directive):
            raise InvalidArgument(f"{where}: expected a Directive, got {type(d).__name__}")
        start = _as_int(d.start, f"{where}.start")
        end = _as_int(d.end, f"{where}.end")
        if start < 0:
            raise InvalidArgument(f"{where}.start: {start} is negative")
        if end > n_tokens:
            raise InvalidArgument(f"{where}.end: {end} exceeds the session length {n_tokens}")
        if end < start:
            raise InvalidArgument(f"{where}.end: {end} is before start {start}")
        try:
            mode = EditMode(d.mode)
        except ValueError:
            raise InvalidArgument(f"{where}.mode: {d.mode!r} is not one of 'amortize', 'forget'") from None
        replacement = validate_tokens(d.replacement, f"{where}.replacement", vocab_size=vocab_size)
        if start == end and len(replacement) == 0:
            raise InvalidArgument(f"{where}: empty edit (start == end == {start} and no replacement tokens)")
        edits.append(Edit(index=i, start=start, end=end, replacement=replacement, mode=mode))
    edits.sort(key=lambda e: (e.start, e.end))
    for prev, cur in zip(edits, edits[1:]):
        if cur.start < prev.end:
            raise InvalidArgument(
                f"directives[{cur.index}].start: span [{cur.start}, {cur.end}) overlaps "
                f"directives[{prev.index}] span [{prev.start}, {prev.end})"
            )
        if cur.start == cur.end == prev.start == prev.end:
            raise InvalidArgument(
                f"directives[{cur.index}].start: insertion at {cur.start} collides with "
                f"directives[{prev.index}], an insertion at the same position (merge them)"
            )
    return tuple(edits)


def apply_edits(tokens: np.ndarray, edits: Sequence[Edit]) -> np.ndarray:
    """The edited sequence, by definition: the untouched stretches of ``tokens`` with each
    span replaced, in one concatenation (``edits`` sorted by start, non-overlapping).

    Kept apart from the planner's bookkeeping (regions, shifts, forget): the invariant checker
    compares the planner's layout against this.
    """
    pieces: list[np.ndarray] = []
    prev = 0
    for e in edits:
        pieces.append(tokens[prev : e.start])
        pieces.append(e.replacement)
        prev = e.end
    pieces.append(tokens[prev:])
    return np.concatenate(pieces).astype(np.uint32, copy=False)
