"""Tiny random-weight models that keep each family's real rotary settings.

Every config below keeps the family's rotary geometry (head_dim / qk_rope_head_dim / partial
rotary / rope_theta / rope scaling and its parameters) and shrinks everything else (1 layer,
tiny hidden size, vocab 128, few experts). Nothing is downloaded.

Family notes (transformers 5.23 model types):
* Kimi-K2's hub config says ``model_type: kimi_k2``; transformers runs it as ``deepseek_v3``
  (see ``kimi_k25``'s text config), so it is built as DeepseekV3 with Kimi-K2's rope settings.
  Moonlight is ``deepseek_v3`` on the hub.
* Phi-2 is ``phi``; GLM-4 (glm-4-9b-chat-hf) is ``glm``; GLM-4-0414 is ``glm4``; GLM-4.5 is
  ``glm4_moe``; MiniCPM3 is in-library (``minicpm3``).
* MiniCPM3-4B uses ``longrope`` with equal short and long factors; the 16 factors here are
  made-up increasing values (the real list is not needed: equal lists are what makes closure
  hold, and the frequency table is compared to the model's own buffer).
* DeepSeek-V2/V3 and MiniCPM3 (MLA) cache ``(latent, k_pe)`` as the (keys, values) of a
  cache layer in transformers 5.x; the rotary tensor is ``k_pe`` ``[B, 1, T, qk_rope_head_dim]``.
  The expanded key ``[B, H, T, nope + rope]`` is produced by the model's own ``expand_kv``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers as tf

VOCAB = 128
T = 12  # tokens per sequence


@dataclass(frozen=True)
class Family:
    name: str
    make_config: Callable[[], tf.PretrainedConfig]
    mla: bool = False

    @property
    def original_max(self) -> int:
        cfg = self.make_config()
        params = cfg.rope_parameters
        return int(params.get("original_max_position_embeddings") or cfg.max_position_embeddings)


def _common(**kw):
    base = dict(vocab_size=VOCAB, num_hidden_layers=1, intermediate_size=64, tie_word_embeddings=False)
    base.update(kw)
    return base


def _yarn(factor, orig, **kw):
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig, **kw}


_MINICPM3_FACTORS = [round(1.0 + 0.37 * i + 0.011 * i * i, 6) for i in range(16)]

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("llama3.1", lambda: tf.LlamaConfig(**_common(
            hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=131072,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))),
        Family("llama2-linear", lambda: tf.LlamaConfig(**_common(
            hidden_size=256, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16384,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}))),
        Family("qwen3", lambda: tf.Qwen3Config(**_common(
            hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=40960,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}))),
        Family("qwen3-yarn", lambda: tf.Qwen3Config(**_common(
            hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=131072,
            rope_parameters={"rope_theta": 1000000.0, **_yarn(4.0, 32768)}))),
        Family("mistral", lambda: tf.MistralConfig(**_common(
            hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=32768,
            sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}))),
        Family("phi3-mini-4k", lambda: tf.Phi3Config(**_common(
            hidden_size=192, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
            original_max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            pad_token_id=0, eos_token_id=1, bos_token_id=1))),
        Family("phi2", lambda: tf.PhiConfig(**_common(
            hidden_size=160, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.4}))),
        Family("gpt-neox", lambda: tf.GPTNeoXConfig(**_common(
            hidden_size=192, num_attention_heads=2, max_position_embeddings=2048, rotary_pct=0.25,
            rotary_emb_base=10000))),
        Family("glm4", lambda: tf.GlmConfig(**_common(
            hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=131072,
            pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}))),
        Family("glm4-0414", lambda: tf.Glm4Config(**_common(
            hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=32768,
            pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}))),
        Family("glm4.5", lambda: tf.Glm4MoeConfig(**_common(
            hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=131072,
            moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}))),
        Family("cohere", lambda: tf.CohereConfig(**_common(
            hidden_size=256, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=131072,
            rope_parameters={"rope_type": "default", "rope_theta": 8000000.0}))),
        Family("gpt-oss", lambda: tf.GptOssConfig(**_common(
            hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=131072,
            num_local_experts=4, num_experts_per_tok=2,
            rope_parameters={"rope_theta": 150000.0, **_yarn(32.0, 4096, beta_fast=32.0, beta_slow=1.0, truncate=False)}))),
        Family("deepseek-v2-lite", lambda: tf.DeepseekV2Config(**_common(
            hidden_size=64, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=163840,
            kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=32,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
            rope_parameters={"rope_theta": 10000.0, **_yarn(40.0, 4096, beta_fast=32, beta_slow=1, mscale=0.707,
                                                           mscale_all_dim=0.707)})), mla=True),
        Family("deepseek-v3", lambda: tf.DeepseekV3Config(**_common(
            hidden_size=64, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=163840,
            kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=32,
            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
            first_k_dense_replace=1, rope_interleave=True,
            rope_parameters={"rope_theta": 10000.0, **_yarn(40.0, 4096, beta_fast=32, beta_slow=1, mscale=1.0,
                                                           mscale_all_dim=1.0)})), mla=True),
        Family("moonlight", lambda: tf.DeepseekV3Config(**_common(
            hidden_size=64, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8192,
            kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=32,
            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
            first_k_dense_replace=1, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})), mla=True),
        Family("kimi-k2", lambda: tf.DeepseekV3Config(**_common(
            hidden_size=64, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=131072,
            kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=32,
            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
            first_k_dense_replace=1,
            rope_parameters={"rope_theta": 50000.0, **_yarn(32.0, 4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                                                           mscale_all_dim=1.0)})), mla=True),
        Family("minicpm3", lambda: tf.MiniCPM3Config(**_common(
            hidden_size=64, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32768,
            kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=32,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32768,
                             "short_factor": _MINICPM3_FACTORS, "long_factor": _MINICPM3_FACTORS})), mla=True),
        # LongRoPE with equal factors and a 4x context extension: attention_factor > 1 sits in K.
        Family("minicpm3-longrope-4x", lambda: tf.MiniCPM3Config(**_common(
            hidden_size=64, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=131072,
            kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=32,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32768,
                             "short_factor": _MINICPM3_FACTORS, "long_factor": _MINICPM3_FACTORS})), mla=True),
        # Llama-like families whose rotary code is Llama's; listed so from_hf_config knows them.
        Family("qwen2.5", lambda: tf.Qwen2Config(**_common(
            hidden_size=256, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}))),
        Family("qwen3-moe", lambda: tf.Qwen3MoeConfig(**_common(
            hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=40960,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}))),
        Family("mixtral", lambda: tf.MixtralConfig(**_common(
            hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=32768,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}))),
    ]
}  # fmt: skip


@dataclass(frozen=True)
class LayerZeroKeys:
    """Layer-0 cached keys of one family at two position grids (src, dst) for the same tokens."""

    family: Family
    config: tf.PretrainedConfig
    model: torch.nn.Module
    src_pos: torch.Tensor  # [B, T] int64
    dst_pos: torch.Tensor  # [B, T] int64
    src: torch.Tensor  # cached rotary-carrying key at src_pos: [B, H, T, D] (k_pe for MLA)
    dst: torch.Tensor  # same at dst_pos
    src_expanded: torch.Tensor | None  # MLA only: expand_kv key [B, H, T, nope + rope]
    dst_expanded: torch.Tensor | None

    @property
    def delta(self) -> torch.Tensor:
        """Per-token delta ``[B, 1, T]``, broadcastable over ``[B, H, T]``."""
        return (self.dst_pos - self.src_pos).unsqueeze(1)

    @property
    def rotary_module(self) -> torch.nn.Module:
        """The model's rotary-embedding module (holds ``inv_freq`` and ``attention_scaling``)."""
        return next(m for m in self.model.modules() if hasattr(m, "inv_freq") and hasattr(m, "attention_scaling"))

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.rotary_module.inv_freq

    @property
    def attention_scaling(self) -> float:
        return float(self.rotary_module.attention_scaling)


