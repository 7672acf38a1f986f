"""Rotation against the models' own code: R(delta) K(p) == the model's cached K(p + delta).

For every family, the reference is the key transformers caches when the same tokens run at the
target positions (layer 0: its pre-RoPE keys do not depend on position). Deltas of both signs
up to +-100000, across ``original_max_position_embeddings``, per token.
"""

from __future__ import annotations

import pytest
import torch

from sidecar.rotation import RopeSpec, rotate_keys, rotate_keys_native
from tests.rotation.bounds import (
    BF16_UNIT,
    assert_within,
    check_against_model,
    model_bound,
    pair_norm,
    pairs_to_elements,
)
from tests.rotation.families import FAMILIES, layer_zero_keys

NAMES = sorted(FAMILIES)
MLA = sorted(n for n, f in FAMILIES.items() if f.mla)
PATHS = {"native": rotate_keys_native, "public": rotate_keys}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("name", NAMES)
def test_fp32_matches_the_models_key_at_the_target(name, path):
    z = layer_zero_keys(name)
    spec = RopeSpec.from_hf_config(z.config)
    out = PATHS[path](z.src, z.delta, spec)
    assert out.dtype == torch.float32 and out.shape == z.src.shape
    check_against_model(out, z.src, z.dst, z, spec, f"{name}/{path}")


@pytest.mark.parametrize("name", NAMES)
def test_scalar_and_zero_d_deltas(name):
    z = layer_zero_keys(name)
    spec = RopeSpec.from_hf_config(z.config)
    for row in range(4):  # rows 0-3 use one delta for all tokens
        delta = int(z.dst_pos[row, 0] - z.src_pos[row, 0])
        src, dst = z.src[row : row + 1], z.dst[row : row + 1]
        sub = _rows(z, row)
        for d in (delta, torch.tensor(delta)):
            check_against_model(rotate_keys(src, d, spec), src, dst, sub, spec, f"{name}/row{row}/{type(d).__name__}")


@pytest.mark.parametrize("name", MLA)
def test_mla_expanded_key_rotates_its_trailing_slice(name):
    z = layer_zero_keys(name)
    cfg = z.config
    spec = RopeSpec.from_hf_config(cfg, key_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    out = rotate_keys(z.src_expanded, z.delta, spec)
    # k_nope (leading qk_nope_head_dim dims) comes back bit-identical; bound is 0 there.
    check_against_model(out, z.src_expanded, z.dst_expanded, z, spec, f"{name}/expanded")


@pytest.mark.parametrize("name", NAMES)
def test_bf16_storage_is_fp32_math_plus_one_rounding(name):
    z = layer_zero_keys(name)
    spec = RopeSpec.from_hf_config(z.config)
    kb = z.src.to(torch.bfloat16)
    out = rotate_keys(kb, z.delta, spec)
    assert out.dtype == torch.bfloat16
    # Exactly: fp32 math on the bf16 values, one rounding back.
    expected = rotate_keys_native(kb.float(), z.delta, spec).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # Against the model: fp32 bound plus one bf16 rounding in and one out.
    r = pairs_to_elements(pair_norm(z.src, spec), spec)
    bound = model_bound(z.src, z.src_pos, z.dst_pos, spec, z.inv_freq) + BF16_UNIT * (r + z.dst.abs().double())
    is_pass = pairs_to_elements(torch.ones(spec.half, dtype=torch.float64), spec) == 0
    bound = torch.where(is_pass, torch.zeros_like(bound), bound)  # pass-through: bit-identical to kb
    assert_within(out, z.dst.to(torch.bfloat16), bound, f"{name}/bf16")


@pytest.mark.parametrize("name", ["phi2", "gpt-neox", "glm4", "glm4.5", "deepseek-v3"])
def test_pass_through_dims_are_bit_identical_to_the_model(name):
    z = layer_zero_keys(name)
    cfg = z.config
    spec = RopeSpec.from_hf_config(cfg)
    src, dst = z.src, z.dst
    if FAMILIES[name].mla:
        spec = spec.with_key(key_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        src, dst = z.src_expanded, z.dst_expanded
    out = rotate_keys(src, z.delta, spec)
    keep = pairs_to_elements(torch.ones(spec.half), spec) == 0
    assert int(keep.sum()) == spec.key_dim - spec.rotary_dim > 0
    torch.testing.assert_close(out[..., keep], dst[..., keep], rtol=0, atol=0)
    torch.testing.assert_close(out[..., keep], src[..., keep], rtol=0, atol=0)


def _rows(z, row: int):
    """A view of ``z`` restricted to one batch row (positions only; used for bounds)."""

    class Row:
        src_pos = z.src_pos[row : row + 1]
        dst_pos = z.dst_pos[row : row + 1]
        inv_freq = z.inv_freq

    return Row
