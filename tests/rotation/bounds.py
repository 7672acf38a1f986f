"""Error bounds for comparing a rotated key with the model's own key at the target position.

transformers forms the angle ``fl32(p * inv_freq[j])`` in fp32, so its cached key at position
``p`` is already off by up to half an fp32 ulp of that angle (~0.004 rad at p = 1e5 for the
fastest pair). ``R(delta) K(p)`` therefore differs from the model's ``K(p + delta)`` by at most

    |pair| * (e(p) + e(p + delta) + c),   e(q) = ulp32(fl32(q * inv_freq[j])) / 2

where ``c`` covers fp32 cos/sin evaluation and the handful of fp32 roundings on both sides (a
few 1e-7). Anything structurally wrong (pairing, frequencies, re-applied scaling) is orders of
magnitude above this bound; the negative-control tests prove it.
"""

from __future__ import annotations

import torch

from sidecar.rotation import Pairing, RopeSpec

#: fp32 cos/sin evaluation + ~6 fp32 roundings on each side, relative to the pair norm.
ROUNDING_SLACK = 2e-6
BF16_UNIT = 2.0**-8  # bf16 unit roundoff is 2**-9; one rounding in, one out


def angle_roundoff(pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Half an fp32 ulp of the model's angle, float64 ``[B, 1, T, half]`` for ``pos [B, T]``."""
    angle = pos.to(torch.float32).unsqueeze(-1) * inv_freq.to(torch.float32)
    up = torch.nextafter(angle.abs(), torch.tensor(float("inf")))
    return (0.5 * (up.double() - angle.abs().double())).unsqueeze(1)


def rotary_pairs(k: torch.Tensor, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    off, rd, h = spec.rotary_offset, spec.rotary_dim, spec.half
    rot = k[..., off : off + rd].double()
    if spec.pairing is Pairing.HALF:
        return rot[..., :h], rot[..., h:]
    return rot[..., 0::2], rot[..., 1::2]


def pair_norm(k: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    x, y = rotary_pairs(k, spec)
    return torch.sqrt(x * x + y * y)


def pairs_to_elements(per_pair: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Spread a per-pair quantity ``[..., half]`` onto key dims ``[..., key_dim]`` (0 elsewhere)."""
    out = torch.zeros(*per_pair.shape[:-1], spec.key_dim, dtype=per_pair.dtype)
    off, rd, h = spec.rotary_offset, spec.rotary_dim, spec.half
    if spec.pairing is Pairing.HALF:
        out[..., off : off + h] = per_pair
        out[..., off + h : off + rd] = per_pair
    else:
        out[..., off : off + rd : 2] = per_pair
        out[..., off + 1 : off + rd : 2] = per_pair
    return out


def model_bound(src: torch.Tensor, src_pos: torch.Tensor, dst_pos: torch.Tensor, spec: RopeSpec, inv_freq: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |R(delta) K(src) - K_model(dst)| for fp32 keys (0 on pass-through)."""
    r = pair_norm(src, spec)
    e = angle_roundoff(src_pos, inv_freq) + angle_roundoff(dst_pos, inv_freq)
    return pairs_to_elements(r * (e + ROUNDING_SLACK), spec).expand(src.shape)


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """Element-wise ``|actual - expected| <= bound`` (bound 0 means bit-identical)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual.double() - expected.double()).abs()
    bad = ~(err <= bound)
    if bool(bad.any()):
        ratio = (err / bound.clamp_min(1e-300))[bad]
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} elements outside the bound; first at {idx}: "
            f"actual {actual[idx].item()!r} expected {expected[idx].item()!r} bound {bound[idx].item():.3g}; "
            f"worst err/bound {ratio.max().item():.3g}"
        )


def check_against_model(out: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, z, spec: RopeSpec, what: str) -> None:
    """Rotary dims within the model's own fp32 angle round-off of ``dst``; pass-through dims
    bit-identical. ``z`` carries ``src_pos``, ``dst_pos`` ``[B, T]`` and the model's ``inv_freq``."""
    bound = model_bound(src, z.src_pos, z.dst_pos, spec, z.inv_freq)
    assert_within(out, dst, bound, what)
