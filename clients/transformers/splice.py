"""Apply Splice op plans to the reference engine's cache (docs/architecture.md, "The edit path").

The sidecar mirrors the engine session with block size 1 (the engine is token-granular) and
answers ``Splice`` with an ``OpPlan`` (``sidecar.directives.op_plan``). The engine's
``SequenceCache`` keeps cache index == position, so a plan's slot ids are translated: the
session keeps, per cache index, the mirror slot that token lives in (``SessionMirror.layout
.slots``; ``0..n-1`` for a freshly opened session), and every op is applied by position::

    MOVE      src_slots -> positions   one gather of K/V rows from their old cache indices to
                                       their new ones (all reads before any write)
    ALLOCATE / FREE                    bookkeeping only (the rows are the cache's own)
    ROTATE    positions, delta         the rotary key part only: GQA keys' rotary dims, MLA
                                       ``k_pe``; V and the MLA latent ``c_kv`` are never touched
    PREFILL / REFRESH  positions       forward passes of those tokens at those positions,
                                       in position order, each attending to ``[0, position)``

Compute ops run after every kept token is already moved and rotated into place, so the
positions AFTER a gap are filled while the gap itself is not. The model's attention (both the
engine's attention implementations and transformers' causal mask) assumes the queries are the
LAST entries of the cache, so a pass over a gap ``[a, b)`` runs with the cache truncated to
``a``::

    before:  [ prefix 0..a-1 ][ gap a..b-1 (stale) ][ kept, rotated b..n2-1 ]
    pass:    length := a; forward(tokens[a:b], positions a..b-1) writes rows a..b-1
             (rows >= b stay in the buffers, invisible to the pass)
    after:   length := n2; the pass saw exactly [0, b): causal attention by position

Nothing after ``b`` is copied except the few rows a deterministic engine's padded pass
overwrites (``MIN_ROWS`` dummy rows after ``b``), which are stashed and put back. Capacity
for the whole edited sequence is reserved first, so no pass reallocates (a reallocation would
copy only ``[0, length)``).

Failure model: ``splice_cache`` checks the whole plan against the session (block size, slot
ids, token ids, coverage of every position, op order) before it touches the cache and raises
``PlanNotApplicable``; the caller aborts the plan (``AbortSplice``) and serves the turn as a
normal prompt (Lookup path). An error after mutation started (out of memory) leaves the cache
unusable; ``SpliceSession`` then refuses further use until it is re-opened.

With a sidecar (``SpliceSession(..., sidecar=client)``) the loop is the product's: the session
is opened there (``OpenSession``, block size 1), every append is mirrored (``AppendSession``),
``splice`` asks the sidecar for the plan (``Splice``), applies it and commits it
(``CommitSplice``). A plan the engine cannot apply is aborted (``AbortSplice``) and the turn
falls back to the Lookup path: the edited prompt (the plan's layout) is prefilled through the
engine's reuse policy (own prefix cache, sidecar Lookup / Fetch) and the session is re-opened
on the sidecar (``SpliceResult.fell_back``).

Rotation chains: the engine holds only its working copy, so a slot rotated twice was rotated
twice (``op.delta`` each time; ``op.cum_deltas`` serves holders of a canonical copy). The
planner proposes REFRESH for slots past its rotation limit, which recomputes them instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from clients.transformers.attention import MIN_ROWS
from clients.transformers.cache import SequenceCache
from clients.transformers.engine import Engine, _select
from clients.transformers.options import PrefillResult, ReusePolicy, Sampling, _as_tokens
from sidecar.directives import (
    DEFAULT_REFRESH_AFTER,
    Directive,
    OpKind,
    OpPlan,
    SessionId,
    SessionMirror,
    apply_edits,
    plan_splice,
    validate_directives,
)
from sidecar.rotation import rotate_keys


class PlanNotApplicable(ValueError):
    """The engine cannot apply this plan (raised before the cache is touched): abort the plan
    and serve the turn as a full prompt. The message names the op index and field."""


@dataclass(slots=True)
class SpliceTimings:
    """Seconds spent per phase of one plan (``total_s`` includes the checks)."""

    grow_s: float = 0.0  # growing the cache's capacity for the edited sequence (reallocation)
    move_s: float = 0.0
    rotate_s: float = 0.0
    prefill_s: float = 0.0
    total_s: float = 0.0


@dataclass(slots=True)
class SpliceResult:
    """One applied plan. ``logits``: float32 ``[vocab]`` next-token logits when the plan
    recomputed the last position (else None: ``SpliceSession.next_logits`` recomputes it)."""

    tokens: np.ndarray  # uint32 [n2]: the edited sequence now in the cache
    slots: np.ndarray  # int64 [n2]: the mirror slot of each cache index (plan.layout.slots)
    logits: torch.Tensor | None
    moved: int  # rows copied to another cache index
    rotated: int  # rows whose rotary part was rotated
    prefilled: int  # PREFILL rows computed
    refreshed: int  # REFRESH rows recomputed
    timings: SpliceTimings = field(default_factory=SpliceTimings)
    fell_back: str | None = None  # why the plan was aborted and the turn prefilled (Lookup path)
    plan_id: str = ""


@dataclass(frozen=True, slots=True)
class _Compiled:
    """A checked plan in cache-index terms."""

    n2: int
    move_src: np.ndarray  # int64 old cache indices (only rows whose index changes)
    move_dst: np.ndarray  # int64 new cache indices
    rotations: tuple[tuple[np.ndarray, int], ...]  # (new cache indices, delta) per ROTATE op
    runs: tuple[tuple[int, int], ...]  # contiguous compute ranges [a, b), ascending
    prefilled: int
    refreshed: int


_TOKEN_GRANULAR = "the reference engine is token-granular (open sessions with block_size=1)"
_ORDER = "ALLOCATE, one MOVE, FREE, ROTATE, then PREFILL/REFRESH"
_RANK = {OpKind.ALLOCATE: 0, OpKind.MOVE: 1, OpKind.FREE: 2, OpKind.ROTATE: 3, OpKind.PREFILL: 4, OpKind.REFRESH: 4}


def _compile(plan: OpPlan, tokens: np.ndarray, slots: np.ndarray) -> _Compiled:
    """Check ``plan`` against a cache holding ``tokens`` in mirror ``slots`` (index == position)."""

    def refuse(msg: str) -> PlanNotApplicable:
        return PlanNotApplicable(f"plan {plan.plan_id}: {msg}")

    if plan.block_size != 1:
        raise refuse(f"block size {plan.block_size}: {_TOKEN_GRANULAR}")
    n = len(tokens)
    if len(slots) != n:
        raise refuse(f"session holds {n} tokens but {len(slots)} slots")
    lay = plan.layout
    n2 = len(lay)
    new_tokens, new_slots = lay.tokens, lay.slots
    if not np.array_equal(lay.positions, np.arange(n2)):
        raise refuse("layout.positions: not 0..n-1 after commit")
    top = int(max(slots.max(initial=-1), new_slots.max(initial=-1))) + 1
    index_of = np.full(top, -1, dtype=np.int64)  # mirror slot -> old cache index
    index_of[slots] = np.arange(n)
    state = np.zeros(n2, dtype=np.int8)  # 0 untouched, 1 moved here, 2 computed here
    rotated = np.zeros(n2, dtype=bool)
    move_src = move_dst = np.zeros(0, dtype=np.int64)
    rotations: list[tuple[np.ndarray, int]] = []
    compute: list[np.ndarray] = []
    prefilled = refreshed = 0
    rank = 0
    for i, op in enumerate(plan.ops):
        where = f"ops[{i}] ({op.kind.name})"
        r = _RANK.get(op.kind)
        if r is None:
            raise refuse(f"{where}: unknown op kind")
        if r < rank or (r == rank == 1):
            raise refuse(f"{where}: out of order; the engine applies {_ORDER}")
        rank = r
        if op.kind in (OpKind.ALLOCATE, OpKind.FREE):
            blocks = np.asarray(op.blocks, dtype=np.int64)
            if len(blocks) and (blocks.min() < 0 or blocks.max() >= top):
                raise refuse(f"{where}.blocks: slot id outside the session")
            live = index_of[blocks] >= 0 if len(blocks) else np.zeros(0, dtype=bool)
            if op.kind is OpKind.ALLOCATE and live.any():
                raise refuse(f"{where}.blocks: allocates slot {int(blocks[live][0])}, which the session holds")
            if op.kind is OpKind.FREE and not live.all():
                raise refuse(f"{where}.blocks: frees slot {int(blocks[~live][0])}, which the session does not hold")
            continue
        pos = np.asarray(op.positions, dtype=np.int64)
        if len(pos) != len(op.slots) or (len(pos) and (pos.min() < 0 or pos.max() >= n2)):
            raise refuse(f"{where}.positions: out of range or not parallel to slots")
        if len(np.unique(pos)) != len(pos):
            raise refuse(f"{where}.positions: a position appears twice")
        if not np.array_equal(new_slots[pos], op.slots):
            raise refuse(f"{where}.slots: disagree with layout.slots at their positions")
        if op.kind is OpKind.MOVE:
            src = np.asarray(op.src_slots, dtype=np.int64)
            if len(src) != len(pos):
                raise refuse(f"{where}.src_slots: not parallel to slots")
            old = index_of[src] if len(src) and src.min() >= 0 and src.max() < top else np.full(len(src), -1)
            if (old < 0).any():
                raise refuse(f"{where}.src_slots: slot {int(src[np.argmax(old < 0)])} is not in the session")
            if not np.array_equal(tokens[old], new_tokens[pos]):
                raise refuse(f"{where}: a moved token differs from the layout's token at its new position "
                             "(the plan was built for another token sequence)")
            state[pos] = 1
            change = old != pos
            move_src, move_dst = old[change], pos[change]
        elif op.kind is OpKind.ROTATE:
            if rotated[pos].any():
                raise refuse(f"{where}.positions: position {int(pos[rotated[pos]][0])} rotated twice")
            rotated[pos] = True
            rotations.append((pos, int(op.delta)))
        else:
            if (state[pos] != 0).any():
                raise refuse(f"{where}.positions: position {int(pos[state[pos] != 0][0])} written twice")
            if not np.array_equal(np.asarray(op.tokens, dtype=np.uint32), new_tokens[pos]):
                raise refuse(f"{where}.tokens: disagree with layout.tokens")
            state[pos] = 2
            compute.append(pos)
            if op.kind is OpKind.PREFILL:
                prefilled += len(pos)
            else:
                refreshed += len(pos)
    rest = np.flatnonzero(state == 0)  # kept where they are: must already be there
    if len(rest) and (rest[-1] >= n or not np.array_equal(slots[rest], new_slots[rest])
                      or not np.array_equal(tokens[rest], new_tokens[rest])):
        raise refuse("layout: some positions are neither kept in place, moved nor computed")
    if (rotated & (state == 2)).any():
        raise refuse("a ROTATE covers a position that is recomputed")
    cpos = np.sort(np.concatenate(compute)) if compute else np.zeros(0, dtype=np.int64)
    cuts = np.flatnonzero(np.diff(cpos) != 1) + 1
    runs = tuple((int(r[0]), int(r[-1]) + 1) for r in np.split(cpos, cuts) if len(r))
    return _Compiled(n2, move_src, move_dst, tuple(rotations), runs, prefilled, refreshed)


def _set_length(cache: SequenceCache, n: int) -> None:
    """Every layer's visible length := ``n`` (growing too: the rows are already written)."""
    for layer in cache.layers:
        layer.length = n
        layer._publish()


