"""Nothing a client sends can reach another tenant's scope: every client-controlled field is
tried against tenant A's private chunks and sessions from tenant B (real gRPC, real tiers)."""

from __future__ import annotations

import dataclasses

import pytest

from sidecar.app import create_server
from sidecar.client import SidecarClient
from sidecar.errors import NotFound
from sidecar.tiers import StoreConfig
from tests.conftest import make_config
from tests.dataplane.test_dataplane import IDENT, LAYOUT, SPEC, conversation, store_all

MiB = 1 << 20


@pytest.fixture
async def two_tenants(rng):
    server, port = await create_server(make_config(store=StoreConfig(cpu_bytes=64 * MiB)))
    target = f"127.0.0.1:{port}"
    toks, _ = conversation(rng, 60)
    async with SidecarClient(target, tenant="a") as a, SidecarClient(target, tenant="b") as b:
        await store_all(a, toks)
        yield server, a, b, toks
    await server.stop(0.1)


async def test_no_client_field_reaches_another_scope(two_tenants):
    server, a, b, toks = two_tenants
    plan = await a.lookup(toks, identity=IDENT)
    hits = plan.hits()
    assert hits and plan.summary.chunks_hit == len(hits)
    hashes = [h.chunk_hash for h in hits]
    # Lookup under every identity field B controls: never a hit.
    for change in ({}, {"namespace": "a"}, {"namespace": "shared"}, {"namespace": ""}):
        ident = dataclasses.replace(IDENT, **change)
        for dry in (False, True):
            assert (await b.lookup(toks, identity=ident, dry_run=dry)).summary.chunks_hit == 0
    # Fetch A's chunk hashes: misses, exactly like hashes that never existed.
    items = [(h.chunk_hash, h.start - h.chunk_offset) for h in hits]
    got = await b.fetch(items + [(12345, 0)], identity=IDENT, layout=LAYOUT, rope=SPEC)
    assert [f.ok for f in got] == [False] * (len(items) + 1)
    assert {(f.num_tokens, f.tier, len(f.data)) for f in got} == {(0, "", 0)}
    # Evict / Delete A's hashes: nothing happens, same answer as for unknown hashes.
    assert await b.evict(hashes) == 0 and await b.evict([12345]) == 0
    assert await b.delete(hashes) == 0 and await b.delete([12345]) == 0
    # Storing the same tokens into B's scope does not touch A's entries; B's own Store
    # registers B's chunks under B's keys.
    meta = await b.store(toks, identity=IDENT)
    assert meta.chunks_registered == meta.chunks_total
    assert (await b.lookup(toks, identity=IDENT)).summary.chunks_hit == 0  # observed only, no KV
    # The shared flag is operator-granted.
    with pytest.raises(Exception, match="may not store into the shared scope"):
        await b.store(toks, identity=IDENT, shared=True)
    # A is intact: every chunk still hits and fetches.
    again = await a.lookup(toks, identity=IDENT)
    assert [h.chunk_hash for h in again.hits()] == hashes
    assert all(f.ok for f in await a.fetch(items, identity=IDENT, layout=LAYOUT, rope=SPEC))


async def test_sessions_and_plans_of_another_tenant_are_not_found(two_tenants):
    _server, a, b, toks = two_tenants
    s = await a.open_session(toks[:64], block_size=1)
    plan = await a.splice(s.session_id, 0, [(3, 4, [7])])
    unknown = "0" * 32
    for sid in (s.session_id, unknown):
        for call in (lambda: b.get_session(sid), lambda: b.append_session(sid, toks[:4]),
                     lambda: b.splice(sid, 1, [(0, 1, [1])]), lambda: b.close_session(sid)):
            with pytest.raises(NotFound, match="not found .unknown, closed or expired."):
                await call()
    for pid in (plan.plan_id, "f" * 32):
        with pytest.raises(NotFound, match="is not pending"):
            await b.commit_splice(pid)
        with pytest.raises(NotFound, match="is not pending"):
            await b.abort_splice(pid)
    info = await a.commit_splice(plan.plan_id)  # A's plan is still A's to commit
    assert info.version == 1
