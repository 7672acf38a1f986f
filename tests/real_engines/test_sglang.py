"""SGLang: the HiCache storage backend built by SGLang's own factory and driven through its own
interface, and the radix-cache plug-in, against a real sidecar (docs/sglang.md).

Runs in the engine environment (``.venv-engines``: sglang installed with --no-deps, CPU torch);
the sidecar runs from the main environment as its own process. SGLang cannot run a model on
CPU, so the pools are SGLang's own pool classes on CPU filled with known tensors.
"""

from __future__ import annotations

import socket
import sys
import time
import types

import numpy as np
import pytest

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
    from sglang.srt.mem_cache.storage import StorageBackendFactory
except ImportError as exc:  # pragma: no cover - the main environment has no sglang
    pytest.skip(f"sglang is not importable here ({exc}); run in .venv-engines", allow_module_level=True)

ANCHOR = 100_000


def _torchvision_shim() -> None:
    """SGLang's config package imports ``torchvision.transforms`` at import time (InternVL /
    DeepSeek-OCR image preprocessing); PyPI has no torchvision for torch 2.13.0+cpu. When it is
    missing, register placeholder modules whose attributes raise on use. transformers decides
    torchvision is unavailable first, so nothing else sees the placeholders."""
    try:
        import torchvision  # noqa: F401
        return
    except ImportError:
        pass
    import transformers.utils.import_utils as iu

    assert not iu.is_torchvision_available()

    class _Missing:
        def __init__(self, *a, **k):
            raise ImportError("torchvision is not installed in this environment")

    def _getattr(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing

    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        mod = types.ModuleType(name)
        mod.__getattr__ = _getattr
        mod.__path__ = []
        sys.modules[name] = mod
    sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]
    sys.modules["torchvision.transforms"].functional = sys.modules["torchvision.transforms.functional"]


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def sidecar_target():
    from sidecar.process import server_python, sidecar_process

    with sidecar_process("--set", f"chunker.anchor_tokens=[{ANCHOR}]", "--set", "default_recompute_tokens=0",
                         python=server_python()) as target:
        yield target


def _dead_target() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


def storage_config(target: str, **extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="org/test-model",
        extra_config={"backend_name": "kv_sidecar", "module_path": "clients.sglang.hicache",
                      "class_name": "SidecarHiCacheStorage", "sidecar_target": target, **extra},
    )


def build_backend(target: str, **extra):
    """Through SGLang's own factory, exactly as ``--hicache-storage-backend dynamic`` does."""
    return StorageBackendFactory.create_backend("dynamic", storage_config(target, **extra), None)


LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 16, 4


@pytest.fixture(scope="module")
def sglang_pools():
    """Factory for SGLang's own CPU pools: device MHA pool, host pool, req_to_token, allocator."""
    _torchvision_shim()
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    def make(size=512, page_size=PAGE, host=True):
        dev = MHATokenToKVPool(size=size, page_size=page_size, dtype=torch.bfloat16, head_num=HEADS,
                               head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                               enable_alt_stream=False)
        out = types.SimpleNamespace(kv=dev)
        if host:
            out.host = MHATokenToKVPoolHost(dev._mha_buffer_info(), 2.0, 0, page_size, "layer_first",
                                            pin_memory=False, device="cpu", device_capacity_tokens=size,
                                            start_layer=0, end_layer=LAYERS)
        out.req_to_token = ReqToTokenPool(size=4, max_context_len=1024, device="cpu", enable_memory_saver=False)
        out.allocator = TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", dev, need_sort=False)
        return out

    return make


# ---------------------------------------------------------------------------- HiCache storage


def test_factory_builds_the_backend(sidecar_target):
    from clients.sglang.hicache import SidecarHiCacheStorage

    b = build_backend(sidecar_target)
    assert isinstance(b, SidecarHiCacheStorage)
    assert b.namespace == "sglang-hicache/tp0of1" and b.model_id == "org/test-model"


