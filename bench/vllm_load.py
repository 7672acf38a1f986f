"""Rows from the shared pool into vLLM's paged KV cache on CPU, as the connector's worker loads
them (``clients.vllm.placing.place``), for the dataplane bench (``bench.dataplane``).

Two caches of the same shape, ``[blocks, H, 16, 2 * D]`` per layer, block size 16, the request's
blocks a shuffled draw of the cache's (vLLM's free-block queue is not in order):

* ``cpu_backend``: the CPU attention backend's packing (``clients.vllm.paged.PagedKV``, the
  ``vec`` block layout: per head, K dim-major then V token-major);
* ``standard``: vLLM's standard ``[B, H, N, K | V]`` cell (``clients.vllm.layouts.StandardKV``,
  the layout of the GPU backends, here on CPU).

One load: a lease of the plan's spans, each item's rows viewed in the pool, ``place`` (rotated
where shifted), ``intact``, release. Checked once per cache and plan: the cache's rows at the
request's positions (``gather``) equal what ``PoolClient.read_into`` staged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from clients.vllm.layouts import PagedSpec, StandardKV
from clients.vllm.paged import BlockLayout, PagedKV
from clients.vllm.placing import Scratch, place
from clients.vllm.rows import GqaRows
from clients.vllm.staging import Staging

BLOCK = 16
CACHES = ("cpu_backend", "standard")


def build(kind: str, num_layers: int, heads: int, head_dim: int, tokens: int) -> tuple[Any, torch.Tensor]:
    """A cache for ``tokens`` (and 64 spare blocks) and a request's block table (int64): a
    shuffled draw of the cache's blocks."""
    nb = tokens // BLOCK + 64
    layers = [torch.zeros((nb, heads, BLOCK, 2 * head_dim), dtype=torch.bfloat16) for _ in range(num_layers)]
    table = torch.from_numpy(np.random.default_rng(1).permutation(nb)[: tokens // BLOCK]).to(torch.int64)
    if kind == "cpu_backend":
        return PagedKV(layers, BlockLayout.vec(heads, BLOCK, head_dim)), table
    spec = PagedSpec(mla=False, num_heads=heads, block_size=BLOCK, head_size=head_dim, head_size_v=head_dim,
                     dtype=torch.bfloat16)
    return StandardKV(layers, spec), table


def load(case: Any, kind: str, cache: Any, table: torch.Tensor, staging: Staging, scratch: Scratch) -> None:
    """One load of ``kind``'s plan (``bench.dataplane.Case``) into ``cache``."""
    spans, base = case.plans[kind]
    pool = case.pool
    got = pool.lease(spans, identity=case.ident, layout=case.layout)
    try:
        items = []
        for it in got.items:
            if not it.ok:
                raise RuntimeError(f"lease: item {it.index} of {kind} is a miss")
            a = spans[it.index].target_pos - base
            for c in it.chunks:
                rows = GqaRows.of(pool.chunk_view(c), case.layout, c.num_tokens).narrow(2, c.row_offset, c.rows)
                items.append((a, a + c.rows, rows, c.delta))
                a += c.rows
        place(cache, GqaRows, items, table, staging=staging, rope=case.spec, layout=case.layout, scratch=scratch)
        if not pool.intact(got):
            raise RuntimeError(f"intact: a lease of {kind} expired during the load")
    finally:
        pool.release(got)


def check(case: Any, kind: str, cache: Any, table: torch.Tensor, staged: torch.Tensor) -> None:
    """The cache's rows at the request's positions must equal ``staged`` (``read_into``'s)."""
    got = cache.gather(table, torch.arange(case.n, dtype=torch.int64))
    if not torch.equal(got, staged):
        raise RuntimeError(f"{kind}: the rows loaded into the cache differ from the pool's read_into")
