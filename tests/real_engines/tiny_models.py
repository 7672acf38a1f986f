"""Tiny model directories for the engine tests, written by the tests themselves (no download):
a Hugging Face ``config.json``, seeded random bf16 weights in ``model.safetensors`` and
SmolLM2's tokenizer files (copied from the ``model_dir`` fixture's directory).

* ``tiny_llama``: ``LlamaForCausalLM``, 2 layers, hidden 256, 4 attention heads over 2 KV heads
  of 64, SmolLM2's vocabulary (49152) and RoPE (theta 100000, NEOX pairing): 2 KV heads split
  over 2 tensor-parallel ranks, one head each (SmolLM2 itself cannot: 9 attention heads).
* ``tiny_deepseek``: ``DeepseekV3ForCausalLM``, 2 layers (one dense, one MoE with 4 routed
  experts), MLA with the latent row vLLM's CPU kernels take (kv_lora_rank 512 + qk_rope_head_dim
  64 = 576), YaRN.

Context-free keys (``context_free_kv``, the default): the attention output projection of every
layer but the last is zero, so every layer's cached K / V (MLA: latent ``c_kv`` and ``k_pe``) is
a function of its token and position alone, never of the tokens before it. Position-independent
reuse is then exact: a chunk stored after one header and re-positioned behind another must give
the engine the rows its own prefill would have computed, and the answer must be vLLM's own
within bf16 noise. The last layer's attention reads every cached row (its queries and keys
have a larger init std, so attention is peaked and the rotary positions matter): a row placed,
sharded or rotated wrongly changes the answer. The price: the earlier layers' caches do not
affect the output (their attention output is zero), so only the last layer's rows are checked
through the answers; the connector moves every layer with the same code (tests/clients/vllm
checks each layer's rows against the fake model's).

Weights: a normal init, std 0.02, from a seeded ``torch.Generator`` (the same bytes on every
run, so the cache identity's weights digest is stable); norms at 1; the projections that make
queries and keys std 0.1 (attention logits of O(1)); the LM head std 0.1 (logits of std ~1.6:
the greedy token's margin is far above bf16 noise, where std 0.02 gives near-ties).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

#: SmolLM2's tokenizer files (the chat template included)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

STD, QK_STD, HEAD_STD = 0.02, 0.1, 0.1

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 2, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "hidden_act": "silu",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "attention_bias": False,
    "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}

DEEPSEEK_V3_CONFIG = {
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
}


def _llama_tensors(c: dict) -> dict[str, tuple[tuple[int, ...], float]]:
    """Checkpoint name -> (shape, init std; 0: zeros, -1: ones) of a Llama checkpoint."""
    h, f, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = {"model.embed_tokens.weight": ((c["vocab_size"], h), STD), "model.norm.weight": ((h,), -1),
           "lm_head.weight": ((c["vocab_size"], h), HEAD_STD)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": ((q, h), QK_STD), p + "self_attn.k_proj.weight": ((kv, h), QK_STD),
                p + "self_attn.v_proj.weight": ((kv, h), STD), p + "self_attn.o_proj.weight": ((h, q), STD),
                p + "mlp.gate_proj.weight": ((f, h), STD), p + "mlp.up_proj.weight": ((f, h), STD),
                p + "mlp.down_proj.weight": ((h, f), STD),
                p + "input_layernorm.weight": ((h,), -1), p + "post_attention_layernorm.weight": ((h,), -1)}
    return out


def _deepseek_tensors(c: dict) -> dict[str, tuple[tuple[int, ...], float]]:
    """Checkpoint name -> (shape, init std) of a DeepSeek-V3 checkpoint (one tensor per expert,
    as the published checkpoints and vLLM's loader have them)."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    r, rope, nope, v = c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
    qr, moe = c["q_lora_rank"], c["moe_intermediate_size"]
    out = {"model.embed_tokens.weight": ((c["vocab_size"], h), STD), "model.norm.weight": ((h,), -1),
           "lm_head.weight": ((c["vocab_size"], h), HEAD_STD)}

    def mlp(p: str, inner: int) -> dict:
        return {p + "gate_proj.weight": ((inner, h), STD), p + "up_proj.weight": ((inner, h), STD),
                p + "down_proj.weight": ((h, inner), STD)}

    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out |= {a + "q_a_proj.weight": ((qr, h), STD), a + "q_a_layernorm.weight": ((qr,), -1),
                a + "q_b_proj.weight": ((heads * (nope + rope), qr), QK_STD),
                a + "kv_a_proj_with_mqa.weight": ((r + rope, h), QK_STD), a + "kv_a_layernorm.weight": ((r,), -1),
                a + "kv_b_proj.weight": ((heads * (nope + v), r), QK_STD), a + "o_proj.weight": ((h, heads * v), STD),
                p + "input_layernorm.weight": ((h,), -1), p + "post_attention_layernorm.weight": ((h,), -1)}
        if i < c["first_k_dense_replace"]:
            out |= mlp(p + "mlp.", c["intermediate_size"])
        else:
            out[p + "mlp.gate.weight"] = ((c["n_routed_experts"], h), STD)
            out |= mlp(p + "mlp.shared_experts.", moe * c["n_shared_experts"])
            for e in range(c["n_routed_experts"]):
                out |= mlp(f"{p}mlp.experts.{e}.", moe)
    return out


def write_weights(d: Path, shapes: dict[str, tuple[tuple[int, ...], float]], *, seed: int = 0,
                  silent: tuple[int, ...] = ()) -> None:
    """``model.safetensors`` in ``d``: each tensor drawn in name order from one seeded
    generator, bf16; the attention output projection of the layers in ``silent`` zeroed."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        shape, std = shapes[name]
        if std == -1:
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=g) * std
        if name.endswith("self_attn.o_proj.weight") and int(name.split(".")[2]) in silent:
            t.zero_()
        tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def copy_tokenizer(tokenizer_dir: str | Path, d: Path) -> None:
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.exists():
            shutil.copyfile(src, d / name)


def _write(d: Path, config: dict, tokenizer_dir: str | Path, shapes: dict | None, seed: int,
           context_free_kv: bool) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=1))
    copy_tokenizer(tokenizer_dir, d)
    if shapes is not None:
        layers = config["num_hidden_layers"]
        write_weights(d, shapes, seed=seed, silent=tuple(range(layers - 1)) if context_free_kv else ())
    return d


def tiny_llama(d: Path, tokenizer_dir: str | Path, *, seed: int = 0, context_free_kv: bool = True) -> Path:
    """The tiny Llama in ``d`` (see the module docstring)."""
    return _write(d, LLAMA_CONFIG, tokenizer_dir, _llama_tensors(LLAMA_CONFIG), seed, context_free_kv)


def tiny_deepseek(d: Path, tokenizer_dir: str | Path, *, weights: bool = True, seed: int = 0,
                  context_free_kv: bool = True) -> Path:
    """The tiny DeepSeek-V3 in ``d``; ``weights=False`` writes the configuration and tokenizer
    only (for vLLM's config objects, or ``load_format: dummy``)."""
    shapes = _deepseek_tensors(DEEPSEEK_V3_CONFIG) if weights else None
    return _write(d, DEEPSEEK_V3_CONFIG, tokenizer_dir, shapes, seed, context_free_kv)
