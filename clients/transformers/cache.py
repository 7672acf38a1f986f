"""``SequenceCache``: a transformers ``Cache`` whose layers grow in place, filled in position order.

The reference engine fills a request's cache position by position: its own prefix hit, then,
segment by segment, fetched chunks (written straight into the buffers) and prefilled tokens
(written by the model's attention through ``update``). transformers' ``DynamicLayer`` grows by
``torch.cat`` on every update, which copies the whole cache once per segment (quadratic in the
number of segments); here every layer owns one preallocated buffer per slot and ``update``
writes into it::

    keys buffer  [B, H, capacity, D]
                 |<----- length ----->|<-- free -->|
    layer.keys = buffer[:, :, :length]   (a view, what attention reads)

For GQA / MHA models ``KVAdapter.new_cache`` cuts every layer's two buffers from one
allocation (``SequenceCache.slab``, ``[layers * 2, B, H, capacity, D]``, the order of a fetched
payload), so a Fetch result is written into the cache with one copy; a layer that outgrows its
capacity gets buffers of its own.

Cache index == token position (the engine never leaves holes), so transformers' causal mask
(``q_offset = get_seq_length()``) is right for any ``position_ids`` the engine passes.
``layer.keys`` / ``layer.values`` keep transformers' meaning: for GQA models they are K and V
``[B, H_kv, T, head_dim]``; for MLA models (DeepSeek-V2/V3 in transformers 5.x) they are the
normalised latent ``c_kv [B, 1, T, kv_lora_rank]`` and the rotary ``k_pe [B, 1, T, rope_dim]``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class GrowLayer(DynamicLayer):
    """A ``DynamicLayer`` backed by preallocated buffers; grows by doubling when full."""

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.capacity_hint = int(capacity)
        self.length = 0
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None

    # -- storage --------------------------------------------------------------------------------

    def _allocate(self, like_k: torch.Tensor, like_v: torch.Tensor, needed: int) -> None:
        cap = max(needed, self.capacity_hint, 16)
        b, hk, _, dk = like_k.shape
        _, hv, _, dv = like_v.shape
        self._kbuf = torch.empty((b, hk, cap, dk), dtype=like_k.dtype, device=like_k.device)
        self._vbuf = torch.empty((b, hv, cap, dv), dtype=like_v.dtype, device=like_v.device)
        self.dtype, self.device = like_k.dtype, like_k.device
        self.is_initialized = True

    def _reserve(self, needed: int) -> None:
        cap = self._kbuf.shape[2]
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap)
        kb = self._kbuf.new_empty((*self._kbuf.shape[:2], new_cap, self._kbuf.shape[3]))
        vb = self._vbuf.new_empty((*self._vbuf.shape[:2], new_cap, self._vbuf.shape[3]))
        kb[:, :, : self.length].copy_(self._kbuf[:, :, : self.length])
        vb[:, :, : self.length].copy_(self._vbuf[:, :, : self.length])
        self._kbuf, self._vbuf = kb, vb

    def _publish(self) -> None:
        self.keys = self._kbuf.narrow(2, 0, self.length)
        self.values = self._vbuf.narrow(2, 0, self.length)

    # -- transformers API -------------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._allocate(key_states, value_states, key_states.shape[-2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        q = key_states.shape[-2]
        if self._kbuf is None:
            self._allocate(key_states, value_states, q)
        n = self.length
        self._reserve(n + q)
        self._kbuf[:, :, n : n + q].copy_(key_states)
        self._vbuf[:, :, n : n + q].copy_(value_states)
        self.length = n + q
        self._publish()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self.length = 0
        if self._kbuf is not None:
            self._publish()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop: pass a negative number of tokens to remove")
        self.truncate(self.length + tokens_to_remove if tokens_to_remove else self.length)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("SequenceCache serves one sequence (batch size 1)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("SequenceCache serves one sequence (batch size 1)")

    # -- engine API -------------------------------------------------------------------------------

    def allocate(
        self, key_shape: tuple[int, int], value_shape: tuple[int, int], dtype: torch.dtype, device: torch.device
    ) -> None:
        """Allocate empty buffers for ``(heads, dim)`` keys/values before anything is written."""
        like_k = torch.empty((1, *key_shape[:1], 0, key_shape[1]), dtype=dtype, device=device)
        like_v = torch.empty((1, *value_shape[:1], 0, value_shape[1]), dtype=dtype, device=device)
        self._allocate(like_k, like_v, 0)
        self._publish()

    def adopt(self, kbuf: torch.Tensor, vbuf: torch.Tensor) -> None:
        """Use ``[B, H, capacity, D]`` buffers allocated by the caller (slices of one allocation
        for every layer: ``KVAdapter.new_cache``) before anything is written."""
        self._kbuf, self._vbuf = kbuf, vbuf
        self.dtype, self.device = kbuf.dtype, kbuf.device
        self.is_initialized = True
        self._publish()

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate: length {length} outside [0, {self.length}]")
        self.length = length
        if self._kbuf is not None:
            self._publish()

    def append_slots(self, n: int, like: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Extend by ``n`` positions and return the new ``[B, H, n, D]`` key/value slots to fill.

        The caller must write every slot before the next forward pass reads them.
        """
        if self._kbuf is None:
            if like is None:
                raise ValueError("append_slots on an empty layer needs example tensors (like=)")
            self._allocate(like[0], like[1], n)
        start = self.grow(n)
        return self._kbuf[:, :, start : start + n], self._vbuf[:, :, start : start + n]

    def grow(self, n: int) -> int:
        """Extend an allocated layer by ``n`` positions (to be filled before the next forward
        pass reads them); returns the first."""
        start = self.length
        self._reserve(start + n)
        self.length = start + n
        self._publish()
        return start


class SequenceCache(Cache):
    """One sequence's KV, all layers, in position order (see the module docstring).

    ``capacity`` preallocates that many positions per layer (the engine passes prompt length +
    decode budget, so a request never reallocates).
    """

    def __init__(self, num_layers: int, capacity: int = 0) -> None:
        super().__init__(layers=[GrowLayer(capacity) for _ in range(num_layers)])
        #: every layer's K and V buffers as one ``[layers * 2, B, H, capacity, D]`` tensor when
        #: ``KVAdapter.new_cache`` allocated them together (uniform layouts), else None
        self.slab: torch.Tensor | None = None

    def extend(self, n: int) -> int:
        """Append ``n`` positions to every layer (to be filled by the caller); returns the first."""
        start = self.length
        for layer in self.layers:
            if layer._kbuf is None:
                raise ValueError("extend: the layers have no buffers yet (allocate them: KVAdapter.new_cache)")
            layer.grow(n)
        return start

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.truncate(length)