def test_set_get_exists_batch_roundtrip(sidecar_target):
    b = build_backend(sidecar_target)
    g = torch.Generator().manual_seed(1)
    pages = [torch.randn(2 * LAYERS * PAGE * HEADS * HEAD_DIM, generator=g).to(torch.bfloat16) for _ in range(4)]
    assert b.set("legacy-0", pages[0]) is True
    assert b.exists("legacy-0") and not b.exists("legacy-missing")
    out = torch.empty_like(pages[0])
    assert b.get("legacy-0", out) is out
    assert torch.equal(out.view(torch.int16), pages[0].view(torch.int16))
    assert b.get("legacy-missing", torch.empty_like(pages[0])) is None

    keys = [f"legacy-b{i}" for i in range(3)]
    assert b.batch_set(keys, pages[1:]) is True
    assert b.batch_exists(keys + ["legacy-missing"] + keys) == 3
    outs = b.batch_get(keys + ["legacy-missing"], [torch.empty_like(p) for p in pages[1:]] + [torch.empty_like(pages[0])])
    for o, p in zip(outs[:3], pages[1:]):
        assert torch.equal(o.view(torch.int16), p.view(torch.int16))
    assert outs[3] is None


def _fill(host, starts, seed):
    g = torch.Generator().manual_seed(seed)
    for s in starts:
        page = host.get_dummy_flat_data_page()
        host.set_from_flat_data_page(s, torch.randn(page.numel(), generator=g).to(page.dtype))


def test_zero_copy_v1_and_v2_with_sglang_host_pool(sidecar_target, sglang_pools):
    pools = sglang_pools()
    host = pools.host
    b = build_backend(sidecar_target)
    b.register_mem_pool_host(host)
    b.register_mem_host_pool_v2(host, PoolName.KV)
    starts = [0, PAGE, 3 * PAGE]
    _fill(host, starts, seed=2)
    before = [host.get_data_page(s, flat=True).clone() for s in starts]
    keys = ["v1-a", "v1-b", "v1-c"]
    idx = torch.cat([torch.arange(s, s + PAGE) for s in starts])
    assert b.batch_set_v1(keys, idx) == [True, True, True]
    assert b.batch_exists(keys) == 3

    _fill(host, starts, seed=3)  # overwrite, then read back from the sidecar
    assert b.batch_get_v1(keys + ["v1-missing"], torch.cat([idx, torch.arange(5 * PAGE, 6 * PAGE)])) == [True, True, True, False]
    for s, want in zip(starts, before):
        assert torch.equal(host.get_data_page(s, flat=True).view(torch.int16), want.view(torch.int16))

    # v2: SGLang's PoolTransfer descriptors, KV pool
    res = b.batch_exists_v2(keys + ["v1-missing"])
    assert res.kv_hit_pages == 3
    _fill(host, starts, seed=4)
    got = b.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=idx, keys=keys)])
    assert got[PoolName.KV.value] == [True, True, True]
    for s, want in zip(starts, before):
        assert torch.equal(host.get_data_page(s, flat=True).view(torch.int16), want.view(torch.int16))
    assert b.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=idx, keys=["v2-a", "v2-b", "v2-c"])]) == {
        PoolName.KV.value: [True, True, True]}


def test_second_host_sees_pages(sidecar_target, sglang_pools):
    """Another engine instance (another "host": its own backend, client and host pool) finds
    the pages the first one stored, through the sidecar alone."""
    a_pools, b_pools = sglang_pools(), sglang_pools()
    a, b = build_backend(sidecar_target), build_backend(sidecar_target)
    a.register_mem_pool_host(a_pools.host)
    b.register_mem_pool_host(b_pools.host)
    _fill(a_pools.host, [0, PAGE], seed=5)
    keys = ["shared-x", "shared-y"]
    idx = torch.arange(0, 2 * PAGE)
    assert a.batch_set_v1(keys, idx) == [True, True]
    assert b.batch_exists(keys) == 2
    assert b.batch_get_v1(keys, idx) == [True, True]
    for s in (0, PAGE):
        assert torch.equal(b_pools.host.get_data_page(s, flat=True).view(torch.int16),
                           a_pools.host.get_data_page(s, flat=True).view(torch.int16))
    # another model (identity) does not see them
    other = build_backend(sidecar_target, model_id="org/other-model")
    other.register_mem_pool_host(b_pools.host)
    assert other.batch_exists(keys) == 0


