"""Session transactions: open / append / close, Splice -> Commit | Abort, limits and expiry.

Lifecycle of one session::

    open --> IDLE(v) --splice(v)--> PENDING(plan p, v) --commit(p)--> IDLE(v+1)
               ^                          |
               +---- abort(p), plan TTL --+
    append (IDLE only) and get keep the version; close or the idle TTL end the session from
    any state (a pending plan is aborted).

Concurrency: every method is synchronous and contains no ``await``; the server calls them
from one asyncio event loop, so each call is atomic with respect to every other. Two clients
racing Splice on one session: the first gets the plan, the second FAILED_PRECONDITION
(pending plan). Not thread-safe: do not call from worker threads.

Tenancy: a session is visible only to the tenant that opened it; another tenant's session
id answers NOT_FOUND with the same message as a missing one, so ids cannot be probed. Ids
are ``uuid4`` hex (unguessable). Time comes from the injected ``clock`` (seconds, monotonic);
nothing runs in the background: ``expire()`` sweeps, and every call also enforces the
deadlines of what it touches.

Held sessions (opened with an identity): the table also keeps a ``HeldKV`` per session, the
canonical-copy reference of every token (``held.py``), permuted on every commit and extended
on every append. The injected ``resolver`` fills references from the stored chunks: when the
session opens, before each commit (so kept tokens keep the copies stored at their original
positions, never the engine's rotated ones), and for unbacked tokens when ``held_span`` is
asked for them. Without a resolver, held sessions simply stay unbacked.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from sidecar.directives.directive import Directive, validate_tokens
from sidecar.directives.held import HeldKV, HeldSpan, Resolver
from sidecar.directives.mirror import SessionInfo, SessionMirror, validate_block_size
from sidecar.directives.op_plan import OpPlan, PlanId, SessionId
from sidecar.directives.planner import DEFAULT_REFRESH_AFTER, plan_splice
from sidecar.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

if TYPE_CHECKING:
    from sidecar.identity import CacheIdentity


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionConfig:
    """Limits and timeouts of the session table (per tenant where it says so)."""

    max_sessions_per_tenant: int = 256
    max_tokens_per_session: int = 262_144
    max_directives: int = 256
    idle_ttl_s: float = 900.0  # a session untouched this long is closed
    plan_ttl_s: float = 30.0  # a pending plan not committed this long is aborted
    refresh_after: int | None = DEFAULT_REFRESH_AFTER
    vocab_size: int | None = None  # token ids must be below it (None: any uint32)

    def __post_init__(self) -> None:
        for name in ("max_sessions_per_tenant", "max_tokens_per_session", "max_directives"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("idle_ttl_s", "plan_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.refresh_after is not None and self.refresh_after < 0:
            raise ValueError(f"refresh_after: must be >= 0 or None, got {self.refresh_after}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size: must be >= 1 or None, got {self.vocab_size}")


@dataclass(frozen=True, slots=True)
class ExpiryReport:
    """What one ``expire`` sweep removed."""

    sessions_closed: tuple[SessionId, ...] = ()
    plans_aborted: tuple[PlanId, ...] = ()


@dataclass(slots=True)
class _Entry:
    mirror: SessionMirror
    last_used: float
    pending: PlanId | None = None
    identity: "CacheIdentity | None" = None  # held sessions only
    held: HeldKV | None = None  # parallel to mirror.layout (held sessions only)


@dataclass(slots=True)
class _Pending:
    plan: OpPlan
    tenant: str
    deadline: float


@dataclass(slots=True)
class SessionTable:
    """All session mirrors of one sidecar, keyed by id. See the module docstring."""

    config: SessionConfig = field(default_factory=SessionConfig)
    clock: Callable[[], float] = time.monotonic
    resolver: Resolver | None = None
    _sessions: dict[SessionId, _Entry] = field(default_factory=dict, init=False)
    _plans: dict[PlanId, _Pending] = field(default_factory=dict, init=False)
    _per_tenant: Counter = field(default_factory=Counter, init=False)

    # ----------------------------------------------------------------------------- sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def sessions_of(self, tenant: str) -> int:
        return self._per_tenant[tenant]

    def open(
        self, tenant: str, tokens: object, *, block_size: int, identity: "CacheIdentity | None" = None
    ) -> SessionInfo:
        """Mirror a new engine session holding ``tokens`` at positions ``0..n-1``.

        With ``identity`` the session is *held*: its tokens' canonical stored copies (chunks
        Stored under ``identity``) are tracked and served by ``held_span``. Raises
        ``InvalidArgument`` (bad tokens or block size), ``ResourceExhausted`` (the tenant's
        session limit, or too many tokens). Nothing is created on error.
        """
        cfg = self.config
        if not isinstance(tenant, str) or not tenant:
            raise InvalidArgument("tenant: must be a non-empty string")
        validate_block_size(block_size)
        if self._per_tenant[tenant] >= cfg.max_sessions_per_tenant:
            self.expire()  # idle sessions past their TTL do not count against the limit
        if self._per_tenant[tenant] >= cfg.max_sessions_per_tenant:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {self._per_tenant[tenant]} open sessions, the limit is "
                f"{cfg.max_sessions_per_tenant}; close sessions or let idle ones expire"
            )
        new = validate_tokens(tokens, "tokens", vocab_size=cfg.vocab_size)
        self._check_length(SessionId("(new)"), len(new), "open")
        sid = SessionId(uuid.uuid4().hex)
        mirror = SessionMirror.open(session_id=sid, tenant=tenant, block_size=block_size, tokens=new)
        entry = _Entry(mirror, self.clock())
        if identity is not None:
            entry.identity = identity
            entry.held = self._resolve(entry, HeldKV.unbacked(len(new)), 0, len(new))
        self._sessions[sid] = entry
        self._per_tenant[tenant] += 1
        return mirror.info()

    def get(self, session_id: SessionId, tenant: str) -> SessionInfo:
        """The session's current state (``NotFound`` if missing, expired or another tenant's)."""
        return self._entry(session_id, tenant).mirror.info()

    def append(self, session_id: SessionId, tenant: str, tokens: object) -> SessionInfo:
        """The engine computed ``tokens`` after the session's end. Refused while a plan is
        pending (``FailedPrecondition``): the plan's layout would no longer match."""
        entry = self._entry(session_id, tenant)
        self._refuse_if_pending(entry, "append")
        mirror = entry.mirror
        new = validate_tokens(tokens, "tokens", vocab_size=self.config.vocab_size)
        self._check_length(session_id, len(mirror) + len(new), "append")
        mirror.append(new)
        if entry.held is not None:
            entry.held = entry.held.extended(len(new))
        return mirror.info()

    def close(self, session_id: SessionId, tenant: str) -> None:
        """Forget the session; a pending plan is aborted. ``NotFound`` if already gone."""
        entry = self._entry(session_id, tenant)
        self._drop(session_id, entry)

    # ----------------------------------------------------------------------------- splice

    def splice(
        self, session_id: SessionId, tenant: str, expected_version: int, directives: Sequence[Directive]
    ) -> OpPlan:
        """Plan ``directives`` against the session at ``expected_version``; the plan is pending
        until ``commit``/``abort`` or until ``plan_ttl_s`` passes.

        Errors (the session is unchanged on every one): ``NotFound``; ``FailedPrecondition``
        for a stale version (names expected and current) or a pending plan;
        ``InvalidArgument`` for bad directives; ``ResourceExhausted`` when the edited session
        would exceed the token limit; ``InvariantViolation`` for a planner bug.
        """
        entry = self._entry(session_id, tenant)
        mirror = entry.mirror
        if isinstance(expected_version, bool) or not isinstance(expected_version, int):
            raise InvalidArgument(f"expected_version: must be an integer, got {type(expected_version).__name__}")
        if expected_version != mirror.version:
            raise FailedPrecondition(
                f"session {session_id}: expected version {expected_version}, current version is "
                f"{mirror.version}; re-read the session and rebuild the directives"
            )
        self._refuse_if_pending(entry, "splice")
        cfg = self.config
        plan = plan_splice(
            mirror,
            directives,
            vocab_size=cfg.vocab_size,
            refresh_after=cfg.refresh_after,
            max_directives=cfg.max_directives,
        )
        self._check_length(session_id, plan.summary.tokens_after, "splice")
        entry.pending = plan.plan_id
        self._plans[plan.plan_id] = _Pending(plan, tenant, self.clock() + cfg.plan_ttl_s)
        return plan

    def pending(self, session_id: SessionId, tenant: str) -> OpPlan | None:
        """The session's pending plan, if any (an expired one is aborted first)."""
        entry = self._entry(session_id, tenant)
        self._refuse_if_pending(entry, None)
        return self._plans[entry.pending].plan if entry.pending else None

    def commit(self, plan_id: PlanId, tenant: str) -> SessionInfo:
        """The engine applied the plan: the session adopts its layout, version + 1.

        Not idempotent: a second commit, or one after abort or expiry, is ``NotFound`` (the
        engine then no longer matches the mirror and must reopen the session).
        """
        pending = self._take_plan(plan_id, tenant)
        entry = self._sessions[pending.plan.session_id]
        held = entry.held
        if held is not None:
            if held.gap(0, len(held)) is not None:
                # Kept tokens must carry the copies stored at their pre-edit positions (never
                # the engine's rotated ones): resolve what is still unbacked against the old
                # layout before the references move.
                held = self._resolve(entry, held, 0, len(held))
            held = held.after(pending.plan)
        entry.mirror.commit(pending.plan)
        entry.held = held
        return entry.mirror.info()

    def abort(self, plan_id: PlanId, tenant: str) -> None:
        """Drop the pending plan; the session stays exactly as it was before Splice."""
        self._take_plan(plan_id, tenant)

    # ----------------------------------------------------------------------------- held

    def held_span(
        self, session_id: SessionId, tenant: str, start: int, end: int | None, *, max_tokens: int | None = None
    ) -> HeldSpan:
        """The canonical copies of positions ``[start, end)`` (``end`` None: the session's
        length) of a held session's committed layout; a pending plan is not applied yet.

        Unbacked positions in the range are resolved first (the engine may have Stored them
        since). Errors (the session is unchanged on every one): ``NotFound``;
        ``FailedPrecondition`` for a session that is not held, or positions still unbacked
        (names the first one and how many: Store them first); ``InvalidArgument`` for a range
        out of bounds or longer than ``max_tokens``. Idempotent.
        """
        entry = self._entry(session_id, tenant)
        self._refuse_if_pending(entry, None)  # expire an overdue plan; a live one is fine
        if entry.held is None:
            raise FailedPrecondition(
                f"session {session_id} is not held by the sidecar: open it with held=true and the identity its "
                "KV is Stored under to fetch its KV"
            )
        n = len(entry.mirror)
        for name, v in (("start", start), ("end", end)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise InvalidArgument(f"{name}: must be an integer, got {type(v).__name__}")
        if end is None:
            end = n
        if start > n:
            raise InvalidArgument(f"start: {start} exceeds the session length {n}")
        if end > n:
            raise InvalidArgument(f"end: {end} exceeds the session length {n}")
        if end < start:
            raise InvalidArgument(f"end: {end} is before start {start}")
        if max_tokens is not None and end - start > max_tokens:
            raise InvalidArgument(
                f"end: the range [{start}, {end}) holds {end - start} tokens, more than {max_tokens} per call; "
                "fetch it in pieces"
            )
        entry.held = held = self._resolve(entry, entry.held, start, end)
        gap = held.gap(start, end)
        if gap is not None:
            first, count = gap
            exact = held.unbacked_exact(start, end)
            hint = (
                f" ({exact} of them were re-prefilled by a forget directive: only a copy computed from the edited "
                "text backs them)" if exact else ""
            )
            raise FailedPrecondition(
                f"session {session_id}: {count} of the {end - start} positions in [{start}, {end}) have no stored "
                f"KV, the first is position {first}; Store the session's tokens with their KV first{hint}"
            )
        mirror = entry.mirror
        return HeldSpan(
            session_id=session_id, tenant=tenant, version=mirror.version, identity=entry.identity, start=start,
            end=end, runs=held.runs(start, end),
        )

    def held(self, session_id: SessionId, tenant: str) -> HeldKV | None:
        """The session's references as they stand (None: not a held session). No resolution."""
        return self._entry(session_id, tenant).held

    # ----------------------------------------------------------------------------- expiry

    def expire(self, now: float | None = None) -> ExpiryReport:
        """Abort plans past their deadline, then close sessions idle for ``idle_ttl_s``."""
        now = self.clock() if now is None else now
        plans = tuple(pid for pid, p in self._plans.items() if p.deadline <= now)
        for pid in plans:
            self._release_plan(pid)
        idle_before = now - self.config.idle_ttl_s
        closed = tuple(sid for sid, e in self._sessions.items() if e.last_used <= idle_before)
        for sid in closed:
            self._drop(sid, self._sessions[sid])
        return ExpiryReport(sessions_closed=closed, plans_aborted=plans)

    # ----------------------------------------------------------------------------- internals

    def _entry(self, session_id: SessionId, tenant: str) -> _Entry:
        now = self.clock()
        entry = self._sessions.get(session_id)
        if entry is not None and entry.last_used <= now - self.config.idle_ttl_s:
            self._drop(session_id, entry)
            entry = None
        if entry is None or entry.mirror.tenant != tenant:
            raise NotFound(f"session {session_id!s} not found (unknown, closed or expired)")
        entry.last_used = now
        return entry

    def _resolve(self, entry: _Entry, held: HeldKV, start: int, end: int) -> HeldKV:
        if self.resolver is None or start >= end:
            return held
        return self.resolver(entry.mirror.tenant, entry.identity, entry.mirror.layout.tokens, held, start, end)

    def _refuse_if_pending(self, entry: _Entry, action: str | None) -> None:
        pid = entry.pending
        if pid is None:
            return
        left = self._plans[pid].deadline - self.clock()
        if left <= 0:
            self._release_plan(pid)
            return
        if action is not None:
            raise FailedPrecondition(
                f"session {entry.mirror.session_id} has a pending plan {pid} (expires in {left:.1f} s); "
                f"commit or abort it before {action}"
            )

    def _take_plan(self, plan_id: PlanId, tenant: str) -> _Pending:
        pending = self._plans.get(plan_id)
        if pending is not None and pending.deadline <= self.clock():
            self._release_plan(plan_id)
            pending = None
        if pending is None or pending.tenant != tenant:
            raise NotFound(
                f"plan {plan_id!s} is not pending: unknown, already committed or aborted, or expired "
                f"(plans expire {self.config.plan_ttl_s:g} s after Splice)"
            )
        self._release_plan(plan_id)
        self._sessions[pending.plan.session_id].last_used = self.clock()
        return pending

    def _release_plan(self, plan_id: PlanId) -> None:
        pending = self._plans.pop(plan_id)
        entry = self._sessions.get(pending.plan.session_id)
        if entry is not None and entry.pending == plan_id:
            entry.pending = None

    def _drop(self, session_id: SessionId, entry: _Entry) -> None:
        if entry.pending is not None:
            self._plans.pop(entry.pending, None)
        del self._sessions[session_id]
        tenant = entry.mirror.tenant
        self._per_tenant[tenant] -= 1
        if not self._per_tenant[tenant]:
            del self._per_tenant[tenant]

    def _check_length(self, session_id: SessionId, n: int, action: str) -> None:
        limit = self.config.max_tokens_per_session
        if n > limit:
            raise ResourceExhausted(
                f"session {session_id}: {action} would hold {n} tokens, the limit is {limit} per session"
            )
