"""Re-sharding: KV stored by an engine at one tensor-parallel size, served to an engine at
another (TP 1 -> 2 -> 4 and back), in process against a real sidecar.

The model has 4 KV heads; a TP ``t`` engine's rank ``r`` holds heads ``[4r/t, 4(r+1)/t)``. Every
loaded cell is compared with the fake model's full KV cut to the worker (``kv_rows``), for exact
and shifted hits; a worker fetches exactly its heads (bytes counted per worker); a chunk one
source shard lost is a miss for exactly the workers that need that shard's heads.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from clients.vllm.layouts import PagedSpec, StandardKV
from clients.vllm.paged import BlockLayout, PagedKV
from clients.vllm.settings import EngineShape, shard_name
from clients.vllm.worker_side import WorkerSide
from sidecar.rotation import rotate_keys_native
from tests.clients.vllm.conftest import BLOCK, HEAD, LAYERS
from tests.clients.vllm.fakes import FakeScheduler, Request, kv_rows

MODEL_HEADS = 4
BLOCKS = 256


def cache(kind: str, heads: int):
    layers = [torch.zeros((BLOCKS, heads, BLOCK, 2 * HEAD), dtype=torch.bfloat16) for _ in range(LAYERS)]
    if kind == "cpu":
        return PagedKV(layers, BlockLayout.vec(heads, BLOCK, HEAD))
    return StandardKV(layers, PagedSpec(mla=False, num_heads=heads, block_size=BLOCK, head_size=HEAD,
                                        head_size_v=HEAD, dtype=torch.bfloat16))


@pytest.fixture(params=["cpu", "standard"])
def engine_at(request, new_engine, shape: EngineShape):
    """``engine_at(tp)`` -> (scheduler side, workers) of a TP ``tp`` engine of the 4-head model."""

    def make(tp: int):
        h = MODEL_HEADS // tp
        base = dataclasses.replace(shape, num_kv_heads=h, tp_size=tp, total_kv_heads=MODEL_HEADS)
        layout = base.layout_of(LAYERS)
        planned = dataclasses.replace(base, layout=layout, identity=dataclasses.replace(
            shape.identity, kv_layout=layout.fingerprint(), shard=shard_name(0, tp)))
        workers = [planned.for_rank(r, 0, num_layers=LAYERS) if tp > 1 else planned for r in range(tp)]
        return new_engine(planned, workers, lambda ws: cache(request.param, ws.num_kv_heads))

    return make


def expected(tokens: list[int], positions: np.ndarray, w: WorkerSide) -> torch.Tensor:
    h = w.shape.num_kv_heads
    full = kv_rows(np.asarray(tokens, dtype=np.uint32), positions, LAYERS, MODEL_HEADS, HEAD)
    return full[:, :, :, w.shape.tp_rank * h:(w.shape.tp_rank + 1) * h]


def expected_shifted(body: list[int], shift: int, positions: np.ndarray, w: WorkerSide) -> torch.Tensor:
    """The full KV engine A computed for ``body`` at positions from 0, moved ``shift`` positions
    later (keys rotated by ``shift``, the torch reference), cut to ``w``'s heads."""
    src = kv_rows(np.asarray(body, dtype=np.uint32), positions - shift, LAYERS, MODEL_HEADS, HEAD)
    src[:, 0] = rotate_keys_native(src[:, 0], shift, w.shape.rope)
    h = w.shape.num_kv_heads
    return src[:, :, :, w.shape.tp_rank * h:(w.shape.tp_rank + 1) * h]


def rows_of(w: WorkerSide, block_ids: list[int], positions: np.ndarray) -> torch.Tensor:
    return w.paged.gather(torch.tensor(block_ids, dtype=torch.int64), torch.from_numpy(positions).to(torch.int64))


def loads(s: FakeScheduler, steps: int = 3) -> list:
    out = []
    for _ in range(steps):
        out += s.step().loads
    return out


def store(engine_at, tp: int, tokens: list[int]) -> list[WorkerSide]:
    side, ranks = engine_at(tp)
    a = FakeScheduler(side, ranks)
    a.add_request(Request("a", tokens))
    [job] = a.step().stores
    assert all(w.counters["stored_chunks"] == len(job.chunks) for w in ranks)
    return ranks


@pytest.mark.parametrize("stored,loaded", [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)],
                         ids=lambda p: f"tp{p}")
def test_a_prompt_stored_at_one_tp_size_loads_at_another(engine_at, prompts, stored, loaded):
    body = prompts.msg(200) + prompts.msg(300) + prompts.msg(150)
    store(engine_at, stored, body)
    header = prompts.msg(40)  # the same messages behind a new header: every hit shifted by 41
    tokens = header + body
    side, ranks = engine_at(loaded)
    b = FakeScheduler(side, ranks)
    b.add_request(Request("b", tokens))
    [load] = loads(b)  # after the header's gap-fill sub-request
    assert load.plan_shard == shard_name(0, stored)
    served = sum(len(it) for it in load.items)
    assert served >= 0.9 * len(body) and not any(it.exact for it in load.items)
    share = LAYERS * 2 * HEAD * 2 * MODEL_HEADS // loaded  # bytes per token of a worker's heads
    moved = {w.counters["fetch_bytes"] for w in ranks}
    [per_worker] = moved  # every worker moved the same: its heads of the same chunks' rows
    assert per_worker % share == 0 and per_worker // share >= served
    for w in ranks:
        assert w.counters["loaded_tokens"] == served and w.counters["load_failed_tokens"] == 0, w.counters
        assert w.counters["resharded_loads"] == 1
        positions = np.concatenate([np.arange(it.start, it.end) for it in load.items])
        want = expected_shifted(body, len(header), positions, w)
        assert torch.equal(rows_of(w, load.block_ids, positions), want), w.shape.identity
    assert b.outputs["b"]["sidecar"]["claimed_tokens"] == served


