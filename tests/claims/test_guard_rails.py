"""Guard rails: per-tenant caps, expiry, tenant scoping, shared chunks, bad input, Evict/Delete
of claimed chunks, modes in the tiers, and the bounded event buffer (a slow watcher is dropped
with a counted gap)."""

from __future__ import annotations

import pytest

from sidecar.claims import Admit
from sidecar.client import SidecarClient
from sidecar.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from tests.claims.helpers import BLOCK, IDENT, blocks, events, held_blocks, start, store


async def _run(fn, usable=80, tenants=("t1",), **kw):
    server, target = await start(usable, **kw)
    try:
        clients = [SidecarClient(target, tenant=t) for t in tenants]
        try:
            return await fn(server, *clients)
        finally:
            for c in clients:
                await c.close()
    finally:
        await server.stop(0.1)


async def test_per_tenant_claim_count_and_bytes_caps():
    async def body(server, a, b):
        r = blocks(4, 1000)
        await store(a, r)
        for i in range(3):
            await a.claim(f"c{i}", identity=IDENT, mode="hard_protected", tokens=r)
        with pytest.raises(ResourceExhausted, match="max_claims_per_tenant"):
            await a.claim("c3", identity=IDENT, mode="hard_protected", tokens=r)
        # another tenant has its own count
        rb = blocks(4, 9000)
        await store(b, rb)
        assert (await b.claim("c0", identity=IDENT, mode="hard_protected", tokens=rb)).claim.state == "materialized"
        await a.release_claim("c0")
        assert (await a.claim("c3", identity=IDENT, mode="hard_protected", tokens=r)).claim.state == "materialized"
        assert (await a.stats()).claims_active == 3
    await _run(body, tenants=("t1", "t2"), max_claims_per_tenant=3)

    async def bytes_cap(server, a):
        r = blocks(4, 1000)  # 4 blocks x 4 KiB payload
        await store(a, r)
        d = await a.claim("x", identity=IDENT, mode="hard_protected", tokens=r)
        assert d.claim.footprint_bytes == 4 * 4096
        with pytest.raises(ResourceExhausted, match="max_claimed_bytes_per_tenant"):
            await a.claim("y", identity=IDENT, mode="hard_protected", tokens=r)
    await _run(bytes_cap, max_claimed_bytes_per_tenant=6 * 4096)


async def test_claims_expire_and_the_default_duration_applies():
    async def body(server, c):
        now = [0.0]
        server.claims.ledger.clock = lambda: now[0]
        r = blocks(4, 1000)
        await store(c, r)
        d = await c.claim("d", identity=IDENT, mode="hard_protected", tokens=r)
        assert d.claim.expires_in_s == pytest.approx(120.0)
        await c.claim("e", identity=IDENT, mode="expiring", tokens=r, duration_s=10.0)
        now[0] = 11.0
        assert (await c.get_claim("e")).state == "expired"
        assert (await c.get_claim("d")).state == "materialized"
        now[0] = 121.0
        assert (await c.get_claim("d")).state == "expired"
        assert [e.event for e in await events(c)][-2:] == ["claim_expired", "claim_expired"]
        assert (await c.stats()).claims_active == 0
    await _run(body, default_duration_s=120.0)


async def test_claims_are_tenant_scoped():
    async def body(server, a, b):
        r = blocks(4, 1000)
        await store(a, r)
        await a.claim("mine", identity=IDENT, mode="hard_protected", tokens=r)
        for call in (b.get_claim("mine"), b.release_claim("mine"), b.demote_claim("mine")):
            with pytest.raises(NotFound):
                await call
        hashes = list((await a.get_claim("mine")).chunk_hashes)
        with pytest.raises(InvalidArgument, match=r"chunk_hashes\[0\]: unknown chunk"):
            await b.claim("steal", identity=IDENT, mode="hard_protected", chunk_hashes=hashes)
        assert await events(b) == []  # b sees none of a's events
        assert {e.event for e in await events(a)} == {"claim_accepted", "claim_materialized"}
    await _run(body, tenants=("t1", "t2"))


