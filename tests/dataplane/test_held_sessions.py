"""Held sessions: the sidecar holds a session's KV in its own tiers, follows every
committed plan, and serves the current layout with FetchSession, each row rotated ONCE from its
canonical source-position copy (never chained).

Real sidecars over loopback gRPC, real clients; the reference engine (tiny random-weight GQA and
MLA models, batch-invariant attention) computes, Stores and splices the KV it compares against.
No mocks.
"""

from __future__ import annotations

import uuid

import grpc
import numpy as np
import pytest
import torch

from clients.transformers import Engine, ReusePolicy
from clients.transformers.splice import SpliceSession, clone_cache
from sidecar.app import ServerThread
from sidecar.client import FetchedRun, SyncSidecarClient
from sidecar.config import AuthConfig, DirectivesConfig
from sidecar.directives import (
    Directive,
    EditMode,
    HeldKV,
    OpKind,
    SessionId,
    SessionMirror,
    kept_sources,
    plan_splice,
)
from sidecar.directives.held import forget_start
from sidecar.errors import FailedPrecondition, InvalidArgument, NotFound
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.rotation import RopeSpec, rotate_keys
from sidecar.tiers import decode_payload, encode_payload
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc
from tests.clients.transformers.conftest import Prompts, get_model
from tests.conftest import ANCHOR_BASE, make_config

LOCAL = ReusePolicy(prefix_cache=False, sidecar=False, store=False)
TENANT, OTHER = "held-a", "held-b"


@pytest.fixture(scope="module")
def server():
    cfg = make_config(auth=AuthConfig(shared_writers=("ops",)), directives=DirectivesConfig(plan_ttl_s=60.0))
    with ServerThread(cfg) as st:
        yield st


@pytest.fixture(scope="module")
def client(server):
    with SyncSidecarClient(server.target, tenant=TENANT) as c:
        yield c


@pytest.fixture(scope="module")
def other(server):
    with SyncSidecarClient(server.target, tenant=OTHER) as c:
        yield c


def sample(server, name: str, **labels) -> float:
    return server.server.metrics.registry.get_sample_value(name, labels) or 0.0


def bounds_of(client: SyncSidecarClient, tokens: np.ndarray, identity: CacheIdentity) -> list[int]:
    """Chunk boundaries of ``tokens`` as Store cuts them (a dry-run Lookup changes nothing)."""
    return client.lookup(tokens, identity=identity, dry_run=True).chunk_bounds.tolist()


def covering(bounds: list[int], positions) -> list[tuple[int, int]]:
    """The chunks ``[a, b)`` that hold any of ``positions`` (all chunks for None)."""
    chunks = list(zip(bounds, bounds[1:]))
    if positions is None:
        return chunks
    pos = np.asarray(positions)
    return [(a, b) for a, b in chunks if ((pos >= a) & (pos < b)).any()]


# ================================================================ with the reference engine


@pytest.fixture(params=["gqa", "mla"])
def engine(request) -> Engine:
    return Engine(get_model(request.param), namespace=uuid.uuid4().hex, reuse=LOCAL)


def store_engine_kv(client, engine: Engine, tokens: np.ndarray, cache, positions=None) -> int:
    """Store the chunks of ``tokens`` that hold ``positions`` from ``cache`` (the engine's KV)."""
    chunks = covering(bounds_of(client, tokens, engine.identity), positions)
    payloads = {a: engine.adapter.payload(cache, a, b) for a, b in chunks}
    return client.store(tokens, identity=engine.identity, layout=engine.layout, payloads=payloads).chunks_stored


def cache_rows(engine: Engine, cache, a: int, b: int) -> list[tuple[bool, torch.Tensor]]:
    """(rotary?, rows [a, b) as [n, ...]) for every layer and part, layer-major."""
    ad = engine.adapter
    return [(p.rotary, ad.part_view(cache, layer, j, a, b).clone())
            for layer in range(ad.layout.num_layers) for j, p in enumerate(ad.layout.parts)]


def fetched_rows(engine: Engine, runs: list[FetchedRun]) -> list[tuple[bool, torch.Tensor]]:
    """The runs' payloads joined into (rotary?, rows [n, ...]) per layer and part."""
    views = [decode_payload(r.data, engine.layout, r.num_tokens) for r in runs]
    return [(p.rotary, torch.cat([v.parts[i].tensor for v in views]))
            for i, p in enumerate(views[0].parts)]


