"""Plan shaping: chunk hits -> coalesced, extended hit segments (the second half of Lookup).

Input: the admitted chunk hits of one Lookup, one *piece* per prompt chunk, in order, grouped
where consecutive pieces already continue each other (the planner checks that as it goes)::

    piece = [start, end, entry, row, exact, is_chunk]
            tokens [start, end) of the prompt are rows [row, row + end - start) of ``entry``

Output: *runs* (hit segments), each a list of contiguous pieces that continue ONE stored
sequence at ONE delta::

    stored   ... | P (prev_key) | E (hit)   | N (next_key) | ...      one Store's chunks
    prompt   xxxxxxx|ppppp|EEEEEEEEEEE|nnnn|yyyyyyy                  same tokens, shifted
                    ^ left extension    ^ right extension (token by token, stops at a mismatch)

* **Coalescing**: a chunk hit joins the run before it when it starts where that run ends and
  its stored copy is the next chunk of the run's stored sequence: its source position follows
  on (same delta) and its prefix digest is the one the run's last chunk recorded for its
  successor (``ChunkEntry.next_digest``), so its KV was computed after exactly those tokens.
  Within a run the left context of every chunk is the stored one, but the text before the run
  is not, so boundary repair (the first ``recompute_tokens`` k re-prefilled) applies at the
  run's start and, with ``repair_chunks`` (``RepairScope.CHUNK``, the default), again at every
  stored chunk's first row inside an approximate run: k-token prefill holes that split the run
  into several hit segments. Re-prefilled tokens see the true prefix, and on a trained model
  they keep answers closer to full prefill than one repair per run (docs/fidelity.md).
* **Extension**: from a run's first and last chunk, the registry's links (``prev_key`` /
  ``next_key``, set at registration) name the neighbouring stored chunks of the same
  sequence; the prompt is compared with their stored tokens token by token and the matching
  rows are served as extra pieces (part of a chunk: ``row`` > 0 or ``end - start`` < the
  chunk). A neighbour is used only when it is the same scope, backed by a tier (RESIDENT;
  OBSERVED too for dry runs), its tokens are known, its source position is adjacent and its
  digests chain (the same stored sequence): extended KV is always stored KV, at the run's delta.
  Right extension of an exact run is exact (same left context, same positions); left extension
  is approximate (the text before it differs, or it would have been a hit). A Fetch item names
  a chunk by the prompt position of its FIRST row (``target_pos``, unsigned), so a left
  extension never enters a stored chunk whose first row would land before position 0.
* **Folding**: after repair and the carve-out (no shifted KV below position 32), a run (or a
  part of one between repair holes) shorter than ``min_hit_tokens`` is dropped: its tokens are
  prefilled with the gap around it (unless it covers the whole request after the engine prefix).

Per piece the plan keeps one row (the wire format is unchanged: a run is a sequence of rows with
contiguous positions and one delta, ``LookupPlan.hit_segments``), so every client fetches the
chunks of a run as before, one Fetch item per chunk, and takes rows ``[row, row + len)``.

This module is the reference: ``lookup_kernel.plan_chunks`` does the same steps in one numba call
over the registry's mirror, and tests/registry/test_compiled_lookup.py holds the two to the
same plans.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from sidecar.registry.entry import ChunkEntry, EntryState
from sidecar.registry.lookup_plan import CARVE_OUT_TOKENS
from sidecar.registry.seeds import SEED_TOKENS, windows

_RESIDENT = EntryState.RESIDENT


def _usable(nb: ChunkEntry | None, scope: str, serve_observed: bool) -> bool:
    return nb is not None and nb.scope == scope and (serve_observed or nb.state is _RESIDENT) and bool(nb.tokens)


def _tokens_of(entry: ChunkEntry) -> np.ndarray:
    return np.frombuffer(entry.tokens, dtype="<u4")


def continues(last: list, p: list) -> bool:
    """Piece ``p`` (starting where ``last`` ends) continues ``last``'s stored sequence."""
    e1: ChunkEntry = last[2]
    e2: ChunkEntry = p[2]
    if p[3] != 0 or last[3] + last[1] - last[0] != e1.num_tokens:
        return False
    if e2.source_pos != e1.source_pos + e1.num_tokens or e2.scope != e1.scope:
        return False
    return (last[4] and p[4]) or (e1.next_digest != 0 and e2.prefix_digest == e1.next_digest)


