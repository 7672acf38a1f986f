"""Plan shaping as compiled code: the numba counterpart of ``shaping`` (its reference).

``lookup_kernel.plan_chunks`` hands ``_shape`` the admitted chunk hits of one Lookup as
*pieces* (int64 rows of 6 fields, below), grouped where consecutive pieces already continue
each other, and gets back the finished hit segments: coalesced, extended token by token into
their stored neighbours through the mirror's links (``entry_table``), repaired at their starts,
carved out below position 32 and folded below ``min_hit_tokens``; the steps and their order are
``shaping.shape_runs``', and tests/registry/test_compiled_lookup.py holds the two to the same
plans. The small helpers (buffer growth, piece rows, 64-token block compares) are shared with
the seed pass in ``lookup_kernel``.

Every integer the kernels compare is uint64 or int64, never mixed (numba promotes mixed 64-bit
arithmetic to float64).
"""

from __future__ import annotations

import numba
import numpy as np

from sidecar.registry.entry_table import (
    I_LEN,
    I_NTOK,
    I_OFF,
    I_POS,
    I_RESIDENT,
    I_SCOPE,
    U_NEXT,
    U_NEXT_DIGEST,
    U_PREFIX,
    U_PREV,
    find_slot,
)
from sidecar.registry.lookup_plan import CARVE_OUT_TOKENS

_U = np.uint64
_CARVE = CARVE_OUT_TOKENS
_ZERO = _U(0)

# A piece (``shaping``): prompt tokens [start, end) are rows [row, row + end - start) of slot.
_S, _E, _SLOT, _ROW, _X, _C = range(6)


@numba.njit(cache=True, nogil=True)
def _grow(buf):
    out = np.empty((2 * buf.shape[0], buf.shape[1]), dtype=buf.dtype)
    out[: buf.shape[0]] = buf
    return out


@numba.njit(cache=True, nogil=True)
def _grow1(buf):
    out = np.empty(2 * buf.shape[0], dtype=buf.dtype)
    out[: buf.shape[0]] = buf
    return out


@numba.njit(inline="always")
def _set(buf, i, s, e, slot, row, exact, chunk):
    buf[i, _S] = s
    buf[i, _E] = e
    buf[i, _SLOT] = slot
    buf[i, _ROW] = row
    buf[i, _X] = exact
    buf[i, _C] = chunk


# Token comparisons run in blocks of 64 without an early exit inside a block, so LLVM
# vectorises them (about 7x faster than a compare-and-branch per token); on slices, whose
# indices are known to be in range.
@numba.njit(inline="always")
def _leading(x, y, n):
    """Number of leading tokens on which x[:n] and y[:n] agree."""
    i = 0
    while i + 64 <= n:
        d = 0
        for t in range(i, i + 64):
            d |= x[t] ^ y[t]
        if d != 0:
            break
        i += 64
    while i < n and x[i] == y[i]:
        i += 1
    return i


@numba.njit(inline="always")
def _trailing(x, y, n):
    """Number of trailing tokens on which x[-n:] and y[-n:] agree (both of length n)."""
    i = 0
    while i + 64 <= n:
        d = 0
        for t in range(n - i - 64, n - i):
            d |= x[t] ^ y[t]
        if d != 0:
            break
        i += 64
    while i < n and x[n - 1 - i] == y[n - 1 - i]:
        i += 1
    return i


@numba.njit(inline="always")
def _copy(dst, d, src, a, b):
    """dst[d : d + b - a] = src[a:b], pieces one field at a time (a 2-D slice assignment costs
    more than the copy for the few rows moved at a time)."""
    for i in range(b - a):
        for f in range(6):
            dst[d + i, f] = src[a + i, f]


@numba.njit(inline="always")
def _emit_part(F, nf, parts, nparts, R, a, b):
    """Append pieces ``R[a:b]`` to ``F`` as one part (its end recorded in ``parts``), growing
    either buffer as needed; returns the (possibly new) buffers and counts."""
    while nf + b - a > F.shape[0]:
        F = _grow(F)
    _copy(F, nf, R, a, b)
    nf += b - a
    if nparts == parts.shape[0]:
        parts = _grow1(parts)
    parts[nparts] = nf
    return F, nf, parts, nparts + 1