def _rotary_buffers(engine: Engine, cache: SequenceCache) -> list[torch.Tensor]:
    ad = engine.adapter
    part = next(i for i, p in enumerate(ad.layout.parts) if p.rotary)
    slot = ad.slots[part].slot
    return [layer._kbuf if slot == "keys" else layer._vbuf for layer in cache.layers]


@torch.inference_mode()
def _execute(engine: Engine, cache: SequenceCache, c: _Compiled, new_tokens: np.ndarray, reserve: int):
    """Run a checked plan: MOVE, ROTATE, compute runs (module docstring). Returns (logits, timings)."""
    clock = time.perf_counter
    tm = SpliceTimings()
    pad = MIN_ROWS if engine.deterministic else 0
    need = c.n2 + pad + max(0, reserve)
    t0 = clock()
    for layer in cache.layers:
        layer._reserve(need)  # at the old length: every live row is carried over
    tm.grow_s = clock() - t0
    dev = engine.device

    t0 = clock()
    if len(c.move_dst):
        src = torch.tensor(c.move_src, device=dev)
        dst = torch.tensor(c.move_dst, device=dev)
        for layer in cache.layers:
            for buf in (layer._kbuf, layer._vbuf):
                buf.index_copy_(2, dst, buf.index_select(2, src))  # the gather copies: reads before writes
    _set_length(cache, c.n2)
    engine._sync()
    tm.move_s = clock() - t0

    t0 = clock()
    spec = engine.rope
    rot_bufs = _rotary_buffers(engine, cache)
    for pos, delta in c.rotations:
        if not delta or not len(pos):
            continue
        a, b = int(pos[0]), int(pos[-1]) + 1
        contiguous = b - a == len(pos) and bool(np.all(np.diff(pos) == 1))
        idx = None if contiguous else torch.tensor(pos, device=dev)
        for buf in rot_bufs:
            if contiguous:
                view = buf[:, :, a:b]
                view.copy_(rotate_keys(view, delta, spec))
            else:
                rows = buf.index_select(2, idx)
                buf.index_copy_(2, idx, rotate_keys(rows, delta, spec, out=rows))
    engine._sync()
    tm.rotate_s = clock() - t0

    t0 = clock()
    logits = None
    for a, b in c.runs:
        hi = min(c.n2, b + pad)  # rows a padded pass may overwrite after the run
        stash = [(lay._kbuf[:, :, b:hi].clone(), lay._vbuf[:, :, b:hi].clone()) for lay in cache.layers if hi > b]
        cache.truncate(a)
        step = engine.max_prefill_tokens or (b - a)
        for x in range(a, b, step):
            y = min(b, x + step)
            out = engine._forward(cache, new_tokens[x:y], x, want_logits=y == c.n2)
            if y == c.n2:
                logits = out
        for lay, (k, v) in zip(cache.layers, stash):
            lay._kbuf[:, :, b:hi].copy_(k)
            lay._vbuf[:, :, b:hi].copy_(v)
        _set_length(cache, c.n2)
    engine._sync()
    tm.prefill_s = clock() - t0
    return logits, tm