def test_a_cut_holding_the_prompt_plans_under_its_own_shard(engine_at, prompts):
    body = prompts.msg(200) + prompts.msg(300)
    store(engine_at, 1, prompts.msg(150))  # TP 1 has stored (another prompt)
    store(engine_at, 2, body)
    side2, _ = engine_at(2)
    side1, _ = engine_at(1)
    tokens = np.asarray(body, dtype=np.uint32)
    own = side2.link.client(None).lookup(tokens, identity=side2.shape.identity, dry_run=True)
    assert own.plan_shard is None and own.summary.prefill_tokens == 0  # its own chunks, its own plan
    other = side1.link.client(None).lookup(tokens, identity=side1.shape.identity, dry_run=True)
    assert other.plan_shard == "tp0of2" and other.summary.prefill_tokens == 0


def test_a_lost_source_shard_is_a_miss_only_for_the_workers_that_need_it(engine_at, prompts):
    body = prompts.msg(200) + prompts.msg(300) + prompts.msg(150)
    ranks_a = store(engine_at, 2, body)
    client = ranks_a[1].link.client(None)
    plan1 = client.lookup(np.asarray(body, dtype=np.uint32), identity=ranks_a[1].shape.identity, dry_run=True)
    lost = [s for s in plan1.hits() if 201 <= s.start < 502]
    assert lost and client.delete([s.chunk_hash for s in lost]) == len(lost)
    side, ranks = engine_at(4)
    b = FakeScheduler(side, ranks)
    b.add_request(Request("b", body))
    [load] = loads(b)
    lost_tokens = sum(min(s.end, load.items[-1].end) - s.start for s in lost)
    failed = [w.counters["load_failed_tokens"] for w in ranks]
    assert failed[:2] == [0, 0] and failed[2] == failed[3] >= lost_tokens > 0, failed  # heads 2-3: source rank 1
    n = len(body)
    for w in ranks:  # the failed blocks were recomputed on every worker: exact either way
        positions = np.arange(n - 1)
        assert torch.equal(rows_of(w, load.block_ids, positions), expected(body, positions, w))


@pytest.mark.parametrize("path", ["pool", "fetch"])
@pytest.mark.parametrize("shifted", [False, True], ids=["exact", "shifted"])
@pytest.mark.parametrize("stored,loaded", [(2, 1), (4, 1), (4, 2)], ids=lambda p: f"tp{p}")
def test_heads_from_several_source_ranks_are_placed_without_a_join_through_the_pool(
        engine_at, new_engine, prompts, stored, loaded, shifted, path):
    """A worker whose heads several source ranks hold: through the shared pool each rank's part
    goes straight into its head range of the cache (shifted: into the placement's own scratch,
    where it is rotated, at its head offset), so no join buffer is taken; a Fetch's parts are
    still joined. Every loaded cell is the reference either way."""
    body = prompts.msg(200) + prompts.msg(300) + prompts.msg(150)
    store(engine_at, stored, body)
    header = prompts.msg(40) if shifted else []
    tokens = header + body
    side, ranks = engine_at(loaded)
    if path == "fetch":  # the same engine shapes and caches, without the shared pool
        side, ranks = new_engine(side.shape, [w.shape for w in ranks], lambda ws: cache_like(ranks[0], ws),
                                 shared_pool=False)
    b = FakeScheduler(side, ranks)
    b.add_request(Request("b", tokens))
    [load] = loads(b)
    assert load.plan_shard == shard_name(0, stored)
    assert all(it.exact for it in load.items) != shifted
    served = sum(len(it) for it in load.items)
    positions = np.concatenate([np.arange(it.start, it.end) for it in load.items])
    for w in ranks:
        assert any(p is not None for p in w._pools.values()) == (path == "pool")  # the path under test
        assert w.counters["loaded_tokens"] == served and w.counters["load_failed_tokens"] == 0, w.counters
        want = (expected_shifted(body, len(header), positions, w) if shifted
                else expected(tokens, positions, w))
        assert torch.equal(rows_of(w, load.block_ids, positions), want), w.shape.identity
        joined = w._reshard_scratch.size
        assert joined == (0 if path == "pool" else served * w.shape.layout.bytes_per_token), joined
        rotated_here = shifted and path == "pool"  # a Fetch's rows come rotated by the sidecar (CPU cache)
        assert w._scratch.size == (served * w.shape.layout.bytes_per_token if rotated_here else 0)


def cache_like(worker: WorkerSide, ws: EngineShape):
    """A fresh cache of ``worker``'s kind for the worker shape ``ws``."""
    return cache("cpu" if isinstance(worker.paged, PagedKV) else "standard", ws.num_kv_heads)
