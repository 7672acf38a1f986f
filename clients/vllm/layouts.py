"""vLLM's standard KV cache layout, read from vLLM (never guessed), and the row copies over it.

Since vLLM 0.32 every attention backend that follows the standard layout hands the connector,
per layer, a *logical* ``[B, H, N, C]`` view of one flat buffer: blocks, KV heads (one slot per
head), tokens in a block, content. The physical order is the group's ``KVCacheLayout`` (a stride
permutation of ``[L, B, H, N, C]``: LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC), so NHD and HND
caches have the same logical shape and differ only in strides; indexing the logical view is
right for all six. The content of one (block, head, token) cell::

    GQA / MHA   [ K (head_size) | V (head_size_v) ]          H = num_kv_heads
    MLA         [ c_kv (kv_lora_rank) | k_pe (rope dim) ]    H = 1, no separate V

The worker's caches (``StandardKV`` for GQA / MHA rows ``[L, 2, n, H, D]``, ``LatentKV`` for MLA
latent rows ``[L, n, C]``; both ``cache_view.CacheView``s) move rows at a request's token
positions, with the same torch ops on CPU and CUDA tensors and no per-token Python:

* ``scatter`` (loads): one indexed write per layer and part, every token addressed by its
  (block, offset) pair (GQA rows held as head ranges, ``rows.HeadParts``: per range);
* ``gather`` (stores): per run of consecutive positions, the whole blocks by one
  ``index_select`` over the block axis per layer, the partial ends (at most ``2 * (block_size -
  1)`` tokens a run) by (block, offset) pairs.

Each direction is the faster of the two ways compared on CPU tensors: block-wise reads beat
per-token reads in every layout; block-wise writes were slower for GQA in most layouts (their
source must be transposed into the block) and about even for MLA. ``bench/vllm_layouts.py``
times exactly these methods.

``PagedSpec.from_vllm`` reads what the copies need from vLLM's ``KVCacheSpec`` by attribute
(no vLLM import, so the main test suite runs it) and refuses what it cannot serve with one
``UnsupportedLayout`` (a ``refusals.Refused``) naming what and why: quantized caches (fp8 and
friends), packed content (``state_content_bytes`` / ``num_head_slots``), compressed or pooled
states (``tokens_per_state != 1``), dtypes other than bf16 / fp16 / fp32. vLLM's CPU backend
packs K inside a block its own way and is served by ``paged.BlockLayout`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from clients.vllm.refusals import Refused
from clients.vllm.rows import HeadParts, head_parts

__all__ = ["KV_CACHE_LAYOUTS", "SUPPORTED_DTYPES", "LatentKV", "PagedSpec", "Run", "StandardKV", "UnsupportedLayout",
           "kv_cache_views", "runs", "slots"]

SUPPORTED_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})


class UnsupportedLayout(Refused):
    """A KV cache group the connector cannot serve; the message names what and why. vLLM then
    serves the group's requests alone."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PagedSpec:
    """One attention group's cache cell as the copies need it.

    ``head_size`` is K's width (GQA) or the whole latent row (MLA: ``kv_lora_rank +
    rope_dim``, the rope part last); ``head_size_v`` is V's width (0 for MLA)."""

    mla: bool
    num_heads: int
    block_size: int
    head_size: int
    head_size_v: int
    dtype: torch.dtype
    rope_dim: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedLayout(f"kv cache dtype {self.dtype}: only bf16 / fp16 / fp32 caches are served")

    @property
    def content(self) -> int:
        """C: elements per (block, head, token) cell."""
        return self.head_size + self.head_size_v

    @classmethod
    def from_vllm(cls, spec: Any, *, mla: bool, rope_dim: int = 0) -> "PagedSpec":
        """From a vLLM ``AttentionSpec`` / ``MLAAttentionSpec`` (read by attribute).
        ``rope_dim``: MLA's ``qk_rope_head_dim`` (the rotary tail of the latent row)."""
        quant = getattr(spec, "kv_quant_mode", None)
        if quant is not None and getattr(quant, "name", str(quant)).upper() != "NONE":
            raise UnsupportedLayout(f"kv cache quantization {getattr(quant, 'name', quant)}: the sidecar stores "
                                    "unquantized rows (bf16 / fp16 / fp32)")
        dtype = getattr(spec, "dtype", None)
        for name in ("num_head_slots", "state_content_bytes"):
            if getattr(spec, name, None) is not None:
                raise UnsupportedLayout(f"{name} is set: the backend packs its cells, so a cell is not "
                                        "[K | V] (or one latent row)")
        if getattr(spec, "tokens_per_state", 1) != 1:
            raise UnsupportedLayout(f"tokens_per_state {spec.tokens_per_state}: states do not map one to one "
                                    "onto tokens")
        head_size, head_size_v = int(spec.head_size), int(getattr(spec, "head_size_v", spec.head_size))
        num_heads = int(spec.num_kv_heads)
        if mla:
            if num_heads != 1 or head_size_v != 0:
                raise UnsupportedLayout(f"MLA cache with {num_heads} heads and head_size_v {head_size_v}: "
                                        "expected one latent row per token")
            if not 0 < rope_dim < head_size:
                raise UnsupportedLayout(f"MLA rope_dim {rope_dim}: must be inside the latent row of {head_size}")
        return cls(mla=mla, num_heads=num_heads, block_size=int(spec.block_size), head_size=head_size,
                   head_size_v=head_size_v, dtype=dtype, rope_dim=rope_dim)

    def check_view(self, view: torch.Tensor) -> None:
        """Raise ``UnsupportedLayout`` unless ``view`` is this group's logical ``[B, H, N, C]``."""
        want = (self.num_heads, self.block_size, self.content)
        if view.dim() != 4 or tuple(view.shape[1:]) != want or view.dtype != self.dtype:
            raise UnsupportedLayout(f"layer view {tuple(view.shape)} {view.dtype}: expected [B, {want[0]}, "
                                    f"{want[1]}, {want[2]}] {self.dtype} (vLLM's standard [B, H, N, C] view)")


