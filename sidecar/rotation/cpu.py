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
~10% of copy bandwidth. All offsets are unsigned: numba's negative-index wraparound check on
signed indices blocked vectorization and cost 2-3x.

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

from sidecar.rotation.angles import Delta, RotationTable, as_delta_tensor, rotation_table
from sidecar.rotation.native import check_key, check_slots, rotate_keys_native, rotate_slots_native_
from sidecar.rotation.spec import Pairing, RopeSpec

logger = logging.getLogger(__name__)

__all__ = ["AVAILABLE", "FUSED_DTYPES", "SERIAL_BELOW_BYTES", "rotate_keys_cpu", "rotate_segments_cpu_", "rotate_slots_cpu_", "supports"]

try:  # numba is a hard dependency of the project; stay importable without it anyway
    import numba
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core.errors import NumbaError
    from numba.extending import intrinsic, overload

    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised only where numba is missing
    AVAILABLE = False

#: torch dtype -> (element view dtype, pair view dtype), both as (torch view dtype, numpy dtype).
_VIEWS: dict[torch.dtype, tuple[tuple[torch.dtype, np.dtype], tuple[torch.dtype, np.dtype]]] = {
    torch.float32: ((torch.float32, np.dtype(np.float32)), (torch.int64, np.dtype(np.uint64))),
    torch.bfloat16: ((torch.int16, np.dtype(np.uint16)), (torch.int32, np.dtype(np.uint32))),
    torch.float16: ((torch.int16, np.dtype(np.int16)), (torch.int32, np.dtype(np.int32))),
}
FUSED_DTYPES = frozenset(_VIEWS)
_disabled: set[torch.dtype] = set()  # dtypes whose kernel failed to compile on this host
# numba's fallback "workqueue" threading layer aborts the process on concurrent parallel
# launches from two Python threads (gRPC handlers); each launch already uses every core.
_launch_lock = threading.Lock()


