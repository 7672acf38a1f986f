"""``DataPlane.fetch(FetchQuery)`` and ``DataPlane.lookup(LookupQuery)``: the domain calls behind
the Fetch and Lookup RPCs, called here without any transport (real registry, real tiers).

A prompt's KV is built as one tensor over positions, so every answer has an independent
reference: the stored rows of its source positions, of the asked heads, rotated by its delta.
Every refusal comes before the first answer and changes nothing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sidecar.app import build
from sidecar.dataplane import FetchQuery
from sidecar.errors import InvalidArgument, ResourceExhausted
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.registry.chunk_index import LookupQuery
from sidecar.rotation import rotate_keys
from tests.conftest import ANCHORS, make_config, message
from tests.dataplane.test_dataplane import SPEC

LAYOUT = KVLayout.gqa(num_layers=2, num_kv_heads=4, head_dim=32, dtype="float32")
IDENT = CacheIdentity(model_id="query-model", kv_layout=LAYOUT.fingerprint(), rope_fingerprint=SPEC.fingerprint)
TENANT = "t"


def kv_of(n: int, seed: int) -> torch.Tensor:
    """``[layers, 2 (k, v), positions, heads, dim]``: the prompt's KV, one row per position."""
    return torch.randn(LAYOUT.num_layers, 2, n, 4, 32, generator=torch.Generator().manual_seed(seed))


def payload(kv: torch.Tensor, a: int, b: int) -> bytearray:
    """Rows ``[a, b)`` in payload order (per layer, k then v, each ``[rows, heads, dim]``)."""
    return bytearray(kv[:, :, a:b].contiguous().numpy().tobytes())


async def stored(dp, tokens: np.ndarray, kv: torch.Tensor, identity: CacheIdentity = IDENT) -> None:
    data = tokens.astype("<u4").tobytes()
    entries, end = dp.store_entries(tokens, data, identity, TENANT, LAYOUT, 0)
    bounds = [e.source_pos for e in entries] + [end]
    pl = {a: payload(kv, a, b) for a, b in zip(bounds, bounds[1:])}
    out = await dp.store_payloads(tokens, data, identity, TENANT, TENANT, LAYOUT, pl, 0)
    assert out.chunks_stored == len(pl)


def query(tokens: np.ndarray, identity: CacheIdentity = IDENT) -> LookupQuery:
    return LookupQuery(tokens=tokens, data=tokens.astype("<u4").tobytes(), identity=identity, scope=TENANT)


def expected(kv: torch.Tensor, src: int, n: int, delta: int, heads: tuple[int, int]) -> bytes:
    h0, hc = heads
    rows = kv[:, :, src : src + n, h0 : h0 + hc].clone()
    if delta:
        for layer in range(LAYOUT.num_layers):
            rows[layer, 0] = rotate_keys(rows[layer, 0], delta, SPEC)
    return rows.contiguous().numpy().tobytes()


async def answers(dp, q: FetchQuery, **kw) -> list:
    out = []
    async for a in dp.fetch(q, **kw):
        data = a.data if a.data is None or isinstance(a.data, memoryview) else b"".join(a.data)
        out.append(dataclasses.replace(a, data=None if data is None else bytes(data)))  # views die with the next
    return out


@pytest.fixture
def dp():
    plane = build(make_config()).dataplane
    yield plane
    plane.close()


@pytest.fixture
def setting(rng):
    header = message(rng, 40)
    body = np.concatenate([message(rng, 400, ANCHORS[1]), message(rng, 300, ANCHORS[2])])
    old = np.concatenate([header, body]).astype(np.uint32)
    new = np.concatenate([message(rng, 57), body]).astype(np.uint32)  # the body moved by +17
    return old, new, kv_of(len(old), 0)


@pytest.mark.parametrize("heads", [None, (1, 2), (3, 1)])
@pytest.mark.parametrize("gather", [False, True])
async def test_span_answers_are_the_stored_rows_of_their_heads_rotated(dp, setting, heads, gather):
    old, new, kv = setting
    await stored(dp, old, kv)
    plan = await dp.lookup(query(new))
    spans = plan.fetch_spans()
    assert spans and plan.summary.shifted_tokens > 0
    got = await answers(dp, FetchQuery(tenant=TENANT, identity=IDENT, layout=LAYOUT, items=spans, rope=SPEC,
                                       heads=heads), gather=gather)
    assert [a.index for a in got] == list(range(len(spans)))
    for a, s in zip(got, spans):
        assert a.data is not None and a.num_tokens == s.num_tokens
        assert a.delta == s.target_pos - a.source_pos and a.rotated == bool(a.delta)
        assert a.data == expected(kv, a.source_pos, a.num_tokens, a.delta, heads or (0, 4))


