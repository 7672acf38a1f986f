"""Span Fetch items: one item per hit segment of a plan (several chunks, part of a chunk).

A plan's hit segment is a run of CHUNK_HIT rows with contiguous positions and one delta
(``LookupPlan.hit_segments``; the planner coalesces chunks that continue one stored sequence).
An engine fetches it as ONE item::

    FetchItem(chunk_hash=first row's chunk, target_pos=segment start, row_offset=first row's
              chunk_offset, num_tokens=segment length, next_hashes=the other rows' chunks)

The server expands a span into the plain per-chunk items the data plane already serves
(``expand``: each chunk at ``target = its source position + delta``), runs the ordinary Fetch
(reads, duplicate collapsing, rotation: untouched), and joins the rows of each span back into
one payload of ``num_tokens`` rows (``join``), in KV-layout order. Plain items (``num_tokens``
0) pass through unchanged, so old clients see no difference.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import torch

from sidecar.dataplane.records import FetchResult
from sidecar.errors import InvalidArgument
from sidecar.identity import KVLayout
from sidecar.payload import payload_nbytes
from sidecar.registry.entry import ChunkEntry
from sidecar.registry.lookup_plan import FetchSpec


@dataclass(slots=True)
class SpanResult:
    """The answer to one span item: ``payload`` (or, from ``fetch_spans(as_pieces=True)``,
    ``pieces``) None for a miss (any chunk of it missing)."""

    index: int
    payload: torch.Tensor | None = None
    pieces: list[memoryview] | None = None  # the payload's bytes in order, not joined
    num_tokens: int = 0
    source_pos: int = 0
    delta: int = 0
    rotated: bool = False
    tier: str = ""


@dataclass(frozen=True, slots=True)
class _Group:
    count: int  # plain items it expanded to (0: a span that cannot be served)
    rows: tuple[tuple[int, int], ...] | None  # rows per chunk (() a miss), None for a plain item
    num_tokens: int = 0
    source_pos: int = 0


def check(specs: Sequence[FetchSpec]) -> None:
    for i, s in enumerate(specs):
        if not s.num_tokens and (s.row_offset or s.next_hashes):
            raise InvalidArgument(f"items[{i}]: row_offset / next_hashes need num_tokens (a span)")


def expand(specs: Sequence[FetchSpec], peek: Callable[[int], ChunkEntry | None]
           ) -> tuple[list[tuple[int, int]], list[_Group]]:
    """Plain ``(chunk_hash, target of its first row)`` items for ``specs``, and how to join
    their results back. A span whose chunks are unknown, do not follow on in their stored
    sequence, or hold fewer rows than asked is a miss (expands to nothing)."""
    flat: list[tuple[int, int]] = []
    groups: list[_Group] = []
    for s in specs:
        if not s.num_tokens:
            flat.append((s.chunk_hash, s.target_pos))
            groups.append(_Group(1, None))
            continue
        entries = [peek(h) for h in (s.chunk_hash, *s.next_hashes)]
        e0 = entries[0]
        ok = all(e is not None for e in entries) and s.row_offset < e0.num_tokens
        if ok:
            for a, b in zip(entries, entries[1:]):
                if b.source_pos != a.source_pos + a.num_tokens:
                    ok = False
                    break
        rows: list[tuple[int, int]] = []
        if ok:
            left, row = s.num_tokens, s.row_offset
            for e in entries:
                if left <= 0:
                    ok = False  # more chunks than rows
                    break
                take = min(e.num_tokens - row, left)
                rows.append((row, row + take))
                left -= take
                row = 0
            ok = ok and left == 0
        if not ok:
            groups.append(_Group(0, ()))
            continue
        delta = s.target_pos - (e0.source_pos + s.row_offset)
        flat.extend((e.key, e.source_pos + delta) for e in entries)
        groups.append(_Group(len(entries), tuple(rows), s.num_tokens, e0.source_pos + s.row_offset))
    return flat, groups


def _part_widths(layout: KVLayout) -> tuple[int, ...]:
    """Bytes per token of every (layer, part) block of a payload, in payload order."""
    return tuple(p.bytes_per_token for _ in range(layout.num_layers) for p in layout.parts)


def _whole(results: Sequence[FetchResult], rows: Sequence[tuple[int, int]]) -> bool:
    """The span is exactly one whole chunk (its payload is the span's, as it is)."""
    return len(results) == 1 and rows[0] == (0, results[0].entry.num_tokens)


def join(results: Sequence[FetchResult], rows: Sequence[tuple[int, int]], layout: KVLayout,
         num_tokens: int) -> torch.Tensor:
    """One payload of ``num_tokens`` rows: ``rows[i]`` of ``results[i]``'s chunk, in order.

    A payload is one contiguous block per (layer, part), each ``n x width`` bytes, so a join is
    byte slices: one strided numpy copy per chunk when every block has the same width (GQA),
    else ``pieces`` copied back to back. A span that is exactly one whole chunk is that chunk's
    payload."""
    if _whole(results, rows):
        return results[0].payload
    out = torch.empty(payload_nbytes(layout, num_tokens), dtype=torch.uint8)
    dst = out.numpy()
    widths = _part_widths(layout)
    if len(set(widths)) == 1:
        blocks, w, pos = len(widths), widths[0], 0
        for r, (a, b) in zip(results, rows, strict=True):
            src, n = r.payload.numpy(), r.entry.num_tokens
            dst.reshape(blocks, num_tokens, w)[:, pos : pos + b - a] = src.reshape(blocks, n, w)[:, a:b]
            pos += b - a
    else:
        off = 0
        for p in pieces(results, rows, layout):
            dst[off : off + len(p)] = p
            off += len(p)
    return out


def pieces(results: Sequence[FetchResult], rows: Sequence[tuple[int, int]], layout: KVLayout) -> list[memoryview]:
    """The span's payload bytes as slices of the chunks' payloads, in payload order (for a
    gathering write, ``os.pwritev``, into a shared-memory buffer: no joined copy)."""
    if _whole(results, rows):
        return [memoryview(results[0].payload.numpy())]
    srcs = [(memoryview(r.payload.numpy()), r.entry.num_tokens, a, b) for r, (a, b) in zip(results, rows, strict=True)]
    out: list[memoryview] = []
    s_off = 0  # the block's offset in a chunk of n rows is (sum of earlier widths) * n
    for w in _part_widths(layout):
        out.extend(src[s_off * n + a * w : s_off * n + b * w] for src, n, a, b in srcs)
        s_off += w
    return out


async def regroup(results: AsyncIterator[FetchResult], groups: Sequence[_Group], layout: KVLayout,
                      as_pieces: bool = False) -> AsyncIterator[FetchResult | SpanResult]:
    """Regroup the plain results of ``expand``'s items into one result per original item
    (a span's payload joined, or with ``as_pieces`` left as ``pieces``)."""
    for index, g in enumerate(groups):
        if g.rows is None:
            r = await anext(results)
            r.index = index
            yield r
            continue
        got = [await anext(results) for _ in range(g.count)]
        if not got or any(r.payload is None for r in got):
            yield SpanResult(index=index)
            continue
        first = got[0]
        yield SpanResult(
            index=index, num_tokens=g.num_tokens, source_pos=g.source_pos, delta=first.delta,
            rotated=all(r.rotated for r in got), tier=first.tier,
            **({"pieces": pieces(got, g.rows, layout)} if as_pieces else {"payload": join(got, g.rows, layout, g.num_tokens)}),
        )