if AVAILABLE:

    @intrinsic
    def _u32_as_f32(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())

        return types.float32(types.uint32), codegen

    @intrinsic
    def _f32_as_u32(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return types.uint32(types.float32), codegen

    @intrinsic
    def _f16_bits_to_f32(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

        return types.float32(types.int16), codegen

    @intrinsic
    def _f32_to_f16_bits(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

        return types.int16(types.float32), codegen

    @njit(inline="always")
    def _bf16_bits_to_f32(b):
        return _u32_as_f32(np.uint32(b) << np.uint32(16))

    @njit(inline="always")
    def _f32_to_bf16_bits(f):
        # Round to nearest even. No NaN special case (it cost ~15%): every NaN reaching here
        # came out of fp32 arithmetic on bf16-derived values, so it is either a propagated bf16
        # NaN or the default NaN; both have zero low 16 bits and stay NaN under the rounding add.
        u = _f32_as_u32(f)
        return np.uint16((u + (((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF))) >> np.uint32(16))

    def _load(arr, i):  # typing stubs; implementations chosen per dtype below
        raise NotImplementedError

    def _store(arr, i, value):
        raise NotImplementedError

    def _load_pair(arr, i):
        raise NotImplementedError

    def _store_pair(arr, i, x, y):
        raise NotImplementedError

    @overload(_load)
    def _load_impl(arr, i):
        if arr.dtype == types.float32:
            return lambda arr, i: arr[i]
        if arr.dtype == types.uint16:
            return lambda arr, i: _bf16_bits_to_f32(arr[i])
        if arr.dtype == types.int16:
            return lambda arr, i: _f16_bits_to_f32(arr[i])
        return None

    @overload(_store)
    def _store_impl(arr, i, value):
        if arr.dtype == types.float32:

            def store_f32(arr, i, value):
                arr[i] = value

            return store_f32
        if arr.dtype == types.uint16:

            def store_bf16(arr, i, value):
                arr[i] = _f32_to_bf16_bits(value)

            return store_bf16
        if arr.dtype == types.int16:

            def store_f16(arr, i, value):
                arr[i] = _f32_to_f16_bits(value)

            return store_f16
        return None

    @overload(_load_pair)
    def _load_pair_impl(arr, i):
        if arr.dtype == types.uint64:

            def load_f32x2(arr, i):
                p = arr[i]
                return _u32_as_f32(np.uint32(p & np.uint64(0xFFFFFFFF))), _u32_as_f32(np.uint32(p >> np.uint64(32)))

            return load_f32x2
        if arr.dtype == types.uint32:

            def load_bf16x2(arr, i):
                p = arr[i]
                return _u32_as_f32(p << np.uint32(16)), _u32_as_f32(p & np.uint32(0xFFFF0000))

            return load_bf16x2
        if arr.dtype == types.int32:

            def load_f16x2(arr, i):
                p = np.uint32(arr[i])
                lo = np.int16(np.uint16(p & np.uint32(0xFFFF)))
                hi = np.int16(np.uint16(p >> np.uint32(16)))
                return _f16_bits_to_f32(lo), _f16_bits_to_f32(hi)

            return load_f16x2
        return None

    @overload(_store_pair)
    def _store_pair_impl(arr, i, x, y):
        if arr.dtype == types.uint64:

            def store_f32x2(arr, i, x, y):
                arr[i] = np.uint64(_f32_as_u32(x)) | (np.uint64(_f32_as_u32(y)) << np.uint64(32))

            return store_f32x2
        if arr.dtype == types.uint32:

            def store_bf16x2(arr, i, x, y):
                arr[i] = np.uint32(_f32_to_bf16_bits(x)) | (np.uint32(_f32_to_bf16_bits(y)) << np.uint32(16))

            return store_bf16x2
        if arr.dtype == types.int32:

            def store_f16x2(arr, i, x, y):
                lo = np.uint32(np.uint16(_f32_to_f16_bits(x)))
                hi = np.uint32(np.uint16(_f32_to_f16_bits(y)))
                arr[i] = np.int32(lo | (hi << np.uint32(16)))

            return store_f16x2
        return None

    @njit(inline="always")
    def _rotate_one(src, dst, src_pairs, dst_pairs, s0, d0, half, c, s, interleaved):
        """Rotate the rotary slice starting at element ``s0`` (src) into ``d0`` (dst) by the
        table row ``c``/``s`` (1-D views: a row view per key lets LLVM keep the table row's
        address out of the inner loop; 2-D ``cos[t, j]`` indexing cost ~30% on 64-dim k_pe)."""
        if interleaved:
            sp = s0 >> np.uint64(1)
            dp = d0 >> np.uint64(1)
            for j in range(np.uint64(0), half):
                x, y = _load_pair(src_pairs, sp + j)
                cj = c[j]
                sj = s[j]
                _store_pair(dst_pairs, dp + j, x * cj - y * sj, y * cj + x * sj)
        else:
            for j in range(np.uint64(0), half):
                x = _load(src, s0 + j)
                y = _load(src, s0 + half + j)
                cj = c[j]
                sj = s[j]
                _store(dst, d0 + j, x * cj - y * sj)
                _store(dst, d0 + half + j, y * cj + x * sj)

    @njit(parallel=True, cache=True)
    def _rotate_rows(
        src, dst, src_pairs, dst_pairs, src_stride, dst_stride, n_rows, key_dim, off, half, cos, sin, index, interleaved, copy_pass, nchunks
    ):
        """Row ``r`` (``key_dim`` elements at ``r * stride``) rotated by table row ``index[r]``."""
        h = np.uint64(half)
        o = np.uint64(off)
        end = o + np.uint64(2) * h
        kd = np.uint64(key_dim)
        ss = np.uint64(src_stride)
        ds = np.uint64(dst_stride)
        per_row = index.shape[0] > 0
        for chunk in prange(nchunks):
            lo = n_rows * chunk // nchunks
            hi = n_rows * (chunk + 1) // nchunks
            for r in range(lo, hi):
                t = np.uint64(index[r]) if per_row else np.uint64(0)
                sb = np.uint64(r) * ss
                db = np.uint64(r) * ds
                if copy_pass:
                    for j in range(np.uint64(0), o):
                        dst[db + j] = src[sb + j]
                    for j in range(end, kd):
                        dst[db + j] = src[sb + j]
                _rotate_one(src, dst, src_pairs, dst_pairs, sb + o, db + o, h, cos[t], sin[t], interleaved)

    @njit(parallel=True, cache=True)
    def _rotate_slots(pool, pool_pairs, slot_ids, slot_stride, head_stride, heads, off, half, cos, sin, index, interleaved, nchunks):
        """In place: every head of slot ``slot_ids[i]`` rotated by table row ``index[i]``."""
        h = np.uint64(half)
        o = np.uint64(off)
        ss = np.uint64(slot_stride)
        hs = np.uint64(head_stride)
        nh = np.uint64(heads)
        n = slot_ids.shape[0]
        per_slot = index.shape[0] > 0
        for chunk in prange(nchunks):
            lo = n * chunk // nchunks
            hi = n * (chunk + 1) // nchunks
            for i in range(lo, hi):
                t = np.uint64(index[i]) if per_slot else np.uint64(0)
                base = np.uint64(slot_ids[i]) * ss + o
                c = cos[t]
                s = sin[t]
                for head in range(np.uint64(0), nh):
                    b = base + head * hs
                    _rotate_one(pool, pool, pool_pairs, pool_pairs, b, b, h, c, s, interleaved)

    @intrinsic
    def _address_as_pointer(typingctx, address, like):
        """``address`` (an int64 from ``Tensor.data_ptr()``) as a pointer to ``like``'s dtype."""
        ptr = types.CPointer(like.dtype)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr))

        return ptr(types.int64, like), codegen

    @njit(inline="always")
    def _rotate_segment(i, addrs, rows, trow, elem_proto, pair_proto, kd, o, h, cos, sin, interleaved):
        """In place: segment ``i`` = ``rows[i]`` keys of ``kd`` elements at ``addrs[i]``, every
        key rotated by table row ``trow[i]`` (one row per segment: it stays in L1)."""
        n = np.uint64(rows[i])
        t = trow[i]
        c = cos[t]
        s = sin[t]
        a = numba.carray(_address_as_pointer(addrs[i], elem_proto), (n * kd,))
        m = n * kd >> np.uint64(1) if interleaved else np.uint64(0)
        p = numba.carray(_address_as_pointer(addrs[i], pair_proto), (m,))
        for r in range(np.uint64(0), n):
            b = r * kd + o
            _rotate_one(a, a, p, p, b, b, h, c, s, interleaved)

    # nogil: a Fetch rotates in a worker thread while the event loop streams earlier items.
    @njit(parallel=True, cache=True, nogil=True)
    def _rotate_segments_parallel(addrs, rows, trow, elem_proto, pair_proto, key_dim, off, half, cos, sin, interleaved):
        """Every segment (see ``_rotate_segment``), segments spread over the numba threads."""
        kd = np.uint64(key_dim)
        o = np.uint64(off)
        h = np.uint64(half)
        for i in prange(addrs.shape[0]):
            _rotate_segment(i, addrs, rows, trow, elem_proto, pair_proto, kd, o, h, cos, sin, interleaved)

    @njit(cache=True, nogil=True)
    def _rotate_segments_serial(addrs, rows, trow, elem_proto, pair_proto, key_dim, off, half, cos, sin, interleaved):
        """``_rotate_segments_parallel`` on the calling thread (no thread-pool launch)."""
        kd = np.uint64(key_dim)
        o = np.uint64(off)
        h = np.uint64(half)
        for i in range(addrs.shape[0]):
            _rotate_segment(i, addrs, rows, trow, elem_proto, pair_proto, kd, o, h, cos, sin, interleaved)


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
    d = as_delta_tensor(delta, k.shape[:-1], k.device)
    in_place = out is not None and out.data_ptr() == k.data_ptr()  # _check_out: then out is k
    src = k if k.is_contiguous() else k.contiguous()
    dst = src if in_place else (torch.empty(k.shape, dtype=k.dtype) if out is None else out)
    n_rows = src.numel() // spec.key_dim
    if n_rows == 0:
        return dst
    interleaved = spec.pairing is Pairing.INTERLEAVED
    src_flat, dst_flat = src.view(-1), dst.view(-1)
    if interleaved and not (_pairs_ok(src_flat, spec.key_dim, spec.rotary_offset) and _pairs_ok(dst_flat)):
        return _fallback(k, d, spec, out)
    table = rotation_table(d, tuple(k.shape[:-1]), spec, dedupe=True)
    src_e, src_p = _views(src_flat, interleaved)
    dst_e, dst_p = (src_e, src_p) if in_place else _views(dst_flat, interleaved)
    cos, sin, index = _table_arrays(table)
    ok = _run(
        _rotate_rows, k.dtype,
        src_e, dst_e, src_p, dst_p, spec.key_dim, spec.key_dim, n_rows, spec.key_dim, spec.rotary_offset, spec.half,
        cos, sin, index, interleaved, not in_place, _nchunks(n_rows),
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
    interleaved = spec.pairing is Pairing.INTERLEAVED
    flat = _span(pool3)
    if interleaved and not _pairs_ok(flat, slot_stride, head_stride, spec.rotary_offset):
        return rotate_slots_native_(pool, slot_ids, deltas, spec)
    table = rotation_table(d, (n,), spec, dedupe=True)
    elem, pairs = _views(flat, interleaved)
    cos, sin, index = _table_arrays(table)
    ids = slot_ids.to(torch.int64).contiguous().numpy()
    ok = _run(
        _rotate_slots, pool.dtype,
        elem, pairs, ids, slot_stride, head_stride, heads, spec.rotary_offset, spec.half, cos, sin, index, interleaved, _nchunks(n),
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
    addresses: np.ndarray, rows: np.ndarray, table_rows: np.ndarray, cos: np.ndarray, sin: np.ndarray,
    dtype: torch.dtype, spec: RopeSpec, *, parallel: bool | None = None,
) -> bool:
    """In place, one kernel call: ``rows[i]`` contiguous keys (``spec.key_dim`` elements each)
    at memory address ``addresses[i]``, all rotated by table row ``table_rows[i]`` of
    ``cos``/``sin`` (contiguous fp32 ``[U, spec.half]``, ``angles.delta_tables``). The three
    index arrays are int64.

    Unchecked memory access: the caller guarantees that every segment lies inside a live,
    writable CPU buffer of ``dtype`` it keeps referenced during the call, that segments do not
    overlap, and that every address is aligned to the element size (to twice it for
    interleaved pairing, with an even ``key_dim`` and ``rotary_offset``).
    ``sidecar.rotation.batch.rotate_payloads_`` is the checked entry point.

    ``parallel``: None picks by size (``SERIAL_BELOW_BYTES``). Returns False, changing nothing,
    when the fused kernels cannot run for ``dtype`` here (the caller falls back).
    """
    if not AVAILABLE or dtype not in FUSED_DTYPES or dtype in _disabled:
        return False
    if addresses.shape[0] == 0:
        return True
    elem, pair = _PROTOS[dtype]
    if parallel is None:
        parallel = int(rows.sum()) * spec.key_dim * dtype.itemsize >= SERIAL_BELOW_BYTES
    args = (addresses, rows, table_rows, elem, pair, spec.key_dim, spec.rotary_offset, spec.half, cos, sin,
            spec.pairing is Pairing.INTERLEAVED)
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
