"""Batched rotation of chunk payloads: many (payload, delta) pairs, one kernel call.

A rotated Fetch re-positions every rotary part of every layer of every chunk it answers. One
``rotate_keys`` call per chunk per layer (~256 calls for 8K tokens) costs more in call overhead
than in work; here the rotary parts of all payloads become one list of segments::

    payload (num_tokens n, KVLayout order)       segments (one per chunk x layer x rotary part)
    | L0: k [n, H, D] | v ... | L1: k ... |  ->   address = payload + n * part_offset_per_token
                                                 rows    = n * H (keys of D = spec.key_dim)
                                                 table   = the payload's delta (deduplicated)

and the fused CPU kernel rotates all of them in place in one call (``cpu.rotate_segments_cpu_``:
the parallel kernel, or the serial one for small batches). Results are bit-identical to
rotating each part with ``rotate_keys`` (same fp32 cos/sin table rows, same expression order,
one rounding). Segment addresses come from ``Tensor.data_ptr()`` and the layout's byte offsets:
the kernel gets one pointer, token count and table row per payload and the layout's offsets,
and forms each segment's address itself (no per-layer or per-token Python, no per-segment
arrays).

Where the fused kernel cannot run (CUDA buffers, fp8 or other dtypes, misaligned parts, numba
missing) each part goes through ``rotate_keys`` instead: same results, one call per part.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

import sidecar.rotation.cpu as cpu
from sidecar.identity import KVLayout
from sidecar.rotation.angles import delta_tables
from sidecar.rotation.spec import Pairing, RopeSpec, RotaryLayout

__all__ = ["PayloadRotation", "rotate_payloads_"]


@dataclass(frozen=True, slots=True)
class PayloadRotation:
    """What ``rotate_payloads_`` did: ``rotated_bytes`` of rotary parts in ``seconds``;
    ``kernel_calls`` fused calls (1 per distinct rotary dtype/shape) or ``fallback_calls``
    per-part ``rotate_keys`` calls."""

    rotated_bytes: int
    seconds: float
    kernel_calls: int
    fallback_calls: int


@dataclass(frozen=True, slots=True)
class _RotaryGroup:
    """The rotary parts of one dtype and key shape, per token: ``offsets`` (bytes from the
    payload start, per layer, in units of ``num_tokens``) and ``keys`` per token per part."""

    dtype: torch.dtype
    offsets: np.ndarray  # int64 [num rotary parts over all layers]
    keys_per_token: int
    bytes_per_token: int  # of one part
    offsets_or: int  # bitwise OR of offsets: a payload address p is aligned to w if (p | this) % w == 0


_GROUPS: dict[tuple[str, int], tuple[int, tuple[_RotaryGroup, ...]]] = {}


def _groups(layout: KVLayout, key_dim: int) -> tuple[int, tuple[_RotaryGroup, ...]]:
    """``layout.bytes_per_token`` and the layout's rotary parts grouped by (dtype, keys per
    token); memoised per layout."""
    key = (layout.fingerprint(), key_dim)
    got = _GROUPS.get(key)
    if got is not None:
        return got
    per_layer = sum(p.bytes_per_token for p in layout.parts)
    found: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    prefix = 0
    starts = []
    for p in layout.parts:
        starts.append(prefix)
        prefix += p.bytes_per_token
    for layer in range(layout.num_layers):
        for p, start in zip(layout.parts, starts):
            if p.rotary:
                if p.shape[-1] != key_dim:
                    raise ValueError(f"rope.key_dim: {key_dim} does not match the last dim {p.shape[-1]} of rotary part {p.name!r}")
                found.setdefault((p.dtype, p.shape), []).append(layer * per_layer + start)
    out = []
    for (dtype, shape), offs in found.items():
        keys = int(np.prod(shape[:-1], dtype=np.int64))
        part = next(p for p in layout.parts if p.rotary and p.dtype == dtype and p.shape == shape)
        out.append(_RotaryGroup(dtype=getattr(torch, dtype), offsets=np.asarray(offs, dtype=np.int64),
                                keys_per_token=keys, bytes_per_token=part.bytes_per_token,
                                offsets_or=int(np.bitwise_or.reduce(np.asarray(offs, dtype=np.int64)))))
    got = (layout.bytes_per_token, tuple(out))
    if len(_GROUPS) >= 256:  # layouts are few per deployment; bound it anyway
        _GROUPS.clear()
    _GROUPS[key] = got
    return got


def _aligned(ptr_or: int, p: np.ndarray, n: np.ndarray, g: _RotaryGroup, width: int) -> bool:
    """Whether every segment address ``p[i] + n[i] * g.offsets[j]`` is a multiple of
    ``width``; ``ptr_or`` is the bitwise OR of ``p`` (the usual, cheap answer)."""
    if (ptr_or | g.offsets_or) % width == 0:
        return True
    return not ((p[:, None] + n[:, None] * g.offsets[None, :]) % width).any()


def rotate_payloads_(
    items: Sequence[tuple[torch.Tensor, int, int]], layout: KVLayout, spec: RopeSpec, *, parallel: bool | None = None
) -> PayloadRotation:
    """Rotate the rotary parts of every payload in place by its delta, in one kernel call.

    Args:
      items: ``(payload, num_tokens, delta)`` per chunk (or per run of consecutive chunks
        stored as one payload): ``payload`` a contiguous 1-D ``uint8`` tensor of
        ``num_tokens * layout.bytes_per_token`` bytes in ``KVLayout`` order, writable, not
        shared between items (pass each buffer once); ``delta`` an int (0 leaves it as is).
      layout: the payloads' ``KVLayout``; its rotary parts' last dim must be ``spec.key_dim``.
      spec: the keys' ``RopeSpec``.
      parallel: force the parallel (True) or serial (False) kernel; None picks by size.
    Returns:
      ``PayloadRotation`` (bytes rotated, time, calls). Pass-through dims and non-rotary parts
      are left bit-identical. Not idempotent: each call rotates again.
    Raises:
      ValueError / TypeError: a payload of the wrong size, dtype or shape, a repeated buffer, a
      non-integer delta. Checked before anything is written.
    """
    t0 = time.perf_counter()
    # Python here is per item, not per segment: at ~1 us per item hot and 2-3x that right
    # after the kernel has evicted the interpreter from L2, it is what a batched call costs
    # beyond the kernel (16 chunks of 32K-token bf16 k_pe: ~0.3 ms of kernel).
    per_token, groups = _groups(layout, spec.key_dim)
    moving: list[int] = []  # items with a non-zero delta
    ptrs: list[int] = []
    ntok: list[int] = []
    trow: list[int] = []
    row_of: dict[int, int] = {}  # distinct delta -> table row
    on_cpu = True
    ptr_or = 0
    for i, (payload, num_tokens, delta) in enumerate(items):
        if not isinstance(payload, torch.Tensor) or payload.dtype is not torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
            raise TypeError(f"items[{i}].payload must be a contiguous 1-D uint8 tensor")
        if type(delta) is not int and (isinstance(delta, bool) or not isinstance(delta, (int, np.integer))):
            raise TypeError(f"items[{i}].delta must be an int, got {type(delta).__name__}")
        if num_tokens <= 0 or payload.numel() != num_tokens * per_token:
            raise ValueError(f"items[{i}].payload has {payload.numel()} bytes; kv_layout x {num_tokens} tokens needs "
                             f"{num_tokens * per_token}")
        if delta:
            on_cpu = on_cpu and payload.is_cpu
            moving.append(i)
            ptr = payload.data_ptr()
            ptr_or |= ptr
            ptrs.append(ptr)
            ntok.append(num_tokens)
            trow.append(row_of.setdefault(int(delta), len(row_of)))
    if not moving:
        return PayloadRotation(0, time.perf_counter() - t0, 0, 0)
    p, n, t = np.array((ptrs, ntok, trow), dtype=np.int64)
    if len(moving) > 1:
        order = p.argsort()
        ps = p[order]
        if (ps[1:] < (ps + n[order] * per_token)[:-1]).any():
            raise ValueError("items: two payloads share memory (a buffer listed twice would be rotated twice)")
    interleaved = spec.pairing is Pairing.INTERLEAVED
    tokens = sum(ntok)
    rotated = kernel_calls = fallback_calls = 0
    tables = None
    for g in groups:
        size = g.dtype.itemsize
        pairs = _aligned(ptr_or, p, n, g, 2 * size)
        fused = on_cpu and (pairs if interleaved else _aligned(ptr_or, p, n, g, size)) and (
            not interleaved or (spec.key_dim % 2 == 0 and spec.rotary_offset % 2 == 0)
        )
        if fused:
            if tables is None:
                # The same memoised fp32 rows a per-chunk rotate_keys(delta) uses: same bits.
                tables = delta_tables(spec, list(row_of))
            fused = cpu.rotate_segments_cpu_(p, n, t, g.offsets, g.keys_per_token, *tables, g.dtype, spec,
                                             aligned=pairs, parallel=parallel)
            kernel_calls += int(fused)
        if not fused:
            fallback_calls += _rotate_parts(items, moving, g, spec)
        rotated += tokens * g.bytes_per_token * len(g.offsets)
    return PayloadRotation(rotated, time.perf_counter() - t0, kernel_calls, fallback_calls)


def _rotate_parts(items, idx: list[int], g: _RotaryGroup, spec: RopeSpec) -> int:
    """One ``rotate_keys`` per rotary part (CUDA buffers, unsupported dtypes, misaligned parts)."""
    from sidecar.rotation.dispatch import rotate_keys

    calls = 0
    for i in idx:
        payload, num_tokens, delta = items[i]
        for off in g.offsets.tolist():
            start = off * num_tokens
            raw = payload[start : start + g.bytes_per_token * num_tokens]
            if raw.data_ptr() % g.dtype.itemsize:
                part = raw.clone().view(g.dtype).view(-1, spec.key_dim)
                rotate_keys(part, int(delta), spec, out=part)
                raw.copy_(part.view(-1).view(torch.uint8))
            else:
                part = raw.view(g.dtype).view(-1, spec.key_dim)
                rotate_keys(part, int(delta), spec, out=part)
            calls += 1
    return calls


#: What ``warmup`` compiles: every storage dtype the CPU kernel takes, both pairings, the rotary
#: dims at the front (GQA keys) and at the back (MLA's k_pe after c_kv), serial and parallel.
_WARM_DTYPES = ("float32", "bfloat16", "float16")


def warmup() -> int:
    """Compile (or load from numba's cache) the Fetch path's rotation kernels for every dtype,
    pairing and rotary placement, so the first rotated Fetch does not pay it (0.28 s from
    numba's cache, 8.4 s on the first start after an install, 2 cores). Returns the kernel calls
    made."""
    calls = 0
    inv = (1.0 / (10000.0 ** (np.arange(0, 8, 2, dtype=np.float64) / 8))).tolist()
    for dtype in _WARM_DTYPES:
        layouts = (KVLayout.gqa(num_layers=1, num_kv_heads=1, head_dim=8, dtype=dtype),
                   KVLayout.mla(num_layers=1, kv_lora_rank=8, qk_rope_head_dim=8, dtype=dtype))
        for layout in layouts:
            placement = RotaryLayout.LEADING if layout.parts[0].rotary else RotaryLayout.TRAILING  # GQA / MLA
            for pairing in Pairing:
                spec = RopeSpec(rotary_dim=8, key_dim=8, pairing=pairing, inv_freq=inv, layout=placement)
                for parallel in (False, True):
                    payload = torch.zeros(layout.bytes_per_token * 4, dtype=torch.uint8)
                    calls += rotate_payloads_([(payload, 4, 1)], layout, spec, parallel=parallel).kernel_calls
    return calls
