"""Tensor-parallel shards: one Lookup (rank 0's identity) plans for every rank; each rank Fetches
its own heads by naming the plan's identity (``FetchRequest.plan_identity``).

Real sidecar over loopback gRPC. Two shards of one model Store the same prompts with different
payloads (each its own KV heads); rank 1 fetching rank 0's plan gets exactly what its own Lookup
and Fetch would give, item by item and span by span, rotated or raw; a chunk only rank 0 holds is
a miss for rank 1; another tenant's plan translates to nothing; a plan identity that is not a
shard of the same model is refused naming the field.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sidecar.app import create_server
from sidecar.client import SidecarClient
from sidecar.errors import InvalidArgument
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.rotation import Pairing, RopeSpec, RotaryLayout
from tests.conftest import make_config, message

LAYOUT = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")  # one rank's heads
ROPE = RopeSpec(rotary_dim=16, key_dim=16, layout=RotaryLayout.LEADING, pairing=Pairing.HALF,
                inv_freq=tuple((1.0 / 10000 ** (np.arange(0, 16, 2) / 16)).tolist()))
BASE = CacheIdentity(model_id="tp-model", kv_layout=LAYOUT.fingerprint(), rope_fingerprint=ROPE.fingerprint)
RANKS = [dataclasses.replace(BASE, shard=f"tp{r}of2") for r in range(2)]


@pytest.fixture
async def served():
    server, port = await create_server(make_config())
    yield f"127.0.0.1:{port}"
    await server.stop(0.1)


def prompt(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([message(rng, 150), message(rng, 220), message(rng, 90)]).astype(np.uint32)


async def store(c: SidecarClient, tokens: np.ndarray, rank: int) -> list[int]:
    """Store ``tokens`` for ``rank`` with payloads that differ per rank; returns the bounds."""
    ident = RANKS[rank]
    bounds = list((await c.store(tokens, identity=ident)).chunk_bounds)
    g = torch.Generator().manual_seed(1000 * rank + int(tokens[1]))
    pl = {a: torch.randn((b - a) * LAYOUT.bytes_per_token // 4, generator=g) for a, b in zip(bounds, bounds[1:])}
    await c.store(tokens, identity=ident, layout=LAYOUT, payloads=pl)
    return bounds


async def test_rank_one_fetches_its_own_heads_from_rank_zeros_plan(served):
    stored = prompt(1)
    shifted = np.concatenate([message(np.random.default_rng(9), 37), stored]).astype(np.uint32)  # every chunk moved
    async with SidecarClient(served, tenant="t") as c:
        for r in (0, 1):
            await store(c, stored, r)
        for tokens in (stored, shifted):
            plan0 = await c.lookup(tokens, identity=RANKS[0])
            plan1 = await c.lookup(tokens, identity=RANKS[1])
            assert [(s.start, s.end) for s in plan0.hits()] == [(s.start, s.end) for s in plan1.hits()]
            assert plan0.hits() and all(a.chunk_hash != b.chunk_hash for a, b in zip(plan0.hits(), plan1.hits()))
            for raw in (True, False):
                kw = dict(layout=LAYOUT, rope=ROPE, raw=raw)
                items0 = [(s.chunk_hash, s.start - s.chunk_offset) for s in plan0.hits()]
                items1 = [(s.chunk_hash, s.start - s.chunk_offset) for s in plan1.hits()]
                own = await c.fetch(items1, identity=RANKS[1], **kw)
                via = await c.fetch(items0, identity=RANKS[1], plan_identity=RANKS[0], **kw)
                zero = await c.fetch(items0, identity=RANKS[0], **kw)
                assert all(f.ok for f in via) and len(via) == len(own)
                assert [bytes(f.data) for f in via] == [bytes(f.data) for f in own]
                assert all(bytes(a.data) != bytes(b.data) for a, b in zip(via, zero))  # rank 1's heads, not 0's
                spans = await c.fetch(plan0.fetch_spans(), identity=RANKS[1], plan_identity=RANKS[0], **kw)
                own_spans = await c.fetch(plan1.fetch_spans(), identity=RANKS[1], **kw)
                assert [bytes(f.data) for f in spans] == [bytes(f.data) for f in own_spans] and all(f.ok for f in spans)


async def test_a_chunk_only_rank_zero_holds_is_a_miss_for_rank_one(served):
    tokens = prompt(2)
    async with SidecarClient(served, tenant="t") as c:
        await store(c, tokens, 0)
        two = 151 + 221  # the first two messages (an anchor starts each: a chunk boundary)
        await store(c, tokens[:two], 1)  # rank 1 stored only those
        plan0 = await c.lookup(tokens, identity=RANKS[0])
        hits = plan0.hits()
        got = await c.fetch([(s.chunk_hash, s.start - s.chunk_offset) for s in hits], identity=RANKS[1],
                            plan_identity=RANKS[0], layout=LAYOUT, raw=True)
        assert [f.ok for f in got] == [s.end <= two for s in hits]
        assert any(f.ok for f in got) and not all(f.ok for f in got)


async def test_another_tenants_plan_translates_to_nothing(served):
    tokens = prompt(3)
    async with SidecarClient(served, tenant="a") as a, SidecarClient(served, tenant="b") as b:
        for r in (0, 1):
            await store(a, tokens, r)
            await store(b, tokens, r)  # b holds the same tokens under its own scope
        plan_a = await a.lookup(tokens, identity=RANKS[0])
        items = [(s.chunk_hash, s.start - s.chunk_offset) for s in plan_a.hits()]
        got = await b.fetch(items, identity=RANKS[1], plan_identity=RANKS[0], layout=LAYOUT, raw=True)
        assert got and not any(f.ok for f in got)


@pytest.mark.parametrize("change,field", [
    (dict(model_id="other"), "plan_identity.model_id"),
    (dict(namespace="elsewhere"), "plan_identity.namespace"),
    (dict(rope_fingerprint="other-rope"), "plan_identity.rope_fingerprint"),
])
async def test_a_plan_identity_of_another_model_is_refused(served, change, field):
    async with SidecarClient(served, tenant="t") as c:
        with pytest.raises(InvalidArgument, match=field):
            await c.fetch([(1, 0)], identity=RANKS[1], plan_identity=dataclasses.replace(RANKS[0], **change),
                          layout=LAYOUT, raw=True)
