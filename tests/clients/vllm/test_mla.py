"""MLA in the connector: the worker moves latent rows ``[c_kv | k_pe]`` between sidecar payloads
(``KVLayout.mla``) and vLLM's MLA cache in the standard layout (``[B, 1, N, C]`` views, three
``KVCacheLayout`` permutations), with a fake scheduler and a real sidecar.

A restarted engine loads exactly the stored latent rows; a shifted body is loaded with only its
rope part re-positioned (the latent ``c_kv`` bit-identical), the same whether the sidecar or the
worker rotates; under tensor parallelism every rank loads the one latent shard and only rank 0
Stores it (the latent is not split by heads).
"""

from __future__ import annotations

import dataclasses
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from clients.vllm.layouts import KV_CACHE_LAYOUTS as LAYOUTS
from clients.vllm.layouts import LatentKV, PagedSpec
from clients.vllm.layouts import kv_cache_views as build
from clients.vllm.refusals import Refused
from clients.vllm.scheduler_side import SchedulerSide
from clients.vllm.settings import EngineShape, vllm_is_neox_style
from clients.vllm.worker_side import WorkerSide, check_rope_pairing
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.rotation import Pairing, RopeSpec, RotaryLayout
from tests.clients.vllm.conftest import BLOCK, Prompts
from tests.clients.vllm.fakes import FakeScheduler, Request, latent_rows

LAYERS, RANK, ROPE_DIM = 2, 16, 8
WIDTH = RANK + ROPE_DIM
BLOCKS = 512


#: vLLM's ModelConfig of a DeepSeek-style model as ``settings.vllm_is_neox_style`` reads it
DEEPSEEK_CONFIG = SimpleNamespace(use_mla=True, using_transformers_backend=lambda: False)


def mla_shape(tp: int = 1) -> EngineShape:
    """The worker's shape of a small MLA model, its pairing read from the model config as the
    connector reads it (``engine_shape``; no ``rope_is_neox_style`` set)."""
    layout = KVLayout.mla(num_layers=LAYERS, kv_lora_rank=RANK, qk_rope_head_dim=ROPE_DIM, dtype="bfloat16")
    inv = (1.0 / (10000.0 ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float32) / ROPE_DIM))).tolist()
    pairing = Pairing.from_neox_style(vllm_is_neox_style(DEEPSEEK_CONFIG))
    rope = RopeSpec(rotary_dim=ROPE_DIM, key_dim=ROPE_DIM, layout=RotaryLayout.TRAILING, pairing=pairing,
                    inv_freq=tuple(inv))
    identity = CacheIdentity(model_id="fake-mla", kv_layout=layout.fingerprint(), rope_fingerprint=rope.fingerprint,
                             block_size=BLOCK, namespace=uuid.uuid4().hex)
    return EngineShape(LAYERS, 1, WIDTH, BLOCK, "bfloat16", layout, rope, identity, tp_size=tp, mla=True,
                       rope_dim=ROPE_DIM)


def latent_cache(layout: str) -> LatentKV:
    spec = PagedSpec(mla=True, num_heads=1, block_size=BLOCK, head_size=WIDTH, head_size_v=0, dtype=torch.bfloat16,
                     rope_dim=ROPE_DIM)
    return LatentKV(build(spec, LAYOUTS[layout], "cpu", LAYERS, BLOCKS), spec)


@pytest.fixture(params=["LBHNC", "BLNHC", "BHLNC"])
def mla_engine(request, new_engine):
    """``mla_engine(tp=1, **extra)`` -> (scheduler side, workers): one MLA worker per TP rank."""
    shapes: dict[int, EngineShape] = {}

    def make(tp: int = 1, **extra) -> tuple[SchedulerSide, list[WorkerSide]]:
        shape = shapes.setdefault(tp, mla_shape(tp))
        return new_engine(shape, [shape.for_rank(rank) for rank in range(tp)], lambda ws: latent_cache(request.param),
                          tenant="mla-tests", **extra)

    return make


def rows_of(worker: WorkerSide, block_ids: list[int], n: int) -> torch.Tensor:
    return worker.paged.gather(torch.tensor(block_ids, dtype=torch.int64), torch.arange(n))


def test_a_restarted_engine_loads_the_stored_latent_rows(mla_engine):
    p = Prompts(3)
    tokens = p.msg(200) + p.msg(300) + p.msg(150)
    n = len(tokens)
    side_a, [worker_a] = mla_engine()
    a = FakeScheduler(side_a, worker_a)
    a.add_request(Request("a", tokens))
    [store] = a.step().stores
    assert worker_a.counters["stored_chunks"] == len(store.chunks)
    side_b, [worker_b] = mla_engine()
    b = FakeScheduler(side_b, worker_b)
    b.add_request(Request("b", tokens))
    [load] = b.step().loads
    end = (n - 1) // BLOCK * BLOCK
    assert load.items[-1].end == end and worker_b.counters["loaded_tokens"] == end
    expected = latent_rows(np.asarray(tokens, dtype=np.uint32), np.arange(n), LAYERS, WIDTH)
    assert torch.equal(rows_of(worker_b, load.block_ids, n), expected)