@dataclass(frozen=True, slots=True)
class Run:
    """Where a request's tokens ``[start, start + n)`` sit in its blocks (``block_ids``: its block
    table as an int64 tensor on the cache's device), split the way the copies move them::

        | head: a partial first block | full blocks: whole [H, N, C] cells | tail: partial |

    Whole blocks are read with one ``index_select`` over the block axis; the partial ends (at most
    ``2 * (block_size - 1)`` tokens) by (block, offset) index pairs."""

    n: int
    head: int
    full: torch.Tensor  # block ids of the whole blocks, in token order
    edge_tokens: torch.Tensor  # run-relative token index of each head/tail token
    edge_blocks: torch.Tensor
    edge_offsets: torch.Tensor

    @classmethod
    def of(cls, block_ids: torch.Tensor, start: int, n: int, block_size: int) -> "Run":
        first = start % block_size
        head = min(n, (block_size - first) % block_size)
        nfull = (n - head) // block_size
        b0 = (start + head) // block_size
        full = block_ids[b0:b0 + nfull]
        tail_from = head + nfull * block_size
        rel = torch.cat((torch.arange(head), torch.arange(tail_from, n))).to(block_ids.device)
        blocks, offsets = slots(block_ids, start + rel, block_size)
        return cls(n=n, head=head, full=full, edge_tokens=rel, edge_blocks=blocks, edge_offsets=offsets)


