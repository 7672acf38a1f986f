"""Tensor and pipeline parallelism: TP x PP workers in process, one scheduler side.

Each worker holds its stage's layers and its rank's KV heads and Stores them as its own shard of
every chunk; the scheduler side plans under rank 0 of stage 0 and each worker fetches the plan's
chunks as its shard. Checked against the fake model's KV of every layer and head (``kv_rows``)
cut between the workers, in the CPU backend's cache and three standard layouts: a restarted
engine's workers each load exactly their own part; a chunk one shard lost is recomputed on every
shard, and the caches still match.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from clients.vllm.layouts import KV_CACHE_LAYOUTS as LAYOUTS
from clients.vllm.layouts import PagedSpec, StandardKV
from clients.vllm.layouts import kv_cache_views as build
from clients.vllm.paged import BlockLayout, PagedKV
from clients.vllm.settings import EngineShape, shard_name
from clients.vllm.worker_side import WorkerSide
from tests.clients.vllm.conftest import BLOCK, HEAD, HEADS, LAYERS
from tests.clients.vllm.fakes import FakeScheduler, Request, kv_rows

BLOCKS = 512


def cache(kind: str, num_layers: int) -> PagedKV | StandardKV:
    """One worker's cache of ``num_layers`` layers of ``HEADS`` heads: the CPU backend's (``vec``
    blocks), or a GPU backend's standard layout (vLLM's ``[L, B, H, N, K | V]`` in a
    ``KVCacheLayout`` permutation: one flat buffer, per-layer strided views, as
    ``create_kv_cache_views`` makes them) on CPU tensors."""
    if kind == "cpu":
        return PagedKV([torch.zeros((BLOCKS, HEADS, BLOCK, 2 * HEAD), dtype=torch.bfloat16) for _ in range(num_layers)],
                       BlockLayout.vec(HEADS, BLOCK, HEAD))
    spec = PagedSpec(mla=False, num_heads=HEADS, block_size=BLOCK, head_size=HEAD, head_size_v=HEAD,
                     dtype=torch.bfloat16)
    return StandardKV(build(spec, LAYOUTS[kind], "cpu", num_layers, BLOCKS), spec)


@pytest.fixture(params=["cpu", "LBHNC", "BLNHC", "BHLNC"])
def layout_kind(request) -> str:
    return request.param


@pytest.fixture(params=[(2, 1), (1, 2), (2, 2)], ids=lambda p: f"tp{p[0]}-pp{p[1]}")
def parallel_engine(request, layout_kind: str, new_engine, shape: EngineShape):
    """``parallel_engine()`` -> (scheduler side, workers): TP x PP workers, each the cache of its
    stage's ``LAYERS / PP`` layers and its rank's ``HEADS`` heads (the model has ``TP * HEADS``
    heads), in the CPU backend's layout or a standard one; the scheduler side plans as vLLM's
    engine core does, under rank 0 of stage 0."""
    tp, pp = request.param
    n = LAYERS // pp
    layout = shape.layout_of(n)
    planned = dataclasses.replace(shape, num_layers=n, layout=layout, tp_size=tp, pp_size=pp, identity=dataclasses.replace(
        shape.identity, kv_layout=layout.fingerprint(), shard=shard_name(0, tp, 0, pp)))
    workers = [planned.for_rank(rank, stage, num_layers=n) for stage in range(pp) for rank in range(tp)]
    return lambda: new_engine(planned, workers, lambda ws: cache(layout_kind, ws.num_layers))


def rows_of(worker: WorkerSide, block_ids: list[int], n: int) -> torch.Tensor:
    return worker.paged.gather(torch.tensor(block_ids, dtype=torch.int64), torch.arange(n))


def expected(tokens: list[int], worker: WorkerSide) -> torch.Tensor:
    """The fake model's KV of every layer and head, cut to ``worker``'s stage and rank."""
    sh = worker.shape
    full = kv_rows(np.asarray(tokens, dtype=np.uint32), np.arange(len(tokens)), LAYERS, sh.tp_size * HEADS, HEAD)
    lo = sh.pp_rank * sh.num_layers
    return full[lo:lo + sh.num_layers, :, :, sh.tp_rank * HEADS:(sh.tp_rank + 1) * HEADS]


def test_shards_are_named_per_rank_and_stage_and_stage_zero_rank_zero_plans(shape):
    tp = dataclasses.replace(shape, tp_size=2, pp_size=2, identity=dataclasses.replace(
        shape.identity, shard=shard_name(0, 2, 0, 2)))
    shards = [tp.for_rank(r, s, num_layers=1) for s in range(2) for r in range(2)]
    assert [x.identity.shard for x in shards] == ["tp0of2.pp0of2", "tp1of2.pp0of2", "tp0of2.pp1of2", "tp1of2.pp1of2"]
    assert len({x.identity.fingerprint for x in shards}) == 4  # chunks of different shards never mix
    assert {x.plan_identity for x in shards} == {tp.identity}  # one plan for all (stage 0 with 2 layers)
    assert shards[0].layout.num_layers == 1 and tp.layout.num_layers == LAYERS
    assert (shard_name(1, 4), shard_name(0, 1, 1, 2), shard_name(0, 1)) == ("tp1of4", "pp1of2", "")
    assert shape.for_rank(0).identity == shape.identity and shape.for_rank(0).plan_identity is None  # no TP/PP
    with pytest.raises(ValueError, match="rank 4 of 2"):
        tp.for_rank(4)


def test_each_shard_loads_its_own_kv_from_one_plan(parallel_engine, prompts):
    tokens = prompts.msg(200) + prompts.msg(300) + prompts.msg(150)
    n = len(tokens)
    side_a, ranks_a = parallel_engine()
    a = FakeScheduler(side_a, ranks_a)
    a.add_request(Request("a", tokens))
    [store] = a.step().stores
    assert all(w.counters["stored_chunks"] == len(store.chunks) for w in ranks_a)

    side_b, ranks_b = parallel_engine()
    b = FakeScheduler(side_b, ranks_b)
    b.add_request(Request("b", tokens))
    [load] = b.step().loads
    end = (n - 1) // BLOCK * BLOCK
    assert load.items[-1].end == end
    for w in ranks_b:
        assert w.counters["loaded_tokens"] == end and w.counters["load_failed_tokens"] == 0, (w.shape, w.counters)
        assert torch.equal(rows_of(w, load.block_ids, n), expected(tokens, w)), w.shape.identity.shard
    assert len({expected(tokens, w).sum().item() for w in ranks_b}) == len(ranks_b)  # every shard differs
    assert b.outputs["b"]["sidecar"]["claimed_tokens"] == end


def test_a_chunk_one_shard_lost_is_recomputed_on_every_shard(parallel_engine, prompts):
    tokens = prompts.msg(200) + prompts.msg(300) + prompts.msg(150)
    n = len(tokens)
    side_a, ranks_a = parallel_engine()
    a = FakeScheduler(side_a, ranks_a)
    a.add_request(Request("a", tokens))
    a.step()
    # the last shard's copy of the second message's chunks is gone (deleted from the sidecar)
    client = ranks_a[-1].link.client(None)
    rank1 = ranks_a[-1].shape.identity
    plan1 = client.lookup(np.asarray(tokens, dtype=np.uint32), identity=rank1, dry_run=True)
    lost = [s for s in plan1.hits() if 201 <= s.start < 502]
    assert lost and client.delete([s.chunk_hash for s in lost]) == len(lost)

    side_b, ranks_b = parallel_engine()
    b = FakeScheduler(side_b, ranks_b)
    b.add_request(Request("b", tokens))
    [load] = b.step().loads
    assert [w.counters["load_failed_tokens"] for w in ranks_b] == [0] * (len(ranks_b) - 1) + [
        sum(s.end - s.start for s in lost)]
    for w in ranks_b:  # the failed blocks were recomputed on every shard: exact either way
        assert torch.equal(rows_of(w, load.block_ids, n), expected(tokens, w)), w.shape.identity.shard
