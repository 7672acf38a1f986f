"""A Fetch from its query to its answers: the one domain call behind the Fetch RPC.

::

    FetchQuery(items, identity, layout, rope, plan_identity?, heads?)
      keys: items named by another shard's plan -> this shard's chunks   (``shards.translate``)
      span items -> plain per-chunk items                                 (``spans.expand``)
      chunk reads: scope-checked, windowed, rotated to target             (``reads.ChunkReads``)
      per-chunk results joined back into one answer per span item         (``spans.regroup``)
      only the asked KV heads kept                                        (``cuts.slice_heads``)
    -> FetchAnswer per item, in order: the bytes that cross, or a miss

The transport decodes a request into a ``FetchQuery`` and frames each ``FetchAnswer``; every
check of the request's meaning (spans, shards, heads, the item and byte bounds) is made here,
and every one of them is raised before the first answer. The lease path of the shared pool
(``dataplane.pool``) takes the same query, whose ``keys`` it leases instead of reading.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

import torch

from sidecar.dataplane.cuts import SliceBuffers, check_heads, slice_heads
from sidecar.dataplane.reads import ChunkReads
from sidecar.dataplane.shards import check_shards, translate
from sidecar.dataplane.spans import SpanResult, expand, regroup
from sidecar.dataplane.spans import check as check_spans
from sidecar.errors import InvalidArgument
from sidecar.identity import SHARED_SCOPE, CacheIdentity, KVLayout
from sidecar.registry.chunk_index import ChunkIndex
from sidecar.registry.lookup_plan import FetchSpec

#: A Fetch's items: ``(chunk_hash, target_pos)`` pairs, or a ``FetchSpec`` per item when any is a span
Items = Sequence[tuple[int, int]] | Sequence[FetchSpec]


@dataclass(frozen=True, kw_only=True, slots=True)
class FetchQuery:
    """A decoded Fetch. ``plan_identity``: the identity whose plan named the items (another
    shard of ``identity``'s model), None when it is ``identity``'s own; ``heads``: the KV head
    range ``(start, count)`` to answer, None for every head; ``rope``: a ``RopeSpec`` (required
    to rotate shifted chunks unless ``raw``); ``max_items`` bounds the chunks the items expand
    to, ``max_bytes`` the answered payload bytes (None: unbounded)."""

    tenant: str
    identity: CacheIdentity
    layout: KVLayout
    items: Items
    rope: object | None = None
    raw: bool = False
    plan_identity: CacheIdentity | None = None
    heads: tuple[int, int] | None = None
    max_items: int | None = None
    max_bytes: int | None = None


@dataclass(slots=True)
class FetchAnswer:
    """The answer to item ``index``: ``data`` None for a miss, else the payload's bytes (one
    view, or, from ``fetch(gather=True)``, its pieces in order, for a gathering write). The
    views are valid until the next answer is asked for (a buffer may be reused)."""

    index: int
    data: memoryview | list[memoryview] | None = None
    num_tokens: int = 0
    source_pos: int = 0
    delta: int = 0
    rotated: bool = False
    tier: str = ""

    @property
    def nbytes(self) -> int:
        d = self.data
        return 0 if d is None else len(d) if isinstance(d, memoryview) else sum(len(p) for p in d)


class FetchPath:
    """Fetch for the data plane: ``keys`` and ``fetch`` over its index and chunk reads."""

    def __init__(self, index: ChunkIndex, reads: ChunkReads) -> None:
        self.index = index
        self.reads = reads
        self._slices = SliceBuffers()  # the buffers head ranges are sliced into, call after call

    def keys(self, q: FetchQuery) -> Items:
        """``q``'s items under ``q.identity``'s own keys (checked): as they are, or, with a
        ``plan_identity``, each planned chunk translated to the same tokens' chunk of this shard
        (``dataplane.shards``; one that cannot be is a miss)."""
        items = q.items
        spans = bool(items) and isinstance(items[0], FetchSpec)
        if spans:
            check_spans(items)
        if q.plan_identity is None:
            return items
        check_shards(q.identity, q.plan_identity)
        if spans:
            hashes = [h for s in items for h in (s.chunk_hash, *s.next_hashes)]
        else:
            hashes = [h for h, _ in items]
        reg = self.index.registry
        key = translate(hashes, q.identity, reg.peek, (q.tenant, SHARED_SCOPE), reg.copy_at).__getitem__
        if spans:
            return [replace(s, chunk_hash=key(s.chunk_hash), next_hashes=tuple(map(key, s.next_hashes)))
                    for s in items]
        return [(key(h), t) for h, t in items]

    async def fetch(self, q: FetchQuery, *, gather: bool = False) -> AsyncIterator[FetchAnswer]:
        """One ``FetchAnswer`` per item of ``q``, in order. Every refusal (INVALID_ARGUMENT or
        FAILED_PRECONDITION naming the field, RESOURCE_EXHAUSTED past a bound) comes before the
        first answer and changes nothing. ``gather``: a span's answer may be its pieces (the
        caller writes them with one gathering write) rather than one joined copy."""
        heads = q.heads
        if heads is not None and check_heads(q.layout, *heads):
            heads = None  # every head: the payloads as stored
        items = self.keys(q)
        if items and isinstance(items[0], FetchSpec):
            # Span items (one per plan hit segment): expanded to per-chunk items, joined back.
            flat, groups = expand(items, self.index.registry.peek)
            if q.max_items is not None and len(flat) > q.max_items:
                raise InvalidArgument(f"items: {len(flat)} chunks exceed max_fetch_items {q.max_items}")
            chunks = self.reads.stream(q.tenant, q.identity, q.layout, q.rope, flat, q.raw, q.max_bytes)
            results = regroup(chunks, groups, q.layout, as_pieces=gather and heads is None)
        else:
            results = self.reads.stream(q.tenant, q.identity, q.layout, q.rope, items, q.raw, q.max_bytes)
        # the head slices' buffer, reused item after item (each answer is framed before the next)
        sliced = self._slices.take() if heads is not None else None
        try:
            async for r in results:
                span = isinstance(r, SpanResult)
                if r.payload is None and not (span and r.pieces):
                    yield FetchAnswer(r.index)
                    continue
                if span:
                    ntok, src = r.num_tokens, r.source_pos
                    data = r.pieces if r.pieces else memoryview(r.payload.numpy())
                else:
                    ntok, src = r.entry.num_tokens, r.entry.source_pos
                    data = memoryview(r.payload.numpy())
                if heads is not None:  # only the caller's share of the heads crosses
                    need = r.payload.numel()  # more than the slice: one buffer for every item
                    if sliced.numel() < need:
                        sliced = torch.empty(need, dtype=torch.uint8)
                    data = memoryview(slice_heads(r.payload, q.layout, ntok, *heads, out=sliced).numpy())
                answer = FetchAnswer(r.index, data, ntok, src, r.delta, r.rotated, r.tier)
                r = None  # a chunk shared by later items is kept by the reads only while needed
                yield answer
        finally:
            await results.aclose()
            if sliced is not None:
                self._slices.give(sliced)