def test_sidecar_down_is_a_miss_never_an_exception(sglang_pools):
    pools = sglang_pools()
    b = build_backend(_dead_target(), timeout_s=1.0)
    b.register_mem_pool_host(pools.host)
    page = pools.host.get_dummy_flat_data_page()
    t0 = time.time()
    assert b.set("k", page) is False
    assert b.batch_set(["k"], [page]) is False
    assert b.get("k", torch.empty_like(page)) is None
    assert b.exists("k") is False and b.batch_exists(["k", "l"]) == 0
    idx = torch.arange(0, PAGE)
    assert b.batch_get_v1(["k"], idx) == [False] and b.batch_set_v1(["k"], idx) == [False]
    assert b.batch_exists_v2(["k"]).kv_hit_pages == 0
    assert b.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=idx, keys=["k"])]) == {"kv": [False]}
    assert time.time() - t0 < 10
    assert b.get_stats()["errors"] > 0


# ---------------------------------------------------------------------------- radix plug-in


def _rope():
    from clients.sglang.radix import rope_spec

    return rope_spec(head_dim=HEAD_DIM, theta=10000.0)


@pytest.fixture()
def radix_env(sidecar_target, sglang_pools, monkeypatch):
    _torchvision_shim()
    import json

    monkeypatch.setenv("KV_SIDECAR_SGLANG", json.dumps({
        "target": sidecar_target, "model_id": "org/test-model", "namespace": f"radix-{time.time_ns()}",
        "policy": "position_independent", "recompute_tokens": 0, "rope": {"theta": 10000.0}}))
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, get_radix_cache_factory

    from clients.sglang import radix

    radix.register()
    radix.register()  # idempotent (load_plugins may run in several processes / twice)
    factory = get_radix_cache_factory(radix.BACKEND_NAME)
    assert factory is radix.sidecar_radix_factory

    def build():
        pools = sglang_pools(page_size=1, host=False)
        params = CacheInitParams(disable=False, req_to_token_pool=pools.req_to_token,
                                 token_to_kv_pool_allocator=pools.allocator, page_size=1)
        ctx = TreeCacheBuildContext(server_args=None, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
                                    enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None,
                                    model_config=None, tp_size=1, tp_rank=0, tp_group=None)
        return factory(ctx), pools

    return build


def _message(rng, n):
    return np.concatenate([[ANCHOR], rng.integers(1, 50_000, n - 1)]).astype(np.int64)


def _prefill_into(cache, pools, tokens, seed):
    """Stand-in for SGLang's forward: K/V rows for ``tokens`` written into allocator slots."""
    g = torch.Generator().manual_seed(seed)
    slots = pools.allocator.alloc(len(tokens))
    for layer in range(LAYERS):
        pools.kv.k_buffer[layer][slots] = torch.randn(len(tokens), HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
        pools.kv.v_buffer[layer][slots] = torch.randn(len(tokens), HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    return slots


def test_radix_plugin_matches_shifted_chunks_at_token_granularity(radix_env):
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from clients.sglang.radix import SidecarRadixCache
    from sidecar.rotation import rotate_keys

    rng = np.random.default_rng(7)
    header_a, header_b = _message(rng, 40), _message(rng, 57)
    body = np.concatenate([_message(rng, 90), _message(rng, 120), _message(rng, 70)])
    prompt_a, prompt_b = np.concatenate([header_a, body]), np.concatenate([header_b, body])

    engine_a, pools_a = radix_env()
    assert isinstance(engine_a, SidecarRadixCache)
    slots_a = _prefill_into(engine_a, pools_a, prompt_a, seed=8)
    assert engine_a.store_prompt(prompt_a, slots_a) >= 3

    engine_b, pools_b = radix_env()
    engine_b.identity = engine_a.identity  # same model, same namespace: another host
    res = engine_b.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt_b.tolist()))))
    assert res.device_prefix_len == 0
    hits = res.sidecar_hits
    shift = len(header_b) - len(header_a)
    assert hits and all(h.delta == shift for h in hits)
    covered = sum(len(h) for h in hits)
    assert covered == len(body)  # every body token, at token granularity, none of the new header
    assert res.host_hit_length == 0  # a prefill gap (the new header) comes first

    req_idx = 1  # a row of SGLang's req_to_token pool
    loaded = engine_b.load_hits(hits, req_pool_idx=req_idx)
    assert not loaded.missed and len(loaded.positions) == covered
    spec = engine_b.rope
    for pos_b, slot_b in zip(loaded.positions.tolist()[:: 37], loaded.slots.tolist()[:: 37]):
        slot_a = int(slots_a[pos_b - shift])
        assert int(pools_b.req_to_token.req_to_token[req_idx, pos_b]) == slot_b
        for layer in range(LAYERS):
            assert torch.equal(pools_b.kv.v_buffer[layer][slot_b], pools_a.kv.v_buffer[layer][slot_a])
            want = rotate_keys(pools_a.kv.k_buffer[layer][slot_a].float(), shift, spec)
            assert torch.allclose(pools_b.kv.k_buffer[layer][slot_b].float(), want, atol=2e-2, rtol=2e-2)