async def test_plain_items_and_misses_answer_in_order(dp, setting):
    old, _, kv = setting
    await stored(dp, old, kv)
    entries, _ = dp.index.entries(old, old.astype("<u4").tobytes(), IDENT, TENANT)
    items = [(entries[1].key, entries[1].source_pos + 5), (12345, 0), (entries[0].key, entries[0].source_pos)]
    got = await answers(dp, FetchQuery(tenant=TENANT, identity=IDENT, layout=LAYOUT, items=items, rope=SPEC))
    assert [a.index for a in got] == [0, 1, 2] and got[1].data is None
    for a, (_, target) in zip((got[0], got[2]), (items[0], items[2])):
        assert a.delta == target - a.source_pos
        assert a.data == expected(kv, a.source_pos, a.num_tokens, a.delta, (0, 4))
    other = await answers(dp, FetchQuery(tenant="u", identity=IDENT, layout=LAYOUT, items=items[:1], rope=SPEC))
    assert other[0].data is None  # another tenant's chunk is a miss


async def test_refusals_come_before_any_answer_and_change_nothing(dp, setting):
    old, new, kv = setting
    await stored(dp, old, kv)
    spans = (await dp.lookup(query(new))).fetch_spans()
    good = FetchQuery(tenant=TENANT, identity=IDENT, layout=LAYOUT, items=spans, rope=SPEC)
    before = (dataclasses.replace(dp.counters, events=dict(dp.counters.events)), dp.store.stats().tiers,
              dp.index.registry.snapshot_stats().entries)
    bad = {
        "heads": (dataclasses.replace(good, heads=(3, 2)), InvalidArgument),
        "plan_identity.model_id": (dataclasses.replace(good, plan_identity=dataclasses.replace(IDENT, model_id="x")),
                                   InvalidArgument),
        "items[0]": (dataclasses.replace(good, items=[dataclasses.replace(spans[0], num_tokens=0, row_offset=3)]),
                     InvalidArgument),
        "items": (dataclasses.replace(good, max_items=1), InvalidArgument),
        "max_fetch_bytes": (dataclasses.replace(good, max_bytes=10), ResourceExhausted),
        "rope": (dataclasses.replace(good, rope=None), InvalidArgument),
    }
    for field, (q, error) in bad.items():
        it = dp.fetch(q)
        with pytest.raises(error) as exc:
            await anext(it)
        assert str(exc.value).startswith(field), (field, str(exc.value))
        await it.aclose()
    after = (dp.counters, dp.store.stats().tiers, dp.index.registry.snapshot_stats().entries)
    assert after == before
    assert len(await answers(dp, good)) == len(spans)  # and the good query still answers


async def test_a_lookup_takes_another_tensor_parallel_cut_when_it_reuses_more(dp, setting):
    old, new, kv = setting
    await stored(dp, old, kv)  # stored at TP 1
    tp2 = dataclasses.replace(IDENT, shard="tp0of2", kv_layout=LAYOUT.fingerprint())
    own = await dp.index.plan(query(new, tp2))
    assert own.summary.exact_tokens + own.summary.shifted_tokens == 0
    plan = await dp.lookup(query(new, tp2))
    assert plan.plan_shard == "" and plan.summary.shifted_tokens > 0
    # a worker of TP 2 reads its half of the heads from the one stored shard
    got = await answers(dp, FetchQuery(tenant=TENANT, identity=IDENT, layout=LAYOUT, items=plan.fetch_spans(),
                                       rope=SPEC, heads=(2, 2)))
    for a in got:
        assert a.data == expected(kv, a.source_pos, a.num_tokens, a.delta, (2, 2))
    assert own.plan_shard is None
    assert (await dp.lookup(query(new))).plan_shard is None  # its own cut holds it: its own plan