def assert_tiles(runs: list[FetchedRun], start: int, end: int, version: int) -> None:
    pos = start
    for i, r in enumerate(runs):
        assert (r.index, r.target_pos, r.version) == (i, pos, version)
        assert r.delta == r.target_pos - r.source_pos and r.rotated == (r.delta != 0)
        pos += r.num_tokens
    assert pos == end


def kept_matches(got, want, delta: int, spec: RopeSpec, what: str) -> None:
    """``got`` holds ``want`` shifted by ``delta``: non-rotary parts bit for bit, rotary parts
    equal to ONE rotation of ``want`` by ``delta`` bit for bit."""
    for layer, ((rotary, g), (_, w)) in enumerate(zip(got, want)):
        expect = rotate_keys(w, delta, spec) if rotary and delta else w
        assert torch.equal(g, expect), f"{what}: part {layer} ({'rotary' if rotary else 'plain'}) differs"


def rows(parts, a: int, b: int):
    return [(rot, t[a:b]) for rot, t in parts]


def test_held_session_rotates_once_from_canonical_across_two_splices(client, server, engine):
    """Prefill, Store, open held; splice 1 (delete a span, replace a span) is applied by the
    engine and committed; the replacement is Stored from the engine's cache; FetchSession of
    the whole session equals the engine's cache bit for bit (V / c_kv untouched, keys one
    rotation of the canonical rows). Splice 2 moves everything again: the sidecar's keys are
    still ONE rotation of the canonical rows by the total shift, while the engine's copy went
    through two."""
    p = Prompts(11)
    toks = p.join(p.msg(30), p.msg(40), p.msg(25), p.msg(35), p.msg(30))
    n = len(toks)
    spec = engine.rope
    res = engine.prefill(toks)
    orig = cache_rows(engine, res.cache, 0, n)
    assert store_engine_kv(client, engine, toks, res.cache) >= 2
    state = client.open_session(toks, block_size=1, identity=engine.identity, held=True)
    sid = state.session_id
    sess = SpliceSession(engine, toks, clone_cache(engine, res.cache), session_id=sid)

    runs = client.fetch_session(sid, layout=engine.layout, rope=spec)
    assert_tiles(runs, 0, n, 0)
    assert all(r.delta == 0 and r.chunk_offset == 0 and r.tier for r in runs)
    kept_matches(fetched_rows(engine, runs), orig, 0, spec, "version 0")

    # ---- splice 1: delete [40, 52) (d -12), replace [100, 110) with 4 tokens (tail d -18)
    rep1 = np.arange(7, 11, dtype=np.uint32)
    plan = client.splice(sid, 0, [(40, 52, []), (100, 110, rep1)])
    sess.apply(plan)
    client.commit_splice(plan.plan_id)
    n1, q1 = len(sess), 100 - 12
    assert n1 == n - 12 - 6
    with pytest.raises(FailedPrecondition, match=rf"4 of the {n1} positions in \[0, {n1}\) have no stored KV, "
                                                   rf"the first is position {q1}"):
        client.fetch_session(sid, layout=engine.layout, rope=spec)
    assert sample(server, "kv_sidecar_requests_total", method="FetchSession", code="FAILED_PRECONDITION") >= 1
    head = client.fetch_session(sid, end=q1, layout=engine.layout, rope=spec)  # kept tokens only: served
    assert_tiles(head, 0, q1, 1)
    assert store_engine_kv(client, engine, sess.tokens, sess.cache, np.arange(q1, q1 + 4)) >= 1

    runs = client.fetch_session(sid, layout=engine.layout, rope=spec)
    assert_tiles(runs, 0, n1, 1)
    got = fetched_rows(engine, runs)
    kept_matches(rows(got, 0, 40), rows(orig, 0, 40), 0, spec, "prefix")
    kept_matches(rows(got, 40, q1), rows(orig, 52, 100), -12, spec, "between the edits")
    kept_matches(rows(got, q1 + 4, n1), rows(orig, 110, n), -18, spec, "tail")
    # the replacement comes from the copy the engine Stored; the engine rotated once as well, so
    # the held copy and the engine's cache agree bit for bit everywhere
    kept_matches(got, cache_rows(engine, sess.cache, 0, n1), 0, spec, "engine cache after splice 1")
    tail = [r for r in runs if r.target_pos >= q1 + 4]
    assert {r.delta for r in tail} == {-18} and tail[0].source_pos == 110
    replacement1 = rows(got, q1, q1 + 4)

    # ---- splice 2: replace [20, 22) with 8 tokens (d +6 for everything after position 22)
    rep2 = np.arange(30, 38, dtype=np.uint32)
    plan = client.splice(sid, 1, [(20, 22, rep2)])
    sess.apply(plan)
    client.commit_splice(plan.plan_id)
    n2 = len(sess)
    assert n2 == n1 + 6
    with pytest.raises(FailedPrecondition, match=r"8 of the .* the first is position 20;"):
        client.fetch_session(sid, layout=engine.layout, rope=spec)
    store_engine_kv(client, engine, sess.tokens, sess.cache, np.arange(20, 28))
    runs = client.fetch_session(sid, layout=engine.layout, rope=spec)
    assert_tiles(runs, 0, n2, 2)
    got = fetched_rows(engine, runs)
    kept_matches(rows(got, 0, 20), rows(orig, 0, 20), 0, spec, "prefix after splice 2")
    kept_matches(rows(got, 20, 28), cache_rows(engine, sess.cache, 20, 28), 0, spec, "replacement 2")
    kept_matches(rows(got, 28, 46), rows(orig, 22, 40), 6, spec, "shifted by splice 2 only")
    kept_matches(rows(got, 46, q1 + 6), rows(orig, 52, 100), -6, spec, "region 1: -12 then +6")
    kept_matches(rows(got, q1 + 6, q1 + 10), replacement1, 6, spec, "replacement 1, from its own stored copy")
    kept_matches(rows(got, q1 + 10, n2), rows(orig, 110, n), -12, spec, "tail: -18 then +6")
    assert {r.delta for r in runs if r.target_pos >= q1 + 10} == {-12}

    # not chained: the engine's twice-rotated keys differ from the single rotation somewhere,
    # by rounding only; the sidecar's are exactly the single rotation (checked above)
    engine_tail = rows(cache_rows(engine, sess.cache, 0, n2), q1 + 10, n2)
    differs = False
    for (rotary, chained), (_, held) in zip(engine_tail, rows(got, q1 + 10, n2)):
        if not rotary:
            assert torch.equal(chained, held)
            continue
        eps = torch.finfo(held.dtype).eps
        torch.testing.assert_close(chained, held, rtol=4 * eps, atol=8 * eps * float(held.abs().max()))
        differs |= not torch.equal(chained, held)
    assert differs, "two chained rotations should differ from one by rounding somewhere"
    client.close_session(sid)


