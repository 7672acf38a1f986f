"""Store with KV payloads and Fetch over real gRPC, on real LMCache-backed tiers."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from sidecar.app import create_server
from sidecar.client import SidecarClient
from sidecar.config import AuthConfig
from sidecar.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.payload import decode_payload
from sidecar.rotation import RopeSpec, rotate_keys
from sidecar.tiers import StoreConfig, TenantQuota
from tests.conftest import ANCHORS, make_config, message

MiB = 1 << 20
HF = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
SPEC = RopeSpec.from_hf_config(HF)
LAYOUT = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32")
IDENT = CacheIdentity(model_id="tiny-llama", kv_layout=LAYOUT.fingerprint(), rope_fingerprint=SPEC.fingerprint)


async def start(tmp_path=None, **store_kw):
    store = StoreConfig(**store_kw) if store_kw else StoreConfig(cpu_bytes=64 * MiB)
    # tenant "a" is an operator: its Stats show the whole server (tier objects, hits)
    server, port = await create_server(make_config(store=store, auth=AuthConfig(operators=("a",))))
    return server, f"127.0.0.1:{port}"


def payloads_for(bounds, seed=0) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per_tok = LAYOUT.bytes_per_token // 4
    return {a: torch.randn((b - a) * per_tok, generator=g) for a, b in zip(bounds[:-1], bounds[1:])}


def conversation(rng, header: int) -> tuple[np.ndarray, np.ndarray]:
    body = np.concatenate([message(rng, 400, ANCHORS[1]), message(rng, 300, ANCHORS[2])])
    return np.concatenate([message(rng, header), body]).astype(np.uint32), body


async def store_all(client, tokens, seed=0):
    meta = await client.store(tokens, identity=IDENT)
    pl = payloads_for(meta.chunk_bounds, seed)
    res = await client.store(tokens, identity=IDENT, layout=LAYOUT, payloads=pl)
    return res, pl


def check_rotated(fetched, payloads):
    """Each fetched payload equals its stored payload with K rotated by delta (V untouched)."""
    for kv in fetched:
        assert kv.ok
        src = decode_payload(payloads[kv.source_pos].view(torch.uint8).clone(), LAYOUT, kv.num_tokens)
        got = decode_payload(bytearray(kv.data), LAYOUT, kv.num_tokens)
        for layer in range(LAYOUT.num_layers):
            want_k = rotate_keys(src.part(layer, "k"), kv.delta, SPEC) if kv.rotated else src.part(layer, "k")
            assert torch.equal(got.part(layer, "k"), want_k)
            assert torch.equal(got.part(layer, "v"), src.part(layer, "v"))


async def test_store_lookup_fetch_rotated(rng):
    server, target = await start()
    try:
        first, body = conversation(rng, 60)
        second = np.concatenate([message(rng, 310), body]).astype(np.uint32)
        async with SidecarClient(target, tenant="a") as c:
            res, pl = await store_all(c, first)
            assert res.chunks_stored == len(pl) and res.chunks_observed == 0
            # not a dry run: resident chunks are served; k=0: whole chunks, no boundary repair
            plan = await c.lookup(second, identity=IDENT, recompute_tokens=0)
            plan.check_tiling(len(second))
            hits = plan.hits()
            assert plan.summary.shifted_tokens == len(body)
            fetched = await c.fetch([(h.chunk_hash, h.start - h.chunk_offset) for h in hits], identity=IDENT,
                                    layout=LAYOUT, rope=SPEC)
            assert [f.chunk_hash for f in fetched] == [h.chunk_hash for h in hits]
            assert all(f.rotated and f.delta == 250 and f.tier == "cpu" for f in fetched)
            check_rotated(fetched, pl)
            raw = await c.fetch([(hits[0].chunk_hash, hits[0].start)], identity=IDENT, layout=LAYOUT, raw=True)
            assert not raw[0].rotated and raw[0].delta == 250
            check_rotated(raw, pl)
            stats = await c.stats()
            cpu = [t for t in stats.tiers if t.tier == "cpu"][0]
            assert cpu.objects == len(pl) and cpu.hits >= len(hits)
    finally:
        await server.stop(0.1)


async def test_demotion_to_disk_and_restart_recovery(rng, tmp_path):
    disk = str(tmp_path / "kv")
    server, target = await start(cpu_bytes=256 << 10, disk_path=disk, disk_bytes=64 * MiB)
    first, body = conversation(rng, 60)
    try:
        async with SidecarClient(target, tenant="a") as c:
            res, pl = await store_all(c, first)
            stats = await c.stats()
            tiers = {t.tier: t for t in stats.tiers}
            assert tiers["disk"].objects >= 1  # the small CPU tier demoted instead of dropping
            plan = await c.lookup(first, identity=IDENT)
            assert plan.summary.exact_tokens == len(first)
            fetched = await c.fetch([(h.chunk_hash, h.start) for h in plan.hits()], identity=IDENT, layout=LAYOUT,
                                    rope=SPEC)
            assert {f.tier for f in fetched} >= {"disk"}
            check_rotated(fetched, pl)
    finally:
        await server.stop(0.1)
    # A new sidecar over the same disk directory serves the old chunks.
    server, target = await start(cpu_bytes=256 << 10, disk_path=disk, disk_bytes=64 * MiB)
    try:
        async with SidecarClient(target, tenant="a") as c:
            second = np.concatenate([message(rng, 200), body]).astype(np.uint32)
            plan = await c.lookup(second, identity=IDENT)
            hits = plan.hits()
            assert hits and plan.summary.shifted_tokens > 0
            fetched = await c.fetch([(h.chunk_hash, h.start - h.chunk_offset) for h in hits], identity=IDENT,
                                    layout=LAYOUT, rope=SPEC)
            check_rotated(fetched, pl)
    finally:
        await server.stop(0.1)


async def test_bad_payloads_change_nothing(rng):
    server, target = await start(cpu_bytes=64 * MiB, tenant_quotas={"small": TenantQuota(max_bytes=200_000)})
    toks, _ = conversation(rng, 60)
    try:
        async with SidecarClient(target, tenant="a") as c, SidecarClient(target, tenant="small") as small:
            meta = await c.store(toks, identity=IDENT)
            bounds = meta.chunk_bounds
            pl = payloads_for(bounds)
            before = (await c.stats()).registry
            other = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16")
            with pytest.raises(FailedPrecondition, match="identity.kv_layout"):
                await c.store(toks, identity=IDENT, layout=other, payloads=pl)
            short = dict(pl)
            short[bounds[1]] = pl[bounds[1]][:-4]
            with pytest.raises(InvalidArgument, match="payload.data"):
                await c.store(toks, identity=IDENT, layout=LAYOUT, payloads=short)
            shifted = {bounds[1] + 1: pl[bounds[1]]}
            with pytest.raises(InvalidArgument, match="payload.chunk_start"):
                await c.store(toks, identity=IDENT, layout=LAYOUT, payloads=shifted)
            with pytest.raises(ResourceExhausted, match="quota"):
                await small.store(toks, identity=IDENT, layout=LAYOUT, payloads=pl)
            after = await c.stats()
            assert after.registry.entries == before.entries
            assert all(t.objects == 0 for t in after.tiers)
            plan = await c.lookup(toks, identity=IDENT)
            assert plan.summary.chunks_hit == 0  # still observed only: nothing resident
    finally:
        await server.stop(0.1)


async def test_fetch_misses_and_refusals(rng):
    server, target = await start()
    first, body = conversation(rng, 60)
    try:
        async with SidecarClient(target, tenant="a") as a, SidecarClient(target, tenant="b") as b:
            _, pl = await store_all(a, first)
            plan = await a.lookup(first, identity=IDENT)
            h = plan.hits()[1]
            unknown = await a.fetch([(12345, 100), (h.chunk_hash, h.start)], identity=IDENT, layout=LAYOUT, rope=SPEC)
            assert [f.ok for f in unknown] == [False, True]
            foreign = await b.fetch([(h.chunk_hash, h.start)], identity=IDENT, layout=LAYOUT, rope=SPEC)
            assert not foreign[0].ok  # another tenant's chunk is a miss, not a leak
            with pytest.raises(InvalidArgument, match="rope"):
                await a.fetch([(h.chunk_hash, h.start + 7)], identity=IDENT, layout=LAYOUT)
            bad_rope = RopeSpec.from_hf_config(HF, pairing="interleaved")
            with pytest.raises(FailedPrecondition, match="rope_fingerprint"):
                await a.fetch([(h.chunk_hash, h.start + 7)], identity=IDENT, layout=LAYOUT, rope=bad_rope)
            # Deleting by another tenant does nothing; by the owner removes KV and entry.
            assert await b.delete([h.chunk_hash]) == 0
            assert await a.delete([h.chunk_hash]) == 1
            gone = await a.fetch([(h.chunk_hash, h.start)], identity=IDENT, layout=LAYOUT, rope=SPEC)
            assert not gone[0].ok
            replan = await a.lookup(first, identity=IDENT)
            assert h.chunk_hash not in {s.chunk_hash for s in replan.hits()}
    finally:
        await server.stop(0.1)


async def test_fetched_payloads_are_writable_buffers_the_caller_owns(rng, monkeypatch):
    # The client carves payloads out of shared blocks (sidecar.sdk.fetch.PayloadArena); each is
    # still the caller's own: writable, exactly its bytes, and writing one changes no other
    # payload and nothing on the server. A tiny block size makes chunks span several blocks.
    import sidecar.sdk.fetch

    monkeypatch.setattr(sidecar.sdk.fetch, "_PAYLOAD_BLOCK", 3 * LAYOUT.bytes_per_token * 64)
    server, target = await start()
    first, _ = conversation(rng, 60)
    try:
        async with SidecarClient(target, tenant="a") as a:
            _, pl = await store_all(a, first)
            items = [(h.chunk_hash, h.start) for h in (await a.lookup(first, identity=IDENT)).hits()]
            got = await a.fetch(items, identity=IDENT, layout=LAYOUT, raw=True)
            assert len(got) == len(pl) >= 3
            for kv in got:
                assert isinstance(kv.data, memoryview) and not kv.data.readonly
                assert bytes(kv.data) == pl[kv.source_pos].numpy().tobytes()
            got[0].data[:] = bytes(len(got[0].data))
            for kv in got[1:]:
                assert bytes(kv.data) == pl[kv.source_pos].numpy().tobytes()
            again = await a.fetch(items[:1], identity=IDENT, layout=LAYOUT, raw=True)
            assert bytes(again[0].data) == pl[again[0].source_pos].numpy().tobytes()
    finally:
        await server.stop(0.1)


async def test_operator_evict_demotes(rng, tmp_path):
    server, target = await start(cpu_bytes=64 * MiB, disk_path=str(tmp_path / "kv"), disk_bytes=64 * MiB)
    toks, _ = conversation(rng, 60)
    try:
        async with SidecarClient(target, tenant="a") as c:
            _, pl = await store_all(c, toks)
            plan = await c.lookup(toks, identity=IDENT)
            keys = [h.chunk_hash for h in plan.hits()]
            with pytest.raises(InvalidArgument, match="tier"):
                await c.evict(keys, tier="tape")
            assert await c.evict(keys[:2], tier="cpu") == 2
            fetched = await c.fetch([(h.chunk_hash, h.start) for h in plan.hits()[:2]], identity=IDENT,
                                    layout=LAYOUT, rope=SPEC)
            assert [f.tier for f in fetched] == ["disk", "disk"]  # demoted, not lost
            check_rotated(fetched, pl)
    finally:
        await server.stop(0.1)


async def test_concurrent_stores_and_fetches_of_the_same_chunks(rng):
    server, target = await start()
    toks, body = conversation(rng, 60)
    shifted = np.concatenate([message(rng, 123), body]).astype(np.uint32)
    try:
        async with SidecarClient(target, tenant="a") as c:
            meta = await c.store(toks, identity=IDENT)
            pl = payloads_for(meta.chunk_bounds)
            await c.store(toks, identity=IDENT, layout=LAYOUT, payloads=pl)
            plan = await c.lookup(shifted, identity=IDENT)
            items = [(h.chunk_hash, h.start - h.chunk_offset) for h in plan.hits()]
            jobs = []
            for i in range(6):
                jobs.append(c.store(toks, identity=IDENT, layout=LAYOUT, payloads=pl))
                jobs.append(c.fetch(items, identity=IDENT, layout=LAYOUT, rope=SPEC))
            out = await asyncio.gather(*jobs)
            for r in out[1::2]:
                check_rotated(r, pl)
            assert all(r.chunks_stored == len(pl) for r in out[0::2])
    finally:
        await server.stop(0.1)


async def test_fetch_requires_layout(rng):
    server, target = await start()
    try:
        from sidecar.api.kv import identity_to_wire
        from sidecar.v1 import sidecar_pb2 as pb
        from sidecar.v1 import sidecar_pb2_grpc as pb_grpc

        async with grpc.aio.insecure_channel(target) as ch:
            stub = pb_grpc.KVSidecarStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                async for _ in stub.Fetch(pb.FetchRequest(identity=identity_to_wire(IDENT))):
                    pass
            assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT and ei.value.details().startswith("layout")
    finally:
        await server.stop(0.1)


async def test_corrupted_disk_chunk_is_a_miss_and_metrics(rng, tmp_path):
    import urllib.request
    from pathlib import Path

    disk = tmp_path / "kv"
    server, target = await start(cpu_bytes=256 << 10, disk_path=str(disk), disk_bytes=64 * MiB)
    toks, _ = conversation(rng, 60)
    try:
        async with SidecarClient(target, tenant="a") as c:
            _, pl = await store_all(c, toks)
            plan = await c.lookup(toks, identity=IDENT)
            on_disk = [h for h in plan.hits()]
            files = [p for p in Path(disk).rglob("*") if p.is_file() and p.stat().st_size > 4096]
            assert files, "expected demoted chunks on disk"
            for f in files:  # truncate every payload file on disk
                with open(f, "r+b") as fh:
                    fh.truncate(f.stat().st_size // 2)
            fetched = await c.fetch([(h.chunk_hash, h.start) for h in on_disk], identity=IDENT, layout=LAYOUT, rope=SPEC)
            ok = [f for f in fetched if f.ok]
            missed = [f for f in fetched if not f.ok]
            assert missed and all(f.tier == "cpu" for f in ok)  # corrupt files are misses, not errors
            check_rotated(ok, pl)
            replan = await c.lookup(toks, identity=IDENT)
            assert not {f.chunk_hash for f in missed} & {s.chunk_hash for s in replan.hits()}
            with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5) as r:
                body = r.read().decode()
            assert 'kv_sidecar_tier_bytes{tier="cpu"}' in body and 'kv_sidecar_tier_objects{tier="disk"}' in body
            assert "kv_sidecar_fetch_bytes_total" in body and "kv_sidecar_store_bytes_total" in body
            losses = [ln for ln in body.splitlines() if ln.startswith("kv_sidecar_tier_losses_total{")]
            assert losses and sum(float(ln.rsplit(" ", 1)[1]) for ln in losses) >= len(missed)
    finally:
        await server.stop(0.1)


async def test_payload_for_a_chunk_observed_elsewhere_takes_the_payload_position(rng):
    """A chunk first registered metadata-only at one position, then stored with KV computed at
    another position, must be served (rotated) from where its KV was computed."""
    server, target = await start()
    body = message(rng, 300, ANCHORS[1])
    t1 = np.concatenate([message(rng, 100), body]).astype(np.uint32)
    t2 = np.concatenate([message(rng, 150), body]).astype(np.uint32)
    t3 = np.concatenate([message(rng, 60), body]).astype(np.uint32)
    try:
        async with SidecarClient(target, tenant="a") as c:
            await c.store(t1, identity=IDENT)  # observed at 101
            meta = await c.store(t2, identity=IDENT, register_from=151)
            pl = payloads_for(meta.chunk_bounds)
            await c.store(t2, identity=IDENT, layout=LAYOUT, payloads=pl, register_from=151)  # KV computed at 151
            plan = await c.lookup(t3, identity=IDENT)
            hits = plan.hits()
            assert hits and all(h.delta == 61 - 151 for h in hits)
            fetched = await c.fetch([(h.chunk_hash, h.start - h.chunk_offset) for h in hits], identity=IDENT,
                                    layout=LAYOUT, rope=SPEC)
            assert all(f.source_pos >= 151 for f in fetched)
            check_rotated(fetched, pl)
    finally:
        await server.stop(0.1)
