"""Copy KV rows between sidecar payloads and vLLM's paged KV cache (CPU backend first).

vLLM hands the connector one tensor per attention layer, ``[num_blocks, kv_heads, block_size,
2 * head_size]`` on the CPU backend. What sits inside a block is the attention kernel's business:
on x86 without AMX (``isa = "vec"``) each (block, head) holds the keys **dim-major** ``[head_size,
block_size]`` followed by the values token-major ``[block_size, head_size]`` (measured against a
transformers forward of the same model: see docs/vllm.md). Other ISAs may pack differently, so
the layout is not assumed: ``BlockLayout.learn`` writes known ids through the engine's own
cache-write kernel (``cpu_attn_reshape_and_cache``) into a scratch block and reads back where
each (token, head, dim) of K and V landed. Copies then use those offsets; the common ``vec``
layout gets a strided fast path.

Sidecar payloads are ``KVLayout.gqa`` order: per layer, K ``[n, H, D]`` then V ``[n, H, D]``
(read and written as ``[L, 2, n, H, D]`` with ``sidecar.payload.stacked_view`` /
``stacked_payload``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from clients.vllm.rows import HeadParts, head_parts


@contextmanager
def single_threaded() -> Iterator[None]:
    """Run the connector's copies on one intra-op thread. They are many small ops (a few per
    layer and run); with the engine's OMP team each op ends at a barrier, and on a busy host (the
    sidecar storing, another engine) one descheduled team thread stalls every op. Measured in the
    engine (bench/vllm.py agent_meta, 3 loads of ~4.8K tokens): 8.3 s per load with one copy per
    fetched item on the 2-thread team, 0.24 s with one copy per contiguous run on one thread.
    Called on the worker's model thread between forwards only, so the forward keeps its threads."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


# bf16 / fp16 hold every integer 0..256 exactly: ids are written in base-256 digits.
_DIGIT = 256


