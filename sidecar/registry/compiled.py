"""The Lookup planner as one compiled call over the registry's mirror (``table``).

``index.ChunkIndex.lookup`` + ``shaping.shape_runs`` are the reference (plain Python, per
chunk); this module computes the same plan in one numba call, with no Python per chunk::

    tokens ──CDC + fingerprints (chunker kernels)──> bounds, keys (own, shared), prefix digests
    per chunk past the engine prefix:  probe the hash table (own key, else shared key)
        scope / state filter, verify tokens against the arena, exact check, admission, grouping
    shaping: coalesce, extend into stored neighbours (links), boundary repair (segment start,
        and every stored chunk's first row with repair_chunks), carve-out, folding
    seeds (``seeds``): in the ranges no run reached, seed windows probed in the seed map,
        verified (scope, state, tokens, the chunk's key for this identity), extended inside
        their chunk, then shaped the same way (folding at seed_min); the two passes merged
    emit ENGINE_PREFIX | CHUNK_HIT | PREFILL rows, hit segment lengths, keys to touch

The kernel reads the mirror only: it changes nothing, so a call that cannot decide returns
FALLBACK and the caller runs the reference planner instead. It cannot decide when an admitted
candidate's tokens are not known yet (an entry recovered after a restart is verified by its
xxh3-128 digest and adopts the prompt's tokens: the reference does that). The caller never asks
it to apply the left-context-window guard (the mirror holds no left context).

Output: one uint64 array (no per-field boxing)::

    [H_* header (HEADER words)] [rows: 7 x n_rows] [hit segment lengths] [keys to touch] [bounds]

``bounds``: the chunk bounds from the first chunk past the engine prefix (``chunk_bounds``).
Every integer the kernel compares is uint64 or int64, never mixed (numba promotes mixed 64-bit
arithmetic to float64).
"""

from __future__ import annotations

import numba
import numpy as np

from sidecar.registry.chunker import ChunkerConfig, Chunks, _boundaries, _digests, chunk_tokens
from sidecar.registry.plan import CARVE_OUT_TOKENS, Fidelity, SegmentKind
from sidecar.registry.registry import ChunkEntry, ChunkHash
from sidecar.registry.seeds import ROW_BITS, SEED_TOKENS, chunk_key, seed_key, windows
from sidecar.registry.table import (
    I_LEN,
    I_NTOK,
    I_OFF,
    I_POS,
    I_RESIDENT,
    I_SCOPE,
    U_KEY,
    U_NEXT,
    U_NEXT_DIGEST,
    U_PREFIX,
    U_PREV,
    RegistryTable,
    find_slot,
)

#: header words of the kernel's output
H_STATUS, H_ROWS, H_SEGS, H_TOUCH, H_BOUNDS, H_CHUNKS, H_HITS, H_EXACT, H_SHIFTED, H_VFAIL, H_SEEDED = range(11)
HEADER = 11
PLANNED, FALLBACK = 0, 1

_U = np.uint64
_HIT = _U(int(SegmentKind.CHUNK_HIT))
_PREFILL = _U(int(SegmentKind.PREFILL))
_PREFIX = _U(int(SegmentKind.ENGINE_PREFIX))
_EXACT = _U(int(Fidelity.EXACT))
_APPROX = _U(int(Fidelity.APPROXIMATE))
_CARVE = CARVE_OUT_TOKENS
_ZERO = _U(0)
_SEED_W = SEED_TOKENS
_ROW_BITS = ROW_BITS
_ROW_MASK = (1 << ROW_BITS) - 1

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


