"""CUDA rotation: a Triton kernel (one read, one write per key), torch reference otherwise.

Used for CUDA tensors. Tables come from ``angles.rotation_table(dedupe=False)``: one fp64-derived
cos/sin row per element of ``delta``, so nothing here waits on the device (no ``unique``, no
``.item()``) except the optional slot-id checks of ``rotate_slots_cuda_``.

Agreement with the reference: same fp32 cos/sin values; the kernel is compiled with
``enable_fp_fusion=False`` where Triton accepts it so ``x*c - y*s`` is not contracted into an FMA,
which makes it bit-identical to eager torch; where that option is missing, results differ from
the reference by at most 1 fp32 ulp before the final rounding.
"""

from __future__ import annotations

import logging

import torch

from sidecar.rotation.angles import Delta, as_delta_tensor, rotation_table
from sidecar.rotation.native import check_key, check_slots, rotate_keys_native, rotate_slots_native_
from sidecar.rotation.spec import Pairing, RopeSpec

logger = logging.getLogger(__name__)

__all__ = ["TRITON_AVAILABLE", "rotate_keys_cuda", "rotate_slots_cuda_"]

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:
    TRITON_AVAILABLE = False

_BLOCK_ROWS = 16
_launch_options: dict[str, bool] = {"enable_fp_fusion": False}


