"""Sessions and Splice over real gRPC on loopback: plans equal the in-process planner's,
transactions, bad input, tenancy, limits, expiry, races, forget tenants, invariant violations,
metrics. Real servers on port 0, real clients, no mocks."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

from sidecar.api.status import status_for
from sidecar.app import ServerThread, SidecarServer, create_server
from sidecar.client import SidecarClient, SyncSidecarClient
from sidecar.config import DirectivesConfig, load_config
from sidecar.directives import (
    Directive,
    EditMode,
    OpKind,
    OpPlan,
    SessionConfig,
    SessionId,
    SessionMirror,
    SessionTable,
    check_plan,
    plan_splice,
)
from sidecar.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    InvariantViolation,
    NotFound,
    ResourceExhausted,
)
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc
from tests.conftest import make_config

TENANT = "tenant-a"
MD = (("x-tenant-id", TENANT),)
#: Upper bound for anything that waits on expiry (plan TTL 1 s: long enough for the "still pending"
#: checks on a loaded machine; sweep every 0.05 s).
DEADLINE_S = 10.0


def config(**directives):
    return make_config(directives=DirectivesConfig(**directives))


async def start(cfg=None, **kw):
    server = SidecarServer(cfg or config(), **kw)
    port = await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def serve():
    """``await serve(**directives_settings) -> (server, target)``; servers stop at teardown."""
    servers = []

    async def make(**directives):
        server, target = await start(config(**directives))
        servers.append(server)
        return server, target

    yield make
    for server in servers:
        await server.stop(0.1)


def toks(n: int, base: int = 1000) -> np.ndarray:
    return np.arange(base, base + n, dtype=np.uint32)


def sample(server: SidecarServer, name: str, **labels) -> float:
    return server.metrics.registry.get_sample_value(name, labels) or 0.0


def assert_same_plan(got: OpPlan, want: OpPlan) -> None:
    """Field by field, arrays with their dtypes."""
    head = ("plan_id", "session_id", "base_version", "next_version", "block_size", "summary")
    assert [getattr(got, f) for f in head] == [getattr(want, f) for f in head]
    assert got.kinds == want.kinds
    for a, b in zip(got.ops, want.ops):
        assert a.delta == b.delta, a.kind
        for f in ("slots", "positions", "src_slots", "tokens", "blocks", "cum_deltas"):
            x, y = getattr(a, f), getattr(b, f)
            assert x.dtype == y.dtype and np.array_equal(x, y), (a.kind, f)
    for f in ("tokens", "slots", "positions", "rotations", "cum_deltas"):
        x, y = getattr(got.layout, f), getattr(want.layout, f)
        assert x.dtype == y.dtype and np.array_equal(x, y), f
    assert len(got.edits) == len(want.edits)
    for a, b in zip(got.edits, want.edits):
        assert (a.index, a.start, a.end, a.mode) == (b.index, b.start, b.end, b.mode)
        assert np.array_equal(a.replacement, b.replacement)


async def poll(cond, what: str):
    """Await ``cond()`` (a coroutine function) until it is truthy, at most DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        value = await cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------------------ round trip


