"""Serving a chunk stored under one tensor-parallel cut of a model to workers of another.

A tensor-parallel rank holds its own KV heads and Stores them as its own shard
(``sidecar.cuts``), so a chunk stored at one TP size is keyed apart from the same tokens at any
other. A chunk's KV per head is the same whatever the cut, so:

* the sidecar remembers, per model (every identity field but ``kv_layout`` and the TP part of
  ``shard``), the rank-0 identity of each TP size that has stored (``CutFamilies``);
* a Lookup under one cut that finds more under another cut's rank 0 answers that plan and names
  its shard (``LookupPlan.plan_shard``);
* a worker of any cut fetches such a plan from the ranks of the stored cut that hold its heads
  (``sidecar.cuts.covering``): each Fetch names the source rank's identity, the plan's identity
  and the head range it needs (``FetchRequest.heads``), and the sidecar answers only those
  heads (``slice_heads``), so a worker moves exactly its share.

Cuts differ only in how heads are split: the pipeline part of the shard, and every other
identity field, must be equal. A model whose KV heads do not divide by the TP size (vLLM then
replicates heads across ranks) is served per shard only.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from sidecar.cuts import cut_of, heads_layout, lead_of, model_key
from sidecar.errors import InvalidArgument
from sidecar.identity import CacheIdentity, KVLayout

#: models remembered at most; the least recently stored go first
MAX_MODELS = 1024


class CutFamilies:
    """Per model, the rank-0 identity of every TP size that has stored (thread-safe)."""

    def __init__(self, max_models: int = MAX_MODELS) -> None:
        self._by_model: dict[tuple, dict[int, CacheIdentity]] = {}
        self._max = max_models
        self._lock = threading.Lock()

    def saw(self, identity: CacheIdentity) -> None:
        """``identity`` stored a chunk."""
        cut = cut_of(identity.shard)
        if cut is None:
            return
        lead = lead_of(identity, cut)
        key = model_key(identity, cut)
        with self._lock:
            sizes = self._by_model.pop(key, None) or {}
            sizes[cut.size] = lead
            self._by_model[key] = sizes  # most recent last
            while len(self._by_model) > self._max:
                self._by_model.pop(next(iter(self._by_model)))

    def others(self, identity: CacheIdentity) -> list[CacheIdentity]:
        """The rank-0 identities of the other TP sizes of ``identity``'s model, smallest first."""
        cut = cut_of(identity.shard)
        if cut is None:
            return []
        with self._lock:
            sizes = dict(self._by_model.get(model_key(identity, cut), {}))
        return [sizes[n] for n in sorted(sizes) if n != cut.size]


def check_heads(layout: KVLayout, start: int, count: int) -> bool:
    """``FetchRequest.heads`` against the fetched layout (INVALID_ARGUMENT naming the field);
    whether the range is every head of the layout."""
    heads = {p.shape[0] if len(p.shape) == 2 else -1 for p in layout.parts}
    if len(heads) != 1 or -1 in heads:
        raise InvalidArgument("heads: the layout has no KV head axis shared by its parts (an MLA latent is not "
                              "split by heads)")
    h = heads.pop()
    if count <= 0 or start + count > h:
        raise InvalidArgument(f"heads: [{start}, {start + count}) is not inside the layout's {h} KV heads")
    return start == 0 and count == h


class SliceBuffers:
    """Host buffers a Fetch slices heads into, reused call after call (a fresh buffer's pages
    fault on first touch, which costs more than the copy here); one per call in flight."""

    def __init__(self, keep: int = 4) -> None:
        self._free: list[torch.Tensor] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self) -> torch.Tensor:
        with self._lock:
            return self._free.pop() if self._free else torch.empty(0, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)


def slice_heads(payload: torch.Tensor, layout: KVLayout, num_tokens: int, start: int, count: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """KV heads ``[start, start + count)`` of a payload (1-D uint8, ``layout`` order: per layer,
    each part ``[num_tokens, heads, ...]``) as a payload of ``heads_layout(layout, count)``: one
    strided copy of exactly those bytes, into the front of ``out`` when given (big enough)."""
    out_layout = heads_layout(layout, count)
    nbytes = num_tokens * out_layout.bytes_per_token
    out = torch.empty(nbytes, dtype=torch.uint8) if out is None else out[:nbytes]
    # numpy over the bytes: one thread (the sidecar shares its cores with an engine; torch's
    # parallel copy waits for a second thread, measured 3-6x slower on a loaded 2-core host)
    src = payload.numpy().reshape(layout.num_layers, -1)
    dst = out.numpy().reshape(layout.num_layers, -1)
    src_at = dst_at = 0
    for p, q in zip(layout.parts, out_layout.parts):
        n_src, n_dst = num_tokens * p.bytes_per_token, num_tokens * q.bytes_per_token  # per layer
        head = np.dtype((np.void, p.bytes_per_token // p.shape[0]))  # one head's bytes: one item
        s = src[:, src_at:src_at + n_src].view(head).reshape(layout.num_layers, num_tokens, p.shape[0])
        d = dst[:, dst_at:dst_at + n_dst].view(head).reshape(layout.num_layers, num_tokens, count)
        np.copyto(d, s[:, :, start:start + count])  # a memcpy per head row, not per byte
        src_at, dst_at = src_at + n_src, dst_at + n_dst
    return out