if TRITON_AVAILABLE:

    @triton.jit
    def _rotate_block(
        src_ptr, dst_ptr, src_base, dst_base, t, row_mask, cos_ptr, sin_ptr, half,
        INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        """Rotate the rotary slices of a block of rows (bases in elements, table rows ``t``)."""
        j = tl.arange(0, BLOCK_H)
        mask = row_mask[:, None] & (j < half)[None, :]
        c = tl.load(cos_ptr + t[:, None] * half + j[None, :], mask=mask, other=1.0)
        s = tl.load(sin_ptr + t[:, None] * half + j[None, :], mask=mask, other=0.0)
        if INTERLEAVED:
            xi = 2 * j
            yi = 2 * j + 1
        else:
            xi = j
            yi = j + half
        x = tl.load(src_ptr + src_base[:, None] + xi[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(src_ptr + src_base[:, None] + yi[None, :], mask=mask, other=0.0).to(tl.float32)
        nx = x * c - y * s
        ny = y * c + x * s
        tl.store(dst_ptr + dst_base[:, None] + xi[None, :], nx.to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(dst_ptr + dst_base[:, None] + yi[None, :], ny.to(dst_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate_rows_kernel(
        src_ptr, dst_ptr, cos_ptr, sin_ptr, index_ptr, n_rows, key_dim, off, half,
        PER_ROW: tl.constexpr, INTERLEAVED: tl.constexpr, COPY_PASS: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_mask = rows < n_rows
        if PER_ROW:
            t = tl.load(index_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        else:
            t = tl.zeros([BLOCK_R], dtype=tl.int64)
        base = rows.to(tl.int64) * key_dim
        if COPY_PASS:
            d = tl.arange(0, BLOCK_D)
            passing = (d < key_dim) & ((d < off) | (d >= off + 2 * half))
            pmask = row_mask[:, None] & passing[None, :]
            v = tl.load(src_ptr + base[:, None] + d[None, :], mask=pmask)
            tl.store(dst_ptr + base[:, None] + d[None, :], v, mask=pmask)
        _rotate_block(src_ptr, dst_ptr, base + off, base + off, t, row_mask, cos_ptr, sin_ptr, half, INTERLEAVED, BLOCK_H)

    @triton.jit
    def _rotate_slots_kernel(
        pool_ptr, slot_ptr, cos_ptr, sin_ptr, index_ptr, n_rows, heads, slot_stride, head_stride, off, half,
        PER_SLOT: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # row = i * heads + head
        row_mask = rows < n_rows
        i = rows // heads
        head = rows % heads
        slot = tl.load(slot_ptr + i, mask=row_mask, other=0).to(tl.int64)
        if PER_SLOT:
            t = tl.load(index_ptr + i, mask=row_mask, other=0).to(tl.int64)
        else:
            t = tl.zeros([BLOCK_R], dtype=tl.int64)
        base = slot * slot_stride + head.to(tl.int64) * head_stride + off
        _rotate_block(pool_ptr, pool_ptr, base, base, t, row_mask, cos_ptr, sin_ptr, half, INTERLEAVED, BLOCK_H)


def _launch(kernel, grid, *args, **meta) -> None:
    """Launch with FMA contraction off where this Triton accepts the option."""
    if _launch_options:
        try:
            kernel[grid](*args, **meta, **_launch_options)
            return
        except TypeError:  # older Triton: no per-launch enable_fp_fusion
            logger.info("Triton rejects enable_fp_fusion; CUDA rotation may differ from the reference by 1 ulp")
            _launch_options.clear()
    kernel[grid](*args, **meta)


def rotate_keys_cuda(k: torch.Tensor, delta: Delta, spec: RopeSpec, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``K(p) -> K(p + delta)`` for a CUDA ``k`` ``[..., key_dim]``; see ``rotate_keys``."""
    check_key(k, spec)
    if out is not None and (out.shape != k.shape or out.dtype != k.dtype or out.device != k.device or not out.is_contiguous()):
        raise ValueError("out must be a contiguous tensor shaped and typed like k, on k's device")
    in_place = out is not None and out.data_ptr() == k.data_ptr()
    if not TRITON_AVAILABLE or (in_place and not k.is_contiguous()):
        result = rotate_keys_native(k, delta, spec)
        return result if out is None else out.copy_(result)
    d = as_delta_tensor(delta, k.shape[:-1], k.device)
    table = rotation_table(d, tuple(k.shape[:-1]), spec, dedupe=False)
    src = k if k.is_contiguous() else k.contiguous()
    dst = src if in_place else (torch.empty(k.shape, dtype=k.dtype, device=k.device) if out is None else out)
    n_rows = src.numel() // spec.key_dim
    if n_rows == 0:
        return dst
    index = table.index if table.index is not None else table.cos  # placeholder pointer when unused
    block_d = triton.next_power_of_2(spec.key_dim)
    block_r = max(1, min(_BLOCK_ROWS, 4096 // block_d))  # ~4K elements per program for wide MLA rows
    grid = (triton.cdiv(n_rows, block_r),)
    _launch(
        _rotate_rows_kernel, grid,
        src, dst, table.cos, table.sin, index, n_rows, spec.key_dim, spec.rotary_offset, spec.half,
        PER_ROW=table.index is not None, INTERLEAVED=spec.pairing is Pairing.INTERLEAVED, COPY_PASS=not in_place,
        BLOCK_R=block_r, BLOCK_H=triton.next_power_of_2(spec.half), BLOCK_D=block_d,
    )  # fmt: skip
    return dst


def rotate_slots_cuda_(pool: torch.Tensor, slot_ids: torch.Tensor, deltas: Delta, spec: RopeSpec, *, check: bool = True) -> torch.Tensor:
    """In-place rotation of ``pool[slot_ids[i]]`` by ``deltas[i]`` on CUDA; see ``rotate_slots_``.

    ``check=True`` validates slot ids (range, no duplicates) and synchronizes with the device.
    """
    if check:
        check_slots(pool, slot_ids, spec, check_unique=True)
    n = slot_ids.numel()
    if n == 0:
        return pool
    if not TRITON_AVAILABLE:
        return rotate_slots_native_(pool, slot_ids, deltas, spec)
    try:
        pool3 = pool.view(pool.shape[0], -1, spec.key_dim)
    except RuntimeError:
        return rotate_slots_native_(pool, slot_ids, deltas, spec)
    slot_stride, head_stride, last = pool3.stride()
    if last != 1:
        return rotate_slots_native_(pool, slot_ids, deltas, spec)
    heads = pool3.shape[1]
    d = as_delta_tensor(deltas, (n,), pool.device)
    table = rotation_table(d, (n,), spec, dedupe=False)
    ids = slot_ids.to(device=pool.device, dtype=torch.int64)
    index = table.index if table.index is not None else ids
    n_rows = n * heads
    grid = (triton.cdiv(n_rows, _BLOCK_ROWS),)
    _launch(
        _rotate_slots_kernel, grid,
        pool3, ids, table.cos, table.sin, index, n_rows, heads, slot_stride, head_stride, spec.rotary_offset, spec.half,
        PER_SLOT=table.index is not None, INTERLEAVED=spec.pairing is Pairing.INTERLEAVED,
        BLOCK_R=_BLOCK_ROWS, BLOCK_H=triton.next_power_of_2(spec.half),
    )  # fmt: skip
    return pool
