"""RopeSpec: tables bit-identical to the models', overrides, refusals, fingerprint."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers as tf

from sidecar.rotation import Pairing, RopeSpec, RotaryLayout
from tests.rotation.families import FAMILIES, layer_zero_keys

# (family, expected pairing, rotary_dim, key_dim, layout) as transformers caches the keys.
EXPECTED = {
    "llama3.1": (Pairing.HALF, 128, 128, RotaryLayout.LEADING),
    "llama2-linear": (Pairing.HALF, 128, 128, RotaryLayout.LEADING),
    "qwen3": (Pairing.HALF, 128, 128, RotaryLayout.LEADING),
    "qwen3-yarn": (Pairing.HALF, 128, 128, RotaryLayout.LEADING),
    "mistral": (Pairing.HALF, 128, 128, RotaryLayout.LEADING),
    "phi3-mini-4k": (Pairing.HALF, 96, 96, RotaryLayout.LEADING),
    "phi2": (Pairing.HALF, 32, 80, RotaryLayout.LEADING),
    "gpt-neox": (Pairing.HALF, 24, 96, RotaryLayout.LEADING),
    "glm4": (Pairing.INTERLEAVED, 64, 128, RotaryLayout.LEADING),
    "glm4-0414": (Pairing.INTERLEAVED, 64, 128, RotaryLayout.LEADING),
    "glm4.5": (Pairing.HALF, 64, 128, RotaryLayout.LEADING),
    "cohere": (Pairing.INTERLEAVED, 128, 128, RotaryLayout.LEADING),
    "gpt-oss": (Pairing.HALF, 64, 64, RotaryLayout.LEADING),
    "deepseek-v2-lite": (Pairing.INTERLEAVED, 64, 64, RotaryLayout.TRAILING),
    "deepseek-v3": (Pairing.HALF, 64, 64, RotaryLayout.TRAILING),
    "moonlight": (Pairing.HALF, 64, 64, RotaryLayout.TRAILING),
    "kimi-k2": (Pairing.HALF, 64, 64, RotaryLayout.TRAILING),
    "minicpm3": (Pairing.HALF, 32, 32, RotaryLayout.TRAILING),
    "minicpm3-longrope-4x": (Pairing.HALF, 32, 32, RotaryLayout.TRAILING),
    "qwen2.5": (Pairing.HALF, 128, 128, RotaryLayout.LEADING),
    "qwen3-moe": (Pairing.HALF, 128, 128, RotaryLayout.LEADING),
    "mixtral": (Pairing.HALF, 128, 128, RotaryLayout.LEADING),
}


def test_every_family_has_an_expectation():
    assert set(EXPECTED) == set(FAMILIES)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_spec_matches_the_models_own_tables(name):
    z = layer_zero_keys(name)
    spec = RopeSpec.from_hf_config(z.config)
    # Bit-identical to the model's inv_freq buffer, and the same attention scaling.
    torch.testing.assert_close(spec.inv_freq_tensor, z.inv_freq, rtol=0, atol=0)
    assert spec.attention_scaling == z.attention_scaling
    assert (spec.pairing, spec.rotary_dim, spec.key_dim, spec.layout) == EXPECTED[name]
    assert spec.key_dim == z.src.shape[-1]


def test_mla_expanded_and_engine_layouts():
    cfg = layer_zero_keys("deepseek-v3").config
    k_pe = RopeSpec.from_hf_config(cfg)
    expanded = RopeSpec.from_hf_config(cfg, key_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    engine_row = RopeSpec.from_hf_config(cfg, key_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert (expanded.key_dim, expanded.rotary_offset) == (192, 128)
    assert (engine_row.key_dim, engine_row.rotary_offset) == (cfg.kv_lora_rank + 64, cfg.kv_lora_rank)
    assert k_pe.with_key(key_dim=192) == expanded
    assert k_pe.inv_freq == expanded.inv_freq == engine_row.inv_freq


def test_engine_overrides_pairing_and_layout():
    cfg = layer_zero_keys("qwen3").config
    spec = RopeSpec.from_hf_config(cfg, pairing="interleaved", layout="trailing", key_dim=192)
    assert spec.pairing is Pairing.INTERLEAVED and spec.layout is RotaryLayout.TRAILING
    assert spec.rotary_offset == 192 - 128
    replaced = dataclasses.replace(spec, pairing=Pairing.HALF)
    assert replaced.pairing is Pairing.HALF and replaced.inv_freq == spec.inv_freq


def test_pairing_from_engine_neox_flag():
    assert Pairing.from_neox_style(True) is Pairing.HALF
    assert Pairing.from_neox_style(False) is Pairing.INTERLEAVED
    cfg = layer_zero_keys("glm4").config
    assert RopeSpec.from_hf_config(cfg, pairing=Pairing.from_neox_style(False)) == RopeSpec.from_hf_config(cfg)


def test_spec_is_frozen_and_validated():
    spec = RopeSpec.from_hf_config(layer_zero_keys("qwen3").config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.rotary_dim = 64  # type: ignore[misc]
    with pytest.raises(ValueError, match="exceeds key_dim"):
        dataclasses.replace(spec, key_dim=64)
    with pytest.raises(ValueError, match="inv_freq has"):
        dataclasses.replace(spec, rotary_dim=64)
    with pytest.raises(ValueError, match="even"):
        dataclasses.replace(spec, rotary_dim=127)
    with pytest.raises(ValueError):
        dataclasses.replace(spec, pairing="sideways")


def test_inv_freq_is_stored_as_fp32():
    spec = RopeSpec(rotary_dim=2, key_dim=2, layout="leading", pairing="half", inv_freq=(0.1,))
    assert spec.inv_freq == (float(torch.tensor(0.1, dtype=torch.float32)),)


# ------------------------------------------------------------------ refusals


def test_dynamic_is_refused():
    cfg = tf.LlamaConfig(hidden_size=64, num_attention_heads=2, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="dynamic"):
        RopeSpec.from_hf_config(cfg)


def test_longrope_with_different_factors_is_refused():
    # Phi-3-mini-128k style: short and long factors differ, frequencies depend on the length.
    cfg = tf.Phi3Config(
        hidden_size=64, num_attention_heads=2, max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 16,
                         "long_factor": [1.0 + i for i in range(16)]},
    )  # fmt: skip
    with pytest.raises(ValueError, match="longrope"):
        RopeSpec.from_hf_config(cfg)


def test_unknown_rope_type_is_refused():
    cfg = types.SimpleNamespace(model_type="llama", hidden_size=64, num_attention_heads=2, rope_parameters={"rope_type": "mrope", "rope_theta": 1e4})
    with pytest.raises(ValueError, match="not supported"):
        RopeSpec.from_hf_config(cfg)


def test_unverified_family_needs_an_explicit_pairing():
    cfg = tf.GemmaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="pairing"):
        RopeSpec.from_hf_config(cfg)
    assert RopeSpec.from_hf_config(cfg, pairing="half").pairing is Pairing.HALF


def test_per_layer_type_parameters_need_layer_type():
    cfg = types.SimpleNamespace(
        model_type="custom", hidden_size=64, num_attention_heads=2, head_dim=32,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    )  # fmt: skip
    with pytest.raises(ValueError, match="layer_type"):
        RopeSpec.from_hf_config(cfg, pairing="half")
    full = RopeSpec.from_hf_config(cfg, pairing="half", layer_type="full_attention")
    local = RopeSpec.from_hf_config(cfg, pairing="half", layer_type="sliding_attention")
    assert full.fingerprint != local.fingerprint


# ------------------------------------------------------------------ fingerprint


def test_fingerprint_tracks_what_changes_the_rotation():
    spec = RopeSpec.from_hf_config(layer_zero_keys("llama3.1").config)
    assert spec.fingerprint == RopeSpec.from_hf_config(layer_zero_keys("llama3.1").config).fingerprint
    variants = [
        dataclasses.replace(spec, pairing=Pairing.INTERLEAVED),
        dataclasses.replace(spec, key_dim=192),
        dataclasses.replace(spec, key_dim=192, layout=RotaryLayout.TRAILING),
        dataclasses.replace(spec, attention_scaling=1.1),
        dataclasses.replace(spec, inv_freq=(spec.inv_freq[0] * 1.0000001, *spec.inv_freq[1:])),
    ]
    prints = {v.fingerprint for v in variants} | {spec.fingerprint}
    assert len(prints) == len(variants) + 1
    # The rope_type label alone does not change the rotation.
    assert dataclasses.replace(spec, rope_type="custom").fingerprint == spec.fingerprint


def test_fingerprint_is_stable_across_processes():
    code = (
        "import transformers as tf\n"
        "from sidecar.rotation import RopeSpec\n"
        "from tests.rotation.families import FAMILIES\n"
        "print(RopeSpec.from_hf_config(FAMILIES['deepseek-v2-lite'].make_config()).fingerprint)\n"
    )
    here = RopeSpec.from_hf_config(FAMILIES["deepseek-v2-lite"].make_config()).fingerprint
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root, env=env).stdout.strip()
    assert there.splitlines()[-1] == here


def test_scaled_tables_come_from_transformers_rope_init_functions():
    """linear / llama3 / yarn / longrope go through transformers' own ROPE_INIT_FUNCTIONS (with
    the layer type), so the table is the function's output bit for bit."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tf.Qwen3Config(head_dim=64, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32768)
    cfg.rope_parameters = {
        "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 8192},
        "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
    }
    for layer_type, rope_type in (("full_attention", "yarn"), ("sliding_attention", "linear")):
        spec = RopeSpec.from_hf_config(cfg, layer_type=layer_type)
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, None, layer_type=layer_type)
        torch.testing.assert_close(spec.inv_freq_tensor, inv_freq.float(), rtol=0, atol=0)
        assert spec.attention_scaling == float(scaling) and spec.rope_type == rope_type