def extend_right(last: list, lim: int, tokens: np.ndarray, peek: Callable[[int], ChunkEntry | None],
                 serve_observed: bool) -> list[list]:
    """Pieces after ``last`` (a run's last piece) up to ``lim``: the stored successors' rows
    that match the prompt token by token."""
    s, e, cur, row, exact, _ = last
    out: list[list] = []
    if row + e - s != cur.num_tokens:
        return out
    pos = e
    while pos < lim and cur.next_key:
        nb = peek(cur.next_key)
        if (not _usable(nb, cur.scope, serve_observed) or nb.source_pos != cur.source_pos + cur.num_tokens
                or nb.prefix_digest != cur.next_digest):
            break
        mmax = min(nb.num_tokens, lim - pos)
        neq = np.flatnonzero(tokens[pos : pos + mmax] != _tokens_of(nb)[:mmax])
        m = int(neq[0]) if len(neq) else mmax
        if m == 0:
            break
        out.append([pos, pos + m, nb, 0, exact, False])
        pos += m
        if m < nb.num_tokens:
            break
        cur = nb
    return out


def extend_left(first: list, lim: int, tokens: np.ndarray, peek: Callable[[int], ChunkEntry | None],
                serve_observed: bool) -> tuple[list[list], int]:
    """Pieces before ``first`` (a run's first piece, row 0) down to ``lim``, and the run's edge:
    the first prompt position from which the prompt equals the stored sequence (boundary
    repair counts from there; below ``lim`` when the stored tokens match past it)."""
    cur = first[2]
    pos = first[0]
    out: list[list] = []
    while pos > lim and cur.prev_key:
        nb = peek(cur.prev_key)
        if (not _usable(nb, cur.scope, serve_observed) or nb.source_pos + nb.num_tokens != cur.source_pos
                or nb.next_digest != cur.prefix_digest):
            break
        size = nb.num_tokens
        if pos < size:
            break  # its first token would sit before position 0: a Fetch item cannot name it
        ref = _tokens_of(nb)
        mmax = min(size, pos - lim)
        neq = np.flatnonzero(tokens[pos - mmax : pos] != ref[size - mmax :])
        m = mmax - 1 - int(neq[-1]) if len(neq) else mmax
        if m:
            out.append([pos - m, pos, nb, size - m, False, False])
            pos -= m
        if m < mmax:
            break  # a mismatch: pos is the edge
        if m < size:
            # Stopped by the limit inside nb: the edge is where the stored tokens stop matching.
            rest = min(size - m, pos)
            neq = np.flatnonzero(tokens[pos - rest : pos] != ref[size - m - rest : size - m])
            extra = rest - 1 - int(neq[-1]) if len(neq) else rest
            out.reverse()
            return out, pos - extra
        cur = nb
    out.reverse()
    return out, pos


def repair_chunk_starts(run: list[list], k: int) -> list[list[list]]:
    """``run`` split by a k-token hole at every approximate piece after the first that starts at
    a stored chunk's first row (the first piece was repaired by the caller)."""
    out: list[list[list]] = []
    cur: list[list] = []
    for i, p in enumerate(run):
        s, e, entry, row, exact, is_chunk = p
        if i and row == 0 and not exact:
            if cur:
                out.append(cur)
                cur = []
            if e - s <= k:
                continue
            p = [s + k, e, entry, k, exact, is_chunk]
        cur.append(p)
    if cur:
        out.append(cur)
    return out


