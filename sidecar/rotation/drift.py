"""Chained-rotation drift: how far rotated keys stray from the exact key (docs/rotation.md).

Every rotation rounds its result once to the storage dtype. Rotating a canonical copy once
costs one rounding; rotating a rotated copy again and again costs one rounding per step. This
measures both against the exact key, so the rule the sidecar keeps (always rotate the canonical
copy, never chain; refresh past ``directives.refresh_after`` rotations) rests on a figure, not a
guess. The benchmark (``./dev bench rotation``) prints it; the tests bound it.
"""

from __future__ import annotations

import torch

from sidecar.rotation.dispatch import rotate_keys
from sidecar.rotation.spec import Pairing, RopeSpec

__all__ = ["chained_drift"]


def chained_drift(spec: RopeSpec, dtype: torch.dtype, chains: tuple[int, ...] = (2, 10, 100), total: int = 25000,
                  rows: int = 512) -> dict[str, float]:
    """Relative error vs the exact key at the target position, for stored ``dtype`` keys.

    ``exact(p) = R(p) k`` in float64 with ``spec``'s fp32 frequencies, for ``rows`` random keys
    (a fixed seed: the same arguments give the same figures). The canonical copy is
    ``exact(p0)`` stored in ``dtype``. Reported, as ||out - exact|| / ||exact|| over all keys
    (and, under ``<name>_worst``, the worst single key):

      fresh: ``exact(p0 + total)`` stored in dtype (a re-prefill, storage rounding only)
      single: one rotation of the canonical copy by ``total``
      chain_n: n rotations whose deltas sum to ``total`` (each rounds to ``dtype``)

    Args:
      spec: a fully rotary, half-split spec (``rotary_dim == key_dim``, ``Pairing.HALF``), the
        layout the float64 reference computes.
      dtype: the storage dtype (floating point).
      chains: the chain lengths n to measure, each at least 1.
      total: the whole shift, in positions.
      rows: how many keys.
    Raises:
      ValueError: an argument outside the above; the message starts with its name.
    """
    if spec.pairing is not Pairing.HALF or spec.rotary_dim != spec.key_dim:
        raise ValueError(f"spec: the float64 reference covers fully rotary half-split keys; got pairing "
                         f"{spec.pairing.value}, rotary_dim {spec.rotary_dim} of key_dim {spec.key_dim}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype: keys are stored in a floating dtype, not {dtype}")
    if any(n < 1 for n in chains):
        raise ValueError(f"chains: each chain is at least one rotation; got {chains}")
    if rows < 1:
        raise ValueError(f"rows: at least one key; got {rows}")
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(rows, spec.key_dim, generator=gen, dtype=torch.float64)
    inv = spec.inv_freq_tensor.double()

    def exact(p: int) -> torch.Tensor:
        ang = p * inv
        x, y = k[:, : spec.half], k[:, spec.half :]
        return torch.cat([x * ang.cos() - y * ang.sin(), y * ang.cos() + x * ang.sin()], dim=-1)

    p0 = 1234
    target = exact(p0 + total)

    def err(out: torch.Tensor) -> tuple[float, float]:
        diff = out.double() - target
        per_key = diff.norm(dim=-1) / target.norm(dim=-1)
        return float(diff.norm() / target.norm()), float(per_key.max())

    stored = exact(p0).to(dtype)
    result: dict[str, float] = {}
    result["fresh"], result["fresh_worst"] = err(exact(p0 + total).to(dtype))
    result["single"], result["single_worst"] = err(rotate_keys(stored, total, spec))
    for n in chains:
        steps = torch.randint(-3000, 3000, (n - 1,), generator=gen).tolist()
        steps.append(total - sum(steps))
        cur = stored
        for s in steps:
            cur = rotate_keys(cur, int(s), spec)
        result[f"chain_{n}"], result[f"chain_{n}_worst"] = err(cur)
    return result