@pytest.mark.parametrize("block_size", [1, 16])
async def test_plans_equal_the_in_process_planner(serve, block_size):
    """open + append + three turns of splices (amortize, forget, REFRESH after one rotation):
    every decoded plan equals ``plan_splice`` on a local mirror fed the same calls."""
    server, target = await serve(refresh_after=1)
    first, more = toks(150), toks(70, base=5000)
    async with SidecarClient(target, tenant=TENANT) as c:
        s = await c.open_session(first, block_size=block_size)
        assert (s.version, s.length, s.block_size) == (0, 150, block_size)
        s = await c.append_session(s.session_id, more)
        assert (s.version, s.length) == (0, 220)
        local = SessionMirror.open(session_id=SessionId(s.session_id), tenant=TENANT, block_size=block_size,
                                   tokens=first)
        local.append(more)
        assert np.array_equal(s.block_table, local.layout.block_table) and np.array_equal(s.slots, local.layout.slots)

        turns = [
            [(3, 9, [7, 8]), Directive(start=40, end=40, replacement=np.array([1, 2, 3], np.uint32)), (100, 131, [])],
            [(10, 12, [9] * 5, "amortize"), (150, 151, [4], EditMode.FORGET)],
            [(0, 1, [])],  # everything downstream was rotated once: REFRESH (refresh_after=1)
        ]
        for version, directives in enumerate(turns):
            plan = await c.splice(s.session_id, version, directives)
            want = plan_splice(
                local,
                [d if isinstance(d, Directive) else Directive(start=d[0], end=d[1], replacement=d[2],
                                                              mode=EditMode(d[3]) if len(d) > 3 else EditMode.AMORTIZE)
                 for d in directives],
                refresh_after=1,
                plan_id=plan.plan_id,
            )
            assert_same_plan(plan, want)
            check_plan(local, plan)  # the decoded plan passes the invariants as it is
            s = await c.commit_splice(plan.plan_id)
            local.commit(want)
            assert (s.version, s.length) == (version + 1, len(want.layout))
            assert np.array_equal(s.block_table, local.layout.block_table)
        assert OpKind.REFRESH in plan.kinds
        assert sample(server, "kv_sidecar_splices_total", mode="amortize", outcome="committed") == 2
        assert sample(server, "kv_sidecar_splices_total", mode="forget", outcome="committed") == 1
        await c.close_session(s.session_id)
        with pytest.raises(NotFound):
            await c.get_session(s.session_id)


async def test_abort_leaves_the_session_unchanged(serve):
    server, target = await serve()
    async with SidecarClient(target, tenant=TENANT) as c:
        s = await c.open_session(toks(64), block_size=4)
        before = server.sessions.table.get(s.session_id, TENANT)
        plan = await c.splice(s.session_id, 0, [(5, 7, [1, 2, 3])])
        assert (await c.get_session(s.session_id)).pending_plan_id == plan.plan_id
        after = await c.abort_splice(plan.plan_id)
        assert (after.version, after.length, after.pending_plan_id) == (0, 64, None)
        assert np.array_equal(after.block_table, s.block_table)
        assert server.sessions.table.get(s.session_id, TENANT).layout.same_as(before.layout)
        with pytest.raises(NotFound, match="not pending"):
            await c.commit_splice(plan.plan_id)
        with pytest.raises(NotFound):
            await c.abort_splice(plan.plan_id)
        again = await c.splice(s.session_id, 0, [(5, 7, [1, 2, 3])])  # the same plan, a new id
        assert again.plan_id != plan.plan_id and again.kinds == plan.kinds and again.summary == plan.summary
        await c.close_session(s.session_id)  # closing aborts the pending plan
    assert sample(server, "kv_sidecar_splices_total", mode="amortize", outcome="aborted") == 2
    assert sample(server, "kv_sidecar_splices_total", mode="amortize", outcome="planned") == 2


def test_sync_client():
    with ServerThread(config()) as st, SyncSidecarClient(st.target, tenant=TENANT) as c:
        s = c.open_session(toks(40).tolist(), block_size=1)
        plan = c.splice(s.session_id, s.version, [Directive(start=0, end=2), (10, 10, np.array([5, 6]), "forget")])
        assert plan.summary.tokens_after == 40 and plan.kinds[-1] is OpKind.PREFILL
        assert c.abort_splice(plan.plan_id).version == 0
        plan = c.splice(s.session_id, 0, [(0, 2, [])])
        s = c.commit_splice(plan.plan_id)
        assert (s.version, s.length) == (1, 38)
        assert c.append_session(s.session_id, [1, 2]).length == 40
        assert c.get_session(s.session_id).pending_plan_id is None
        c.close_session(s.session_id)
        with pytest.raises(NotFound):
            c.close_session(s.session_id)