def slots(block_ids: torch.Tensor, positions: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks and in-block offsets of a request's token ``positions`` (int64 ``[n]``), given its
    block table ``block_ids`` (int64, on the same device): two ``[n]`` index tensors."""
    return block_ids[positions // block_size], positions % block_size


def runs(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """``positions`` (int64 ``[n]``, any order) as runs of consecutive positions: ``(row, start,
    length)`` per run, ``row`` its first index in ``positions``. One vectorized pass; the loop
    is over runs (a Store job's chunks), never tokens."""
    p = positions.cpu()
    if not len(p):
        return []
    cuts = (torch.nonzero(p[1:] - p[:-1] != 1).view(-1) + 1).tolist()
    bounds = [0, *cuts, len(p)]
    starts = p[bounds[:-1]].tolist()
    return [(a, s, b - a) for a, b, s in zip(bounds, bounds[1:], starts)]


class _ViewCache:
    """A cache of vLLM's standard ``[B, H, N, C]`` layer views, as the worker moves it (a
    ``cache_view.CacheView``): rows ``scatter``ed at and ``gather``ed from a request's token
    positions (see the module docstring). Subclasses say which cells they serve (``refuses``),
    what a row is (``token_axis``, ``_rows_shape``) and how one layer's cells move."""

    token_axis: int

    def __init__(self, layers: list[torch.Tensor], spec: PagedSpec) -> None:
        why = self.refuses(spec)
        if why:
            raise UnsupportedLayout(why)
        for t in layers:
            spec.check_view(t)
        self.layers = layers
        self.spec = spec
        self.device = layers[0].device
        self.dtype = spec.dtype

    @staticmethod
    def refuses(spec: PagedSpec) -> str:
        """Why this class cannot serve ``spec`` ("" when it can)."""
        raise NotImplementedError

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def scatter(self, rows: torch.Tensor | HeadParts, block_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Write rows (any device) at ``positions`` (int64 ``[n]``) of the request whose block
        table is ``block_ids``: one indexed write per layer and part (K, V), and per head range
        of a ``HeadParts``."""
        blk, off = slots(block_ids.to(self.device), positions.to(self.device), self.spec.block_size)
        for part, first in self._parts(rows):
            part = part.to(self.device, non_blocking=False)
            for li, t in enumerate(self.layers):
                self._write(t, part[li], blk, off, first)

    def gather(self, block_ids: torch.Tensor, positions: torch.Tensor, host: bool = True) -> torch.Tensor:
        """The rows at ``positions`` (int64 ``[n]``), a new tensor on the CPU (``host``) or the
        cache's device: per run of consecutive positions, whole blocks by block index and the
        partial ends by (block, offset) pairs."""
        table = block_ids.to(self.device)
        out = torch.empty(self._rows_shape(len(positions)), dtype=self.dtype, device=self.device)
        for row, start, n in runs(positions):
            run = Run.of(table, start, n, self.spec.block_size)
            part = out.narrow(self.token_axis, row, n)
            for li, t in enumerate(self.layers):
                self._read(t, run, part[li])
        return out.cpu() if host else out

    def _rows_shape(self, n: int) -> tuple[int, ...]:
        raise NotImplementedError

    def _parts(self, rows: torch.Tensor | HeadParts) -> tuple[tuple[torch.Tensor, int], ...]:
        """``rows`` as ``(rows, first head)`` parts (``rows.head_parts``)."""
        return head_parts(rows)

    def _write(self, t: torch.Tensor, rows: torch.Tensor, blk: torch.Tensor, off: torch.Tensor,
               first_head: int) -> None:
        raise NotImplementedError

    def _read(self, t: torch.Tensor, run: Run, out: torch.Tensor) -> None:
        raise NotImplementedError


class StandardKV(_ViewCache):
    """A GQA / MHA cache in vLLM's standard layout, on any device (flash-attn, FlashInfer, Triton
    on GPUs): rows ``[L, 2, n, H, D]`` (K then V per layer, ``rows.GqaRows``), like the CPU
    backend's ``paged.PagedKV``."""

    token_axis = 2

    @staticmethod
    def refuses(spec: PagedSpec) -> str:
        if spec.mla or spec.head_size != spec.head_size_v:
            return "StandardKV serves GQA / MHA caches whose K and V have one width"
        return ""

    def _rows_shape(self, n: int) -> tuple[int, ...]:
        return self.num_layers, 2, n, self.spec.num_heads, self.spec.head_size

    def _write(self, t: torch.Tensor, rows: torch.Tensor, blk: torch.Tensor, off: torch.Tensor,
               first_head: int) -> None:
        """``rows``: this layer's ``[2, n, h, D]``, heads ``[first_head, first_head + h)``."""
        D = self.spec.head_size
        heads = slice(first_head, first_head + rows.shape[2])
        t[..., :D][blk, heads, off] = rows[0]
        t[..., D:][blk, heads, off] = rows[1]

    def _read(self, t: torch.Tensor, run: Run, out: torch.Tensor) -> None:
        """``out``: this layer's ``[2, n, H, D]`` rows of the run."""
        H, B, D = self.spec.num_heads, self.spec.block_size, self.spec.head_size
        nfull = len(run.full)
        if nfull:  # [nfull, H, B, K | V] -> [K / V, nfull, B, H, D]
            cells = t.index_select(0, run.full).view(nfull, H, B, 2, D)
            out[:, run.head:run.head + nfull * B].view(2, nfull, B, H, D).copy_(cells.permute(3, 0, 2, 1, 4))
        if len(run.edge_tokens):
            edge = t[run.edge_blocks, :, run.edge_offsets]  # [e, H, K | V]
            out[:, run.edge_tokens] = edge.reshape(-1, H, 2, D).permute(2, 0, 1, 3)


class LatentKV(_ViewCache):
    """An MLA cache in vLLM's standard layout (per layer the logical ``[B, 1, N, C]`` view, ``C =
    kv_lora_rank + rope_dim``, rope part last), on any device: latent rows ``[L, n, C]``
    (``rows.LatentRows``)."""

    token_axis = 1

    @staticmethod
    def refuses(spec: PagedSpec) -> str:
        return "" if spec.mla else "LatentKV serves MLA caches (one latent row per token)"

    def _rows_shape(self, n: int) -> tuple[int, ...]:
        return self.num_layers, n, self.spec.content

    def _parts(self, rows: torch.Tensor | HeadParts) -> tuple[tuple[torch.Tensor, int], ...]:
        if isinstance(rows, HeadParts):
            raise ValueError("rows: MLA latent rows have no heads to hold in parts")
        return ((rows, 0),)

    def _write(self, t: torch.Tensor, rows: torch.Tensor, blk: torch.Tensor, off: torch.Tensor,
               first_head: int) -> None:
        t[blk, 0, off] = rows

    def _read(self, t: torch.Tensor, run: Run, out: torch.Tensor) -> None:
        """``out``: this layer's ``[n, C]`` latent rows of the run."""
        B, nfull = self.spec.block_size, len(run.full)
        if nfull:
            out[run.head:run.head + nfull * B].view(nfull, B, -1).copy_(t.index_select(0, run.full)[:, 0])
        if len(run.edge_tokens):
            out[run.edge_tokens] = t[run.edge_blocks, 0, run.edge_offsets]


#: vLLM's ``KVCacheLayout`` values (vllm/v1/kv_cache_layout.py): the physical order of the
#: logical axes ``[L, B, H, N, C]`` of a cache group's one flat buffer
KV_CACHE_LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}


def kv_cache_views(spec: PagedSpec, order: tuple[int, ...], device: str, layers: int,
                   blocks: int) -> list[torch.Tensor]:
    """A zeroed cache as vLLM builds one: one flat buffer, per-layer logical ``[B, H, N, C]``
    views whose strides follow ``order`` (a ``KV_CACHE_LAYOUTS`` permutation of ``[L, B, H, N, C]``)."""
    shape = (layers, blocks, spec.num_heads, spec.block_size, spec.content)
    strides = [0] * 5
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    raw = torch.zeros(step, dtype=spec.dtype, device=device)
    return [torch.as_strided(raw, shape[1:], strides[1:], storage_offset=i * strides[0]) for i in range(layers)]