async def test_two_tenants_on_one_shared_chunk_each_hold_a_reference():
    async def body(server, a, b):
        shared = blocks(10, 1000)
        await store(a, shared, shared=True)
        hashes = None
        for c, cid in ((a, "a-claim"), (b, "b-claim")):
            d = await c.claim(cid, identity=IDENT, mode="hard_protected", tokens=shared, shared=True)
            assert d.claim.state == "materialized"
            hashes = list(d.claim.chunk_hashes)
        assert all(len(server.claims.ledger.watched[h]) == 2 for h in hashes)
        await a.release_claim("a-claim")
        assert all(len(server.claims.ledger.watched[h]) == 1 for h in hashes)
        # b's reference still protects the chunks: pressure evicts everything else first and
        # a Store that cannot fit around them is refused, naming b's claim to b.
        with pytest.raises(ResourceExhausted) as err:
            await store(b, blocks(75, 50_000))
        assert err.value.blocking_claim_ids == ("b-claim",)
        assert held_blocks(server, shared, scope="shared") == (10, 10)
        await b.release_claim("b-claim")
        assert not any(h in server.claims.ledger.watched for h in hashes)
        await store(b, blocks(75, 50_000))
        assert held_blocks(server, shared, scope="shared")[0] == 0  # ordinary eviction once released
    await _run(body, tenants=("t1", "t2"))


async def test_evict_and_delete_of_claimed_chunks_are_refused():
    async def body(server, c):
        r = blocks(4, 1000)
        await store(c, r)
        d = await c.claim("k", identity=IDENT, mode="hard_protected", tokens=r)
        hashes = list(d.claim.chunk_hashes)
        with pytest.raises(FailedPrecondition, match="'k'"):
            await c.delete(hashes)
        with pytest.raises(FailedPrecondition):
            await c.evict(hashes)
        assert held_blocks(server, r) == (4, 4)
        await c.release_claim("k")
        assert await c.delete(hashes) == 4
    await _run(body)


async def test_offloadable_moves_down_a_tier_but_is_never_dropped(tmp_path):
    import dataclasses

    from sidecar.app import create_server
    from sidecar.tiers import StoreConfig
    from tests.claims.helpers import SLOT, config

    cfg = config(20)
    cfg = dataclasses.replace(cfg, store=StoreConfig(cpu_bytes=20 * SLOT, disk_bytes=30 * SLOT,
                                                     disk_path=str(tmp_path), pin_wait_s=0.0))
    server, port = await create_server(cfg)
    try:
        async with SidecarClient(f"127.0.0.1:{port}", tenant="t1") as c:
            r = blocks(10, 1000)
            await store(c, r)
            await c.claim("o", identity=IDENT, mode="offloadable", tokens=r)
            await store(c, blocks(40, 50_000))  # 50 blocks of 50 slots: claimed ones demoted, kept
            assert held_blocks(server, r) == (10, 10)
            tiers = {server.index.registry.peek(h).tier for h in (await c.get_claim("o")).chunk_hashes}
            assert tiers == {"disk"}
            with pytest.raises(ResourceExhausted):
                await store(c, blocks(45, 90_000))  # would need to drop them from the last tier
            assert (await c.get_claim("o")).state == "materialized"
    finally:
        await server.stop(0.1)


async def test_demotable_claim_is_demoted_before_loss():
    async def body(server, c):
        r = blocks(60, 1000)
        await store(c, r)
        await c.claim("dm", identity=IDENT, mode="demotable", tokens=r)
        res = await store(c, blocks(70, 50_000))  # relaxes the demotable claim, then evicts
        assert res.chunks_stored == 70
        assert (await c.get_claim("dm")).state == "demoted"
        evs = [e.event for e in await events(c)]
        assert evs == ["claim_accepted", "claim_materialized", "claim_demoted"]
        assert held_blocks(server, r)[0] == 0
    await _run(body)


