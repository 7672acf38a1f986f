"""Deltas -> rotation angles -> fp32 cos/sin tables: the one place angles are computed.

Every path (reference, fused CPU, CUDA) takes its cos/sin from ``cos_sin``, so they agree:

* the angle ``delta * inv_freq[j]`` is formed in float64 from the exact fp32 table value; for
  ``|delta| < 2**31`` its relative error is ~1e-16, i.e. the rotation is ``R(delta)`` of the
  model's own fp32 frequencies, with no fp32 angle round-off of our own;
* ``cos``/``sin`` are evaluated in float64 and rounded once to fp32; the rotation itself is fp32.

The model's cached key at position ``p`` used the fp32 angle ``fl(p * inv_freq)``, which is off
by up to half an fp32 ulp of ``p * inv_freq`` (~0.004 rad at p = 1e5 for the fastest pair);
that round-off, not ours, bounds how closely ``R(delta) K(p)`` can match the model's ``K(p +
delta)``.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from sidecar.rotation.spec import RopeSpec

__all__ = ["Delta", "RotationTable", "as_delta_tensor", "cos_sin", "delta_arrays", "delta_tables", "rotation_table"]

#: What callers may pass as a delta: a Python/NumPy integer or an integer tensor.
Delta = int | torch.Tensor


def as_delta_tensor(delta: Delta, batch_shape: torch.Size | tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Validate ``delta`` against the key batch shape; return an int64 tensor on ``device``.

    The result has ``delta``'s own shape (a 0-d tensor for a scalar), broadcastable over
    ``batch_shape``.
    """
    if isinstance(delta, torch.Tensor):
        if delta.dtype.is_floating_point or delta.dtype.is_complex or delta.dtype == torch.bool:
            raise TypeError(f"delta must be an integer tensor (positions are integers), got {delta.dtype}")
        try:
            broadcast = torch.broadcast_shapes(delta.shape, tuple(batch_shape))
        except RuntimeError as exc:
            raise ValueError(f"delta of shape {tuple(delta.shape)} does not broadcast over {tuple(batch_shape)}") from exc
        if broadcast != torch.Size(batch_shape):
            raise ValueError(f"delta of shape {tuple(delta.shape)} does not broadcast over {tuple(batch_shape)}")
        return delta.to(device=device, dtype=torch.int64)
    if isinstance(delta, bool) or not isinstance(delta, numbers.Integral):
        raise TypeError(f"delta must be an int or an integer tensor, got {type(delta).__name__}")
    return torch.tensor(int(delta), dtype=torch.int64, device=device)


def cos_sin(delta: torch.Tensor, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos``/``sin`` of ``delta[..., None] * inv_freq``, shaped ``delta.shape + (half,)``."""
    return _cos_sin_of(delta, spec.inv_freq_tensor.to(device=delta.device, dtype=torch.float64))


def _cos_sin_of(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angle = delta.to(torch.float64).unsqueeze(-1) * inv_freq
    return torch.cos(angle).to(torch.float32), torch.sin(angle).to(torch.float32)


def _scalar_table(spec: RopeSpec, delta: int) -> "RotationTable":
    """CPU table for one scalar delta, memoised: a Fetch rotates every layer of every chunk of a
    shifted run by the same delta, and building the table is most of a small call's cost."""
    return _scalar_table_for(spec.inv_freq, delta)


# The table depends only on the fp32 frequencies and the delta; tables are read-only. An LRU
# bounded to 4,096 entries (~1 MB at 64 pairs) instead of a hand-kept dict.
@functools.lru_cache(maxsize=4096)
def _scalar_table_for(inv_freq: tuple[float, ...], delta: int) -> "RotationTable":
    cos, sin = _cos_sin_of(torch.tensor([delta], dtype=torch.int64), torch.tensor(inv_freq, dtype=torch.float64))
    return RotationTable(cos=cos, sin=sin, index=None)


def delta_arrays(spec: RopeSpec, delta: int) -> tuple[np.ndarray, np.ndarray]:
    """``_scalar_table(spec, delta)``'s fp32 ``cos``/``sin`` ``[1, half]`` as numpy arrays
    (read-only by contract; they share the memoised table's memory)."""
    return _scalar_arrays_for(spec.inv_freq, delta)


def delta_tables(spec: RopeSpec, deltas: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """fp32 ``cos``/``sin`` ``[len(deltas), half]`` (numpy, contiguous), one row per delta, from
    the same memoised rows scalar-delta calls use (so a batched rotation has the same bits as
    one call per chunk)."""
    inv_freq = spec.inv_freq
    rows = [_scalar_arrays_for(inv_freq, d) for d in deltas]
    if len(rows) == 1:
        return rows[0]
    return np.concatenate([c for c, _ in rows]), np.concatenate([s for _, s in rows])


# The CPU kernels take numpy arrays; Tensor.numpy() costs ~1 us (2-3 us right after a kernel
# has evicted the interpreter from L2) and a call needs two per distinct delta, so the numpy
# views are memoised next to the tables (same bound).
@functools.lru_cache(maxsize=4096)
def _scalar_arrays_for(inv_freq: tuple[float, ...], delta: int) -> tuple[np.ndarray, np.ndarray]:
    table = _scalar_table_for(inv_freq, delta)
    return table.cos.numpy(), table.sin.numpy()


@dataclass(frozen=True, kw_only=True)
class RotationTable:
    """Per-distinct-delta tables for the fused kernels.

    ``cos``/``sin``: fp32 ``[U, half]``, contiguous. ``index``: int32 ``[rows]`` naming each key
    row's table row (rows are ``batch_shape`` flattened, C order); ``None`` when every row uses
    row 0 (one delta for the whole call).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    index: torch.Tensor | None


def rotation_table(delta: torch.Tensor, batch_shape: tuple[int, ...], spec: RopeSpec, *, dedupe: bool) -> RotationTable:
    """Build the table for ``delta`` (from ``as_delta_tensor``) over ``batch_shape`` rows.

    ``dedupe=True`` computes cos/sin once per run of equal deltas, or once per distinct delta
    when runs are short (a sort); cos/sin cost ~10 ns per (table row, pair), so 32K distinct
    deltas x 64 pairs is ~20 ms while 256 per-chunk deltas is ~0.1 ms. It syncs on CUDA.
    ``dedupe=False`` computes one table row per element of ``delta`` (no sync; the CUDA path).
    """
    if delta.numel() == 1:
        if delta.device.type == "cpu":
            return _scalar_table(spec, int(delta))
        cos, sin = cos_sin(delta.reshape(1), spec)
        return RotationTable(cos=cos, sin=sin, index=None)
    flat = delta.reshape(-1)
    if dedupe:
        # Deltas come in runs (one per chunk or spliced region): an O(n) run scan usually
        # suffices; sort only when the runs are short. Repeated values across runs just cost
        # a table row each.
        values, inverse = torch.unique_consecutive(flat, return_inverse=True)
        if values.numel() > max(64, flat.numel() // 16):
            values, inverse = torch.unique(flat, return_inverse=True)
    else:
        values, inverse = flat, torch.arange(flat.numel(), device=delta.device)
    cos, sin = cos_sin(values, spec)
    index = inverse.to(torch.int32).view(delta.shape).expand(batch_shape).reshape(-1)
    return RotationTable(cos=cos, sin=sin, index=index)
