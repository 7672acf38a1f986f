"""Fused CPU rotation kernels (numba): one pass over memory, bit-identical to the reference.

Eager torch needs ~8 passes (slice, upcast, 4 products, 2 sums, downcast, cat) and reaches 5-20%
of copy bandwidth; these kernels read each key once and write it once.

Storage travels into numba as integer bit patterns so that one kernel source serves every dtype
(numba has no bf16/fp16 arithmetic); ``_load``/``_store`` pick the conversion from the array's
dtype at compile time:

    torch dtype   element view (half-split, pass-through)   pair view (interleaved (x, y))
    float32       float32                                   uint64  (x = low 32 bits)
    bfloat16      uint16  (fp32 = bits << 16; RNE back)     uint32  (x = low 16 bits)
    float16       int16   (LLVM half fpext / fptrunc)       int32   (x = low 16 bits)

Interleaved pairs are loaded as one wide word: strided even/odd loads do not vectorize and ran at
~10% of copy bandwidth. bf16 half-split keys go through the pair view too (``_HALF_WORDS``): a
word of the x half and the matching word of the y half hold two pairs, unpacked with a shift
and a mask; the element view needed a widening and a narrowing shuffle per 8 keys (MLA k_pe:
0.77 -> 0.91 of copy bandwidth). All offsets are unsigned: numba's negative-index wraparound
check on signed indices blocked vectorization and cost 2-3x.

Every kernel walks runs of rows that share one table row (``_rotate_run``), with the pairing
mode decided outside the row loop, so that LLVM checks the aliasing of its vector loop once per
run, not once per row (~50 instructions, as many as a 64-dim bf16 row's rotation).

Rounding: fp32 math without FMA contraction (``fastmath=False``), as eager torch does, then one
round-to-nearest-even to the storage dtype. Results are bit-identical to ``rotate_keys_native``
(the tests check it bit for bit); a NaN stays a NaN but its payload is not part of the contract
(torch's own bf16 cast differs between its vector and scalar paths there).
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

from sidecar.rotation.angles import Delta, RotationTable, as_delta_tensor, delta_arrays, rotation_table
from sidecar.rotation.cpu_kernels import (
    _HALF,
    _HALF_WORDS,
    _INTERLEAVED,
    _VIEWS,
    _WORD_DTYPES,
    AVAILABLE,
    FUSED_DTYPES,
    _rotate_rows,
    _rotate_segments_parallel,
    _rotate_segments_serial,
    _rotate_slots,
)
from sidecar.rotation.native import check_key, check_slots, rotate_keys_native, rotate_slots_native_
from sidecar.rotation.spec import Pairing, RopeSpec

if AVAILABLE:
    import numba
    from numba.core.errors import NumbaError

logger = logging.getLogger(__name__)

_disabled: set[torch.dtype] = set()  # dtypes whose kernel failed to compile on this host
# numba's fallback "workqueue" threading layer aborts the process on concurrent parallel
# launches from two Python threads (gRPC handlers); each launch already uses every core.
_launch_lock = threading.Lock()

__all__ = ["AVAILABLE", "FUSED_DTYPES", "SERIAL_BELOW_BYTES", "rotate_keys_cpu", "rotate_segments_cpu_", "rotate_slots_cpu_", "supports"]

_NO_INDEX = np.empty(0, dtype=np.int32)


def supports(t: torch.Tensor) -> bool:
    """Whether the fused kernels handle ``t`` (CPU, fp32/bf16/fp16, numba present)."""
    return AVAILABLE and t.device.type == "cpu" and t.dtype in FUSED_DTYPES and t.dtype not in _disabled


def _span(t: torch.Tensor) -> torch.Tensor:
    """1-D tensor over the memory ``t`` covers, from its first element (shares storage)."""
    n = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)
    return torch.as_strided(t, (n,), (1,))


def _views(flat: torch.Tensor, want_pairs: bool) -> tuple[np.ndarray, np.ndarray]:
    (elem_t, elem_np), (pair_t, pair_np) = _VIEWS[flat.dtype]
    elem = flat.view(elem_t).numpy().view(elem_np)
    if not want_pairs:
        return elem, np.empty(0, dtype=pair_np)
    return elem, flat.view(pair_t).numpy().view(pair_np)


def _pairs_ok(flat: torch.Tensor, *strides_and_offsets: int) -> bool:
    width = flat.element_size() * 2
    return flat.data_ptr() % width == 0 and flat.numel() % 2 == 0 and all(v % 2 == 0 for v in strides_and_offsets)


def _mode(spec: RopeSpec, dtype: torch.dtype, pairs_ok: bool) -> int:
    """The kernels' row mode for ``spec``/``dtype``; ``pairs_ok``: the buffers, strides and
    rotary offset allow the pair view (``_pairs_ok``). INTERLEAVED needs it (callers check)."""
    if spec.pairing is Pairing.INTERLEAVED:
        return _INTERLEAVED
    if dtype in _WORD_DTYPES and pairs_ok and spec.half % 2 == 0:
        return _HALF_WORDS
    return _HALF


def _nchunks(n: int) -> int:
    return max(1, min(n, numba.get_num_threads()))


def _table_arrays(table: RotationTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    index = _NO_INDEX if table.index is None else table.index.numpy()
    return table.cos.numpy(), table.sin.numpy(), index


def _run(kernel, dtype: torch.dtype, *args) -> bool:
    """Call a kernel; on a compile failure for this dtype, disable it and report False."""
    try:
        with _launch_lock:
            kernel(*args)
        return True
    except NumbaError:  # e.g. no half-precision lowering on this CPU
        logger.warning("fused CPU rotation unavailable for %s; using the torch reference", dtype, exc_info=True)
        _disabled.add(dtype)
        return False


def rotate_keys_cpu(k: torch.Tensor, delta: Delta, spec: RopeSpec, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Fused ``K(p) -> K(p + delta)`` on CPU; falls back to the reference where unsupported.

    Args:
      k: ``[..., key_dim]`` CPU keys (fp32 / bf16 / fp16 fused; other dtypes use the reference).
        Non-contiguous ``k`` is copied to contiguous first.
      delta: int, 0-d integer tensor, or integer tensor broadcastable over ``k.shape[:-1]``.
      out: optional contiguous destination shaped and typed like ``k``; may be ``k`` itself
        (in place). Must not otherwise overlap ``k``.
    Returns:
      ``out`` (or a new contiguous tensor); non-rotary dims are bit-identical to ``k``.
    """
    check_key(k, spec)
    if out is not None:
        _check_out(k, out)
    if not supports(k):
        return _fallback(k, delta, spec, out)
    # The Python of a call was ~34 us, ~114 us right after a kernel or a copy had evicted the
    # interpreter from L2: a third of a 32K-token bf16 k_pe's copy time. Hence addresses
    # instead of numpy views, memoised numpy table rows, no delta tensor for an int delta.
    if type(delta) is int:
        d = delta
        cos, sin = delta_arrays(spec, delta)
        index = _NO_INDEX
    else:
        d = as_delta_tensor(delta, k.shape[:-1], k.device)
        if d.dim() == 0:
            cos, sin = delta_arrays(spec, int(d))
            index = _NO_INDEX
        else:
            cos = None
    in_place = out is not None and out.data_ptr() == k.data_ptr()  # _check_out: then out is k
    src = k if k.is_contiguous() else k.contiguous()
    dst = src if in_place else (torch.empty(k.shape, dtype=k.dtype) if out is None else out)
    n_rows = src.numel() // spec.key_dim
    if n_rows == 0:
        return dst
    src_addr, dst_addr = src.data_ptr(), dst.data_ptr()
    width = 2 * k.element_size()
    pairs_ok = src_addr % width == 0 and dst_addr % width == 0 and spec.key_dim % 2 == 0 and spec.rotary_offset % 2 == 0
    if spec.pairing is Pairing.INTERLEAVED and not pairs_ok:
        return _fallback(k, d, spec, out)
    if cos is None:
        cos, sin, index = _table_arrays(rotation_table(d, tuple(k.shape[:-1]), spec, dedupe=True))
    elem, pair = _PROTOS[k.dtype]
    ok = _run(
        _rotate_rows, k.dtype,
        src_addr, dst_addr, elem, pair, n_rows, spec.key_dim, spec.rotary_offset, spec.half, cos, sin, index,
        _mode(spec, k.dtype, pairs_ok), in_place, _nchunks(n_rows),
    )  # fmt: skip
    return dst if ok else _fallback(k, delta, spec, out)


