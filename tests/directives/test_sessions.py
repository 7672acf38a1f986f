"""SessionTable: tenancy, limits, versions, one pending plan, commit/abort, expiry."""

from __future__ import annotations

import numpy as np
import pytest

from sidecar.directives import SessionConfig, SessionTable
from sidecar.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

from .helpers import d


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def table(clock: Clock, **config) -> SessionTable:
    return SessionTable(config=SessionConfig(**config), clock=clock)


def test_open_get_append_close(clock):
    t = table(clock)
    info = t.open("acme", np.arange(10), block_size=4)
    assert len(info.session_id) == 32 and info.version == 0 and len(info) == 10
    assert info.live_blocks == 3
    assert t.get(info.session_id, "acme").layout.tokens.tolist() == list(range(10))
    info = t.append(info.session_id, "acme", [7, 8])
    assert info.layout.tokens.tolist()[-2:] == [7, 8] and info.version == 0
    t.close(info.session_id, "acme")
    with pytest.raises(NotFound):
        t.get(info.session_id, "acme")
    assert len(t) == 0 and t.sessions_of("acme") == 0


def test_ids_are_unguessable_and_unique(clock):
    t = table(clock)
    ids = {t.open("acme", [1], block_size=1).session_id for _ in range(50)}
    assert len(ids) == 50


def test_another_tenants_session_is_not_found_like_a_missing_one(clock):
    t = table(clock)
    sid = t.open("acme", np.arange(10), block_size=1).session_id
    with pytest.raises(NotFound) as other:
        t.get(sid, "evil")
    with pytest.raises(NotFound) as missing:
        t.get("0" * 32, "evil")
    assert str(other.value).replace(sid, "X") == str(missing.value).replace("0" * 32, "X")
    for call in (
        lambda: t.splice(sid, "evil", 0, [d(0, 1)]),
        lambda: t.append(sid, "evil", [1]),
        lambda: t.close(sid, "evil"),
    ):
        with pytest.raises(NotFound):
            call()
    plan = t.splice(sid, "acme", 0, [d(0, 1)])
    with pytest.raises(NotFound):
        t.commit(plan.plan_id, "evil")
    with pytest.raises(NotFound):
        t.abort(plan.plan_id, "evil")
    assert t.get(sid, "acme").version == 0


def test_splice_commit_bumps_the_version(clock):
    t = table(clock)
    sid = t.open("acme", np.arange(10), block_size=1).session_id
    plan = t.splice(sid, "acme", 0, [d(2, 4, [50])])
    assert (plan.base_version, plan.next_version) == (0, 1)
    assert t.get(sid, "acme").version == 0  # pending: nothing changed yet
    info = t.commit(plan.plan_id, "acme")
    assert info.version == 1 and info.layout.tokens.tolist() == [0, 1, 50, 4, 5, 6, 7, 8, 9]
    with pytest.raises(NotFound, match="is not pending"):
        t.commit(plan.plan_id, "acme")  # not idempotent
    plan2 = t.splice(sid, "acme", 1, [d(0, 1)])
    assert plan2.next_version == 2


def test_stale_version_names_expected_and_current(clock):
    t = table(clock)
    sid = t.open("acme", np.arange(10), block_size=1).session_id
    t.commit(t.splice(sid, "acme", 0, [d(0, 1)]).plan_id, "acme")
    with pytest.raises(FailedPrecondition, match="expected version 0, current version is 1"):
        t.splice(sid, "acme", 0, [d(0, 1)])


def test_one_pending_plan_per_session_the_racer_loses(clock):
    t = table(clock)
    sid = t.open("acme", np.arange(10), block_size=1).session_id
    first = t.splice(sid, "acme", 0, [d(0, 1)])
    with pytest.raises(FailedPrecondition, match=f"pending plan {first.plan_id}"):
        t.splice(sid, "acme", 0, [d(3, 4)])
    with pytest.raises(FailedPrecondition, match="pending plan"):
        t.append(sid, "acme", [1])
    assert t.pending(sid, "acme") is first
    t.commit(first.plan_id, "acme")
    with pytest.raises(FailedPrecondition, match="expected version 0, current version is 1"):
        t.splice(sid, "acme", 0, [d(3, 4)])  # the loser's retry is now stale


def test_abort_leaves_the_session_exactly_as_it_was(clock):
    t = table(clock)
    sid = t.open("acme", np.arange(40), block_size=16).session_id
    before = t.get(sid, "acme")
    plan = t.splice(sid, "acme", 0, [d(3, 9, [1, 2, 3]), d(20, 20, [4])])
    t.abort(plan.plan_id, "acme")
    after = t.get(sid, "acme")
    assert after.layout.same_as(before.layout) and after.version == 0 and after.live_blocks == before.live_blocks
    with pytest.raises(NotFound):
        t.abort(plan.plan_id, "acme")
    again = t.splice(sid, "acme", 0, [d(3, 9, [1, 2, 3]), d(20, 20, [4])])
    assert again.allocated_blocks.tolist() == plan.allocated_blocks.tolist()  # nothing was leaked


def test_invalid_directives_leave_no_pending_plan(clock):
    t = table(clock, vocab_size=100)
    sid = t.open("acme", np.arange(10), block_size=1).session_id
    with pytest.raises(InvalidArgument, match=r"directives\[0\].replacement\[0\]: token id 100"):
        t.splice(sid, "acme", 0, [d(0, 1, [100])])
    assert t.pending(sid, "acme") is None
    with pytest.raises(InvalidArgument, match=r"tokens\[1\]: token id 200"):
        t.append(sid, "acme", [1, 200])
    assert len(t.get(sid, "acme")) == 10