def test_client_side_directive_checks():
    from sidecar.api.splice import directives_to_wire

    cases = [
        ([(-1, 2, [])], "directives[0].start"),
        ([(0, 2, [], "sometimes")], "directives[0].mode"),
        ([(0, 1, [1]), (0, 2.5, [])], "directives[1].end"),
        ([(0, 1, [-3])], "directives[0].replacement"),
        ([(0, 1)], "directives[0]: expected"),
    ]
    for directives, field in cases:
        with pytest.raises(InvalidArgument) as ei:
            directives_to_wire(directives)
        assert str(ei.value).startswith(field), (field, str(ei.value))
    (msg,) = directives_to_wire([(1, 4, np.array([7, 8], np.int64), "forget")])
    assert (msg.start, msg.end, msg.mode) == (1, 4, pb.SPLICE_MODE_FORGET)
    assert np.frombuffer(msg.replacement, "<u4").tolist() == [7, 8]


# ------------------------------------------------------------------------------ bad input


def splice_cases(sid: str):
    D = pb.Directive
    r = lambda *t: np.asarray(t, "<u4").tobytes()  # noqa: E731
    req = lambda *ds, v=0, s=sid: pb.SpliceRequest(session_id=s, expected_version=v, directives=list(ds))  # noqa: E731
    bad = grpc.StatusCode.INVALID_ARGUMENT
    return [
        (bad, "directives: at least one", req()),
        (bad, "directives: 5 directives exceed the limit of 4", req(*[D(start=i, end=i + 1) for i in range(5)])),
        (bad, "directives[1].replacement: length 3 bytes is not a multiple of 4",
         req(D(start=0, end=1), D(start=4, end=5, replacement=b"abc"))),
        (bad, "directives[0].mode: unknown SpliceMode value 7", req(D(start=0, end=1, mode=7))),
        (bad, "directives[0].end: 65 exceeds the session length 64", req(D(start=3, end=65))),
        (bad, "directives[1].end: 2 is before start 9", req(D(start=0, end=1), D(start=9, end=2))),
        (bad, "directives[0]: empty edit", req(D(start=5, end=5))),
        (bad, "directives[1].start: span [8, 12) overlaps directives[0]", req(D(start=5, end=10), D(start=8, end=12))),
        (bad, "directives[1].start: insertion at 4 collides with directives[0]",
         req(D(start=4, end=4, replacement=r(1)), D(start=4, end=4, replacement=r(2)))),
        (bad, "directives[0].replacement[1]: token id 50000 is outside the vocabulary",
         req(D(start=1, end=2, replacement=r(5, 50_000)))),
        (bad, "session_id: required", req(D(start=0, end=1), s="")),
        (grpc.StatusCode.FAILED_PRECONDITION, f"session {sid}: expected version 3, current version is 0",
         req(D(start=0, end=1), v=3)),
        (grpc.StatusCode.NOT_FOUND, "session " + "0" * 32 + " not found", req(D(start=0, end=1), s="0" * 32)),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, f"session {sid}: splice would hold 101 tokens, the limit is 100",
         req(D(start=64, end=64, replacement=r(*range(37))))),
    ]


