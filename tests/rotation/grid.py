"""The bounded grid of key layouts shared by the kernel tests (CPU and CUDA)."""

from __future__ import annotations

import torch

from sidecar.rotation import Pairing, RopeSpec

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rotary_dim, key_dim, layout): full head, leading partial (Phi-2 like, odd pair count), MLA
# expanded trailing, MLA k_pe, engine MLA row (kv_lora_rank + rope).
GEOMETRIES = [(128, 128, "leading"), (32, 80, "leading"), (24, 96, "leading"), (64, 192, "trailing"), (64, 64, "trailing"), (64, 576, "trailing")]


def make_spec(rotary_dim: int, key_dim: int, layout: str, pairing: Pairing) -> RopeSpec:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    return RopeSpec(rotary_dim=rotary_dim, key_dim=key_dim, layout=layout, pairing=pairing, inv_freq=tuple(inv_freq.tolist()))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(bits(a.contiguous()), bits(b.contiguous()), rtol=0, atol=0)