def splice_cache(
    engine: Engine,
    cache: SequenceCache,
    tokens: np.ndarray,
    slots: np.ndarray,
    plan: OpPlan,
    *,
    reserve: int = 0,
) -> SpliceResult:
    """Apply ``plan`` to ``cache`` in place (module docstring for the op semantics).

    Args:
      engine: the engine whose model filled ``cache``.
      cache: holds ``tokens`` at cache indices ``0..n-1`` (== positions). Mutated; must not be
        shared (e.g. with the engine's own prefix cache).
      tokens: uint32 ``[n]``, the session's token sequence before the plan.
      slots: int64 ``[n]``, the mirror slot of each cache index (the session layout's slots).
      plan: an ``OpPlan`` for block size 1 built against exactly this session.
      reserve: extra positions to preallocate after the edited sequence (decode budget).
    Returns:
      ``SpliceResult``; the cache then holds ``plan.layout.tokens`` at ``0..n2-1``.
    Raises:
      PlanNotApplicable: before any change to the cache.
    """
    clock = time.perf_counter
    t_start = clock()
    tokens = np.asarray(tokens, dtype=np.uint32)
    if cache.length != len(tokens):
        raise PlanNotApplicable(
            f"plan {plan.plan_id}: cache holds {cache.length} positions, session {len(tokens)} tokens"
        )
    try:
        c = _compile(plan, tokens, np.asarray(slots, dtype=np.int64))
    except PlanNotApplicable:
        raise
    except (IndexError, ValueError, TypeError) as e:  # malformed arrays (wrong dtype, shape)
        raise PlanNotApplicable(f"plan {plan.plan_id}: malformed: {e}") from e
    logits, tm = _execute(engine, cache, c, plan.layout.tokens, reserve)
    tm.total_s = clock() - t_start
    return SpliceResult(
        tokens=plan.layout.tokens, slots=plan.layout.slots, logits=logits, moved=len(c.move_dst),
        rotated=sum(len(p) for p, d in c.rotations if d), prefilled=c.prefilled, refreshed=c.refreshed, timings=tm,
    )