def rotate_slots_cpu_(pool: torch.Tensor, slot_ids: torch.Tensor, deltas: Delta, spec: RopeSpec, *, check: bool = True) -> torch.Tensor:
    """Fused in-place rotation of ``pool[slot_ids[i]]`` by ``deltas[i]``; see ``rotate_slots_``.

    Slot ids are always range-checked here (a stray id would write outside the pool);
    ``check=False`` skips only the duplicate check.
    """
    check_slots(pool, slot_ids, spec, check_unique=check)
    n = slot_ids.numel()
    if n == 0:
        return pool
    if not supports(pool):
        return rotate_slots_native_(pool, slot_ids, deltas, spec)
    d = as_delta_tensor(deltas, (n,), pool.device)
    try:
        pool3 = pool.view(pool.shape[0], -1, spec.key_dim)
    except RuntimeError:  # middle dims not collapsible into one stride
        return rotate_slots_native_(pool, slot_ids, deltas, spec)
    slot_stride, head_stride, last = pool3.stride()
    heads = pool3.shape[1]
    if last != 1 or (heads > 1 and head_stride < spec.key_dim) or slot_stride < (heads - 1) * head_stride + spec.key_dim:
        return rotate_slots_native_(pool, slot_ids, deltas, spec)
    flat = _span(pool3)
    pairs_ok = _pairs_ok(flat, slot_stride, head_stride, spec.rotary_offset)
    if spec.pairing is Pairing.INTERLEAVED and not pairs_ok:
        return rotate_slots_native_(pool, slot_ids, deltas, spec)
    mode = _mode(spec, pool.dtype, pairs_ok)
    table = rotation_table(d, (n,), spec, dedupe=True)
    elem, pairs = _views(flat, mode != _HALF)
    cos, sin, index = _table_arrays(table)
    ids = slot_ids.to(torch.int64).contiguous().numpy()
    ok = _run(
        _rotate_slots, pool.dtype,
        elem, pairs, ids, slot_stride, head_stride, heads, spec.rotary_offset, spec.half, cos, sin, index, mode, _nchunks(n),
    )  # fmt: skip
    return pool if ok else rotate_slots_native_(pool, slot_ids, deltas, spec)