def position_grid(original_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Source and target positions: deltas of both signs up to +-100000, across original_max.

    rows: 0: [0, T) -> +100000      1: 100000 + [0, T) -> [0, T) (delta -100000)
          2: just below original_max -> just above    3: far above -> below (negative)
          4: per-token mixed deltas (non-monotone targets)
    """
    i = torch.arange(T)
    src = torch.stack([i, 100000 + i, original_max - 20 + i, original_max + 5000 + i, 50 + 3 * i])
    gen = torch.Generator().manual_seed(1234)
    mixed = torch.randint(-50, 90000, (T,), generator=gen)
    delta = torch.stack([
        torch.full((T,), 100000), torch.full((T,), -100000), torch.full((T,), 37),
        torch.full((T,), -5064), mixed,
    ])  # fmt: skip
    return src, src + delta


@functools.cache
def layer_zero_keys(name: str) -> LayerZeroKeys:
    """Run the family's tiny model twice (src, dst positions) and collect layer-0 cached keys.

    Layer 0's pre-RoPE keys depend only on the tokens, so the model's own key at ``dst`` is the
    reference for rotating its key at ``src`` by ``dst - src``.
    """
    family = FAMILIES[name]
    config = family.make_config()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval().to(torch.float32)
    src_pos, dst_pos = position_grid(family.original_max)
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(7)).expand(src_pos.shape[0], T)

    def run(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        with torch.no_grad():
            cache = model(input_ids=ids, position_ids=pos, use_cache=True).past_key_values
        layer = cache.layers[0]
        if not family.mla:
            return layer.keys.clone(), None
        latent, k_pe = layer.keys, layer.values
        with torch.no_grad():
            expanded, _ = model.model.layers[0].self_attn.expand_kv(latent, k_pe)
        return k_pe.clone(), expanded.clone()

    src, src_x = run(src_pos)
    dst, dst_x = run(dst_pos)
    return LayerZeroKeys(family, config, model, src_pos, dst_pos, src, dst, src_x, dst_x)
