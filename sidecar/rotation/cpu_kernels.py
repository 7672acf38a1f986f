"""The numba kernels behind ``sidecar.rotation.cpu`` (the design and its measurements are in that
module's docstring): dtype views, the pairing modes, the per-run row loop and its parallel drivers.
"""

from __future__ import annotations

import numpy as np
import torch

try:  # numba is a hard dependency of the project; stay importable without it anyway
    import numba
    from llvmlite import ir
    from numba import njit, prange, types
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


