"""Repeated content keeps an exact copy per left context (docs/architecture.md, "Copies of one chunk").

Agents re-read files and re-print listings: the same chunk text sits at several positions of
one history, each occurrence computed by the engine after its own left context. The registry
keeps, per chunk, its first stored copy (canonical: the rotation source of shifted hits) and up
to ``registry.copies_per_chunk - 1`` more copies computed after other left contexts, each under
its own key (``variant_key(chunk key, prefix digest)``) with its own payload in the tiers. A
Lookup plans a chunk EXACT (delta 0) from the copy computed after the prompt's own left
context when one is held, and Fetch serves that copy's own bytes.

Real sidecars over loopback gRPC with real LMCache-backed tiers; the bound and its replacement
rule are also checked on the registry alone.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from sidecar.app import create_server
from sidecar.client import SidecarClient
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.registry.entry import ChunkEntry, EntryState, variant_key
from sidecar.registry.lookup_plan import Fidelity, SegmentKind
from sidecar.registry.registry import InMemoryRegistry, RegistryConfig
from sidecar.routing.config import RoutingConfig
from sidecar.tiers import StoreConfig, Tier, chunk_key
from tests.conftest import ANCHORS, make_config, message

MiB = 1 << 20
LAYOUT = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32")
IDENT = CacheIdentity(model_id="copies", kv_layout=LAYOUT.fingerprint())


async def start(tmp_path=None, registry: RegistryConfig | None = None, **store_kw):
    store = StoreConfig(**(store_kw or {"cpu_bytes": 64 * MiB}))
    kw = {"registry": registry} if registry is not None else {}
    return await create_server(make_config(store=store, routing=RoutingConfig(replica_id="r0"), **kw))


def repeated(rng: np.random.Generator, m: np.ndarray, headers=(40, 50, 70, 30)) -> np.ndarray:
    """``m`` three times, each after other text: [h0] m [h1] m [h2] m [h3]."""
    parts = [message(rng, headers[0], ANCHORS[0])]
    for n in headers[1:]:
        parts += [m, message(rng, n, ANCHORS[2])]
    return np.concatenate(parts).astype(np.uint32)


def payloads_for(bounds, seed: int) -> dict[int, torch.Tensor]:
    """A distinct payload per chunk position: the engine computed each occurrence itself."""
    g = torch.Generator().manual_seed(seed)
    per_tok = LAYOUT.bytes_per_token // 4
    return {a: torch.randn((b - a) * per_tok, generator=g) for a, b in zip(bounds[:-1], bounds[1:])}


async def store(c: SidecarClient, tokens: np.ndarray, seed: int, metadata_first: bool) -> dict[int, torch.Tensor]:
    """Store a payload for every chunk; with ``metadata_first`` a metadata-only Store goes
    first (as a dry registration would), else the chunk bounds come from a dry-run Lookup."""
    if metadata_first:
        bounds = (await c.store(tokens, identity=IDENT)).chunk_bounds
    else:
        bounds = (await c.lookup(tokens, identity=IDENT, dry_run=True)).chunk_bounds.tolist()
    pl = payloads_for(bounds, seed)
    res = await c.store(tokens, identity=IDENT, layout=LAYOUT, payloads=pl)
    assert res.chunks_stored == len(pl)
    return pl


def hits(plan) -> list:
    return [s for s in plan.segments if s.kind is SegmentKind.CHUNK_HIT]


def occurrences(tokens: np.ndarray, m: np.ndarray) -> list[int]:
    n = len(m)
    return [i for i in range(len(tokens) - n + 1) if tokens[i] == m[0] and np.array_equal(tokens[i : i + n], m)]


async def check_served_exactly(c: SidecarClient, tokens: np.ndarray, pl: dict[int, torch.Tensor]) -> list:
    """Every chunk of ``tokens`` planned EXACT at delta 0 and fetched as its own stored bytes."""
    plan = await c.lookup(tokens, identity=IDENT)
    plan.check_tiling(len(tokens))
    m = plan.summary
    assert (m.exact_tokens, m.shifted_tokens, m.prefill_tokens) == (len(tokens), 0, 0)
    segs = hits(plan)
    assert all(s.fidelity is Fidelity.EXACT and s.delta == 0 and s.chunk_offset == 0 for s in segs)
    assert sorted(s.start for s in segs) == sorted(pl)
    got = await c.fetch([(s.chunk_hash, s.start) for s in segs], identity=IDENT, layout=LAYOUT, raw=True)
    for s, kv in zip(segs, got):
        assert kv.ok and kv.delta == 0 and not kv.rotated and kv.source_pos == s.start
        assert bytes(kv.data) == pl[s.start].view(torch.uint8).numpy().tobytes(), s
    return segs


@pytest.mark.parametrize("metadata_first", [False, True], ids=["one-store", "metadata-first"])
async def test_a_chunk_repeated_three_times_is_exact_at_every_occurrence(rng, metadata_first):
    server, port = await start()
    try:
        async with SidecarClient(f"127.0.0.1:{port}", tenant="a") as c:
            m = message(rng, 150, ANCHORS[1])
            tokens = repeated(rng, m)
            pl = await store(c, tokens, seed=1, metadata_first=metadata_first)
            segs = await check_served_exactly(c, tokens, pl)
            # the three occurrences: one chunk key each (the first copy's, then two more copies')
            at = occurrences(tokens, m)
            assert len(at) == 3
            keys = [next(s.chunk_hash for s in segs if s.start == a) for a in at]
            assert len(set(keys)) == 3
            reg = server.index.registry
            first = reg.peek(keys[0])
            assert first.base_key == 0 and sorted(reg.copies(keys[0])) == sorted(keys)
            for a, k in zip(at[1:], keys[1:]):
                e = reg.peek(k)
                assert (e.base_key, e.source_pos, e.tokens) == (keys[0], a, first.tokens)
                assert k == variant_key(keys[0], e.prefix_digest)
            # the exact policy serves all of it too
            plan = await c.lookup(tokens, identity=IDENT, policy="exact")
            assert plan.summary.exact_tokens == len(tokens)
            # Score: the leading exact run is the whole prompt
            s = (await c.score(tokens, IDENT, ["r0"])).scores[0]
            assert (s.prefix_tokens, s.exact_tokens, s.shifted_tokens, s.prefill_tokens) == (len(tokens), 0, 0, 0)
            # storing the same prompt again dedups: no new copies, no new bytes
            objects = server.dataplane.store.stats().tiers[Tier.CPU].objects
            assert objects == len(pl)
            n = len(reg)
            await store(c, tokens, seed=2, metadata_first=False)
            assert len(reg) == n and server.dataplane.store.stats().tiers[Tier.CPU].objects == objects
            await check_served_exactly(c, tokens, pl)  # still the first Store's bytes
            # text moved elsewhere: shifted, rotated from the canonical (first) copy
            moved = np.concatenate([message(rng, 90, ANCHORS[0]), m]).astype(np.uint32)
            plan = await c.lookup(moved, identity=IDENT, recompute_tokens=0)
            (h,) = [s for s in hits(plan) if s.start == 91]
            assert h.chunk_hash == keys[0] and h.fidelity is Fidelity.APPROXIMATE and h.delta == 91 - at[0]
            # Delete of one copy removes the chunk's content wherever it was stored: every copy
            assert await c.delete([keys[1]]) == 3
            assert not any(server.dataplane.store.contains(chunk_key(k)) for k in keys)
            assert not any(s.start in at for s in hits(await c.lookup(tokens, identity=IDENT)))
    finally:
        await server.stop(0.1)


async def test_copies_are_bounded_per_chunk(rng):
    """registry.copies_per_chunk 2 (and no token allowance): the canonical copy and one more. Each new left context's
    copy replaces the least recently used other copy (its payload leaves the tiers with it); the
    canonical copy stays. Every Lookup still plans correctly: EXACT from a held copy, else
    APPROXIMATE from the canonical one, with the right bytes either way."""
    server, port = await start(registry=RegistryConfig(copies_per_chunk=2, copy_tokens_per_chunk=0))
    try:
        async with SidecarClient(f"127.0.0.1:{port}", tenant="a") as c:
            m = message(rng, 60, ANCHORS[1])  # one chunk (below the expected chunk size; checked)
            prompts = [np.concatenate([message(rng, 40 + 9 * i, ANCHORS[0]), m]).astype(np.uint32) for i in range(5)]
            stored = []
            reg = server.index.registry
            for i, p in enumerate(prompts):
                stored.append(await store(c, p, seed=10 + i, metadata_first=False))
                assert max(stored[-1]) == len(p) - len(m)  # m is the last chunk, whole
            keys_m = [k for k in (e.key for e in reg.entries()) if reg.peek(k).tokens == m.tobytes()]
            assert len(keys_m) == 2  # bounded
            base = [k for k in keys_m if reg.peek(k).base_key == 0]
            assert len(base) == 1 and reg.peek(base[0]).source_pos == len(prompts[0]) - len(m)  # the first copy
            kept = {reg.peek(k).source_pos for k in keys_m}
            assert kept == {len(prompts[0]) - len(m), len(prompts[-1]) - len(m)}
            # evicted copies took their payloads with them
            assert all(server.dataplane.store.contains(chunk_key(k)) for k in keys_m)
            for i, p in enumerate(prompts):
                a = len(p) - len(m)
                plan = await c.lookup(p, identity=IDENT, recompute_tokens=0)
                plan.check_tiling(len(p))
                (h,) = [s for s in hits(plan) if s.start == a]
                got = (await c.fetch([(h.chunk_hash, a)], identity=IDENT, layout=LAYOUT, raw=True))[0]
                assert got.ok
                if a in kept:
                    assert h.fidelity is Fidelity.EXACT and h.delta == 0
                    assert bytes(got.data) == stored[i][a].view(torch.uint8).numpy().tobytes()
                else:
                    assert h.fidelity is Fidelity.APPROXIMATE and h.chunk_hash == base[0]
                    assert bytes(got.data) == stored[0][len(prompts[0]) - len(m)].view(torch.uint8).numpy().tobytes()
    finally:
        await server.stop(0.1)


async def test_copies_survive_a_restart(rng, tmp_path):
    """Each copy's payload names the chunk it is a copy of (``aux``): a sidecar restarted over
    the same disk tier serves every occurrence exactly again and keeps bounding the copies."""
    disk = str(tmp_path / "kv")
    kw = dict(cpu_bytes=64 * MiB, disk_path=disk, disk_bytes=64 * MiB)
    m = message(rng, 60, ANCHORS[1])  # one chunk
    tokens = repeated(rng, m)
    server, port = await start(**kw)
    try:
        async with SidecarClient(f"127.0.0.1:{port}", tenant="a") as c:
            pl = await store(c, tokens, seed=3, metadata_first=False)
            keys = sorted(server.index.registry.copies(next(k for k in server.index.registry.keys_lru()
                                                             if server.index.registry.peek(k).tokens == m.tobytes())))
    finally:
        await server.stop(0.1)  # spills the CPU tier to disk
    server, port = await start(**kw)
    try:
        async with SidecarClient(f"127.0.0.1:{port}", tenant="a") as c:
            reg = server.index.registry
            assert sorted(reg.copies(keys[0])) == keys
            await check_served_exactly(c, tokens, pl)
    finally:
        await server.stop(0.1)


# ------------------------------------------------------------------------------ registry alone


def entry(key: int, base: int = 0, pos: int = 0, scope: str = "a") -> ChunkEntry:
    return ChunkEntry(key=key, scope=scope, tokens=b"\x01\x00\x00\x00" * 4, source_pos=pos, prefix_digest=pos,
                      left_context=b"", state=EntryState.RESIDENT, base_key=base)


def test_bound_and_replacement_rule():
    """Copies of one chunk beyond the bound: the least recently used other copy goes (a served
    hit refreshes a copy), never the canonical one, never a claimed one; events say why."""
    reg = InMemoryRegistry(RegistryConfig(copies_per_chunk=3, copy_tokens_per_chunk=0, compiled_lookup=False))
    reg.insert(entry(1))
    for k in (11, 12):
        assert reg.insert(entry(k, base=1, pos=k))
    assert sorted(reg.copies(1)) == [1, 11, 12]
    reg.touch(reg.peek(11))  # 12 is now the least recently used copy
    assert reg.insert(entry(13, base=1, pos=13))
    assert sorted(reg.copies(1)) == [1, 11, 13]
    assert [(ev.key, ev.reason) for ev in reg.take_events()] == [(12, "copies")]
    reg.touch(reg.peek(1))
    reg.protected.add(11)  # claimed: skipped
    assert reg.insert(entry(14, base=1, pos=14))
    assert sorted(reg.copies(1)) == [1, 11, 14]
    assert [(ev.key, ev.reason) for ev in reg.take_events()] == [(13, "copies")]
    # every copy of the chunk answers for all of them; other chunks are not affected
    assert sorted(reg.copies(14)) == [1, 11, 14]
    reg.insert(entry(2))
    assert reg.copies(2) == [2] and reg.copies(99) == []
    # the canonical copy evicted or deleted: its copies stay (each still an exact hit)
    reg.delete(1)
    assert sorted(reg.copies(11)) == [11, 14]
    with pytest.raises(ValueError, match="registry.copies_per_chunk"):
        RegistryConfig(copies_per_chunk=0)
    with pytest.raises(ValueError, match="registry.copy_tokens_per_chunk"):
        RegistryConfig(copy_tokens_per_chunk=-1)


def test_short_chunks_keep_more_copies():
    """copy_tokens_per_chunk: a short chunk (a template piece repeated in every message) keeps
    other copies while they hold at most that many tokens; a long one copies_per_chunk - 1."""
    cfg = RegistryConfig(copies_per_chunk=3, copy_tokens_per_chunk=20, compiled_lookup=False)
    assert [cfg.max_copies(n) for n in (1, 4, 8, 10, 128)] == [20, 5, 2, 2, 2]
    assert RegistryConfig(copies_per_chunk=1).max_copies(1) == 0  # the first copy only
    reg = InMemoryRegistry(cfg)
    reg.insert(entry(1))  # 4 tokens: 5 other copies
    for k in range(11, 18):
        reg.insert(entry(k, base=1, pos=k))
    assert sorted(reg.copies(1)) == [1, 13, 14, 15, 16, 17]
    assert [ev.key for ev in reg.take_events()] == [11, 12]


# --------------------------------------------------------------------- peers (shared registry)


def test_a_peer_serves_every_copy_through_the_shared_registry(redis_url, redis_client, prefix, rng):
    """Two sidecar processes share one Redis registry and remote tier: A Stores the repeated
    history; B's first Lookup (one round trip) plans every occurrence EXACT from A's copies and
    B's Fetch reads each occurrence's own bytes through the remote tier."""
    from sidecar.client import SyncSidecarClient
    from sidecar.process import sidecar_process

    sets = {
        "chunker.anchor_tokens": "[" + ",".join(map(str, ANCHORS)) + "]",
        "shared_registry.redis_url": redis_url, "shared_registry.key_prefix": prefix,
        "shared_registry.publish_interval_s": 0.02, "store.namespace": prefix, "store.cpu_bytes": 64 * MiB,
        "store.remote_url": redis_url, "store.remote_bytes": 256 * MiB,
    }
    argv = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    m = message(rng, 60, ANCHORS[1])
    tokens = repeated(rng, m)
    with sidecar_process(*argv) as a, sidecar_process(*argv) as b, \
            SyncSidecarClient(a, tenant="alice") as ca, SyncSidecarClient(b, tenant="alice") as cb:
        bounds = ca.lookup(tokens, identity=IDENT, dry_run=True).chunk_bounds.tolist()
        pl = payloads_for(bounds, seed=4)
        assert ca.store(tokens, identity=IDENT, layout=LAYOUT, payloads=pl).chunks_stored == len(pl)
        want = {a: t.view(torch.uint8).numpy().tobytes() for a, t in pl.items()}
        deadline = time.monotonic() + 20
        while True:  # publication is asynchronous (publish_interval_s): a liveness bound
            plan = cb.lookup(tokens, identity=IDENT)
            if plan.summary.exact_tokens == len(tokens) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert (plan.summary.exact_tokens, plan.summary.shifted_tokens) == (len(tokens), 0)
        segs = hits(plan)
        assert all(s.fidelity is Fidelity.EXACT and s.delta == 0 for s in segs)
        got = cb.fetch([(s.chunk_hash, s.start) for s in segs], identity=IDENT, layout=LAYOUT, raw=True)
        assert {kv.source_pos: bytes(kv.data) for kv in got} == want
        assert {kv.tier for kv in got} == {"remote"}


async def test_another_shard_fetches_its_own_copies_from_the_plan(rng):
    """Tensor-parallel ranks Store the same repeated history (each its own heads); rank 1 fetching
    rank 0's plan (``plan_identity``) gets each occurrence's own copy of rank 1's heads, exactly
    what its own Lookup and Fetch give."""
    import dataclasses

    ranks = [dataclasses.replace(IDENT, shard=f"tp{r}of2") for r in range(2)]
    server, port = await start()
    try:
        async with SidecarClient(f"127.0.0.1:{port}", tenant="a") as c:
            tokens = repeated(rng, message(rng, 60, ANCHORS[1]))
            bounds = (await c.lookup(tokens, identity=ranks[0], dry_run=True)).chunk_bounds.tolist()
            for r, ident in enumerate(ranks):
                pl = payloads_for(bounds, seed=20 + r)
                assert (await c.store(tokens, identity=ident, layout=LAYOUT, payloads=pl)).chunks_stored == len(pl)
            plan0 = await c.lookup(tokens, identity=ranks[0])
            plan1 = await c.lookup(tokens, identity=ranks[1])
            assert plan0.summary.exact_tokens == plan1.summary.exact_tokens == len(tokens)
            items0 = [(s.chunk_hash, s.start) for s in plan0.hits()]
            items1 = [(s.chunk_hash, s.start) for s in plan1.hits()]
            own = await c.fetch(items1, identity=ranks[1], layout=LAYOUT, raw=True)
            via = await c.fetch(items0, identity=ranks[1], plan_identity=ranks[0], layout=LAYOUT, raw=True)
            assert all(f.ok and f.delta == 0 for f in via)
            assert [bytes(f.data) for f in via] == [bytes(f.data) for f in own]
    finally:
        await server.stop(0.1)
