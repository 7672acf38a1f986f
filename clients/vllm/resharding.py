"""A worker's load of chunks another tensor-parallel cut of the model stored (re-sharding).

When the scheduler side's Lookup found the items under another cut (``LoadJob.plan_shard``,
the stored cut's rank-0 shard: a TP 1 engine reading what a TP 4 one stored, or the reverse),
each worker reads from the ranks of that cut holding its own KV heads
(``sidecar.cuts.covering``): on the sidecar's host it leases their chunks in the shared pool and
reads only its heads there, in place (from several source ranks an item's rows are a
``rows.HeadParts``: the placement writes each part into its head range of the cache, no join);
elsewhere one Fetch per source rank names the source rank's identity, the plan's identity and
the head range it needs (``FetchRequest.heads``), so the sidecar sends exactly this worker's
share, and the parts are joined (one copy: each Fetch's payloads are views of a buffer lent to
that call).

A source rank missing a chunk makes the item a miss for this worker only: vLLM recomputes its
blocks (on every worker, as for any failed load). Pipeline stages must match; an MLA latent is
not cut by heads (every TP size reads the same shard, so it never gets here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from clients.vllm.rows import GqaRows, HeadParts, fetched_rows, leased_rows
from sidecar.cuts import covering, cut_of, heads_layout

if TYPE_CHECKING:
    from clients.vllm.jobs import LoadJob
    from clients.vllm.placing import Scratch
    from clients.vllm.settings import EngineShape
    from sidecar.sdk.pool import PoolClient


def fetch_across(job: "LoadJob", shape: "EngineShape", call: Any, scratch: "Scratch", *, raw: bool,
                 pool: "PoolClient | None" = None
                 ) -> tuple[list[tuple[Any, torch.Tensor | HeadParts | None, int, int]], Callable[[], bool]] | None:
    """Each item's rows (None: a miss), the delta still to apply here and the bytes read, from
    the cut ``job.plan_shard`` names, and ``finish()``: call it once the rows are placed; False
    when a leased chunk's bytes changed meanwhile (its lease expired: the load is not to be
    trusted). None when this worker cannot read that cut (every item is a miss).

    ``call(fn)``: the worker's fail-soft call (``fn(client)``, None when the sidecar failed).
    With ``pool`` (the sidecar's shared pool, mapped), each source rank's chunks are leased and
    only this worker's heads are read: the rows are strided views of the pool (no copy here;
    the placement reads them), from several source ranks a ``HeadParts`` of them. Without,
    each source rank's Fetch names the head range (``FetchRequest.heads``) and the parts are
    joined into ``scratch`` (valid until its next use)."""
    own, src = cut_of(shape.identity.shard), cut_of(job.plan_shard or "")
    if own is None or src is None or shape.mla or own.rest != src.rest:
        return None
    parts = covering(shape.model_kv_heads, own.rank, own.size, src.size)
    if parts is None:
        return None
    src_layout = heads_layout(shape.layout, shape.model_kv_heads // src.size)
    plan = replace(shape.identity, shard=src.shard(0), kv_layout=src_layout.fingerprint())
    items = job.items
    join = pool is None and len(parts) > 1
    per_token = shape.layout.bytes_per_token
    buf = scratch.take(sum(len(it) for it in items) * per_token) if join else None
    at = [0]
    for it in items:
        at.append(at[-1] + len(it) * per_token)
    joined: list[torch.Tensor | None] = [None] * len(items)  # (join) each item's rows in the scratch
    held: list[list[tuple[torch.Tensor, int]]] = [[] for _ in items]  # (else) each item's (part, first head)
    deltas: list[int | None] = [None] * len(items)
    ok = [True] * len(items)
    moved = [0] * len(items)
    finishes = []
    for rank, first, count, here in parts:
        source = replace(plan, shard=src.shard(rank))
        read = _leased if pool is not None else _fetched
        answers, finish = read(call, pool, items, source, plan, src_layout, shape, first, count, raw)
        finishes.append(finish)
        for i, got in enumerate(answers):
            if not ok[i] or got is None:
                ok[i] = False
                continue
            part, delta, nbytes = got
            moved[i] += nbytes
            if deltas[i] is None:
                deltas[i] = delta
                if join:
                    joined[i] = GqaRows.of(buf[at[i]:at[i + 1]], shape.layout, len(items[i]))
            elif deltas[i] != delta:  # the shards were stored at other positions: not one chunk
                ok[i] = False
                continue
            if join:
                joined[i][:, :, :, here:here + count] = part
            else:
                held[i].append((part, here))

    def rows(i: int) -> torch.Tensor | HeadParts | None:
        if not ok[i]:
            return None
        if join:
            return joined[i]
        return held[i][0][0] if len(held[i]) == 1 else HeadParts(tuple(held[i]))

    def finish_all() -> bool:
        return all([f() for f in finishes])  # every one ends its leases

    return [(it, rows(i), deltas[i] or 0, moved[i]) for i, it in enumerate(items)], finish_all


def _fetched(call, pool, items, source, plan, src_layout, shape, first, count, raw):
    """Per item: this worker's heads of the source rank's rows (a Fetch of only those), the
    delta still to apply, the bytes received (None for a miss); and ``finish()``, True."""
    heads = None if count == src_layout.parts[0].shape[0] else (first, count)  # a whole shard: as stored
    got = call(lambda c: c.fetch([it.fetch_item for it in items], identity=source, layout=src_layout,
                                 rope=shape.rope, raw=raw, plan_identity=plan, heads=heads))
    share = heads_layout(src_layout, count)
    out = []
    for i, it in enumerate(items):
        f = got[i] if got is not None else None
        rows = fetched_rows(f, it, GqaRows, share, raw)
        out.append(None if rows is None else (*rows, len(f.data)))
    return out, lambda: True


def _leased(call, pool, items, source, plan, src_layout, shape, first, count, raw):
    """``_fetched`` through the shared pool: the source rank's chunks leased and this worker's
    heads viewed in place (the placement reads them there); ``finish()`` ends the lease and
    says whether every chunk still held its leased bytes."""
    leased = call(lambda c: pool.lease([it.fetch_item for it in items], identity=source, layout=src_layout,
                                       plan_identity=plan))
    if leased is None:
        return [None] * len(items), lambda: True
    share = heads_layout(src_layout, count).bytes_per_token
    out = []
    for li, it in zip(leased.items, items):
        rows = leased_rows(pool, li, it, GqaRows, src_layout)
        out.append(None if rows is None else (rows[0][:, :, :, first:first + count], rows[1],
                                              li.chunks[0].num_tokens * share))

    def finish() -> bool:
        intact = pool.intact(leased)
        call(lambda _c: pool.release(leased))
        return intact

    return out, finish