@numba.njit(cache=True, nogil=True)
def _seed_hits(tok, epl, n, X, nx, own_sid, shared_sid, key_seeds, chain_seed, bits, min_len, serve_observed, sd_key,
               sd_val, su, si, arena):
    """Seed hits in the prompt ranges no run reached (``X[:nx]``: the runs' extents, in order)
    of at least ``min_len`` tokens (a seed run stays inside its range: a shorter one would fold),
    one piece per hit, extended inside its stored chunk (``seeds``; ``shaping.seed_pieces``).
    Returns the pieces ``S[:ns]``, and per piece its edge and the range [lo, hi) it was found in."""
    S = np.empty((16, 6), dtype=np.int64)
    aux = np.empty((16, 3), dtype=np.int64)  # edge, lo, hi
    ns = 0
    lo = epl
    for x in range(nx + 1):
        hi = X[x, 0] if x < nx else n
        if hi - lo >= _SEED_W and hi - lo >= min_len:
            pos, mix = windows(tok, lo, hi, bits)
            covered = lo
            for i in range(pos.shape[0]):
                p = pos[i]
                if p < covered:
                    continue
                slot = -1
                row = 0
                for c in range(key_seeds.shape[0]):
                    sid = own_sid if c == 0 else shared_sid
                    if sid < 0:
                        continue
                    v = find_slot(sd_key, sd_val, seed_key(mix[i], sid))
                    if v < 0:
                        continue
                    cs = v >> _ROW_BITS
                    cr = v & _ROW_MASK
                    ln = si[cs, I_LEN]
                    if si[cs, I_SCOPE] != sid or (not serve_observed and si[cs, I_RESIDENT] == 0):
                        continue
                    if ln <= 0 or cr + _SEED_W > ln or p < cr:
                        continue
                    off = si[cs, I_OFF]
                    if _leading(tok[p : p + _SEED_W], arena[off + cr : off + cr + _SEED_W], _SEED_W) != _SEED_W:
                        continue
                    if chunk_key(arena, off, off + ln, key_seeds[c], chain_seed) != su[cs, U_KEY]:
                        continue
                    slot = cs
                    row = cr
                    break
                if slot < 0:
                    continue
                off = si[slot, I_OFF]
                ln = si[slot, I_LEN]
                stop = min(hi, p - row + ln)
                m = stop - p - _SEED_W
                pr = p + _SEED_W + _leading(tok[p + _SEED_W : stop], arena[off + row + _SEED_W : off + row + _SEED_W + m], m)
                tmax = min(row, p - covered)
                t = _trailing(tok[p - tmax : p], arena[off + row - tmax : off + row], tmax)
                pl = p - t
                rl = row - t
                edge = pl
                if t == tmax and t < row:
                    # stopped by the range, not by a mismatch: the edge is where the stored tokens stop matching
                    rest = min(rl, pl)
                    edge = pl - _trailing(tok[pl - rest : pl], arena[off + rl - rest : off + rl], rest)
                if ns == S.shape[0]:
                    S = _grow(S)
                    aux = _grow(aux)
                _set(S, ns, pl, pr, slot, rl, 0, 0)
                aux[ns, 0] = edge
                aux[ns, 1] = lo
                aux[ns, 2] = hi
                ns += 1
                covered = pr
        if x < nx:
            lo = X[x, 1]
    return S, ns, aux[:ns, 0].copy(), aux[:ns, 1].copy(), aux[:ns, 2].copy()


@numba.njit(cache=True, nogil=True)
def _merge(F, nf, parts, nparts, G, ng, gparts, ngparts):
    """The finished parts of two shaping passes (each in order, never overlapping) in one order."""
    M = np.empty((nf + ng + 1, 6), dtype=np.int64)
    mparts = np.empty(nparts + ngparts + 1, dtype=np.int64)
    nm = 0
    i = 0
    j = 0
    a = 0
    b = 0
    while i < nparts or j < ngparts:
        if j == ngparts or (i < nparts and F[a, _S] < G[b, _S]):
            _copy(M, nm, F, a, parts[i])
            nm += parts[i] - a
            a = parts[i]
            i += 1
        else:
            _copy(M, nm, G, b, gparts[j])
            nm += gparts[j] - b
            b = gparts[j]
            j += 1
        mparts[i + j - 1] = nm
    return M, nm, mparts, nparts + ngparts