def clone_cache(engine: Engine, cache: SequenceCache, *, reserve: int = 0) -> SequenceCache:
    """A private copy of ``cache`` (rows ``0..length-1``) with ``reserve`` spare positions."""
    n = cache.length
    out = engine.adapter.new_cache(n + reserve + MIN_ROWS)
    out.extend(n)
    for dst, src in zip(out.layers, cache.layers):
        dst._kbuf[:, :, :n].copy_(src._kbuf[:, :, :n])
        dst._vbuf[:, :, :n].copy_(src._vbuf[:, :, :n])
    return out


class SpliceSession:
    """One engine session that can be edited in place: its cache, tokens and slot mirror.

    The session keeps a ``SessionMirror`` (block size 1) in step with the sidecar's mirror of
    the same session: same tokens appended in the same order give the same slot ids, and a
    plan is checked against it (session id, version, the slots it allocates) before it is
    applied. Two ways to get plans:

    * ``apply(plan)``: a plan from the sidecar's ``Splice`` RPC for this session (open the
      session there with the same ``session_id`` and tokens, mirror every ``append`` with
      ``AppendSession``, and ``CommitSplice`` after ``apply`` returns; ``AbortSplice`` and a
      full prompt when it raises ``PlanNotApplicable``).
    * ``splice(directives)``: with ``sidecar`` (a ``SyncSidecarClient``), the whole loop over
      gRPC: the session is opened there when this object is created, appends are mirrored,
      and ``splice`` is Splice -> ``apply`` -> CommitSplice, or AbortSplice and a prefill of
      the edited prompt through the engine (Lookup path) when the plan cannot be applied.
      Without one it plans in process with ``sidecar.directives.plan_splice`` (tests,
      single-process use).

    ``tokens`` are always the tokens whose KV is in the cache: after ``generate`` the last
    sampled token is not (pass it first in the next ``append``). Not thread-safe.
    """

    def __init__(
        self,
        engine: Engine,
        tokens: Any,
        cache: SequenceCache,
        *,
        logits: torch.Tensor | None = None,
        session_id: str = "local",
        tenant: str = "",
        sidecar: Any = None,
    ) -> None:
        tokens = _as_tokens(tokens)
        if cache.length != len(tokens):
            raise ValueError(f"cache holds {cache.length} positions but {len(tokens)} tokens were given")
        self.engine = engine
        self.cache = cache
        self.logits = logits
        self.sidecar = sidecar
        if sidecar is not None:
            session_id = sidecar.open_session(tokens, block_size=1).session_id
        self.mirror = SessionMirror.open(session_id=SessionId(session_id), tenant=tenant, block_size=1, tokens=tokens)
        self._broken: str | None = None

    @classmethod
    def from_prefill(
        cls, engine: Engine, res: PrefillResult, *, shared: bool = True, reserve: int = 0, **kwargs: Any
    ) -> "SpliceSession":
        """A session over a prefilled prompt. ``shared``: the cache is also referenced by the
        engine's own prefix cache (a ``prefill`` with ``store`` and ``prefix_cache``), so it is
        copied first (with ``reserve`` spare positions for later growth); pass False to edit
        ``res.cache`` itself."""
        cache = clone_cache(engine, res.cache, reserve=reserve) if shared else res.cache
        return cls(engine, res.tokens, cache, logits=res.logits, **kwargs)

    @classmethod
    def open(
        cls, engine: Engine, tokens: Any, *, reuse: ReusePolicy | None = None, reserve: int = 0, **kwargs: Any
    ) -> "SpliceSession":
        """Prefill ``tokens`` through the engine (own prefix cache / sidecar per ``reuse``)."""
        reuse = reuse or engine.reuse
        res = engine.prefill(tokens, reuse=reuse, reserve=reserve)
        return cls.from_prefill(engine, res, shared=reuse.store and reuse.prefix_cache, **kwargs)

    # ------------------------------------------------------------------ state

    @property
    def tokens(self) -> np.ndarray:
        return self.mirror.layout.tokens

    @property
    def slots(self) -> np.ndarray:
        return self.mirror.layout.slots

    @property
    def version(self) -> int:
        return self.mirror.version

    @property
    def session_id(self) -> str:
        return self.mirror.session_id

    def __len__(self) -> int:
        return len(self.mirror)

    def _usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(
                f"session {self.session_id}: cache unusable after a failed splice ({self._broken}); re-open it"
            )

    # ------------------------------------------------------------------ edits

    def apply(self, plan: OpPlan, *, reserve: int = 0) -> SpliceResult:
        """Apply a plan built against this session's current version, then adopt its layout.

        Raises ``PlanNotApplicable`` (session unchanged) for a plan of another session or
        version, or one ``splice_cache`` refuses."""
        self._usable()
        m = self.mirror
        if plan.block_size != 1:
            raise PlanNotApplicable(f"plan {plan.plan_id}: block size {plan.block_size}: {_TOKEN_GRANULAR}")
        if plan.session_id != m.session_id or plan.base_version != m.version:
            raise PlanNotApplicable(
                f"plan {plan.plan_id} is for session {plan.session_id!r} version {plan.base_version}; "
                f"this is session {m.session_id!r} version {m.version}"
            )
        if not np.array_equal(m.allocator.peek(len(plan.allocated_blocks)), plan.allocated_blocks):
            raise PlanNotApplicable(
                f"plan {plan.plan_id}: allocates slots this session's mirror does not offer (mirrors out of step)"
            )
        try:
            res = splice_cache(self.engine, self.cache, self.tokens, self.slots, plan, reserve=reserve)
        except PlanNotApplicable:
            raise
        except BaseException as e:
            self._broken = f"{type(e).__name__}: {e}"
            raise
        m.commit(plan)
        self.logits = res.logits
        return res

    def splice(
        self,
        directives: Sequence[Directive],
        *,
        refresh_after: int | None = DEFAULT_REFRESH_AFTER,
        reserve: int = 0,
    ) -> SpliceResult:
        """Edit the session: plan ``directives`` (on the sidecar when the session has one, else
        in process with ``plan_splice``; ``refresh_after`` applies to the latter, the sidecar
        uses its own setting) and apply them. Invalid directives raise
        ``sidecar.errors.InvalidArgument`` and change nothing."""
        self._usable()
        if self.sidecar is not None:
            return self._splice_remote(directives, reserve)
        vocab = getattr(self.engine.config, "vocab_size", None)
        plan = plan_splice(self.mirror, directives, vocab_size=vocab, refresh_after=refresh_after)
        return self.apply(plan, reserve=reserve)

    def _splice_remote(self, directives: Sequence[Directive], reserve: int) -> SpliceResult:
        t0 = time.perf_counter()
        plan = self.sidecar.splice(self.session_id, self.version, directives)
        try:
            res = self.apply(plan, reserve=reserve)
        except PlanNotApplicable as e:
            self.sidecar.abort_splice(plan.plan_id)
            edited = apply_edits(self.tokens, validate_directives(directives, len(self)))
            return self._fall_back(edited, plan.plan_id, str(e), reserve, t0)
        self.sidecar.commit_splice(plan.plan_id)
        res.plan_id = plan.plan_id
        res.timings.total_s = time.perf_counter() - t0
        return res

    def _fall_back(self, tokens: np.ndarray, plan_id: str, why: str, reserve: int, t0: float) -> SpliceResult:
        """The plan was aborted: prefill the edited prompt through the engine's reuse policy
        (own prefix cache, sidecar Lookup) and re-open the session on the sidecar."""
        res = self.engine.prefill(tokens, reserve=reserve)
        reuse = self.engine.reuse
        cache = clone_cache(self.engine, res.cache) if reuse.store and reuse.prefix_cache else res.cache
        self.sidecar.close_session(self.session_id)
        state = self.sidecar.open_session(tokens, block_size=1)
        self.cache, self.logits = cache, res.logits
        self.mirror = SessionMirror.open(session_id=state.session_id, tenant=self.mirror.tenant, block_size=1,
                                         tokens=tokens)
        timings = SpliceTimings(prefill_s=res.timings.prefill_s, total_s=time.perf_counter() - t0)
        return SpliceResult(tokens=self.tokens, slots=self.slots, logits=res.logits, moved=0, rotated=0,
                            prefilled=res.prefill_tokens, refreshed=0, timings=timings, fell_back=why,
                            plan_id=plan_id)

    def close(self) -> None:
        """End the session on the sidecar (if it has one); the cache is the caller's to drop."""
        if self.sidecar is not None:
            self.sidecar.close_session(self.session_id)
            self.sidecar = None

    # ------------------------------------------------------------------ growing

    def append(self, tokens: Any) -> torch.Tensor:
        """Prefill ``tokens`` after the current end (the new turn); returns the next-token
        logits (float32 ``[vocab]``)."""
        self._usable()
        ids = _as_tokens(tokens)
        n = len(self)
        step = self.engine.max_prefill_tokens or len(ids)
        for a in range(0, len(ids), step):
            b = min(len(ids), a + step)
            out = self.engine._forward(self.cache, ids[a:b], n + a, want_logits=b == len(ids))
        self._append_mirrors(ids)
        self.logits = out
        return out

    def _append_mirrors(self, ids: np.ndarray) -> None:
        self.mirror.append(ids)
        if self.sidecar is not None:
            self.sidecar.append_session(self.session_id, ids)

    def next_logits(self) -> torch.Tensor:
        """Next-token logits after the last token; recomputes the last token when the last
        splice kept it (its KV is then computed against the edited context)."""
        self._usable()
        if self.logits is None:
            n = len(self)
            if n == 0:
                raise ValueError("the session is empty: append tokens first")
            self.cache.truncate(n - 1)
            self.logits = self.engine._forward(self.cache, self.tokens[n - 1 :], n - 1, want_logits=True)
        return self.logits

    def generate(
        self, max_new_tokens: int, *, sampling: Sampling = Sampling(), stop_tokens: Sequence[int] = ()
    ) -> list[int]:
        """Decode from the current end (as ``Engine.generate`` does after its prefill); the
        decoded tokens but the last are appended to the session."""
        if max_new_tokens <= 0:
            raise ValueError("max_new_tokens must be positive")
        logits = self.next_logits()
        gen = torch.Generator(device="cpu").manual_seed(sampling.seed)
        stop = set(int(t) for t in stop_tokens)
        out: list[int] = []
        pos = len(self)
        while True:
            tok = _select(logits, sampling, gen)
            out.append(tok)
            if len(out) >= max_new_tokens or tok in stop:
                break
            logits = self.engine._decode(self.cache, tok, pos)
            pos += 1
        if len(out) > 1:
            self._append_mirrors(np.asarray(out[:-1], dtype=np.uint32))
        self.logits = None
        return out


__all__ = ["PlanNotApplicable", "SpliceResult", "SpliceSession", "SpliceTimings", "clone_cache", "splice_cache"]
