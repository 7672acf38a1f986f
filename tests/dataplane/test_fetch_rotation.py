"""A rotated Fetch over real gRPC rotates every chunk and layer of a window in one batched call:
the streamed payloads are bit-identical to rotating each chunk's rotary parts on
their own, for GQA and MLA layouts in fp32 / fp16 / bf16, with mixed deltas (negative, zero,
positive), duplicates, misses and small fetch windows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sidecar.app import create_server
from sidecar.client import SidecarClient
from sidecar.dataplane import reads as chunk_reads
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.payload import decode_payload
from sidecar.rotation import Pairing, RopeSpec, RotaryLayout, rotate_keys
from sidecar.tiers import StoreConfig
from tests.conftest import ANCHORS, make_config, message

MiB = 1 << 20


def setup(kind: str, dtype: str):
    inv = tuple((1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))).tolist())
    if kind == "gqa":
        layout = KVLayout.gqa(num_layers=3, num_kv_heads=2, head_dim=32, dtype=dtype)
        spec = RopeSpec(rotary_dim=32, key_dim=32, layout=RotaryLayout.LEADING, pairing=Pairing.HALF, inv_freq=inv)
    else:
        layout = KVLayout.mla(num_layers=3, kv_lora_rank=48, qk_rope_head_dim=32, dtype=dtype)
        spec = RopeSpec(rotary_dim=32, key_dim=32, layout=RotaryLayout.TRAILING, pairing=Pairing.INTERLEAVED,
                        inv_freq=inv)
    ident = CacheIdentity(model_id=f"t-{kind}-{dtype}", kv_layout=layout.fingerprint(), rope_fingerprint=spec.fingerprint)
    return layout, spec, ident


def payloads_for(bounds, layout: KVLayout, dtype: torch.dtype, seed: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        a: (torch.randn((b - a) * layout.bytes_per_token // dtype.itemsize, generator=g) * 3).to(dtype).view(torch.uint8)
        for a, b in zip(bounds[:-1], bounds[1:])
    }


def expected(stored: torch.Tensor, layout: KVLayout, n: int, delta: int, spec: RopeSpec) -> bytes:
    """The per-chunk path: each rotary part of each layer rotated on its own."""
    view = decode_payload(stored.clone(), layout, n)
    for part in view.rotary_parts():
        if delta:
            rotate_keys(part.tensor, delta, spec, out=part.tensor)
    view.write_back()
    return view.buffer.numpy().tobytes()


@pytest.fixture
async def served():
    server, port = await create_server(make_config(store=StoreConfig(cpu_bytes=64 * MiB)))
    yield server, f"127.0.0.1:{port}"
    await server.stop(0.1)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["gqa", "mla"])
async def test_rotated_fetch_is_bit_identical_to_the_per_chunk_path(served, rng, kind, dtype):
    server, target = served
    layout, spec, ident = setup(kind, dtype)
    tdtype = getattr(torch, dtype)
    toks = np.concatenate([message(rng, 60), message(rng, 400, ANCHORS[1]), message(rng, 300, ANCHORS[2])]).astype(np.uint32)
    async with SidecarClient(target, tenant="a") as c:
        meta = await c.store(toks, identity=ident)
        bounds = list(meta.chunk_bounds)
        pl = payloads_for(bounds, layout, tdtype, seed=7)
        await c.store(toks, identity=ident, layout=layout, payloads=pl)
        hits = (await c.lookup(toks, identity=ident)).hits()
        chunks = [(h.chunk_hash, h.start - h.chunk_offset, h.end - h.start + h.chunk_offset) for h in hits]
        assert len(chunks) >= 4
        # Mixed deltas: to position 0 (negative), in place (zero), forward, backward by one, and a
        # chunk fetched twice at two targets plus a miss in between.
        items, deltas = [], []
        for i, (h, src, _) in enumerate(chunks):
            d = [-src, 0, 250, -1][i % 4] if src else [0, 17][i % 2]
            items.append((h, src + d))
            deltas.append(d)
        items.append((0xDEAD, 5))
        deltas.append(None)
        h0, src0, _ = chunks[1]
        items.append((h0, src0 + 1000))
        deltas.append(1000)
        fetched = await c.fetch(items, identity=ident, layout=layout, rope=spec)
    assert [f.index for f in fetched] == list(range(len(items)))
    by_hash = {h: src for h, src, _ in chunks}
    for f, (h, _), d in zip(fetched, items, deltas):
        if d is None:
            assert not f.ok
            continue
        assert f.ok and f.delta == d and f.rotated == bool(d)
        src = by_hash[h]
        assert f.data == expected(pl[src], layout, f.num_tokens, d, spec), (kind, dtype, d)


async def test_small_fetch_windows_rotate_each_window_in_one_call(served, rng, monkeypatch):
    """Chunks are read and rotated a bounded window at a time; results do not depend on it."""
    server, target = served
    layout, spec, ident = setup("gqa", "bfloat16")
    toks = np.concatenate([message(rng, 60), message(rng, 400, ANCHORS[1]), message(rng, 300, ANCHORS[2])]).astype(np.uint32)
    async with SidecarClient(target, tenant="a") as c:
        meta = await c.store(toks, identity=ident)
        pl = payloads_for(list(meta.chunk_bounds), layout, torch.bfloat16, seed=8)
        await c.store(toks, identity=ident, layout=layout, payloads=pl)
        hits = (await c.lookup(toks, identity=ident)).hits()
        items = [(h.chunk_hash, h.start - h.chunk_offset + 33) for h in hits]
        whole = await c.fetch(items, identity=ident, layout=layout, rope=spec)
        monkeypatch.setattr(chunk_reads, "_FETCH_WINDOW_BYTES", 1)  # one chunk per window
        rotated0 = server.dataplane.counters.rotated_bytes
        windowed = await c.fetch(items, identity=ident, layout=layout, rope=spec)
    assert [f.data for f in windowed] == [f.data for f in whole]
    for f, h in zip(windowed, hits):
        assert f.data == expected(pl[h.start - h.chunk_offset], layout, f.num_tokens, 33, spec)
    per_token_k = layout.parts[0].bytes_per_token * layout.num_layers
    assert server.dataplane.counters.rotated_bytes - rotated0 == per_token_k * sum(f.num_tokens for f in windowed)