@numba.njit(cache=True, nogil=True)
def plan_chunks(tok, bounds, fps, prefix, epl, own_sid, shared_sid, exact_only, k, repair_chunks, min_hit,
                ext_left, ext_right, serve_observed, key_seeds, chain_seed, seed_bits, seed_min, ht_key, ht_slot, su,
                si, arena, sd_key, sd_val):
    """The plan of ``tok`` (uint32 [n], ``epl`` < n) chunked as ``bounds`` / ``fps`` (uint64
    [n_seeds, n_chunks]: own scope, then shared) / ``prefix`` under ``key_seeds`` (the scopes'
    seeds) and ``chain_seed`` (the identity's salt); see the module docstring."""
    n = tok.shape[0]
    nck = bounds.shape[0] - 1
    c0 = np.searchsorted(bounds, epl, side="right") - 1
    m = nck - c0
    nseeds = fps.shape[0]
    header = np.zeros(HEADER, dtype=np.uint64)
    header[H_CHUNKS] = m

    # ---- phase 1: admitted chunk hits, one piece per chunk, grouped as they go (index.lookup)
    P = np.empty((m + 1, 6), dtype=np.int64)
    grp = np.empty(m + 2, dtype=np.int64)
    npc = 0
    ng = 0
    last = -1
    last_end = -1
    last_exact = False
    vfail = 0
    for j in range(c0, nck):
        s = find_slot(ht_key, ht_slot, fps[0, j])
        if s < 0 and nseeds > 1:
            s = find_slot(ht_key, ht_slot, fps[1, j])
        if s < 0:
            continue
        sc = si[s, I_SCOPE]
        if (sc != own_sid and sc != shared_sid) or (not serve_observed and si[s, I_RESIDENT] == 0):
            continue
        a = bounds[j]
        b = bounds[j + 1]
        ln = si[s, I_LEN]
        if ln <= 0:
            header[H_STATUS] = FALLBACK
            return header
        off = si[s, I_OFF]
        if ln != b - a or _leading(tok[a:b], arena[off : off + ln], ln) != ln:
            vfail += 1
            continue
        exact = si[s, I_POS] == a and su[s, U_PREFIX] == prefix[j]
        if not exact and exact_only:
            continue
        if (a == last_end and si[s, I_POS] == si[last, I_POS] + si[last, I_NTOK] and sc == si[last, I_SCOPE]
                and ((exact and last_exact)
                     or (su[last, U_NEXT_DIGEST] != _ZERO and su[s, U_PREFIX] == su[last, U_NEXT_DIGEST]))):
            _set(P, npc, a, b, s, 0, exact, 1)
        else:
            seg = a if a > epl else epl
            grp[ng] = npc
            ng += 1
            _set(P, npc, seg, b, s, seg - a, exact, 1)
        npc += 1
        last = s
        last_end = b
        last_exact = exact
    grp[ng] = npc
    header[H_VFAIL] = vfail

    # ---- phase 2: runs (shaping.shape_runs) of the chunk hits, then of seed hits in what they left
    seed_min = min(max(min_hit, seed_min), n - epl)
    min_hit = min(min_hit, n - epl)
    gedge = np.empty(ng + 1, dtype=np.int64)
    for gi in range(ng):
        gedge[gi] = P[grp[gi], _S] - P[grp[gi], _ROW]  # the chunk's start (the piece may begin at the engine prefix)
    glo = np.full(ng + 1, epl, dtype=np.int64)
    ghi = np.full(ng + 1, n, dtype=np.int64)
    F, nf, parts, nparts, X, nx = _shape(P, grp, ng, gedge, glo, ghi, tok, n, k, repair_chunks, min_hit, ext_left,
                                         ext_right, serve_observed, ht_key, ht_slot, su, si, arena)
    if seed_bits >= 0 and not exact_only:
        S, ns, sedge, slo, shi = _seed_hits(tok, epl, n, X, nx, own_sid, shared_sid, key_seeds, chain_seed, seed_bits,
                                            seed_min, serve_observed, sd_key, sd_val, su, si, arena)
        if ns:
            sgrp = np.arange(ns + 1, dtype=np.int64)
            F2, nf2, parts2, nparts2, _, _ = _shape(S, sgrp, ns, sedge, slo, shi, tok, n, k, repair_chunks, seed_min,
                                                    ext_left, ext_right, serve_observed, ht_key, ht_slot, su, si, arena)
            seeded = 0
            for i in range(nf2):
                seeded += F2[i, _E] - F2[i, _S]
            header[H_SEEDED] = seeded
            F, nf, parts, nparts = _merge(F, nf, parts, nparts, F2, nf2, parts2, nparts2)

    # ---- emission: rows tiling [0, n), segment lengths, keys to touch
    nrows = 1 if epl > 0 else 0
    pos = epl
    for i in range(nf):
        if F[i, _S] > pos:
            nrows += 1
        nrows += 1
        pos = F[i, _E]
    if pos < n:
        nrows += 1
    ntouch = 0 if serve_observed else nf
    nb_out = nck + 1 - c0
    out = np.empty(HEADER + 7 * nrows + nparts + ntouch + nb_out, dtype=np.uint64)
    for i in range(HEADER):
        out[i] = header[i]
    r = HEADER
    if epl > 0:
        out[r] = _PREFIX
        out[r + 1] = 0
        out[r + 2] = epl
        out[r + 3] = out[r + 4] = out[r + 5] = out[r + 6] = 0
        r += 7
    pos = epl
    hits = 0
    exact_tokens = 0
    shifted_tokens = 0
    t = HEADER + 7 * nrows + nparts
    for i in range(nf):
        s = F[i, _S]
        e = F[i, _E]
        slot = F[i, _SLOT]
        row = F[i, _ROW]
        if s > pos:
            out[r] = _PREFILL
            out[r + 1] = pos
            out[r + 2] = s
            out[r + 3] = out[r + 4] = out[r + 5] = out[r + 6] = 0
            r += 7
        out[r] = _HIT
        out[r + 1] = s
        out[r + 2] = e
        out[r + 3] = su[slot, U_KEY]
        out[r + 4] = row
        out[r + 5] = si[slot, I_POS] + row
        if F[i, _X] != 0:
            out[r + 6] = _EXACT
            exact_tokens += e - s
        else:
            out[r + 6] = _APPROX
            shifted_tokens += e - s
        r += 7
        pos = e
        hits += F[i, _C]
        if not serve_observed:
            out[t] = su[slot, U_KEY]
            t += 1
    if pos < n:
        out[r] = _PREFILL
        out[r + 1] = pos
        out[r + 2] = n
        out[r + 3] = out[r + 4] = out[r + 5] = out[r + 6] = 0
        r += 7
    start = 0
    for p in range(nparts):
        out[r + p] = F[parts[p] - 1, _E] - F[start, _S]
        start = parts[p]
    r = HEADER + 7 * nrows + nparts + ntouch
    for c in range(c0, nck + 1):
        out[r + c - c0] = bounds[c]
    out[H_ROWS] = nrows
    out[H_SEGS] = nparts
    out[H_TOUCH] = ntouch
    out[H_BOUNDS] = nb_out
    out[H_HITS] = hits
    out[H_EXACT] = exact_tokens
    out[H_SHIFTED] = shifted_tokens
    return out