def shape_runs(
    groups: list[list[list]],
    tokens: np.ndarray,
    engine_prefix_len: int,
    n: int,
    peek: Callable[[int], ChunkEntry | None],
    *,
    extend_left_: bool = True,
    extend_right_: bool = True,
    serve_observed: bool = False,
    recompute_tokens: int = 0,
    repair_chunks: bool = False,
    min_hit_tokens: int = 0,
    edges: list[int] | None = None,
    limits: list[tuple[int, int]] | None = None,
    extents: list[tuple[int, int]] | None = None,
) -> list[list[list]]:
    """Runs (hit segments) from the chunk-hit pieces, given in ``groups`` of pieces that
    already continue each other (``continues``; the planner groups them as it finds them);
    never overlapping each other or the engine prefix, in order.

    ``edges``: per group, where the prompt starts to equal the stored sequence (default: the
    first piece's chunk start); ``limits``: per group, the prompt range [lo, hi) its extension
    stays in (default: everything); ``extents``: if given, receives every run's [start, end)
    before repair and folding."""
    runs: list[list[list]] = []
    k = recompute_tokens
    # A hit covering everything after the engine prefix is kept however short: folding it would
    # prefill the whole request (short keys such as SGLang HiCache's 8-token page names).
    min_hit_tokens = min(min_hit_tokens, n - engine_prefix_len)

    def close(run: list[list], edge: int) -> None:
        if extents is not None:
            extents.append((run[0][0], run[-1][1]))
        if not run[0][4]:  # approximate start: boundary repair and the carve-out
            lo = max(edge + k, CARVE_OUT_TOKENS)
            if lo > run[0][0]:
                while run and run[0][1] <= lo:
                    run.pop(0)
                if run and run[0][0] < lo:
                    s, e, entry, row, exact, is_chunk = run[0]
                    run[0] = [lo, e, entry, row + lo - s, exact, is_chunk]
        if not run:
            return
        for part in repair_chunk_starts(run, k) if repair_chunks and k else (run,):
            if part[-1][1] - part[0][0] >= min_hit_tokens:
                runs.append(part)

    run: list[list] | None = None
    edge = 0
    prev_end = limits[0][0] if limits else engine_prefix_len
    count = len(groups)
    for i, g in enumerate(groups):
        p = g[0]
        if run is not None:
            if run[-1][1] == p[0] and continues(run[-1], p):
                run.extend(g)
            else:
                prev_end = run[-1][1]
                close(run, edge)
                run = None
        if run is None:
            run = list(g)
            edge = edges[i] if edges else p[0] - p[3]  # the chunk's start (the piece may begin at the engine prefix)
            if limits:
                prev_end = max(prev_end, limits[i][0])
            if extend_left_ and p[3] == 0 and p[0] > prev_end:
                left, edge = extend_left(p, prev_end, tokens, peek, serve_observed)
                if left:
                    run = left + run
        if extend_right_:
            lim = groups[i + 1][0][0] if i + 1 < count else n
            if limits:
                lim = min(lim, limits[i][1])
            if lim > run[-1][1]:
                run += extend_right(run[-1], lim, tokens, peek, serve_observed)
    if run is not None:
        close(run, edge)
    return runs


def _match_back(x: np.ndarray, y: np.ndarray) -> int:
    """Number of trailing tokens on which x and y (same length) agree."""
    neq = np.flatnonzero(x != y)
    return len(x) - 1 - int(neq[-1]) if len(neq) else len(x)


def _match_forward(x: np.ndarray, y: np.ndarray) -> int:
    """Number of leading tokens on which x and y (same length) agree."""
    neq = np.flatnonzero(x != y)
    return int(neq[0]) if len(neq) else len(x)


def seed_pieces(
    gaps: list[tuple[int, int]],
    tokens: np.ndarray,
    find: Callable[[int, int], tuple[ChunkEntry, int] | None],
    bits: int,
    min_len: int = 0,
) -> tuple[list[list[list]], list[int], list[tuple[int, int]]]:
    """Seed hits in the prompt ranges ``gaps`` (``seeds``) of at least ``min_len`` tokens (a
    seed run stays inside its range, so a shorter one would fold): scanning each from the left,
    a seed window not yet covered whose stored copy ``find(p, mix)`` accepts (the entry and the
    window's row, or None) becomes one piece, extended token by token inside that chunk within
    the range. Returns one group per piece, and per group its edge and range (``shape_runs``'
    ``edges`` / ``limits``)."""
    groups: list[list[list]] = []
    edges: list[int] = []
    limits: list[tuple[int, int]] = []
    w = SEED_TOKENS
    for lo, hi in gaps:
        if hi - lo < max(w, min_len):
            continue
        pos, mix = windows(tokens, lo, hi, bits)
        covered = lo
        for p, m in zip(pos.tolist(), mix.tolist()):
            if p < covered:
                continue
            found = find(p, m)
            if found is None:
                continue
            entry, row = found
            ref = _tokens_of(entry)
            stop = min(hi, p - row + entry.num_tokens)
            pr = p + w + _match_forward(tokens[p + w : stop], ref[row + w : row + stop - p])
            tmax = min(row, p - covered)
            t = _match_back(tokens[p - tmax : p], ref[row - tmax : row])
            pl, rl = p - t, row - t
            edge = pl
            if t == tmax and t < row:  # stopped by the range, not by a mismatch
                rest = min(rl, pl)
                edge = pl - _match_back(tokens[pl - rest : pl], ref[rl - rest : rl])
            groups.append([[pl, pr, entry, rl, False, False]])
            edges.append(edge)
            limits.append((lo, hi))
            covered = pr
    return groups, edges, limits