def test_pending_plans_expire_and_abort(clock):
    t = table(clock, plan_ttl_s=5)
    sid = t.open("acme", np.arange(10), block_size=1).session_id
    plan = t.splice(sid, "acme", 0, [d(0, 1)])
    clock.now += 4.9
    assert t.expire().plans_aborted == ()
    clock.now += 0.2
    report = t.expire()
    assert report.plans_aborted == (plan.plan_id,) and report.sessions_closed == ()
    with pytest.raises(NotFound, match="expire 5 s after Splice"):
        t.commit(plan.plan_id, "acme")
    assert t.get(sid, "acme").version == 0


def test_an_expired_plan_is_aborted_on_use_even_without_a_sweep(clock):
    t = table(clock, plan_ttl_s=5)
    sid = t.open("acme", np.arange(10), block_size=1).session_id
    stale = t.splice(sid, "acme", 0, [d(0, 1)])
    clock.now += 6
    fresh = t.splice(sid, "acme", 0, [d(1, 2)])  # the expired plan no longer blocks
    with pytest.raises(NotFound):
        t.commit(stale.plan_id, "acme")
    clock.now += 6
    with pytest.raises(NotFound):
        t.commit(fresh.plan_id, "acme")


def test_idle_sessions_expire(clock):
    t = table(clock, idle_ttl_s=60)
    a = t.open("acme", [1, 2], block_size=1).session_id
    clock.now += 30
    b = t.open("acme", [1, 2], block_size=1).session_id
    clock.now += 31
    report = t.expire()
    assert report.sessions_closed == (a,)
    t.get(b, "acme")  # touching keeps it alive
    clock.now += 59
    assert t.expire().sessions_closed == ()
    clock.now += 2
    with pytest.raises(NotFound):
        t.get(b, "acme")  # idle past the TTL: gone on use, before any sweep
    assert t.sessions_of("acme") == 0


def test_closing_a_session_drops_its_pending_plan(clock):
    t = table(clock)
    sid = t.open("acme", np.arange(10), block_size=1).session_id
    plan = t.splice(sid, "acme", 0, [d(0, 1)])
    t.close(sid, "acme")
    with pytest.raises(NotFound):
        t.commit(plan.plan_id, "acme")


def test_per_tenant_session_limit(clock):
    t = table(clock, max_sessions_per_tenant=2)
    t.open("acme", [1], block_size=1)
    sid = t.open("acme", [1], block_size=1).session_id
    with pytest.raises(ResourceExhausted, match="tenant 'acme' has 2 open sessions, the limit is 2"):
        t.open("acme", [1], block_size=1)
    t.open("other", [1], block_size=1)  # limits are per tenant
    t.close(sid, "acme")
    t.open("acme", [1], block_size=1)
    clock.now += t.config.idle_ttl_s + 1  # idle sessions past their TTL do not count
    t.open("acme", [1], block_size=1)
    assert t.sessions_of("acme") == 1


def test_token_limit_on_open_append_and_splice(clock):
    t = table(clock, max_tokens_per_session=10)
    with pytest.raises(ResourceExhausted, match="would hold 11 tokens, the limit is 10"):
        t.open("acme", np.arange(11), block_size=1)
    assert t.sessions_of("acme") == 0
    sid = t.open("acme", np.arange(8), block_size=1).session_id
    with pytest.raises(ResourceExhausted, match="append would hold 11 tokens"):
        t.append(sid, "acme", [1, 2, 3])
    with pytest.raises(ResourceExhausted, match="splice would hold 12 tokens"):
        t.splice(sid, "acme", 0, [d(0, 0, [1, 2, 3, 4])])
    assert t.pending(sid, "acme") is None and len(t.get(sid, "acme")) == 8


def test_directive_limit_and_bad_arguments(clock):
    t = table(clock, max_directives=2)
    sid = t.open("acme", np.arange(10), block_size=1).session_id
    with pytest.raises(InvalidArgument, match="exceed the limit of 2"):
        t.splice(sid, "acme", 0, [d(0, 1), d(2, 3), d(4, 5)])
    with pytest.raises(InvalidArgument, match="block_size: 24 is not a power of two"):
        t.open("acme", [1], block_size=24)
    with pytest.raises(InvalidArgument, match="expected_version: must be an integer"):
        t.splice(sid, "acme", "0", [d(0, 1)])
    with pytest.raises(ValueError, match="plan_ttl_s"):
        SessionConfig(plan_ttl_s=0)


async def test_two_clients_racing_splice_exactly_one_wins(clock):
    import asyncio

    t = table(clock)
    sid = t.open("acme", np.arange(10), block_size=1).session_id

    async def client(directive):
        await asyncio.sleep(0)
        try:
            return t.splice(sid, "acme", 0, [directive])
        except FailedPrecondition as exc:
            return exc

    results = await asyncio.gather(client(d(0, 1)), client(d(5, 6)))
    winners = [r for r in results if not isinstance(r, Exception)]
    assert len(winners) == 1 and isinstance(results[1], FailedPrecondition)
    assert t.pending(sid, "acme") is winners[0]