async def test_soft_priority_gets_a_second_chance_only():
    async def body(server, c):
        old, soft = blocks(5, 1000), blocks(5, 2000)
        await store(c, soft)
        await store(c, old)
        await c.claim("s", identity=IDENT, mode="soft_priority", tokens=soft)
        await store(c, blocks(5, 3000))  # needs 5 slots: the soft chunks (LRU) are skipped once
        assert held_blocks(server, soft) == (5, 5) and held_blocks(server, old) == (0, 0)
        await store(c, blocks(5, 4000))  # second time round they go
        assert held_blocks(server, soft)[1] == 0
        info = await c.get_claim("s")
        assert info.state == "demoted"  # soft priority carries no obligation: lost, not harmed
        assert "claim_harmed" not in [e.event for e in await events(c)]
    await _run(body, usable=10)


@pytest.mark.parametrize("kwargs,field", [
    (dict(claim_id="", mode="hard_protected", tokens=blocks(1, 0)), "claim_id"),
    (dict(claim_id="bad id!", mode="hard_protected", tokens=blocks(1, 0)), "claim_id"),
    (dict(claim_id="x", mode="expiring", tokens=blocks(1, 0)), "duration_s"),
    (dict(claim_id="x", mode="hard_protected", tokens=blocks(1, 0), duration_s=-1.0), "duration_s"),
    (dict(claim_id="x", mode="hard_protected"), "chunk_hashes | tokens | session_id"),
    (dict(claim_id="x", mode="hard_protected", tokens=blocks(1, 0), chunk_hashes=[1]),
     "chunk_hashes | tokens | session_id"),
    (dict(claim_id="x", mode="hard_protected", tokens=blocks(1, 0), predicate_min_tokens=BLOCK + 1),
     "predicate_min_tokens"),
])
async def test_bad_input_names_the_field_and_changes_nothing(kwargs, field):
    async def body(server, c):
        cid = kwargs.pop("claim_id")
        mode = kwargs.pop("mode")
        with pytest.raises(InvalidArgument, match=field.replace("|", r"\|")):
            await c.claim(cid, identity=IDENT, mode=mode, **kwargs)
        assert (await c.stats()).claims_active == 0 and await events(c) == []
    await _run(body)


async def test_pool_and_admit_validation():
    async def body(server, c):
        with pytest.raises(FailedPrecondition, match="ReportPool"):
            await c.admit_active("r", 10)
        with pytest.raises(InvalidArgument, match="free_blocks"):
            await c.report_pool(usable_blocks=10, free_blocks=11, block_size=16, hard_protection=True)
        with pytest.raises(InvalidArgument, match="block_size"):
            await c.report_pool(usable_blocks=10, free_blocks=10, block_size=0, hard_protection=True)
        await c.report_pool(usable_blocks=10, free_blocks=10, block_size=16, hard_protection=True)
        with pytest.raises(InvalidArgument, match="active_live_blocks"):
            await c.admit_active("r", 0)
        assert (await c.admit_active("r", 10)).decision == Admit.ADMITTED
    await _run(body)


async def test_deferred_when_running_work_holds_the_free_blocks():
    async def body(server, c):
        r = blocks(20, 1000)
        await store(c, r)
        await c.claim("res", identity=IDENT, mode="hard_protected", tokens=r)
        await c.report_pool(usable_blocks=100, free_blocks=50, block_size=BLOCK, hard_protection=True)
        adm = await c.admit_active("big", 40)  # 20 + 40 <= 100, but only 50 - 20 = 30 are free now
        assert adm.decision == Admit.DEFERRED and adm.retry_after_s > 0
        assert list(adm.blocking_claim_ids) == ["res"] and adm.proof.free == 50
        await c.report_pool(usable_blocks=100, free_blocks=100, block_size=BLOCK, hard_protection=True)
        assert (await c.admit_active("big", 40)).decision == Admit.ADMITTED
        assert [e.event for e in await events(c)][-2:] == ["active_deferred", "active_admitted"]
    await _run(body)