async def test_bad_splices_change_nothing(serve):
    server, target = await serve(vocab_size=50_000, max_directives=4, max_tokens_per_session=100)
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.KVSidecarStub(ch)
        s = await stub.OpenSession(pb.OpenSessionRequest(tokens=toks(64).astype("<u4").tobytes(), block_size=4),
                                   metadata=MD)
        before = server.sessions.table.get(s.session_id, TENANT)
        for code, words, req in splice_cases(s.session_id):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.Splice(req, metadata=MD)
            assert ei.value.code() is code, (words, ei.value.details())
            assert ei.value.details().startswith(words), (words, ei.value.details())
            now = server.sessions.table.get(s.session_id, TENANT)
            assert now.version == 0 and now.layout.same_as(before.layout), words
            assert server.sessions.table.pending(s.session_id, TENANT) is None, words
        refused = sample(server, "kv_sidecar_splices_total", mode="amortize", outcome="refused")
        assert refused == len(splice_cases(s.session_id))
        assert sample(server, "kv_sidecar_requests_total", method="Splice", code="INVALID_ARGUMENT") == 11
        # A pending plan refuses the next Splice and appends; the session is still untouched.
        ok = pb.SpliceRequest(session_id=s.session_id, directives=[pb.Directive(start=0, end=1)])
        plan = await stub.Splice(ok, metadata=MD)
        for call, req in ((stub.Splice, ok), (stub.AppendSession, pb.AppendSessionRequest(session_id=s.session_id,
                                                                                          tokens=b"\1\0\0\0"))):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await call(req, metadata=MD)
            assert ei.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert f"has a pending plan {plan.plan_id}" in ei.value.details()
        assert server.sessions.table.get(s.session_id, TENANT).layout.same_as(before.layout)


async def test_bad_session_calls(serve):
    _, target = await serve(vocab_size=50_000)
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.KVSidecarStub(ch)
        t = toks(8).astype("<u4").tobytes()
        cases = [
            (stub.OpenSession, pb.OpenSessionRequest(tokens=t), "block_size: 0 is not a power of two"),
            (stub.OpenSession, pb.OpenSessionRequest(tokens=t, block_size=12), "block_size: 12 is not a power of two"),
            (stub.OpenSession, pb.OpenSessionRequest(tokens=t[:-1], block_size=1), "tokens: length 31 bytes"),
            (stub.OpenSession, pb.OpenSessionRequest(tokens=t + np.uint32(60_000).tobytes(), block_size=1),
             "tokens[8]: token id 60000 is outside the vocabulary"),
            (stub.OpenSession, pb.OpenSessionRequest(tokens=t, block_size=1, identity=pb.CacheIdentity(namespace="x")),
             "identity.model_id is required"),
            (stub.AppendSession, pb.AppendSessionRequest(tokens=t), "session_id: required"),
            (stub.CommitSplice, pb.CommitSpliceRequest(), "plan_id: required"),
            (stub.AbortSplice, pb.AbortSpliceRequest(), "plan_id: required"),
        ]
        for call, req, words in cases:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await call(req, metadata=MD)
            assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT, words
            assert ei.value.details().startswith(words), (words, ei.value.details())
        for call, req in ((stub.AppendSession, pb.AppendSessionRequest(session_id="nope", tokens=t)),
                          (stub.GetSession, pb.GetSessionRequest(session_id="nope")),
                          (stub.CloseSession, pb.CloseSessionRequest(session_id="nope")),
                          (stub.CommitSplice, pb.CommitSpliceRequest(plan_id="nope")),
                          (stub.AbortSplice, pb.AbortSpliceRequest(plan_id="nope"))):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await call(req, metadata=MD)
            assert ei.value.code() is grpc.StatusCode.NOT_FOUND
        # An empty session is fine; with a valid identity too.
        s = await stub.OpenSession(pb.OpenSessionRequest(block_size=1, identity=pb.CacheIdentity(model_id="m")),
                                   metadata=MD)
        assert (s.length, s.block_table) == (0, b"")


# --------------------------------------------------------------------------- tenancy, limits


async def test_another_tenants_session_and_plan_are_not_found(serve):
    _, target = await serve()
    async with SidecarClient(target, tenant="team-a") as a, SidecarClient(target, tenant="team-b") as b:
        s = await a.open_session(toks(32), block_size=1)
        plan = await a.splice(s.session_id, 0, [(0, 1, [])])
        calls = [
            b.get_session(s.session_id), b.append_session(s.session_id, [1]), b.close_session(s.session_id),
            b.splice(s.session_id, 0, [(2, 3, [])]), b.commit_splice(plan.plan_id), b.abort_splice(plan.plan_id),
        ]
        for call in calls:
            with pytest.raises(NotFound) as ei:
                await call
            assert "team-a" not in str(ei.value)
        assert (await a.commit_splice(plan.plan_id)).version == 1  # untouched by team-b's attempts