def test_raw_rows_are_the_canonical_copy(client, engine):
    """raw=True: rows stay at their canonical source position; rotating them by the reported
    delta on the client gives exactly what the server sends rotated."""
    p = Prompts(12)
    toks = p.join(p.msg(40), p.msg(50), p.msg(40))
    res = engine.prefill(toks)
    orig = cache_rows(engine, res.cache, 0, len(toks))
    store_engine_kv(client, engine, toks, res.cache)
    sid = client.open_session(toks, block_size=1, identity=engine.identity, held=True).session_id
    plan = client.splice(sid, 0, [(45, 60, [])])  # a pure deletion: every token stays backed
    client.commit_splice(plan.plan_id)
    raw = client.fetch_session(sid, start=30, layout=engine.layout, raw=True)  # no rope needed raw
    rotated = client.fetch_session(sid, start=30, layout=engine.layout, rope=engine.rope)
    assert [(r.target_pos, r.source_pos, r.delta) for r in raw] == [
        (r.target_pos, r.source_pos, r.delta) for r in rotated
    ]
    assert not any(r.rotated for r in raw) and any(r.rotated for r in rotated)
    assert raw[-1].delta == -15
    for r, s in zip(raw, rotated):
        a = r.source_pos
        kept_matches(fetched_rows(engine, [r]), rows(orig, a, a + r.num_tokens), 0, engine.rope, "raw")
        kept_matches(fetched_rows(engine, [s]), fetched_rows(engine, [r]), r.delta, engine.rope, "client rotation")
    client.close_session(sid)


# ============================================================= synthetic KV (no model)

LAYOUT = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
SPEC = RopeSpec(rotary_dim=8, key_dim=8, layout="leading", pairing="half",
                inv_freq=tuple((1.0 / 10000 ** (np.arange(4) / 4)).tolist()))


def ident(**kw) -> CacheIdentity:
    base = dict(model_id="held-synthetic", kv_layout=LAYOUT.fingerprint(), rope_fingerprint=SPEC.fingerprint,
                namespace=uuid.uuid4().hex)
    base.update(kw)
    return CacheIdentity(**base)


