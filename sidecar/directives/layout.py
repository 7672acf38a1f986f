"""A session's cache layout: which slot holds each token, at which position, rotated how often.

Slots are physical KV slots in the engine's pool: ``slot = block_id * B + offset``. A paged
pool stores token ``q`` at offset ``q % B`` of block ``block_table[q // B]``, so a layout keeps
that shape (checked by ``check_plan``)::

    B = 4            q:  0  1  2  3 | 4  5  6  7 | 8  9
    block_table = [7, 2, 5]
    slots            = 28 29 30 31 | 8  9 10 11 |20 21        (block 5's offsets 2, 3 unused)

``B == 1`` is a token-granular pool (SGLang's ``req_to_token``): any slot per token.
``rotations`` counts the delta-rotations a slot's keys went through since they were computed
and ``cum_deltas`` sums them, so ``positions - cum_deltas`` is the position the KV was
computed at (the canonical copy's source position).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def frozen(arr: np.ndarray) -> np.ndarray:
    """Mark ``arr`` read-only (layouts and plans are shared, never mutated) and return it."""
    arr.flags.writeable = False
    return arr


EMPTY_I64 = frozen(np.zeros(0, dtype=np.int64))
_IOTA = [frozen(np.arange(1 << 16, dtype=np.int64))]


def arange(n: int) -> np.ndarray:
    """Read-only int64 ``0..n-1``: a view of one shared buffer (no allocation per call).

    Layout positions are such views; ``check_plan`` recognises them without reading them.
    """
    if n > len(_IOTA[0]):
        _IOTA[0] = frozen(np.arange(max(n, 2 * len(_IOTA[0])), dtype=np.int64))
    return _IOTA[0][:n]
EMPTY_I32 = frozen(np.zeros(0, dtype=np.int32))
EMPTY_U32 = frozen(np.zeros(0, dtype=np.uint32))


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Layout:
    """Parallel read-only arrays, one entry per token of the sequence.

    tokens: uint32 token ids; slots: int64 physical slots; positions: int64 (``0..n-1`` for a
    committed layout); rotations: int32 rotation count; cum_deltas: int64 summed rotation.
    """

    block_size: int
    tokens: np.ndarray = field(default_factory=lambda: EMPTY_U32)
    slots: np.ndarray = field(default_factory=lambda: EMPTY_I64)
    positions: np.ndarray = field(default_factory=lambda: EMPTY_I64)
    rotations: np.ndarray = field(default_factory=lambda: EMPTY_I32)
    cum_deltas: np.ndarray = field(default_factory=lambda: EMPTY_I64)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def block_table(self) -> np.ndarray:
        """int64 block id per ``B`` positions (block ``j`` holds positions ``[jB, jB + B)``)."""
        b = self.block_size
        return self.slots if b == 1 else self.slots[::b] // b

    @property
    def source_positions(self) -> np.ndarray:
        """int64 position each slot's KV was computed at (``positions - cum_deltas``)."""
        return self.positions - self.cum_deltas

    def same_as(self, other: "Layout") -> bool:
        """True when both layouts hold identical arrays (used to prove "session unchanged")."""
        return self.block_size == other.block_size and all(
            np.array_equal(getattr(self, f), getattr(other, f))
            for f in ("tokens", "slots", "positions", "rotations", "cum_deltas")
        )