async def test_limits_are_resource_exhausted(serve):
    _, target = await serve(max_sessions_per_tenant=2, max_tokens_per_session=50)
    async with SidecarClient(target, tenant="team-a") as a, SidecarClient(target, tenant="team-b") as b:
        s1 = await a.open_session(toks(10), block_size=1)
        await a.open_session(toks(10), block_size=1)
        with pytest.raises(ResourceExhausted, match="2 open sessions, the limit is 2"):
            await a.open_session(toks(10), block_size=1)
        await b.open_session(toks(10), block_size=1)  # per tenant
        await a.close_session(s1.session_id)
        s3 = await a.open_session(toks(10), block_size=1)
        with pytest.raises(ResourceExhausted, match="the limit is 50 per session"):
            await b.open_session(toks(51), block_size=1)
        with pytest.raises(ResourceExhausted, match="append would hold 51 tokens"):
            await a.append_session(s3.session_id, toks(41))
        assert (await a.get_session(s3.session_id)).length == 10


# ------------------------------------------------------------------------- expiry, races


async def test_pending_plan_expires(serve):
    server, target = await serve(plan_ttl_s=1.0, sweep_interval_s=0.05)
    async with SidecarClient(target, tenant=TENANT) as c:
        s = await c.open_session(toks(32), block_size=1)
        plan = await c.splice(s.session_id, 0, [(0, 1, [])])
        with pytest.raises(FailedPrecondition, match="pending plan"):
            await c.splice(s.session_id, 0, [(0, 1, [])])

        async def expired():
            return (await c.get_session(s.session_id)).pending_plan_id is None

        await poll(expired, "the pending plan to expire")
        with pytest.raises(NotFound, match="expired"):
            await c.commit_splice(plan.plan_id)
        assert (await c.get_session(s.session_id)).version == 0
        await c.splice(s.session_id, 0, [(0, 1, [])])
    assert sample(server, "kv_sidecar_splices_total", mode="amortize", outcome="expired") == 1


async def test_a_disconnected_clients_plan_expires(serve):
    server, target = await serve(plan_ttl_s=1.0, sweep_interval_s=0.05)
    a = SidecarClient(target, tenant=TENANT)
    s = await a.open_session(toks(64), block_size=4)
    await a.splice(s.session_id, 0, [(8, 8, [1, 2, 3, 4])])
    await a.close()  # the engine goes away without Commit or Abort

    def expired_count():
        return sample(server, "kv_sidecar_splices_total", mode="amortize", outcome="expired")

    async with SidecarClient(target, tenant=TENANT) as b:
        with pytest.raises(FailedPrecondition, match="pending plan"):
            await b.splice(s.session_id, 0, [(0, 4, [])])

        async def swept():  # the background sweep counts it, with no call touching the session
            return expired_count() == 1

        await poll(swept, "the sweep to expire the plan")
        plan = await b.splice(s.session_id, 0, [(0, 4, [])])
        assert (await b.commit_splice(plan.plan_id)).version == 1


