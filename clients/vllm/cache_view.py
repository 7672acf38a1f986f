"""``CacheView``: the one interface of the worker's KV caches.

The worker moves rows between sidecar payloads and vLLM's paged cache through one of three
classes, picked at ``register_kv_caches`` (``worker_side.py``) and used alike from then on
(``placing.place`` for loads, ``WorkerSide.save`` for Stores):

* ``paged.PagedKV``: the CPU backend's cache, its block layout learned from the engine's kernel;
* ``layouts.StandardKV``: vLLM's standard ``[B, H, N, K | V]`` views (GQA / MHA, any device);
* ``layouts.LatentKV``: vLLM's standard ``[B, 1, N, c_kv | k_pe]`` views (MLA, any device).

Rows are what ``rows.py`` says for the cache's kind: ``[L, 2, n, H, D]`` (GQA / MHA) or latent
rows ``[L, n, C]`` (MLA). ``tests/clients/vllm/test_cache_view.py`` holds each class to this
protocol, members and signatures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from clients.vllm.rows import HeadParts

__all__ = ["CacheView"]


@runtime_checkable
class CacheView(Protocol):
    """A paged KV cache as the worker moves rows through it. ``layers``: the engine's per-layer
    cache tensors in layer order (the cache's storage, written in place; the view never owns
    them); ``dtype`` / ``device``: theirs."""

    layers: list[torch.Tensor]
    dtype: torch.dtype
    device: torch.device

    @property
    def num_layers(self) -> int:
        """L: the layers this worker holds (its pipeline stage's, under pipeline parallelism)."""
        ...

    def scatter(self, rows: torch.Tensor | HeadParts, block_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Write ``rows`` (the cache's dtype, any device) at token ``positions`` (int64 ``[n]``,
        ascending) of the request whose block table is ``block_ids`` (int64). Overwrites those
        tokens' cells only. GQA rows may be a ``rows.HeadParts`` (head ranges of several
        buffers): each part lands in its heads, with no join first, and heads no part holds
        stay as they were."""
        ...

    def gather(self, block_ids: torch.Tensor, positions: torch.Tensor, host: bool = True) -> torch.Tensor:
        """The rows at ``positions`` (int64 ``[n]``, ascending) of the request whose block table is
        ``block_ids``: a new tensor (never a view of the cache), on the CPU when ``host``, else
        on the cache's device."""
        ...