@pytest.mark.parametrize("rotate", ["sidecar", "engine"])
def test_a_shifted_body_moves_only_its_rope_part(mla_engine, rotate):
    p = Prompts(4)
    body = p.msg(300) + p.msg(300)
    tenant = f"mla-{rotate}-{uuid.uuid4().hex[:6]}"
    side_a, [worker_a] = mla_engine()
    a = FakeScheduler(side_a, worker_a)
    a.add_request(Request("y", p.msg(60) + body + p.msg(20), {"sidecar_tenant": tenant}))
    a.run()
    x = body[:5] + body + body[-25:]  # the body moved from position 61 to 5
    side, [worker] = mla_engine(min_gap_run=64, rotate=rotate)
    s = FakeScheduler(side, worker)
    s.add_request(Request("x", x, {"sidecar_tenant": tenant}))
    s.run()
    [load] = s.steps[-1][1].loads
    assert not load.items[0].exact and worker.counters["load_failed_tokens"] == 0
    assert (worker.counters["engine_rotated_tokens"] > 0) is (rotate == "engine")
    lo, hi = load.items[0].start, load.items[-1].end
    got = worker.paged.gather(torch.tensor(load.block_ids, dtype=torch.int64), torch.arange(lo, hi))
    stored = latent_rows(np.concatenate([np.zeros(61, np.uint32), np.asarray(x[5:], np.uint32)]),
                         np.arange(lo, hi) - 5 + 61, LAYERS, WIDTH)
    assert torch.equal(got[..., :RANK], stored[..., :RANK])  # c_kv as stored
    assert not torch.equal(got[..., RANK:], stored[..., RANK:])  # k_pe re-positioned
    # the rotation is the one RoPE delta rotation: rotating the stored rope part by -56 gives it
    from sidecar.rotation import rotate_keys

    want = rotate_keys(stored[..., RANK:].contiguous(), torch.full((1, hi - lo), 5 - 61), worker.shape.rope)
    assert torch.equal(got[..., RANK:], want)


def test_under_tensor_parallelism_every_rank_loads_the_one_latent_and_rank_zero_stores_it(mla_engine):
    p = Prompts(6)
    tokens = p.msg(200) + p.msg(300)
    n = len(tokens)
    side_a, ranks_a = mla_engine(tp=2)
    assert {w.shape.identity for w in ranks_a} == {side_a.shape.identity}  # one shard for every rank
    a = FakeScheduler(side_a, ranks_a)
    a.add_request(Request("a", tokens))
    [store] = a.step().stores
    assert [w.counters["stored_chunks"] for w in ranks_a] == [len(store.chunks), 0]
    side_b, ranks_b = mla_engine(tp=2)
    b = FakeScheduler(side_b, ranks_b)
    b.add_request(Request("b", tokens))
    [load] = b.step().loads
    expected = latent_rows(np.asarray(tokens, dtype=np.uint32), np.arange(n), LAYERS, WIDTH)
    for w in ranks_b:
        assert w.counters["loaded_tokens"] == load.items[-1].end
        assert torch.equal(rows_of(w, load.block_ids, n), expected)


def test_mla_shape_names_no_tensor_parallel_shard():
    shape = mla_shape(tp=4)
    assert [shape.for_rank(r).identity.shard for r in range(4)] == [""] * 4
    assert [shape.for_rank(r).stores for r in range(4)] == [True, False, False, False]
    assert dataclasses.replace(shape, mla=False).for_rank(1).identity.shard == "tp1of4"


def test_a_deepseek_models_pairing_is_read_from_its_config_and_passes_the_workers_check():
    """vLLM rotates every MLA model's ``k_pe`` with ``is_neox_style=False``
    (vllm/model_executor/models/deepseek_v2.py), so the connector derives GPT-J pairing from
    ``use_mla`` without ``rope_is_neox_style`` being set; the worker's check at
    ``register_kv_caches`` accepts the rotary embeddings such a model builds (``k_pe``'s, and
    DeepSeek-V3.2's indexer rotating its own keys the other way), and refuses a pairing none of
    them uses, naming the setting."""
    shape = mla_shape()
    assert vllm_is_neox_style(DEEPSEEK_CONFIG) is False and shape.rope.pairing is Pairing.INTERLEAVED
    assert vllm_is_neox_style(SimpleNamespace(use_mla=False)) is True  # vLLM's get_rope default
    transformers_backend = SimpleNamespace(use_mla=True, using_transformers_backend=lambda: True)
    assert vllm_is_neox_style(transformers_backend) is None  # HF's code rotates: its family table decides

    def emb(neox: bool, dims: int = ROPE_DIM) -> SimpleNamespace:
        return SimpleNamespace(head_size=dims, rotary_dim=dims, is_neox_style=neox)

    vision = emb(True, 32)  # another size: not the cached key's
    check_rope_pairing(shape.rope, [emb(False), vision])
    check_rope_pairing(shape.rope, [emb(False), emb(True), vision])  # + the V3.2 indexer's
    with pytest.raises(Refused, match="rope_is_neox_style") as info:
        check_rope_pairing(shape.rope, [emb(True), vision])
    assert "is_neox_style=True" in str(info.value) and "assumes False" in str(info.value)
    with pytest.raises(Refused, match="rotary embedding"):
        check_rope_pairing(shape.rope, [vision])
    check_rope_pairing(shape.rope, [])  # no registry entries: nothing to check against
