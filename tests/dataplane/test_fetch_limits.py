"""Fetch streams item by item with a per-request byte cap and duplicate items read once
(before, 4,096 copies of one chunk were read, rotated and held 4,096 times)."""

from __future__ import annotations

import dataclasses

import pytest

from sidecar.app import create_server
from sidecar.client import SidecarClient
from sidecar.errors import ResourceExhausted
from sidecar.tiers import Tier
from tests.conftest import make_config
from tests.dataplane.test_dataplane import IDENT, LAYOUT, SPEC, check_rotated, conversation, store_all


@pytest.fixture
async def served():
    server, port = await create_server(make_config())
    yield server, f"127.0.0.1:{port}"
    await server.stop(0.1)


def cpu_hits(server) -> int:
    return server.dataplane.store.stats().tiers[Tier.CPU].hits


async def test_4096_copies_of_one_chunk_are_read_once():
    from tests.claims import helpers

    server, port = await create_server(helpers.config(200))
    try:
        async with SidecarClient(f"127.0.0.1:{port}", tenant="t1") as c:
            r = helpers.blocks(4, 0)
            await helpers.store(c, r)
            h = (await c.lookup(r, identity=helpers.IDENT)).hits()[2].chunk_hash
            hits0 = cpu_hits(server)
            fetched = await c.fetch([(h, 2 * helpers.BLOCK)] * 4096, identity=helpers.IDENT, layout=helpers.LAYOUT,
                                    raw=True)
            assert cpu_hits(server) - hits0 == 1  # one read for 4,096 items
            assert [f.index for f in fetched] == list(range(4096)) and all(f.ok for f in fetched)
            assert len({bytes(f.data) for f in fetched}) == 1
            assert fetched[0].data == helpers.payloads(r)[2 * helpers.BLOCK].numpy().tobytes()
    finally:
        await server.stop(0.1)


async def test_duplicates_at_several_targets_each_rotated_once(served, rng):
    server, target = served
    toks, _ = conversation(rng, 60)
    async with SidecarClient(target, tenant="a") as c:
        res, pl = await store_all(c, toks)
        plan = await c.lookup(toks, identity=IDENT)
        first = plan.hits()[1]  # a chunk not at position 0
        h, src = first.chunk_hash, first.start
        hits0 = cpu_hits(server)
        targets = [src, src + 7, src + 250]  # in place and two shifts, interleaved
        items = [(h, targets[i % 3]) for i in range(30)]
        fetched = await c.fetch(items, identity=IDENT, layout=LAYOUT, rope=SPEC)
        assert cpu_hits(server) - hits0 == 1
        assert [f.index for f in fetched] == list(range(30)) and all(f.ok for f in fetched)
        assert [f.delta for f in fetched[:3]] == [0, 7, 250]
        check_rotated(fetched[:6], pl)  # each delta rotated right, the shared copy not rotated twice
        for f in fetched[3:]:
            assert f.data == fetched[f.index % 3].data
        # the last uses of one delta rotate in place: the other delta is still right after it
        tail = await c.fetch([(h, src + 7), (h, src + 250), (h, src + 250)], identity=IDENT, layout=LAYOUT, rope=SPEC)
        check_rotated(tail, pl)
        raw = await c.fetch([(h, 999), (h, 5)] * 8, identity=IDENT, layout=LAYOUT, raw=True)
        assert len({bytes(f.data) for f in raw}) == 1 and not any(f.rotated for f in raw)
        check_rotated(raw[:2], pl)


async def test_max_fetch_bytes_refuses_whole_request(rng):
    server, port = await create_server(make_config())
    target = f"127.0.0.1:{port}"
    try:
        async with SidecarClient(target, tenant="a") as c:
            toks, _ = conversation(rng, 60)
            res, pl = await store_all(c, toks)
            plan = await c.lookup(toks, identity=IDENT)
            hits = plan.hits()
            items = [(x.chunk_hash, x.start) for x in hits]
            size = sum(len(p.view(-1)) * p.element_size() for p in pl.values())
        await server.stop(0.1)
        server, port = await create_server(make_config(max_fetch_bytes=size - 1))
        target = f"127.0.0.1:{port}"
        # the same chunks again on a server with a smaller cap
        async with SidecarClient(target, tenant="a") as c:
            res, pl = await store_all(c, toks)
            hits0 = cpu_hits(server)
            with pytest.raises(ResourceExhausted, match="^max_fetch_bytes: "):  # RESOURCE_EXHAUSTED on the wire
                await c.fetch(items, identity=IDENT, layout=LAYOUT, rope=SPEC)
            assert cpu_hits(server) == hits0  # refused before reading anything
            ok = await c.fetch(items[1:] + [(123456789, 0)] * 50, identity=IDENT, layout=LAYOUT, rope=SPEC)
            assert all(f.ok for f in ok[: len(items) - 1]) and not any(f.ok for f in ok[len(items) - 1:])
    finally:
        await server.stop(0.1)


def test_max_fetch_bytes_must_be_positive():
    with pytest.raises(ValueError, match="max_fetch_bytes"):
        make_config(max_fetch_bytes=0)
    assert dataclasses.replace(make_config(), max_fetch_bytes=1).max_fetch_bytes == 1