@numba.njit(inline="always")
def _usable(nb, scope, serve_observed, si):
    return nb >= 0 and si[nb, I_SCOPE] == scope and (serve_observed or si[nb, I_RESIDENT] != 0) and si[nb, I_LEN] > 0


@numba.njit(inline="always")
def _continues(a, i, b, j, su, si):
    """Piece b[j] (starting where a[i] ends) continues a[i]'s stored sequence (``shaping.continues``)."""
    e1 = a[i, _SLOT]
    e2 = b[j, _SLOT]
    if b[j, _ROW] != 0 or a[i, _ROW] + a[i, _E] - a[i, _S] != si[e1, I_NTOK]:
        return False
    if si[e2, I_POS] != si[e1, I_POS] + si[e1, I_NTOK] or si[e2, I_SCOPE] != si[e1, I_SCOPE]:
        return False
    if a[i, _X] != 0 and b[j, _X] != 0:
        return True
    return su[e1, U_NEXT_DIGEST] != _ZERO and su[e2, U_PREFIX] == su[e1, U_NEXT_DIGEST]


@numba.njit(cache=True, nogil=True)
def _shape(P, grp, ng, gedge, glo, ghi, tok, n, k, repair_chunks, min_hit, ext_left, ext_right, serve_observed,
           ht_key, ht_slot, su, si, arena):
    """Runs (hit segments) of the pieces ``P`` grouped by ``grp`` (``shaping.shape_runs``):
    coalesce, extend, repair, carve out, fold. ``gedge`` / ``glo`` / ``ghi``: per group, the
    run's edge (``shape_runs``' edges) and the prompt range its extension stays in. Returns the
    finished parts' pieces ``F[:nf]``, their ends ``parts[:nparts]``, and every run's extent
    before repair and folding ``X[:nx]`` (start, end)."""
    prev_end = glo[0] if ng else 0
    npc = grp[ng]
    R = np.empty((2 * (npc + 4), 6), dtype=np.int64)
    L = np.empty((16, 6), dtype=np.int64)
    F = np.empty((2 * (npc + 4), 6), dtype=np.int64)
    parts = np.empty(npc + 4, dtype=np.int64)
    X = np.empty((ng + 1, 2), dtype=np.int64)
    nx = 0
    nf = 0
    nparts = 0
    rl = 0
    has_run = False
    edge = 0
    gi = 0
    while True:
        close = has_run
        if gi < ng:
            g0 = grp[gi]
            g1 = grp[gi + 1]
            if has_run and R[rl - 1, _E] == P[g0, _S] and _continues(R, rl - 1, P, g0, su, si):
                while rl + (g1 - g0) > R.shape[0]:
                    R = _grow(R)
                _copy(R, rl, P, g0, g1)
                rl += g1 - g0
                close = False
        if close:
            # close(run, edge): repair + carve-out at an approximate start, split, fold
            prev_end = R[rl - 1, _E]
            X[nx, 0] = R[0, _S]
            X[nx, 1] = prev_end
            nx += 1
            h = 0
            if R[0, _X] == 0:
                lo = max(edge + k, _CARVE)
                if lo > R[0, _S]:
                    while h < rl and R[h, _E] <= lo:
                        h += 1
                    if h < rl and R[h, _S] < lo:
                        R[h, _ROW] += lo - R[h, _S]
                        R[h, _S] = lo
            if h < rl:
                split = repair_chunks and k > 0
                cur = h  # first piece of the current part; parts are contiguous runs of R
                i = h
                while i < rl:
                    if split and i > h and R[i, _ROW] == 0 and R[i, _X] == 0:
                        if i > cur and R[i - 1, _E] - R[cur, _S] >= min_hit:
                            F, nf, parts, nparts = _emit_part(F, nf, parts, nparts, R, cur, i)
                        if R[i, _E] - R[i, _S] <= k:
                            cur = i + 1
                            i += 1
                            continue
                        R[i, _S] += k
                        R[i, _ROW] = k
                        cur = i
                    i += 1
                if rl > cur and R[rl - 1, _E] - R[cur, _S] >= min_hit:
                    F, nf, parts, nparts = _emit_part(F, nf, parts, nparts, R, cur, rl)
            has_run = False
            rl = 0
        if gi == ng:
            break
        g0 = grp[gi]
        g1 = grp[gi + 1]
        if not has_run:
            p_s = P[g0, _S]
            edge = gedge[gi]
            rl = 0
            if glo[gi] > prev_end:
                prev_end = glo[gi]
            if ext_left and P[g0, _ROW] == 0 and p_s > prev_end:
                # extend_left: stored predecessors matching the prompt backwards from p_s
                cur_s = P[g0, _SLOT]
                pos = p_s
                nl = 0
                done = False
                while pos > prev_end and su[cur_s, U_PREV] != _ZERO:
                    nb = find_slot(ht_key, ht_slot, su[cur_s, U_PREV])
                    if (not _usable(nb, si[cur_s, I_SCOPE], serve_observed, si)
                            or si[nb, I_POS] + si[nb, I_NTOK] != si[cur_s, I_POS]
                            or su[nb, U_NEXT_DIGEST] != su[cur_s, U_PREFIX]):
                        break
                    size = si[nb, I_NTOK]
                    if pos < size:
                        break  # its first token would sit before position 0: a Fetch item cannot name it
                    off = si[nb, I_OFF]
                    mmax = min(size, pos - prev_end)
                    mt = _trailing(tok[pos - mmax : pos], arena[off + size - mmax : off + size], mmax)
                    if mt:
                        if nl == L.shape[0]:
                            L = _grow(L)
                        _set(L, nl, pos - mt, pos, nb, size - mt, 0, 0)
                        nl += 1
                        pos -= mt
                    if mt < mmax:
                        break
                    if mt < size:
                        rest = min(size - mt, pos)
                        extra = _trailing(tok[pos - rest : pos], arena[off + size - mt - rest : off + size - mt], rest)
                        edge = pos - extra
                        done = True
                        break
                    cur_s = nb
                if not done:
                    edge = pos
                while nl + (g1 - g0) > R.shape[0]:
                    R = _grow(R)
                for t in range(nl):
                    _copy(R, t, L, nl - 1 - t, nl - t)
                rl = nl
            while rl + (g1 - g0) > R.shape[0]:
                R = _grow(R)
            _copy(R, rl, P, g0, g1)
            rl += g1 - g0
            has_run = True
        if ext_right:
            lim = P[grp[gi + 1], _S] if gi + 1 < ng else n
            if ghi[gi] < lim:
                lim = ghi[gi]
            if lim > R[rl - 1, _E]:
                # extend_right: stored successors matching the prompt forwards
                cur_s = R[rl - 1, _SLOT]
                if R[rl - 1, _ROW] + R[rl - 1, _E] - R[rl - 1, _S] == si[cur_s, I_NTOK]:
                    xr = R[rl - 1, _X]
                    pos = R[rl - 1, _E]
                    while pos < lim and su[cur_s, U_NEXT] != _ZERO:
                        nb = find_slot(ht_key, ht_slot, su[cur_s, U_NEXT])
                        if (not _usable(nb, si[cur_s, I_SCOPE], serve_observed, si)
                                or si[nb, I_POS] != si[cur_s, I_POS] + si[cur_s, I_NTOK]
                                or su[nb, U_PREFIX] != su[cur_s, U_NEXT_DIGEST]):
                            break
                        size = si[nb, I_NTOK]
                        off = si[nb, I_OFF]
                        mmax = min(size, lim - pos)
                        mt = _leading(tok[pos : pos + mmax], arena[off : off + mmax], mmax)
                        if mt == 0:
                            break
                        if rl == R.shape[0]:
                            R = _grow(R)
                        _set(R, rl, pos, pos + mt, nb, 0, xr, 0)
                        rl += 1
                        pos += mt
                        if mt < size:
                            break
                        cur_s = nb
        gi += 1
    return F, nf, parts, nparts, X, nx