@dataclass(frozen=True)
class BlockLayout:
    """Where K[t, h, d] and V[t, h, d] of a block's token ``t`` live inside the block's flat
    storage (``H * block_size * 2 * D`` elements). ``kind`` is ``"kT_v"`` for the vec layout
    (fast path) or ``"generic"``."""

    num_kv_heads: int
    block_size: int
    head_size: int
    k_off: torch.Tensor  # int64 [B, H, D]
    v_off: torch.Tensor  # int64 [B, H, D]
    kind: str

    @property
    def block_elems(self) -> int:
        return self.num_kv_heads * self.block_size * 2 * self.head_size

    @classmethod
    def vec(cls, num_kv_heads: int, block_size: int, head_size: int) -> "BlockLayout":
        """The layout of the CPU backend's ``vec`` kernel: per head, K as [D, B] then V as [B, D]."""
        H, B, D = num_kv_heads, block_size, head_size
        t = torch.arange(B).view(B, 1, 1)
        h = torch.arange(H).view(1, H, 1)
        d = torch.arange(D).view(1, 1, D)
        base = h * (2 * B * D)
        return cls(H, B, D, (base + d * B + t).expand(B, H, D).contiguous(),
                   (base + B * D + t * D + d).expand(B, H, D).contiguous(), "kT_v")

    @classmethod
    def learn(
        cls,
        write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
        num_kv_heads: int,
        block_size: int,
        head_size: int,
        dtype: torch.dtype,
    ) -> "BlockLayout":
        """Learn the layout from ``write(key, value, key_cache, value_cache, slot_mapping)`` (the
        engine's cache-write kernel) on a one-block scratch cache."""
        H, B, D = num_kv_heads, block_size, head_size
        n_ids = 2 * B * H * D
        ids = torch.arange(n_ids, dtype=torch.int64)
        found = torch.zeros(H * B * 2 * D, dtype=torch.int64)
        written = torch.zeros(H * B * 2 * D, dtype=torch.bool)
        scale = 1
        while scale < n_ids:
            digit = ((ids // scale) % _DIGIT).to(dtype)
            scratch = torch.full((1, H, B, 2 * D), -1.0, dtype=dtype)
            kc, vc = scratch.view(1, H, 2 * B, D).chunk(2, dim=2)
            key = digit[: B * H * D].view(B, H, D).contiguous()
            value = digit[B * H * D :].view(B, H, D).contiguous()
            write(key, value, kc, vc, torch.arange(B, dtype=torch.int64))
            flat = scratch.view(-1).float()
            ok = flat >= 0
            written |= ok
            found += torch.where(ok, flat, torch.zeros_like(flat)).to(torch.int64) * scale
            scale *= _DIGIT
        if int(written.sum()) != n_ids:
            raise RuntimeError(f"cache-write kernel filled {int(written.sum())} of {n_ids} block elements")
        pos = torch.full((n_ids,), -1, dtype=torch.int64)
        pos[found[written]] = torch.nonzero(written).view(-1)
        if bool((pos < 0).any()):
            raise RuntimeError("cache-write kernel layout is not a permutation of the block")
        k_off = pos[: B * H * D].view(B, H, D).contiguous()
        v_off = pos[B * H * D :].view(B, H, D).contiguous()
        vec = cls.vec(H, B, D)
        kind = "kT_v" if torch.equal(k_off, vec.k_off) and torch.equal(v_off, vec.v_off) else "generic"
        return cls(H, B, D, k_off, v_off, kind)


#: the most elements ``PagedKV`` builds whole blocks in at a time (4 MiB of bf16): layers are
#: grouped up to this, so a load's copies are few and large without holding a load's bytes twice
_BUILD_ELEMS = 2 << 20


class PagedKV:
    """The engine's per-layer paged caches in layer order, with copies to and from payloads: a
    ``cache_view.CacheView`` on host memory."""

    def __init__(self, layers: list[torch.Tensor], layout: BlockLayout) -> None:
        self.layers = layers
        self.layout = layout
        self.dtype = layers[0].dtype
        self.device = layers[0].device
        nb = layers[0].shape[0]
        self._flat = [t.view(nb, -1) for t in layers]
        self._build = torch.empty(0, dtype=self.dtype)  # whole blocks built here (scatter), reused
        H, B, D = layout.num_kv_heads, layout.block_size, layout.head_size
        if layout.kind == "kT_v":
            # [nb, H, 2, D*B] -> K [nb, H, D, B], V [nb, H, B, D]
            self._k = [t.view(nb, H, 2, B * D)[:, :, 0].view(nb, H, D, B) for t in layers]
            self._v = [t.view(nb, H, 2, B * D)[:, :, 1].view(nb, H, B, D) for t in layers]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _blocks(self, block_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The engine blocks covering ``positions`` (ascending) and each position's row in
        those blocks laid end to end."""
        B = self.layout.block_size
        uniq, inv = torch.unique_consecutive(positions // B, return_inverse=True)
        return block_ids[uniq], inv * B + positions % B, len(uniq)

    def gather(self, block_ids: torch.Tensor, positions: torch.Tensor, host: bool = True) -> torch.Tensor:
        """KV rows of ``positions`` (int64 [n], ascending) as ``[L, 2, n, H, D]`` (a new tensor).
        ``host`` is moot: the cache is host memory, so the rows are on the CPU either way."""
        L, n = self.num_layers, len(positions)
        H, B, D = self.layout.num_kv_heads, self.layout.block_size, self.layout.head_size
        out = torch.empty((L, 2, n, H, D), dtype=self.dtype)
        if self.layout.kind == "kT_v":
            blks, rows, m = self._blocks(block_ids, positions)
            for li in range(L):
                x = self._flat[li].index_select(0, blks).view(m, H, 2, B * D)  # whole blocks, one copy
                k = x[:, :, 0].view(m, H, D, B).permute(0, 3, 1, 2).reshape(m * B, H, D)
                v = x[:, :, 1].view(m, H, B, D).permute(0, 2, 1, 3).reshape(m * B, H, D)
                torch.index_select(k, 0, rows, out=out[li, 0])
                torch.index_select(v, 0, rows, out=out[li, 1])
            return out
        blk, off = block_ids[positions // B], positions % B
        kidx, vidx = self.layout.k_off[off], self.layout.v_off[off]
        b3 = blk.view(n, 1, 1)
        for li in range(L):
            out[li, 0] = self._flat[li][b3, kidx]
            out[li, 1] = self._flat[li][b3, vidx]
        return out

    def scatter(self, rows: torch.Tensor | HeadParts, block_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Write ``rows`` ``[L, 2, n, H, D]`` (engine dtype; or a ``HeadParts`` whose parts tile one
        head range) at ``positions`` (ascending). A block holds its heads one after another, so
        a head range is one slice of each block."""
        parts = sorted(head_parts(rows), key=lambda p: p[1])
        lo = hi = parts[0][1]
        for part, first in parts:
            if first != hi:
                raise ValueError(f"rows: head parts at {[f for _, f in parts]} do not tile one head range")
            hi += part.shape[3]
        B, D = self.layout.block_size, self.layout.head_size
        cells = slice(lo * 2 * B * D, hi * 2 * B * D)  # of a block, the head range's
        blks, at, m = self._blocks(block_ids, positions)
        if self.layout.kind == "kT_v" and m * B == len(positions):  # whole blocks (block-aligned loads)
            self._write_blocks(parts, lo, hi, blks, m, cells)
            return
        for part, first in parts:
            self._write_tokens(part, first, blks, at, m, block_ids, positions)

    def _write_blocks(self, parts: list[tuple[torch.Tensor, int]], lo: int, hi: int, blks: torch.Tensor, m: int,
                      cells: slice) -> None:
        """``kT_v``, every covered block overwritten: its cells built for a group of layers at a
        time (one transposing copy per part, K and V, each group) and written whole, one
        ``index_copy_`` per layer."""
        B, D, h = self.layout.block_size, self.layout.head_size, hi - lo
        per_layer = m * h * 2 * B * D
        group = max(1, min(self.num_layers, _BUILD_ELEMS // per_layer))
        if self._build.numel() < group * per_layer:
            self._build = torch.empty(group * per_layer, dtype=self.dtype)
        for l0 in range(0, self.num_layers, group):
            g = min(group, self.num_layers - l0)
            x = self._build[:g * per_layer].view(g, m, h, 2, B * D)
            for part, first in parts:
                n, k = part.shape[3], first - lo
                src = part[l0:l0 + g]
                x[:, :, k:k + n, 0].view(g, m, n, D, B).copy_(src[:, 0].reshape(g, m, B, n, D).permute(0, 1, 3, 4, 2))
                x[:, :, k:k + n, 1].view(g, m, n, B, D).copy_(src[:, 1].reshape(g, m, B, n, D).permute(0, 1, 3, 2, 4))
            for i in range(g):
                self._flat[l0 + i][:, cells].index_copy_(0, blks, x[i].view(m, -1))

    def _write_tokens(self, rows: torch.Tensor, first: int, blks: torch.Tensor, at: torch.Tensor, m: int,
                      block_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """``rows`` ``[L, 2, n, h, D]``, heads ``[first, first + h)``, token by token: ``kT_v`` with
        partial blocks (the covered blocks read, the tokens written in, written back), or any
        learned layout by its offsets."""
        n, h = len(positions), rows.shape[3]
        B, D = self.layout.block_size, self.layout.head_size
        if self.layout.kind == "kT_v":
            dest = [t[:, first * 2 * B * D:(first + h) * 2 * B * D] for t in self._flat]
            for li in range(self.num_layers):
                cur = dest[li].index_select(0, blks).view(m, h, 2, B * D)
                k = cur[:, :, 0].view(m, h, D, B).permute(0, 3, 1, 2).reshape(m * B, h, D)
                v = cur[:, :, 1].view(m, h, B, D).permute(0, 2, 1, 3).reshape(m * B, h, D)
                k.index_copy_(0, at, rows[li, 0])
                v.index_copy_(0, at, rows[li, 1])
                x = torch.empty((m, h, 2, B * D), dtype=self.dtype)
                x[:, :, 0].view(m, h, D, B).copy_(k.view(m, B, h, D).permute(0, 2, 3, 1))
                x[:, :, 1].view(m, h, B, D).copy_(v.view(m, B, h, D).permute(0, 2, 1, 3))
                dest[li].index_copy_(0, blks, x.view(m, -1))
            return
        heads = slice(first, first + h)
        blk, off = block_ids[positions // B], positions % B
        kidx, vidx = self.layout.k_off[off][:, heads], self.layout.v_off[off][:, heads]
        b3 = blk.view(n, 1, 1)
        for li in range(self.num_layers):
            self._flat[li][b3, kidx] = rows[li, 0]
            self._flat[li][b3, vidx] = rows[li, 1]