class FakeKV:
    """Per-position KV of a token sequence (random values: the sidecar must only move and
    rotate them), stored chunk by chunk through the real Store RPC."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.parts = [(p.rotary, torch.randn((n, *p.shape), generator=g))
                      for _ in range(LAYOUT.num_layers) for p in LAYOUT.parts]

    def payload(self, a: int, b: int) -> torch.Tensor:
        per = len(LAYOUT.parts)
        return encode_payload([{p.name: self.parts[i * per + j][1][a:b] for j, p in enumerate(LAYOUT.parts)}
                               for i in range(LAYOUT.num_layers)], LAYOUT)

    def rows(self, a: int, b: int):
        return rows(self.parts, a, b)

    def store(self, client, tokens, identity, positions=None, **kw) -> int:
        chunks = covering(bounds_of(client, tokens, identity), positions)
        payloads = {a: self.payload(a, b) for a, b in chunks}
        return client.store(tokens, identity=identity, layout=LAYOUT, payloads=payloads, **kw).chunks_stored


def fetched(runs: list[FetchedRun]):
    views = [decode_payload(r.data, LAYOUT, r.num_tokens) for r in runs]
    return [(p.rotary, torch.cat([v.parts[i].tensor for v in views])) for i, p in enumerate(views[0].parts)]


def conversation(seed: int, sizes=(40, 50, 30, 45)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([np.concatenate([[ANCHOR_BASE], rng.integers(0, 5000, k)]) for k in sizes]).astype(np.uint32)


@pytest.fixture
def held(client):
    """A held session over a stored conversation: (session id, tokens, identity, FakeKV)."""
    toks = conversation(1)
    identity = ident()
    kv = FakeKV(len(toks), 1)
    kv.store(client, toks, identity)
    sid = client.open_session(toks, block_size=1, identity=identity, held=True).session_id
    yield sid, toks, identity, kv
    try:
        client.close_session(sid)
    except NotFound:
        pass


def test_open_held_bad_input_creates_nothing(client, server):
    table = server.server.sessions.table
    before = table.sessions_of(TENANT)
    toks = conversation(2)
    for kwargs, match in [
        (dict(held=True), "identity: required for a held session"),
        (dict(held=True, identity=CacheIdentity(model_id="m")), "identity.kv_layout: required for a held session"),
        (dict(held=True, identity=ident(), block_size=3), "block_size: 3 is not a power of two"),
    ]:
        kwargs.setdefault("block_size", 1)
        with pytest.raises(InvalidArgument, match=match):
            client.open_session(toks, **kwargs)
    assert table.sessions_of(TENANT) == before


def test_fetch_session_bad_input_changes_nothing(client, other, server, held):
    sid, toks, identity, kv = held
    n = len(toks)
    plan = client.splice(sid, 0, [(10, 20, [])])
    client.commit_splice(plan.plan_id)  # shifted rows: rope is needed now
    n1 = n - 10
    before = client.fetch_session(sid, layout=LAYOUT, rope=SPEC)
    state = client.get_session(sid)
    bad_layout = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
    cases = [
        (client, dict(session_id=""), InvalidArgument, "session_id: required"),
        (client, dict(start=5, end=3), InvalidArgument, "end: 3 is before start 5"),
        (client, dict(end=n1 + 1), InvalidArgument, f"end: {n1 + 1} exceeds the session length {n1}"),
        (client, dict(start=n1 + 1), InvalidArgument, f"start: {n1 + 1} exceeds the session length {n1}"),
        (client, dict(rope=None), InvalidArgument, "rope: required to rotate"),
        (client, dict(layout=bad_layout), FailedPrecondition, "identity.kv_layout"),
        (client, dict(session_id="0" * 32), NotFound, "not found"),
        (other, dict(), NotFound, "not found"),
    ]
    for who, kwargs, err, match in cases:
        call = dict(session_id=sid, layout=LAYOUT, rope=SPEC)
        call.update(kwargs)
        with pytest.raises(err, match=match):
            who.fetch_session(call.pop("session_id"), **call)
    # another tenant's id answers exactly like an unknown one
    with pytest.raises(NotFound) as mine:
        other.fetch_session(sid, layout=LAYOUT, rope=SPEC)
    with pytest.raises(NotFound) as unknown:
        client.fetch_session("f" * 32, layout=LAYOUT, rope=SPEC)
    assert str(mine.value).replace(sid, "ID") == str(unknown.value).replace("f" * 32, "ID")
    after = client.get_session(sid)
    assert (after.version, after.length, after.pending_plan_id) == (state.version, state.length, None)
    again = client.fetch_session(sid, layout=LAYOUT, rope=SPEC)
    assert [bytes(r.data) for r in again] == [bytes(r.data) for r in before]
    assert sample(server, "kv_sidecar_requests_total", method="FetchSession", code="INVALID_ARGUMENT") >= 5
    # an empty range is valid: no runs
    assert client.fetch_session(sid, start=7, end=7, layout=LAYOUT, rope=SPEC) == []


def test_raw_requests_name_the_field(server, held):
    """Requests the SDK cannot build: no layout, a held open without model_id."""
    sid = held[0]
    md = (("x-tenant-id", TENANT),)
    table = server.server.sessions.table
    before = table.sessions_of(TENANT)
    with grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.KVSidecarStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.FetchSession(pb.FetchSessionRequest(session_id=sid), metadata=md))
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == "layout: required"
        with pytest.raises(grpc.RpcError) as e:
            stub.OpenSession(pb.OpenSessionRequest(block_size=1, held=True, identity=pb.CacheIdentity(namespace="x")),
                             metadata=md)
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == "identity.model_id is required"
        assert table.sessions_of(TENANT) == before
        # the proto field numbers shared with FetchResponse keep their meaning
        req = pb.FetchSessionRequest(session_id=sid, start=3, end=9, layout=pb.KVLayout(
            num_layers=LAYOUT.num_layers,
            parts=[pb.KVPart(name=p.name, shape=list(p.shape), dtype=p.dtype, rotary=p.rotary) for p in LAYOUT.parts],
        ))
        msgs = list(stub.FetchSession(req, metadata=md))
        assert (msgs[0].index, msgs[0].target_pos, msgs[0].version, msgs[0].delta) == (0, 3, 0, 0)
        assert sum(m.num_tokens for m in msgs) == 6 and msgs[-1].last
        assert sum(len(m.data) for m in msgs) == 6 * LAYOUT.bytes_per_token


def test_plain_sessions_are_not_held(client):
    toks = conversation(3)
    s = client.open_session(toks, block_size=4, identity=ident())  # identity alone: not held
    with pytest.raises(FailedPrecondition, match="is not held by the sidecar"):
        client.fetch_session(s.session_id, layout=LAYOUT, rope=SPEC)
    plan = client.splice(s.session_id, 0, [(8, 12, [1, 2])])
    after = client.commit_splice(plan.plan_id)
    assert (after.version, after.length) == (1, len(toks) - 2)
    with pytest.raises(FailedPrecondition, match="is not held by the sidecar"):
        client.fetch_session(s.session_id, layout=LAYOUT, rope=SPEC)
    client.close_session(s.session_id)


def test_unbacked_ranges_appends_and_lazy_resolution(client, server):
    toks = conversation(4)
    n = len(toks)
    identity = ident()
    kv = FakeKV(n + 40, 4)
    bounds = bounds_of(client, toks, identity)
    half = bounds[2]
    kv.store(client, toks, identity, np.arange(0, half))  # only the first two chunks
    sid = client.open_session(toks, block_size=1, identity=identity, held=True).session_id
    assert server.server.sessions.table.held(SessionId(sid), TENANT).backed_count == half
    runs = client.fetch_session(sid, end=half, layout=LAYOUT, rope=SPEC)
    assert_tiles(runs, 0, half, 0)
    kept_matches(fetched(runs), kv.rows(0, half), 0, SPEC, "stored half")
    with pytest.raises(FailedPrecondition, match=rf"{n - half} of the {n - 5} positions in \[5, {n}\) have no "
                                                   rf"stored KV, the first is position {half};"):
        client.fetch_session(sid, start=5, layout=LAYOUT, rope=SPEC)
    kv.store(client, toks, identity)  # the engine Stores the rest: resolved lazily at fetch time
    runs = client.fetch_session(sid, layout=LAYOUT, rope=SPEC)
    kept_matches(fetched(runs), kv.rows(0, n), 0, SPEC, "all stored")

    # appended (decoded) tokens are unbacked until Stored
    more = np.concatenate([[ANCHOR_BASE], np.arange(300, 339)]).astype(np.uint32)
    client.append_session(sid, more)
    full = np.concatenate([toks, more])
    with pytest.raises(FailedPrecondition, match=rf"40 of the {n + 40} positions .* first is position {n};"):
        client.fetch_session(sid, layout=LAYOUT, rope=SPEC)
    kv.store(client, full, identity, np.arange(n, n + 40))
    runs = client.fetch_session(sid, layout=LAYOUT, rope=SPEC)
    assert_tiles(runs, 0, n + 40, 0)
    kept_matches(fetched(runs), kv.rows(0, n + 40), 0, SPEC, "after append")
    client.close_session(sid)


def test_scope_other_tenants_chunks_never_back_a_session_shared_ones_do(client, server):
    toks = conversation(5)
    n = len(toks)
    identity = ident()
    kv = FakeKV(n, 5)
    with SyncSidecarClient(server.target, tenant=OTHER) as b, SyncSidecarClient(server.target, tenant="ops") as ops:
        kv.store(b, toks, identity)  # tenant b's scope
        sid = client.open_session(toks, block_size=1, identity=identity, held=True).session_id
        with pytest.raises(FailedPrecondition, match=rf"{n} of the {n} positions"):
            client.fetch_session(sid, layout=LAYOUT, rope=SPEC)
        shared = FakeKV(n, 55)
        shared.store(ops, toks, identity, shared=True)  # the operator-granted shared scope
        runs = client.fetch_session(sid, layout=LAYOUT, rope=SPEC)
        kept_matches(fetched(runs), shared.rows(0, n), 0, SPEC, "served from the shared scope")
    client.close_session(sid)


def test_deleted_chunk_makes_its_positions_unbacked_until_stored_again(client, held):
    sid, toks, identity, kv = held
    runs = client.fetch_session(sid, layout=LAYOUT, rope=SPEC)
    victim = runs[1]
    assert client.delete([victim.chunk_hash]) == 1
    a, b = victim.target_pos, victim.target_pos + victim.num_tokens
    with pytest.raises(FailedPrecondition, match=rf"{b - a} of the {len(toks)} positions .* first is position {a};"):
        client.fetch_session(sid, layout=LAYOUT, rope=SPEC)
    client.fetch_session(sid, end=a, layout=LAYOUT, rope=SPEC)  # the rest is still served
    fresh = FakeKV(len(toks), 99)
    fresh.store(client, toks, identity, np.arange(a, b))
    runs = client.fetch_session(sid, layout=LAYOUT, rope=SPEC)
    got = fetched(runs)
    kept_matches(rows(got, a, b), fresh.rows(a, b), 0, SPEC, "re-stored chunk")
    kept_matches(rows(got, 0, a), kv.rows(0, a), 0, SPEC, "untouched chunks")


def test_pending_plan_serves_the_committed_layout(client, held):
    sid, toks, identity, kv = held
    n = len(toks)
    plan = client.splice(sid, 0, [(50, 60, [])])
    runs = client.fetch_session(sid, layout=LAYOUT, rope=SPEC)  # pending: version 0, unshifted
    assert_tiles(runs, 0, n, 0)
    assert all(r.delta == 0 for r in runs)
    client.commit_splice(plan.plan_id)
    runs = client.fetch_session(sid, layout=LAYOUT, rope=SPEC)
    assert_tiles(runs, 0, n - 10, 1)
    got = fetched(runs)
    kept_matches(rows(got, 0, 50), kv.rows(0, 50), 0, SPEC, "prefix")
    kept_matches(rows(got, 50, n - 10), kv.rows(60, n), -10, SPEC, "tail")
    # an aborted plan changes nothing either
    plan = client.splice(sid, 1, [(0, 5, [])])
    client.abort_splice(plan.plan_id)
    assert [bytes(r.data) for r in client.fetch_session(sid, layout=LAYOUT, rope=SPEC)] == [bytes(r.data) for r in runs]


def test_forget_drops_the_canonical_copies_from_its_start_on(client, held):
    """Everything a FORGET directive re-prefills loses its copy and is backed again only by a
    copy computed from the edited text (same position, same left context): never by an older
    copy of the same content, which still remembers what was forgotten."""
    sid, toks, identity, kv = held
    n = len(toks)
    old_chunks = client.fetch_session(sid, layout=LAYOUT, rope=SPEC)
    plan = client.splice(sid, 0, [(70, 75, [9, 9], EditMode.FORGET)])
    client.commit_splice(plan.plan_id)
    n1 = n - 3
    with pytest.raises(FailedPrecondition, match=rf"{n1 - 70} of the {n1} positions .* first is position 70; .*"
                                                   rf"\({n1 - 70} of them were re-prefilled by a forget directive"):
        client.fetch_session(sid, layout=LAYOUT, rope=SPEC)
    client.fetch_session(sid, end=70, layout=LAYOUT, rope=SPEC)  # before the forget: still served
    new_tokens = np.concatenate([toks[:70], [9, 9], toks[75:]]).astype(np.uint32)
    recomputed = FakeKV(n1, 77)  # what the engine re-prefilled from position 70 on
    assert recomputed.store(client, new_tokens, identity, np.arange(70, n1)) >= 1
    # the chunks of new text are stored and back their tokens; downstream chunks of unchanged
    # text keep their older copies in the tiers, which may not back a forgotten position, and
    # get a copy computed after the edited text next to them (docs/architecture.md, "Copies of
    # one chunk"): that copy backs it
    runs = client.fetch_session(sid, layout=LAYOUT, rope=SPEC)
    stale = {r.chunk_hash for r in old_chunks if r.target_pos >= 75}
    assert not stale & {r.chunk_hash for r in runs if r.target_pos >= 70}
    assert_tiles(runs, 0, n1, 1)
    got = fetched(runs)
    kept_matches(rows(got, 0, 70), kv.rows(0, 70), 0, SPEC, "before the forget")
    kept_matches(rows(got, 70, n1), recomputed.rows(70, n1), 0, SPEC, "re-prefilled")
    assert all(r.delta == 0 for r in runs)


def test_refresh_keeps_the_canonical_copy():
    """refresh_after=0: a kept shifted token is REFRESHed instead of rotated; for a held copy
    that is one rotation from canonical, so it keeps its reference."""
    cfg = make_config(directives=DirectivesConfig(refresh_after=0))
    with ServerThread(cfg) as st, SyncSidecarClient(st.target, tenant=TENANT) as c:
        toks = conversation(6)
        identity = ident()
        kv = FakeKV(len(toks), 6)
        kv.store(c, toks, identity)
        sid = c.open_session(toks, block_size=1, identity=identity, held=True).session_id
        plan = c.splice(sid, 0, [(30, 40, [])])
        assert plan.summary.refresh_proposals == len(toks) - 40
        c.commit_splice(plan.plan_id)
        got = fetched(c.fetch_session(sid, layout=LAYOUT, rope=SPEC))
        kept_matches(rows(got, 30, len(toks) - 10), kv.rows(40, len(toks)), -10, SPEC, "refreshed tail")


def test_fetch_session_metrics(client, server, held):
    sid = held[0]
    ok = sample(server, "kv_sidecar_requests_total", method="FetchSession", code="OK")
    nbytes = sample(server, "kv_sidecar_fetch_bytes_total")
    runs = client.fetch_session(sid, start=3, end=40, layout=LAYOUT, rope=SPEC)
    assert sample(server, "kv_sidecar_requests_total", method="FetchSession", code="OK") == ok + 1
    assert sample(server, "kv_sidecar_fetch_bytes_total") - nbytes == 37 * LAYOUT.bytes_per_token
    assert sum(len(r.data) for r in runs) == 37 * LAYOUT.bytes_per_token


async def test_async_client_fetch_session(server, held):
    from sidecar.client import SidecarClient

    sid, toks, identity, kv = held
    async with SidecarClient(server.target, tenant=TENANT) as c:
        plan = await c.splice(sid, 0, [(12, 14, [])])
        await c.commit_splice(plan.plan_id)
        runs = await c.fetch_session(sid, start=10, end=30, layout=LAYOUT, rope=SPEC)
        assert_tiles(runs, 10, 30, 1)
        got = fetched(runs)
        kept_matches(rows(got, 0, 2), kv.rows(10, 12), 0, SPEC, "before the cut")
        kept_matches(rows(got, 2, 20), kv.rows(14, 32), -2, SPEC, "after the cut")
        plain = await c.open_session(toks, block_size=1)
        with pytest.raises(FailedPrecondition, match="not held"):
            await c.fetch_session(plain.session_id, layout=LAYOUT, rope=SPEC)
        s2 = await c.open_session(toks, block_size=1, identity=identity, held=True)
        assert len(await c.fetch_session(s2.session_id, layout=LAYOUT, rope=SPEC)) >= 2


# ============================================================= domain: the reference table


@pytest.mark.parametrize("seed", range(12))
def test_held_references_follow_tokens_through_plans(seed):
    """With distinct token ids a token's identity says where its KV came from: after any plan
    (amortize, forget, refresh, block sizes 1 and 16), every kept token still references the
    copy of the SAME token, and exactly the prefilled positions are unbacked."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(20, 120))
    b = int(rng.choice([1, 16]))
    mirror = SessionMirror.open(session_id=SessionId("s"), tenant="t", block_size=b,
                                tokens=np.arange(n, dtype=np.uint32))
    # canonical copy of token t: chunk t // 10, row t % 10, computed at position t
    held = HeldKV.unbacked(n).filled(np.arange(n), (np.arange(n) // 10).astype(np.uint64), np.arange(n) % 10,
                                     np.arange(n, dtype=np.int64))
    if seed % 3 == 0:
        held = held.dropped(np.arange(0, n, 7))  # some tokens never stored
    fresh_id = 10_000
    for _turn in range(3):
        cur = len(mirror)
        cuts = np.sort(rng.choice(cur + 1, size=4, replace=False))
        directives = []
        for s, e in ((cuts[0], cuts[1]), (cuts[2], cuts[3])):
            k = int(rng.integers(0, 5))
            if s == e and k == 0:
                k = 1
            mode = EditMode.FORGET if rng.random() < 0.2 else EditMode.AMORTIZE
            directives.append(Directive(start=int(s), end=int(e), mode=mode,
                                        replacement=np.arange(fresh_id, fresh_id + k, dtype=np.uint32)))
            fresh_id += k
        plan = plan_splice(mirror, directives, refresh_after=int(rng.integers(0, 3)))
        old_tokens = mirror.layout.tokens
        src = kept_sources(plan, cur)
        new = held.after(plan)
        mirror.commit(plan)
        tokens = mirror.layout.tokens
        kept = src >= 0
        assert np.array_equal(tokens[kept], old_tokens[src[kept]])
        prefilled = np.zeros(len(tokens), dtype=bool)
        for op in plan.ops_of(OpKind.PREFILL):
            prefilled[op.positions] = True
        assert np.array_equal(~kept, prefilled)
        assert not new.backed[prefilled].any()
        fa = forget_start(plan)
        if fa is not None:  # forgotten: only an exact copy may back them again
            assert any(e.mode is EditMode.FORGET for e in plan.edits)
            assert new.exact[fa:].all() and not new.backed[fa:].any()
        else:
            assert np.array_equal(new.exact[kept], held.exact[src[kept]]) and not new.exact[~kept].any()
        was = held.backed[src[kept]]
        assert np.array_equal(new.backed[kept], was)
        ok = np.flatnonzero(kept)[was]
        tt = tokens[ok].astype(np.int64)
        assert np.array_equal(new.chunk_hash[ok], (tt // 10).astype(np.uint64))
        assert np.array_equal(new.row[ok], tt % 10) and np.array_equal(new.source_pos[ok], tt)
        held = new
        # runs: maximal, consecutive rows of one chunk, tiling a backed range
        backed = np.flatnonzero(held.backed)
        if len(backed):
            a = int(backed[0])
            z = a
            while z < len(held) and held.backed[z]:
                z += 1
            runs = held.runs(a, z)
            assert int(runs.num_tokens.sum()) == z - a and runs.target_pos[0] == a
            for i in range(len(runs)):
                q, m = int(runs.target_pos[i]), int(runs.num_tokens[i])
                assert np.all(held.chunk_hash[q : q + m] == runs.chunk_hash[i])
                assert np.array_equal(held.row[q : q + m], runs.row[i] + np.arange(m))
        # appends are unbacked
        held = held.extended(2)
        mirror.append(np.arange(fresh_id, fresh_id + 2, dtype=np.uint32))
        fresh_id += 2
        assert len(held) == len(mirror) and not held.backed[-2:].any()


def test_fetch_session_through_shared_memory_equals_the_inline_stream(server, held):
    sid = held[0]
    with SyncSidecarClient(server.target, tenant=TENANT, shared_memory=False) as inline:
        want = inline.fetch_session(sid, layout=LAYOUT, rope=SPEC)
    with SyncSidecarClient(server.target, tenant=TENANT) as c:
        assert c._shm is not None  # a loopback sidecar: buffers are on by default
        b0 = sample(server, "kv_sidecar_fetch_shared_memory_bytes_total")
        got = c.fetch_session(sid, layout=LAYOUT, rope=SPEC)
        assert sample(server, "kv_sidecar_fetch_shared_memory_bytes_total") - b0 == sum(len(r.data) for r in got) > 0
        assert [(r.target_pos, r.delta, r.chunk_hash, bytes(r.data)) for r in got] == \
            [(r.target_pos, r.delta, r.chunk_hash, bytes(r.data)) for r in want]
