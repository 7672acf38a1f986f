"""The Lookup planner as one compiled call over the registry's mirror (``entry_table``).

``chunk_index.ChunkIndex.lookup`` + ``shaping.shape_runs`` are the reference (plain Python, per
chunk); this module computes the same plan in one numba call, with no Python per chunk::

    tokens ──CDC + fingerprints (chunker kernels)──> bounds, keys (own, shared), prefix digests
    per chunk past the engine prefix:  probe the hash table for the chunk's copy computed after
        this left context (``entry.variant_key``; own key, else shared key): scope / state
        filter, tokens verified, same position and prefix digest -> an EXACT hit from it; else
        the chunk key (own, else shared): scope / state filter, verify tokens against the
        arena, exact check, admission; then grouping
    shaping (``shaping_kernel``): coalesce, extend into stored neighbours (links), boundary
        repair (segment start, and every stored chunk's first row with repair_chunks),
        carve-out, folding
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

from sidecar.registry.chunker import ChunkerConfig, Chunks, _boundaries, _digests, _variant, chunk_tokens
from sidecar.registry.entry import ChunkEntry, ChunkHash
from sidecar.registry.entry_table import (
    I_LEN,
    I_NTOK,
    I_OFF,
    I_POS,
    I_RESIDENT,
    I_SCOPE,
    U_KEY,
    U_NEXT_DIGEST,
    U_PREFIX,
    EntryTable,
    find_slot,
)
from sidecar.registry.lookup_plan import Fidelity, SegmentKind
from sidecar.registry.seeds import ROW_BITS, SEED_TOKENS, chunk_key, seed_key, windows
from sidecar.registry.shaping_kernel import _C, _E, _ROW, _S, _SLOT, _X, _copy, _grow, _leading, _set, _shape, _trailing

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
_ZERO = _U(0)
_SEED_W = SEED_TOKENS
_ROW_BITS = ROW_BITS
_ROW_MASK = (1 << ROW_BITS) - 1


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


#: ``_served`` outcomes other than the slot itself
_UNSERVED = -1  # another tenant's, or not resident where only resident entries are served
_MISMATCH = -2  # the stored tokens differ from the prompt's (a 64-bit collision): a counted miss
_NO_TOKENS = -3  # the entry's tokens are not in the mirror: the Python planner plans this prompt


@numba.njit(cache=True, nogil=True)
def _served(s, si, arena, tok, a, b, own_sid, shared_sid, serve_observed):
    """Slot ``s`` if it may serve ``tok[a:b]`` (visible to the caller, served, its stored tokens
    verified), else one of the outcomes above."""
    sc = si[s, I_SCOPE]
    if (sc != own_sid and sc != shared_sid) or (not serve_observed and si[s, I_RESIDENT] == 0):
        return _UNSERVED
    ln = si[s, I_LEN]
    if ln <= 0:
        return _NO_TOKENS
    off = si[s, I_OFF]
    if ln != b - a or _leading(tok[a:b], arena[off : off + ln], ln) != ln:
        return _MISMATCH
    return s


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

    # ---- phase 1: admitted chunk hits, one piece per chunk, grouped as they go (chunk_index.lookup)
    P = np.empty((m + 1, 6), dtype=np.int64)
    grp = np.empty(m + 2, dtype=np.int64)
    npc = 0
    ng = 0
    last = -1
    last_end = -1
    last_exact = False
    vfail = 0
    for j in range(c0, nck):
        a = bounds[j]
        b = bounds[j + 1]
        # the copy computed after this very left context, when one is held: an EXACT hit
        s = find_slot(ht_key, ht_slot, _variant(fps[0, j], prefix[j]))
        if s < 0 and nseeds > 1:
            s = find_slot(ht_key, ht_slot, _variant(fps[1, j], prefix[j]))
        if s >= 0:
            s = _served(s, si, arena, tok, a, b, own_sid, shared_sid, serve_observed)
            if s == _NO_TOKENS:
                header[H_STATUS] = FALLBACK
                return header
            if s == _MISMATCH:
                vfail += 1
            if s >= 0 and (si[s, I_POS] != a or su[s, U_PREFIX] != prefix[j]):
                s = -1
        if s >= 0:
            exact = True
        else:
            s = find_slot(ht_key, ht_slot, fps[0, j])
            if s < 0 and nseeds > 1:
                s = find_slot(ht_key, ht_slot, fps[1, j])
            if s < 0:
                continue
            s = _served(s, si, arena, tok, a, b, own_sid, shared_sid, serve_observed)
            if s == _NO_TOKENS:
                header[H_STATUS] = FALLBACK
                return header
            if s < 0:
                if s == _MISMATCH:
                    vfail += 1
                continue
            exact = si[s, I_POS] == a and su[s, U_PREFIX] == prefix[j]
            if not exact and exact_only:
                continue
        sc = si[s, I_SCOPE]
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
    table: EntryTable,
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
    table = EntryTable(8, seed_bits=0)
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