def test_radix_plugin_init_load_back_extends_the_device_prefix(radix_env):
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    rng = np.random.default_rng(9)
    prompt = np.concatenate([_message(rng, 60), _message(rng, 80)])
    engine_a, pools_a = radix_env()
    slots_a = _prefill_into(engine_a, pools_a, prompt, seed=10)
    assert engine_a.store_prompt(prompt, slots_a) >= 2
    engine_b, _ = radix_env()
    engine_b.identity = engine_a.identity
    req = types.SimpleNamespace(cache_request_handle="req-1")
    key = RadixKey(array("q", prompt.tolist()))
    res = engine_b.match_prefix(MatchPrefixParams(key=key, req=req))
    assert res.host_hit_length == len(prompt)  # exact hits from position 0: one contiguous run
    n, node = engine_b.init_load_back(InitLoadBackParams(best_match_node=res.best_match_node,
                                                         host_hit_length=res.host_hit_length, req=req))
    assert n == len(prompt)
    again = engine_b.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt.tolist()))))
    assert again.device_prefix_len == len(prompt)  # SGLang's own tree now serves it


def test_radix_plugin_applies_a_splice_plan_on_a_token_row(radix_env, sidecar_target):
    from sidecar.client import SyncSidecarClient
    from sidecar.rotation import rotate_keys

    rng = np.random.default_rng(11)
    tokens = np.concatenate([_message(rng, 30), _message(rng, 20), _message(rng, 40)])
    engine, pools = radix_env()
    slots = _prefill_into(engine, pools, tokens, seed=12)
    k_before = [pools.kv.k_buffer[layer][slots].clone() for layer in range(LAYERS)]
    with SyncSidecarClient(sidecar_target) as sc:
        session = sc.open_session(tokens, block_size=1)
        plan = sc.splice(session.session_id, session.version, [(30, 50, np.array([7, 8, 9], dtype=np.uint32), "amortize")])
        work = engine.apply_splice_plan(plan, slots, {i: int(s) for i, s in enumerate(slots.tolist())})
        sc.commit_splice(plan.plan_id)
    assert len(work.slots) == len(tokens) - 20 + 3
    assert [c[0] for c in work.compute] == ["PREFILL"] and work.compute[0][1].tolist() == [30, 31, 32]
    assert torch.equal(work.slots[:30], slots[:30])  # the prefix keeps its slots
    kept = work.slots[33:]
    assert torch.equal(kept, slots[50:])  # block size 1: no data moves, only the row changes
    for layer in range(LAYERS):
        want = rotate_keys(k_before[layer][50:].float(), -17, engine.rope)
        assert torch.allclose(pools.kv.k_buffer[layer][kept].float(), want, atol=2e-2, rtol=2e-2)
