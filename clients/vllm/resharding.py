"""A worker's load of chunks another tensor-parallel cut of the model stored (re-sharding).

When the scheduler side's Lookup found the items under another cut (``LoadJob.plan_shard``,
the stored cut's rank-0 shard: a TP 1 engine reading what a TP 4 one stored, or the reverse),
each worker fetches from the ranks of that cut holding its own KV heads
(``sidecar.cuts.covering``): one Fetch per source rank, naming the source rank's identity, the
plan's identity and the head range it needs (``FetchRequest.heads``), so the sidecar sends
exactly this worker's share. The parts are joined into the worker's rows (one copy) before the
usual placement. Same-host or not, these loads go over Fetch (its shared-memory buffer on the
sidecar's host): a lease answers whole chunks.

A source rank missing a chunk makes the item a miss for this worker only: vLLM recomputes its
blocks (on every worker, as for any failed load). Pipeline stages must match; an MLA latent is
not cut by heads (every TP size reads the same shard, so it never gets here).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from sidecar.cuts import covering, cut_of, heads_layout

from clients.vllm.rows import GqaRows

if TYPE_CHECKING:
    from clients.vllm.jobs import LoadJob
    from clients.vllm.settings import EngineShape


def fetch_across(job: "LoadJob", shape: "EngineShape", call: Any, *, raw: bool
                 ) -> list[tuple[Any, torch.Tensor | None, int, int]] | None:
    """Each item's rows (None: a miss), the delta still to apply here, and the bytes fetched,
    from the cut ``job.plan_shard`` names; None when this worker cannot read that cut (then
    every item is a miss). ``call(fn)``: the worker's fail-soft Fetch (``fn(client)``, None when
    the sidecar failed)."""
    own, src = cut_of(shape.identity.shard), cut_of(job.plan_shard or "")
    if own is None or src is None or shape.mla or own.rest != src.rest:
        return None
    parts = covering(shape.model_kv_heads, own.rank, own.size, src.size)
    if parts is None:
        return None
    src_layout = heads_layout(shape.layout, shape.model_kv_heads // src.size)
    plan = replace(shape.identity, shard=src.shard(0), kv_layout=src_layout.fingerprint())
    items = job.items
    rows: list[torch.Tensor | None] = [None] * len(items)
    deltas: list[int | None] = [None] * len(items)
    ok = [True] * len(items)
    moved = [0] * len(items)
    for rank, first, count, here in parts:
        ident = replace(plan, shard=src.shard(rank))
        got = call(lambda c, ident=ident, first=first, count=count: c.fetch(
            [it.fetch_item for it in items], identity=ident, layout=src_layout, rope=shape.rope, raw=raw,
            plan_identity=plan, heads=(first, count)))
        share = heads_layout(src_layout, count)
        for i, it in enumerate(items):
            f = got[i] if got is not None else None
            n = len(it)
            if not ok[i] or f is None or not f.ok or f.num_tokens < it.row + n or not (f.rotated or f.delta == 0 or raw):
                ok[i] = False
                continue
            delta = 0 if f.rotated else f.delta
            if deltas[i] is None:
                deltas[i] = delta
                rows[i] = torch.empty((shape.num_layers, 2, n, shape.num_kv_heads, shape.head_size),
                                      dtype=GqaRows.of(f.data, share, f.num_tokens).dtype)
            elif deltas[i] != delta:  # the shards were stored at other positions: not one chunk
                ok[i] = False
                continue
            rows[i][:, :, :, here:here + count] = GqaRows.of(f.data, share, f.num_tokens).narrow(2, it.row, n)
            moved[i] += len(f.data)
    return [(it, rows[i] if ok[i] else None, deltas[i] or 0, moved[i]) for i, it in enumerate(items)]