def _check_out(k: torch.Tensor, out: torch.Tensor) -> None:
    if out.shape != k.shape or out.dtype != k.dtype or out.device != k.device:
        raise ValueError(f"out must match k: {tuple(out.shape)}/{out.dtype} vs {tuple(k.shape)}/{k.dtype}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    same = out.data_ptr() == k.data_ptr() and out.stride() == k.stride()
    if not same and out.untyped_storage().data_ptr() == k.untyped_storage().data_ptr():
        raise ValueError("out shares storage with k but is not k; pass out=k for in place, or a separate buffer")


def _fallback(k: torch.Tensor, delta: Delta, spec: RopeSpec, out: torch.Tensor | None) -> torch.Tensor:
    result = rotate_keys_native(k, delta, spec)
    if out is None:
        return result
    out.copy_(result)
    return out


#: Below this many rotary bytes (whole keys, pass-through dims included) a segment batch runs
#: on the calling thread: waking the numba thread pool costs more than the work it splits.
#: Chosen with ``./dev bench rotation --crossover`` (bf16 GQA keys and MLA k_pe in 128-token
#: chunks, 2 threads, 2-core development machine): with the cores idle the parallel kernel
#: took 1.02-1.11x the serial time up to 256 KiB and 0.75-0.88x from 512 KiB; with the cores
#: busy with other processes (load average ~6) it took 2-90x up to 4 MiB (its second thread
#: waits for a core) and first won at 32 MiB. A sidecar shares its host with an engine, so
#: the threshold sits where losing the parallel gain costs little (< 0.3 ms per window).
SERIAL_BELOW_BYTES = 4 << 20


def rotate_segments_cpu_(
    ptrs: np.ndarray, tokens: np.ndarray, table_rows: np.ndarray, offsets: np.ndarray, keys_per_token: int,
    cos: np.ndarray, sin: np.ndarray, dtype: torch.dtype, spec: RopeSpec, *, aligned: bool, parallel: bool | None = None,
) -> bool:
    """In place, one kernel call, for every item ``i`` and every offset ``j``: the
    ``tokens[i] * keys_per_token`` contiguous keys (``spec.key_dim`` elements each) at memory
    address ``ptrs[i] + tokens[i] * offsets[j]``, all rotated by table row ``table_rows[i]`` of
    ``cos``/``sin`` (contiguous fp32 ``[U, spec.half]``, ``angles.delta_tables``). ``ptrs``,
    ``tokens``, ``table_rows`` and ``offsets`` are int64 (a payload of ``tokens[i]`` tokens in
    ``KVLayout`` order has its rotary parts at ``tokens[i] * offsets[j]``).

    Unchecked memory access: the caller guarantees that every segment lies inside a live,
    writable CPU buffer of ``dtype`` it keeps referenced during the call, that segments do not
    overlap, and that every address is aligned to the element size (to twice it for
    interleaved pairing, with an even ``key_dim`` and ``rotary_offset``).
    ``sidecar.rotation.batch.rotate_payloads_`` is the checked entry point. ``aligned``: every
    address is also aligned to twice the element size (lets HALF pairing use the pair view).

    ``parallel``: None picks by size (``SERIAL_BELOW_BYTES``). Returns False, changing nothing,
    when the fused kernels cannot run for ``dtype`` here (the caller falls back).
    """
    if not AVAILABLE or dtype not in FUSED_DTYPES or dtype in _disabled:
        return False
    if ptrs.shape[0] == 0 or offsets.shape[0] == 0:
        return True
    elem, pair = _PROTOS[dtype]
    if parallel is None:
        parallel = int(tokens.sum()) * keys_per_token * offsets.shape[0] * spec.key_dim * dtype.itemsize >= SERIAL_BELOW_BYTES
    words = aligned and spec.key_dim % 2 == 0 and spec.rotary_offset % 2 == 0
    args = (ptrs, tokens, table_rows, offsets, keys_per_token, elem, pair, spec.key_dim, spec.rotary_offset, spec.half,
            cos, sin, _mode(spec, dtype, words))
    if not parallel:
        try:
            _rotate_segments_serial(*args)  # no thread pool: safe without the launch lock
            return True
        except NumbaError:
            logger.warning("fused CPU rotation unavailable for %s; using the torch reference", dtype, exc_info=True)
            _disabled.add(dtype)
            return False
    return _run(_rotate_segments_parallel, dtype, *args)


#: Empty arrays that carry each storage dtype's element and pair view types into the kernels.
_PROTOS = {dt: (np.empty(0, dtype=e[1]), np.empty(0, dtype=p[1])) for dt, (e, p) in _VIEWS.items()}