async def test_racing_splices_exactly_one_wins(serve):
    _, target = await serve()
    async with SidecarClient(target, tenant=TENANT) as a, SidecarClient(target, tenant=TENANT) as b:
        s = await a.open_session(toks(256), block_size=16)
        for version in range(3):
            results = await asyncio.gather(
                a.splice(s.session_id, version, [(1, 2, [7])]),
                b.splice(s.session_id, version, [(3, 9, [])]),
                return_exceptions=True,
            )
            plans = [r for r in results if isinstance(r, OpPlan)]
            errors = [r for r in results if not isinstance(r, OpPlan)]
            assert len(plans) == 1 and len(errors) == 1, results
            assert isinstance(errors[0], FailedPrecondition) and "pending plan" in str(errors[0])
            # Two commits of one plan: one wins, the other finds nothing pending.
            commits = await asyncio.gather(a.commit_splice(plans[0].plan_id), b.commit_splice(plans[0].plan_id),
                                           return_exceptions=True)
            assert sorted(type(r).__name__ for r in commits) == ["NotFound", "SessionState"]
        assert (await a.get_session(s.session_id)).version == 3


def test_racing_splices_from_threads():
    """Sync clients on their own channels and threads, released together, at one version."""
    n = 6
    with ServerThread(config()) as st:
        clients = [SyncSidecarClient(st.target, tenant=TENANT) for _ in range(n)]
        try:
            s = clients[0].open_session(toks(100), block_size=1)
            barrier = threading.Barrier(n)
            results: list[object] = [None] * n

            def race(i: int) -> None:
                barrier.wait()
                try:
                    results[i] = clients[i].splice(s.session_id, 0, [(i, i + 1, [])])
                except FailedPrecondition as exc:
                    results[i] = exc

            threads = [threading.Thread(target=race, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            winners = [r for r in results if isinstance(r, OpPlan)]
            assert len(winners) == 1 and sum(isinstance(r, FailedPrecondition) for r in results) == n - 1
            assert clients[0].get_session(s.session_id).pending_plan_id == winners[0].plan_id
        finally:
            for c in clients:
                c.close()


# ------------------------------------------------------------------------ forget, invariants


async def test_forget_tenants_force_forget(serve):
    server, target = await serve(forget_tenants=("bank",))
    directives = [(10, 12, [5]), (40, 41, [6, 6, 6])]
    async with SidecarClient(target, tenant="bank") as bank, SidecarClient(target, tenant="shop") as shop:
        forced = await bank.splice((await bank.open_session(toks(64), block_size=1)).session_id, 0, directives)
        normal = await shop.splice((await shop.open_session(toks(64), block_size=1)).session_id, 0, directives)
    assert all(e.mode is EditMode.FORGET for e in forced.edits)
    assert all(e.mode is EditMode.AMORTIZE for e in normal.edits)
    # Forget: everything from the first edit's start is re-prefilled from the edited text.
    (prefill,) = forced.ops_of(OpKind.PREFILL)
    assert prefill.positions.tolist() == list(range(10, 65))
    assert forced.summary.tokens_prefilled == 55 and forced.summary.tokens_kept == 10
    assert not forced.ops_of(OpKind.ROTATE)
    assert normal.summary.tokens_prefilled == 4 and [op.delta for op in normal.ops_of(OpKind.ROTATE)] == [-1, 1]
    assert sample(server, "kv_sidecar_splices_total", mode="forget", outcome="planned") == 1
    assert sample(server, "kv_sidecar_splices_total", mode="amortize", outcome="planned") == 1


class BuggyPlannerTable(SessionTable):
    """A session table whose planner has a bug: the plan it produces carries one wrong token.
    The real ``check_plan`` catches it, as it must before any plan leaves the server."""

    def splice(self, session_id, tenant, expected_version, directives):
        info = self.get(session_id, tenant)
        mirror = SessionMirror.open(session_id=session_id, tenant=tenant, block_size=info.block_size,
                                    tokens=info.layout.tokens)
        plan = plan_splice(mirror, directives)
        tokens = plan.layout.tokens.copy()
        tokens[0] += 1
        check_plan(mirror, dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, tokens=tokens)))
        raise AssertionError("check_plan accepted a corrupted plan")


