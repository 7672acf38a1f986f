"""Negative controls: plausible wrong rotations must FAIL the model-reference check.

These prove the bound in ``test_models`` bites: a wrong pairing, scaling applied a second time,
scaling ignored, or partial rotary ignored are each caught on every family they apply to.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from sidecar.rotation import Pairing, RopeSpec, rotate_keys
from tests.rotation.bounds import check_against_model, pairs_to_elements
from tests.rotation.families import FAMILIES, layer_zero_keys

NAMES = sorted(FAMILIES)
SCALED_K = [n for n in NAMES if RopeSpec.from_hf_config(FAMILIES[n].make_config()).attention_scaling != 1.0]
FREQ_SCALED = [n for n in NAMES if RopeSpec.from_hf_config(FAMILIES[n].make_config()).rope_type != "default"]
PARTIAL = [n for n in NAMES if not FAMILIES[n].mla and RopeSpec.from_hf_config(FAMILIES[n].make_config()).rotary_dim < RopeSpec.from_hf_config(FAMILIES[n].make_config()).key_dim]


def _setup(name):
    z = layer_zero_keys(name)
    return z, RopeSpec.from_hf_config(z.config)


def _default_inv_freq(theta: float, rotary_dim: int) -> tuple[float, ...]:
    return tuple((1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))).tolist())


def test_control_sets_are_not_empty():
    assert {"qwen3-yarn", "gpt-oss", "minicpm3-longrope-4x"} <= set(SCALED_K)
    assert {"llama3.1", "llama2-linear", "qwen3-yarn", "gpt-oss", "deepseek-v2-lite", "deepseek-v3", "kimi-k2"} <= set(FREQ_SCALED)
    assert {"phi2", "gpt-neox", "glm4", "glm4-0414", "glm4.5"} <= set(PARTIAL)


@pytest.mark.parametrize("name", NAMES)
def test_wrong_pairing_fails(name):
    z, spec = _setup(name)
    other = Pairing.HALF if spec.pairing is Pairing.INTERLEAVED else Pairing.INTERLEAVED
    wrong = rotate_keys(z.src, z.delta, dataclasses.replace(spec, pairing=other))
    with pytest.raises(AssertionError, match="outside the bound"):
        check_against_model(wrong, z.src, z.dst, z, spec, f"{name}/wrong-pairing")


@pytest.mark.parametrize("name", SCALED_K)
def test_reapplied_attention_scaling_fails(name):
    z, spec = _setup(name)
    out = rotate_keys(z.src, z.delta, spec)
    rotary = pairs_to_elements(torch.ones(spec.half), spec) != 0
    out[..., rotary] *= spec.attention_scaling
    with pytest.raises(AssertionError, match="outside the bound"):
        check_against_model(out, z.src, z.dst, z, spec, f"{name}/scaled-twice")


def test_reapplied_mscale_fails_on_deepseek_v2_lite():
    # DeepSeek-V2-Lite's K carries mscale(40, 0.707) / mscale(40, 0.707) = 1; multiplying by the
    # undivided mscale 0.1 * 0.707 * ln(40) + 1 ~= 1.26 (a classic port bug) must be caught.
    z, spec = _setup("deepseek-v2-lite")
    params = z.config.rope_parameters
    assert spec.attention_scaling == 1.0
    mscale = 0.1 * params["mscale"] * math.log(params["factor"]) + 1.0
    out = rotate_keys(z.src, z.delta, spec) * mscale
    with pytest.raises(AssertionError, match="outside the bound"):
        check_against_model(out, z.src, z.dst, z, spec, "deepseek-v2-lite/mscale")


@pytest.mark.parametrize("name", FREQ_SCALED)
def test_ignored_frequency_scaling_fails(name):
    z, spec = _setup(name)
    theta = z.config.rope_parameters["rope_theta"]
    unscaled = dataclasses.replace(spec, inv_freq=_default_inv_freq(theta, spec.rotary_dim))
    assert unscaled.inv_freq != spec.inv_freq
    wrong = rotate_keys(z.src, z.delta, unscaled)
    with pytest.raises(AssertionError, match="outside the bound"):
        check_against_model(wrong, z.src, z.dst, z, spec, f"{name}/unscaled")


@pytest.mark.parametrize("name", PARTIAL)
def test_ignored_partial_rotary_fails(name):
    z, spec = _setup(name)
    theta = z.config.rope_parameters["rope_theta"]
    full = dataclasses.replace(spec, rotary_dim=spec.key_dim, inv_freq=_default_inv_freq(theta, spec.key_dim))
    wrong = rotate_keys(z.src, z.delta, full)
    with pytest.raises(AssertionError, match="outside the bound"):
        check_against_model(wrong, z.src, z.dst, z, spec, f"{name}/full-rotary")


@pytest.mark.parametrize("name", ["llama3.1", "qwen3", "deepseek-v3", "glm4"])
def test_sign_flipped_delta_fails(name):
    z, spec = _setup(name)
    wrong = rotate_keys(z.src, -z.delta, spec)
    with pytest.raises(AssertionError, match="outside the bound"):
        check_against_model(wrong, z.src, z.dst, z, spec, f"{name}/negated-delta")