async def test_slow_watcher_is_dropped_with_a_counted_gap():
    async def body(server, c):
        objs = [blocks(1, 1000 + 100 * i) for i in range(10)]
        for i, o in enumerate(objs):  # 10 claims accepted before their chunks exist
            await c.claim(f"w{i}", identity=IDENT, mode="hard_protected", tokens=o)
        stream = c.watch_events(follow=True)
        first = [await stream.__anext__() for _ in range(4)]  # the 4 retained events
        assert [e.event for e in first] == ["claim_accepted"] * 4
        import numpy as np
        await store(c, np.concatenate(objs))  # 10 claim_materialized at once > buffer of 4
        dropped = await stream.__anext__()
        assert dropped.event == "watcher_dropped" and dropped.gap == 6
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        assert server.claims.ledger.events.watchers_dropped == 1
        # the server kept going: a new watcher reads the retained tail
        assert [e.event for e in await events(c)] == ["claim_materialized"] * 4
    await _run(body, event_buffer=4)


async def test_session_prefix_object_and_metrics():
    async def body(server, c):
        toks = blocks(8, 1000)
        await store(c, toks)
        sess = await c.open_session(toks, block_size=BLOCK)
        d = await c.claim("sess", identity=IDENT, mode="hard_protected", session_id=sess.session_id,
                          predicate_min_tokens=4 * BLOCK)
        by_tokens = await c.claim("tok", identity=IDENT, mode="hard_protected", tokens=toks[: 4 * BLOCK])
        assert list(d.claim.chunk_hashes) == list(by_tokens.claim.chunk_hashes) and len(d.claim.chunk_hashes) == 4
        assert d.claim.materialized and d.claim.predicate_min_tokens == 4 * BLOCK
        with pytest.raises(NotFound):
            await c.claim("nope", identity=IDENT, mode="hard_protected", session_id="no-such-session")
        await c.report_pool(usable_blocks=5, free_blocks=5, block_size=BLOCK, hard_protection=True)
        assert (await c.admit_active("r1", 3)).decision == Admit.REFUSED  # 4 + 4 + 3 > 5
        from prometheus_client import generate_latest
        text = generate_latest(server.metrics.registry).decode()
        assert 'kv_sidecar_claims{state="materialized"} 2.0' in text
        assert 'kv_sidecar_claim_events_total{event="active_refused"} 1.0' in text
        assert "kv_sidecar_active_refusals_total 1.0" in text
        assert "kv_sidecar_pins_in_flight 0.0" in text
        assert "kv_sidecar_event_watchers_dropped_total 0.0" in text
    await _run(body)


async def test_registry_lru_skips_claimed_entries():
    import dataclasses

    from sidecar.registry.registry import RegistryConfig
    from tests.claims.helpers import config

    cfg = dataclasses.replace(config(80), registry=RegistryConfig(capacity_entries=8))
    from sidecar.app import create_server

    server, port = await create_server(cfg)
    try:
        async with SidecarClient(f"127.0.0.1:{port}", tenant="t1") as c:
            claimed, other = blocks(4, 1000), blocks(4, 2000)
            await store(c, claimed)
            await store(c, other)
            await c.claim("reg", identity=IDENT, mode="hard_protected", tokens=claimed)
            await store(c, blocks(6, 3000))  # 14 entries > 8: the LRU ones go, except the claimed
            assert held_blocks(server, claimed) == (4, 4)
            assert held_blocks(server, other) == (0, 0)
            assert len(server.index.registry) == 8
            assert (await c.get_claim("reg")).state == "materialized"
    finally:
        await server.stop(0.1)