async def test_invariant_violation_is_internal_with_a_bug_id_and_counted():
    code, message = status_for(InvariantViolation("broken", bug_id="abc123"))
    assert code is grpc.StatusCode.INTERNAL and message == "broken (bug id abc123)"

    server, target = await start(session_table=BuggyPlannerTable(config=SessionConfig()))
    try:
        async with SidecarClient(target, tenant=TENANT) as c:
            s = await c.open_session(toks(40), block_size=4)
            with pytest.raises(Internal) as ei:
                await c.splice(s.session_id, 0, [(2, 3, [])])
            err = ei.value
            assert err.code is grpc.StatusCode.INTERNAL
            assert re.search(r"layout tokens differ .* \(bug id [0-9a-f]{12}\)$", str(err)), str(err)
            after = await c.get_session(s.session_id)
            assert (after.version, after.length, after.pending_plan_id) == (0, 40, None)
        assert sample(server, "kv_sidecar_cache_invariant_violations_total") == 1
        assert sample(server, "kv_sidecar_splices_total", mode="amortize", outcome="refused") == 1
        assert sample(server, "kv_sidecar_requests_total", method="Splice", code="INTERNAL") == 1
    finally:
        await server.stop(0.1)


# ---------------------------------------------------------------------------- metrics, config


async def test_metrics_endpoint(serve):
    server, target = await serve()
    async with SidecarClient(target, tenant=TENANT) as c:
        s = await c.open_session(toks(64), block_size=1)
        await c.open_session(toks(8), block_size=1)
        plan = await c.splice(s.session_id, 0, [(4, 6, [1, 2, 3])])
        await c.commit_splice(plan.plan_id)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5) as r:
        body = r.read().decode()
    sm = plan.summary
    assert "kv_sidecar_sessions 2.0" in body
    assert 'kv_sidecar_splices_total{mode="amortize",outcome="planned"} 1.0' in body
    assert 'kv_sidecar_splices_total{mode="amortize",outcome="committed"} 1.0' in body
    assert 'kv_sidecar_splices_total{mode="forget",outcome="refused"} 0.0' in body
    for kind, value in (("prefilled", sm.tokens_prefilled), ("kept", sm.tokens_kept), ("moved", sm.slots_moved),
                        ("rotated", sm.slots_rotated), ("refreshed", 0)):
        assert f'kv_sidecar_splice_tokens_total{{kind="{kind}"}} {float(value)}' in body
    assert (sm.tokens_prefilled, sm.tokens_kept, sm.slots_rotated) == (3, 62, 58)
    assert "kv_sidecar_splice_seconds_count 1.0" in body
    assert 'kv_sidecar_requests_total{code="OK",method="CommitSplice"} 1.0' in body


def test_directives_config():
    c = load_config(env={"KV_SIDECAR_DIRECTIVES__FORGET_TENANTS": "[bank, clinic]"},
                    overrides={"directives.plan_ttl_s": 2, "directives.refresh_after": None})
    d = c.directives
    assert (d.forget_tenants, d.plan_ttl_s, d.refresh_after) == (("bank", "clinic"), 2.0, None)
    assert d.session_config() == SessionConfig(plan_ttl_s=2.0, refresh_after=None)
    assert DirectivesConfig().session_config() == SessionConfig()  # one set of defaults
    for key, value in (("plan_ttl_s", 0), ("idle_ttl_s", -1), ("max_directives", 0), ("sweep_interval_s", 0),
                       ("max_sessions_per_tenant", 0), ("refresh_after", -1), ("vocab_size", 0),
                       ("forget_tenants", [""])):
        with pytest.raises(ValueError, match=f"directives.{key}"):
            load_config(env={}, overrides={f"directives.{key}": value})


async def test_create_server_serves_sessions():
    server, port = await create_server(make_config())
    try:
        async with SidecarClient(f"127.0.0.1:{port}", tenant=TENANT) as c:
            assert (await c.open_session(block_size=16)).length == 0
    finally:
        await server.stop(0.1)
