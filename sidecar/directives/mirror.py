"""The sidecar's mirror of one engine session: its layout, its block ids, its version.

A mirror changes in exactly two ways: ``append`` (the engine prefilled or decoded more tokens
at the end) and ``commit`` (a Splice plan the engine applied). Planning never mutates it
(``plan_splice`` is pure), so an aborted or rejected plan leaves nothing to undo.
``version`` counts committed plans; appends do not bump it because they never move an
existing token, so directives built against a version stay valid across appends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sidecar.directives.allocator import BlockAllocator
from sidecar.directives.directive import validate_tokens
from sidecar.directives.layout import Layout, arange, frozen
from sidecar.directives.op_plan import OpPlan, SessionId
from sidecar.errors import InvalidArgument, InvariantViolation

#: Largest block size accepted (vLLM uses 16 on GPU and 32 on CPU; 1 is token-granular).
MAX_BLOCK_SIZE = 1024


def validate_block_size(block_size: object) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise InvalidArgument(f"block_size: must be an integer, got {type(block_size).__name__}")
    b = int(block_size)
    if b < 1 or b > MAX_BLOCK_SIZE or b & (b - 1):
        raise InvalidArgument(f"block_size: {b} is not a power of two in [1, {MAX_BLOCK_SIZE}]")
    return b


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class SessionInfo:
    """A snapshot of a session (the layout is immutable, so this is cheap and safe to share)."""

    session_id: SessionId
    tenant: str
    block_size: int
    version: int
    layout: Layout
    live_blocks: int

    def __len__(self) -> int:
        return len(self.layout)


class SessionMirror:
    """One engine session's layout (see ``layout.py``) plus the block ids it owns.

    Invariant between calls: ``layout.positions == arange(n)``, slots follow the paged shape
    for ``block_size``, and the allocator's live blocks are exactly the layout's block table.
    Not thread-safe; the session table serialises access.
    """

    __slots__ = ("session_id", "tenant", "block_size", "layout", "version", "allocator")

    def __init__(self, *, session_id: SessionId, tenant: str, block_size: int) -> None:
        self.session_id = session_id
        self.tenant = tenant
        self.block_size = validate_block_size(block_size)
        self.layout = Layout(block_size=self.block_size)
        self.version = 0
        self.allocator = BlockAllocator()

    @classmethod
    def open(
        cls,
        *,
        session_id: SessionId,
        tenant: str,
        block_size: int,
        tokens: object = (),
        vocab_size: int | None = None,
    ) -> "SessionMirror":
        """A mirror holding ``tokens`` freshly prefilled at positions ``0..n-1``."""
        mirror = cls(session_id=session_id, tenant=tenant, block_size=block_size)
        mirror.append(tokens, vocab_size=vocab_size)
        return mirror

    def __len__(self) -> int:
        return len(self.layout)

    def info(self) -> SessionInfo:
        return SessionInfo(
            session_id=self.session_id,
            tenant=self.tenant,
            block_size=self.block_size,
            version=self.version,
            layout=self.layout,
            live_blocks=self.allocator.live_count,
        )

    def append(self, tokens: object, *, vocab_size: int | None = None) -> int:
        """The engine computed ``tokens`` after the current end; returns how many were added.

        The last partial block is filled first, then fresh blocks are taken. New slots are
        unrotated (count 0, delta 0). Raises ``InvalidArgument`` for bad token ids (nothing
        changes).
        """
        new = validate_tokens(tokens, "tokens", vocab_size=vocab_size)
        k = len(new)
        if k == 0:
            return 0
        old = self.layout
        b = self.block_size
        n = len(old)
        table = old.block_table
        n_blocks = -(-(n + k) // b)
        fresh = self.allocator.take(n_blocks - len(table))
        table = np.concatenate((table, fresh))
        q = np.arange(n, n + k, dtype=np.int64)
        slots = table[q] if b == 1 else table[q // b] * b + q % b
        self.layout = Layout(
            block_size=b,
            tokens=frozen(np.concatenate((old.tokens, new))),
            slots=frozen(np.concatenate((old.slots, slots))),
            positions=arange(n + k),
            rotations=frozen(np.concatenate((old.rotations, np.zeros(k, dtype=np.int32)))),
            cum_deltas=frozen(np.concatenate((old.cum_deltas, np.zeros(k, dtype=np.int64)))),
        )
        return k

    def commit(self, plan: OpPlan) -> None:
        """Adopt ``plan.layout``: claim its allocated blocks, release its freed ones, version+1.

        The plan must have been built against this mirror at its current version (the session
        table guarantees it); anything else is an invariant violation, and the mirror is left
        unchanged when one is raised.
        """
        if plan.session_id != self.session_id or plan.base_version != self.version:
            raise InvariantViolation(
                f"commit of plan {plan.plan_id} (session {plan.session_id}, version {plan.base_version}) "
                f"onto session {self.session_id} at version {self.version}; this indicates a bug in the "
                "session table (sidecar/directives/sessions.py)"
            )
        want = plan.allocated_blocks
        if not np.array_equal(self.allocator.peek(len(want)), want):
            raise InvariantViolation(
                f"plan {plan.plan_id} allocates blocks the session allocator no longer offers; something "
                "allocated between Splice and Commit (bug in sidecar/directives/sessions.py)"
            )
        self.allocator.take(len(want))
        self.allocator.release(plan.freed_blocks)
        self.layout = plan.layout
        self.version = plan.next_version