@numba.njit(cache=True, nogil=True)
def plan_tokens(tok, anchors, marker_flat, marker_offsets, mask, min_size, max_size, seeds, chain_seed, epl, own_sid,
                shared_sid, exact_only, k, repair_chunks, min_hit, ext_left, ext_right, serve_observed, seed_bits,
                seed_min, ht_key, ht_slot, su, si, arena, sd_key, sd_val):
    """``plan_chunks`` of ``tok`` chunked in the same call (``chunker.chunk_tokens``)."""
    bounds = _boundaries(tok, anchors, marker_flat, marker_offsets, mask, min_size, max_size)
    fps, prefix, _ = _digests(tok, bounds, seeds, chain_seed)
    return plan_chunks(tok, bounds, fps, prefix, epl, own_sid, shared_sid, exact_only, k, repair_chunks, min_hit,
                       ext_left, ext_right, serve_observed, seeds, chain_seed, seed_bits, seed_min, ht_key, ht_slot,
                       su, si, arena, sd_key, sd_val)


def plan(
    table: RegistryTable,
    tokens: np.ndarray,
    scope: str,
    shared_scope: str | None,
    *,
    engine_prefix_len: int,
    exact_only: bool,
    recompute_tokens: int,
    repair_chunks: bool,
    min_hit_tokens: int,
    seed_min_tokens: int,
    extend_left: bool,
    extend_right: bool,
    serve_observed: bool,
    seeds: np.ndarray,
    chain_seed: int,
    chunks: Chunks | None = None,
    chunker: ChunkerConfig | None = None,
) -> np.ndarray:
    """Plan ``tokens`` (uint32 ``[n]``, ``engine_prefix_len`` < n) for ``scope``, and for
    ``shared_scope`` too when not None (``seeds`` (uint64 ``[n_scopes]``, the scopes' key
    seeds) and ``chunks.fingerprints`` then have two rows, own scope first) under the identity
    salt ``chain_seed``. Either ``chunks`` (already computed) or ``chunker`` (chunked in the
    same call). The switches are the reference planner's (``shaping.shape_runs``;
    ``serve_observed``: a dry run); seed hits follow the table's ``seed_bits``. Returns the
    kernel's packed output (module docstring). Syncs ``table``, then only reads it."""
    table.sync()
    ids = table.scope_ids
    own = ids.get(scope, -1)
    shared = ids.get(shared_scope, -2) if shared_scope is not None else -2
    t = table
    if chunks is not None:
        return plan_chunks(tokens, chunks.bounds, chunks.fingerprints, chunks.prefix_digests, engine_prefix_len, own,
                           shared, exact_only, recompute_tokens, repair_chunks, min_hit_tokens, extend_left,
                           extend_right, serve_observed, seeds, _U(chain_seed), t.seed_bits, seed_min_tokens, t.ht_key,
                           t.ht_slot, t.su, t.si, t.arena, t.sd_key, t.sd_val)
    c = chunker
    return plan_tokens(tokens, c._anchors, c._marker_flat, c._marker_offsets, _U(c.mask), c.min_size, c.max_size, seeds,
                       _U(chain_seed), engine_prefix_len, own, shared, exact_only, recompute_tokens, repair_chunks,
                       min_hit_tokens, extend_left, extend_right, serve_observed, t.seed_bits, seed_min_tokens,
                       t.ht_key, t.ht_slot, t.su, t.si, t.arena, t.sd_key, t.sd_val)


