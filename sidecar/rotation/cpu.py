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
#: Dtypes whose HALF pairing runs two pairs per step through the pair view (``_HALF_WORDS``):
#: for bf16 the element loop widened every key to fp32 and narrowed it back with cross-lane
#: shuffles (``vpmovzxwd`` / ``vpmovdw``), ~3.5 instructions per pair; the word loop splits
#: each 32-bit word with a shift and a mask, ~2.3 (bf16 MLA k_pe: 0.77 -> 0.91 of copy
#: bandwidth in place). fp16 converts 8 lanes per instruction either way; fp32 gains nothing.
_WORD_DTYPES = frozenset({torch.bfloat16})
# How a kernel walks a key's rotary slice (a runtime argument; every kernel takes all three):
_HALF = 0  # HALF pairing, element by element through the element view
_INTERLEAVED = 1  # INTERLEAVED pairing, each (x, y) pair one word of the pair view
_HALF_WORDS = 2  # HALF pairing, pairs (2w, 2w + 1) per word of the pair view (_WORD_DTYPES)
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
    def _rotate_elems(src, dst, s0, d0, half, c, s):
        """HALF pairing through the element views: pairs ``(k[s0 + j], k[s0 + half + j])``
        into ``d0``, rotated by the table row ``c``/``s`` (1-D views: a row view per key lets
        LLVM keep the table row's address out of the inner loop; 2-D ``cos[t, j]`` indexing
        cost ~30% on 64-dim k_pe)."""
        for j in range(np.uint64(0), half):
            x = _load(src, s0 + j)
            y = _load(src, s0 + half + j)
            cj = c[j]
            sj = s[j]
            _store(dst, d0 + j, x * cj - y * sj)
            _store(dst, d0 + half + j, y * cj + x * sj)

    def _rotate_elems_to(src, dst, s0, d0, half, c, s):  # typing stub; implementation per dtype below
        raise NotImplementedError

    @overload(_rotate_elems_to, inline="always")
    def _rotate_elems_to_impl(src, dst, s0, d0, half, c, s):
        """``_rotate_elems`` out of place. fp32 writes the x outputs, then the y outputs: each
        pass stores whole cache lines in sequence, which the one-pass loop (alternating x and
        y stores 256 bits at a time) did not, and 128 MB fp32 keys ran at 0.78 of copy
        bandwidth instead of 0.88 (2 threads; write-allocate traffic, presumably). Same
        expressions, same bits. The 16-bit dtypes convert every key twice that way and lose
        more than they gain (fp16 k_pe: 0.67 -> 0.57)."""
        if src.dtype == types.float32:

            def two_passes(src, dst, s0, d0, half, c, s):
                for j in range(np.uint64(0), half):
                    x = _load(src, s0 + j)
                    y = _load(src, s0 + half + j)
                    _store(dst, d0 + j, x * c[j] - y * s[j])
                for j in range(np.uint64(0), half):
                    x = _load(src, s0 + j)
                    y = _load(src, s0 + half + j)
                    _store(dst, d0 + half + j, y * c[j] + x * s[j])

            return two_passes
        return lambda src, dst, s0, d0, half, c, s: _rotate_elems(src, dst, s0, d0, half, c, s)

    @njit(inline="always")
    def _rotate_pairs(src_pairs, dst_pairs, s0, d0, half, c, s):
        """INTERLEAVED pairing: pair ``j`` is word ``s0 + j`` of the pair view."""
        for j in range(np.uint64(0), half):
            x, y = _load_pair(src_pairs, s0 + j)
            cj = c[j]
            sj = s[j]
            _store_pair(dst_pairs, d0 + j, x * cj - y * sj, y * cj + x * sj)

    @njit(inline="always")
    def _rotate_words(src_pairs, dst_pairs, s0, d0, half, c, s):
        """HALF pairing through the pair view (``_HALF_WORDS``): word ``s0 + w`` holds
        ``(x[2w], x[2w + 1])``, word ``s0 + half/2 + w`` holds ``(y[2w], y[2w + 1])``; the low
        lanes are pairs ``2w`` (table entries ``[0, half/2)`` of a ``_split_pairs`` row), the
        high lanes pairs ``2w + 1`` (entries ``[half/2, half)``). Same products in the same
        order as ``_rotate_elems``, so the same bits."""
        hw = half >> np.uint64(1)
        for w in range(np.uint64(0), hw):
            x0, x1 = _load_pair(src_pairs, s0 + w)
            y0, y1 = _load_pair(src_pairs, s0 + hw + w)
            c0 = c[w]
            c1 = c[hw + w]
            sn0 = s[w]
            sn1 = s[hw + w]
            _store_pair(dst_pairs, d0 + w, x0 * c0 - y0 * sn0, x1 * c1 - y1 * sn1)
            _store_pair(dst_pairs, d0 + hw + w, y0 * c0 + x0 * sn0, y1 * c1 + x1 * sn1)

    @njit(cache=True, nogil=True)
    def _split_pairs(table, mode):
        """``table`` as ``_rotate_words`` reads it: each row's even entries, then its odd ones
        (the same fp32 values, moved; a copy of U x half floats). Other modes: ``table``."""
        if mode != _HALF_WORDS:
            return table
        hw = table.shape[1] // 2
        out = np.empty_like(table)
        for t in range(table.shape[0]):
            for w in range(hw):
                out[t, w] = table[t, 2 * w]
                out[t, hw + w] = table[t, 2 * w + 1]
        return out

    @njit(inline="always")
    def _copy_pass_through(src, dst, sb, db, o, end, kd):
        for j in range(np.uint64(0), o):
            dst[db + j] = src[sb + j]
        for j in range(end, kd):
            dst[db + j] = src[sb + j]

    @njit(inline="always")
    def _rotate_run(src, dst, src_pairs, dst_pairs, r0, r1, ss, ds, o, h, kd, c, s, mode, copy_pass):
        """Rows ``[r0, r1)`` (row ``r`` at element ``r * ss`` in src, ``r * ds`` in dst, its
        rotary slice at ``o``), all by one table row ``c``/``s``; ``copy_pass`` (a constant
        at every call site) also copies the pass-through dims, for out of place.

        One row loop per mode: with the mode branch inside the row loop LLVM re-checked its
        vector loop's aliasing on every row (bf16 k_pe in place: 0.76 of copy bandwidth
        instead of 0.91); here it checks once per run. Pair-view offsets are formed as
        ``r * (stride / 2) + o / 2``, affine in ``r`` (``(r * stride + o) / 2`` is not, and
        had the same effect)."""
        end = o + np.uint64(2) * h
        if mode == _HALF:
            for r in range(r0, r1):
                if copy_pass:
                    _copy_pass_through(src, dst, r * ss, r * ds, o, end, kd)
                    _rotate_elems_to(src, dst, r * ss + o, r * ds + o, h, c, s)
                else:
                    _rotate_elems(src, dst, r * ss + o, r * ds + o, h, c, s)
        else:
            one = np.uint64(1)
            sw = ss >> one
            dw = ds >> one
            ow = o >> one
            if mode == _HALF_WORDS:
                for r in range(r0, r1):
                    if copy_pass:
                        _copy_pass_through(src, dst, r * ss, r * ds, o, end, kd)
                    _rotate_words(src_pairs, dst_pairs, r * sw + ow, r * dw + ow, h, c, s)
            else:
                for r in range(r0, r1):
                    if copy_pass:
                        _copy_pass_through(src, dst, r * ss, r * ds, o, end, kd)
                    _rotate_pairs(src_pairs, dst_pairs, r * sw + ow, r * dw + ow, h, c, s)

    # The two ways the kernels call _rotate_run, each compiled once per dtype and shared by the
    # kernels: as functions called per run rather than inlined into every kernel they keep the
    # first compilation to seconds. In place, one array is source and destination, so LLVM
    # knows they coincide: given as two arrays its runtime overlap check failed and every row
    # ran scalar (~0.16 of copy bandwidth). Rows r of a run start at element r * stride + o.
    @njit(cache=True, nogil=True)
    def _run_in_place(a, p, r0, r1, stride, o, h, c, s, mode):
        _rotate_run(a, a, p, p, r0, r1, stride, stride, o, h, stride, c, s, mode, False)

    @njit(cache=True, nogil=True)
    def _run_out_of_place(src, dst, src_pairs, dst_pairs, r0, r1, kd, o, h, c, s, mode):
        _rotate_run(src, dst, src_pairs, dst_pairs, r0, r1, kd, kd, o, h, kd, c, s, mode, True)

    @njit(inline="always")
    def _rotate_rows_chunk(src, dst, src_pairs, dst_pairs, lo, hi, kd, o, h, cos, sin, index, mode, in_place):
        """Rows ``[lo, hi)`` of ``kd`` elements by ``index`` (or all by table row 0 when it
        is empty), one run per stretch of equal table rows (a per-chunk delta is one run of
        128 tokens x heads)."""
        per_row = index.shape[0] > 0
        r = lo
        while r < hi:
            t = 0
            e = hi
            if per_row:
                t = index[r]
                e = r + np.uint64(1)
                # Blocks of 16 first: a branch-free compare of 16 entries vectorizes, an
                # entry-by-entry scan cost ~3-5% of a 64-dim fp32 k_pe rotation.
                while e + np.uint64(16) <= hi:
                    same = 0
                    for j in range(16):
                        same += index[e + np.uint64(j)] == t
                    if same != 16:
                        break
                    e += np.uint64(16)
                while e < hi and index[e] == t:
                    e += np.uint64(1)
            if in_place:
                _run_in_place(src, src_pairs, r, e, kd, o, h, cos[t], sin[t], mode)
            else:
                _run_out_of_place(src, dst, src_pairs, dst_pairs, r, e, kd, o, h, cos[t], sin[t], mode)
            r = e

    @intrinsic
    def _address_as_pointer(typingctx, address, like):
        """``address`` (an int64 from ``Tensor.data_ptr()``) as a pointer to ``like``'s dtype."""
        ptr = types.CPointer(like.dtype)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr))

        return ptr(types.int64, like), codegen

    @njit(parallel=True, cache=True)
    def _rotate_rows(src_addr, dst_addr, elem_proto, pair_proto, n_rows, key_dim, off, half, cos, sin, index, mode, in_place, nchunks):
        """``n_rows`` contiguous keys of ``key_dim`` elements at address ``src_addr``, row ``r``
        rotated by table row ``index[r]`` (row 0 for all when ``index`` is empty) into
        ``dst_addr``, or in place (``in_place``; ``dst_addr`` is then ignored). Rows are split
        evenly into ``nchunks`` over the numba threads."""
        h = np.uint64(half)
        o = np.uint64(off)
        kd = np.uint64(key_dim)
        n = np.uint64(n_rows)
        m = n * kd >> np.uint64(1) if mode != _HALF else np.uint64(0)
        src = numba.carray(_address_as_pointer(src_addr, elem_proto), (n * kd,))
        src_pairs = numba.carray(_address_as_pointer(src_addr, pair_proto), (m,))
        dst = numba.carray(_address_as_pointer(dst_addr, elem_proto), (n * kd,))
        dst_pairs = numba.carray(_address_as_pointer(dst_addr, pair_proto), (m,))
        cos = _split_pairs(cos, mode)
        sin = _split_pairs(sin, mode)
        for chunk in prange(nchunks):
            lo = n * np.uint64(chunk) // np.uint64(nchunks)
            hi = n * np.uint64(chunk + 1) // np.uint64(nchunks)
            _rotate_rows_chunk(src, dst, src_pairs, dst_pairs, lo, hi, kd, o, h, cos, sin, index, mode, in_place)

    @njit(parallel=True, cache=True)
    def _rotate_slots(pool, pool_pairs, slot_ids, slot_stride, head_stride, heads, off, half, cos, sin, index, mode, nchunks):
        """In place: every head of slot ``slot_ids[i]`` rotated by table row ``index[i]``."""
        h = np.uint64(half)
        o = np.uint64(off)
        ss = np.uint64(slot_stride)
        hs = np.uint64(head_stride)
        nh = np.uint64(heads)
        one = np.uint64(1)
        n = slot_ids.shape[0]
        per_slot = index.shape[0] > 0
        cos = _split_pairs(cos, mode)
        sin = _split_pairs(sin, mode)
        for chunk in prange(nchunks):
            lo = n * chunk // nchunks
            hi = n * (chunk + 1) // nchunks
            for i in range(lo, hi):
                t = np.uint64(index[i]) if per_slot else np.uint64(0)
                base = np.uint64(slot_ids[i]) * ss + o
                c = cos[t]
                s = sin[t]
                # Per head, not per run: a call per slot (8 heads) cost ~7% of fp32 throughput.
                for head in range(np.uint64(0), nh):
                    b = base + head * hs
                    if mode == _HALF:
                        _rotate_elems(pool, pool, b, b, h, c, s)
                    elif mode == _HALF_WORDS:
                        _rotate_words(pool_pairs, pool_pairs, b >> one, b >> one, h, c, s)
                    else:
                        _rotate_pairs(pool_pairs, pool_pairs, b >> one, b >> one, h, c, s)

    @njit(inline="always")
    def _rotate_segment(g, ptrs, tokens, trow, offsets, keys_per_token, elem_proto, pair_proto, kd, o, h, cos, sin, mode):
        """In place: segment ``g`` = rotary part ``g % len(offsets)`` of item ``g //
        len(offsets)``: ``tokens[i] * keys_per_token`` keys of ``kd`` elements at address
        ``ptrs[i] + tokens[i] * offsets[j]``, all rotated by table row ``trow[i]`` (one row per
        segment: it stays in L1)."""
        parts = offsets.shape[0]
        i = g // parts
        n = np.uint64(tokens[i])
        rows = n * np.uint64(keys_per_token)
        addr = ptrs[i] + tokens[i] * offsets[g - i * parts]
        t = trow[i]
        a = numba.carray(_address_as_pointer(addr, elem_proto), (rows * kd,))
        m = rows * kd >> np.uint64(1) if mode != _HALF else np.uint64(0)
        p = numba.carray(_address_as_pointer(addr, pair_proto), (m,))
        _run_in_place(a, p, np.uint64(0), rows, kd, o, h, cos[t], sin[t], mode)

    # nogil: a Fetch rotates in a worker thread while the event loop streams earlier items.
    @njit(parallel=True, cache=True, nogil=True)
    def _rotate_segments_parallel(ptrs, tokens, trow, offsets, keys_per_token, elem_proto, pair_proto, key_dim, off, half, cos, sin, mode):
        """Every segment (see ``_rotate_segment``), segments spread over the numba threads."""
        kd = np.uint64(key_dim)
        o = np.uint64(off)
        h = np.uint64(half)
        cos = _split_pairs(cos, mode)
        sin = _split_pairs(sin, mode)
        for g in prange(ptrs.shape[0] * offsets.shape[0]):
            _rotate_segment(g, ptrs, tokens, trow, offsets, keys_per_token, elem_proto, pair_proto, kd, o, h, cos, sin, mode)

    @njit(cache=True, nogil=True)
    def _rotate_segments_serial(ptrs, tokens, trow, offsets, keys_per_token, elem_proto, pair_proto, key_dim, off, half, cos, sin, mode):
        """``_rotate_segments_parallel`` on the calling thread (no thread-pool launch)."""
        kd = np.uint64(key_dim)
        o = np.uint64(off)
        h = np.uint64(half)
        cos = _split_pairs(cos, mode)
        sin = _split_pairs(sin, mode)
        for g in range(ptrs.shape[0] * offsets.shape[0]):
            _rotate_segment(g, ptrs, tokens, trow, offsets, keys_per_token, elem_proto, pair_proto, kd, o, h, cos, sin, mode)


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