def warmup(chunker: ChunkerConfig) -> None:
    """Compile (or load from numba's cache) the planner and the mirror's kernels before the
    first request, with the argument types Lookups use."""
    table = RegistryTable(8, seed_bits=0)
    tokens = np.frombuffer(np.arange(600, dtype="<u4").tobytes(), dtype="<u4")  # read-only, as from the wire
    entry = ChunkEntry(key=ChunkHash(1), scope="warmup", tokens=tokens[:40].tobytes(), source_pos=0, prefix_digest=0,
                       left_context=b"")
    table.add(entry, True)
    table.put(entry, False)
    table.set_tokens(entry)
    table.sync()
    seeds = np.array([1, 2], dtype=np.uint64)
    switches = dict(engine_prefix_len=0, exact_only=False, recompute_tokens=0, repair_chunks=True, min_hit_tokens=0,
                    seed_min_tokens=0, extend_left=True, extend_right=True, serve_observed=False)
    plan(table, tokens, "warmup", "shared", chunker=chunker, seeds=seeds, chain_seed=3, **switches)
    chunks = chunk_tokens(tokens, chunker, seeds, 3)
    plan(table, tokens, "warmup", "shared", seeds=seeds, chain_seed=3, chunks=chunks, **switches)
    table.remove(entry.key)
    table.sync()
