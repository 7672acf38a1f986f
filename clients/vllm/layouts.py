"""vLLM's standard KV cache layout, read from vLLM (never guessed), and the row copies over it.

Since vLLM 0.32 every attention backend that follows the standard layout hands the connector,
per layer, a *logical* ``[B, H, N, C]`` view of one flat buffer: blocks, KV heads (one slot per
head), tokens in a block, content. The physical order is the group's ``KVCacheLayout`` (a stride
permutation of ``[L, B, H, N, C]``: LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC), so NHD and HND
caches have the same logical shape and differ only in strides; indexing the logical view is
right for all six. The content of one (block, head, token) cell::

    GQA / MHA   [ K (head_size) | V (head_size_v) ]          H = num_kv_heads
    MLA         [ c_kv (kv_lora_rank) | k_pe (rope dim) ]    H = 1, no separate V

Sidecar payloads are ``KVLayout`` order (per layer, each part contiguous over the tokens:
``k [n, H, D]``, ``v [n, H, D]``; MLA ``c_kv [n, r]``, ``k_pe [n, d]``), so a part is one
content slice of the view. ``load_`` and ``gather`` move a ``Run`` of ``n`` tokens with at most
two copies per layer and part (whole blocks by block index, the partial ends by (block,
offset) pairs): no per-token Python, and the same torch ops on CPU and CUDA tensors.

``PagedSpec.from_vllm`` reads what the copies need from vLLM's ``KVCacheSpec`` by attribute
(no vLLM import, so the main test suite runs it) and refuses what it cannot serve with one
``UnsupportedLayout`` naming what and why: quantized caches (fp8 and friends), packed content
(``state_content_bytes`` / ``num_head_slots``), compressed or pooled states
(``tokens_per_state != 1``), dtypes other than bf16 / fp16 / fp32. vLLM's CPU backend packs K
inside a block its own way and is served by ``paged.BlockLayout`` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sidecar.api.payload import decode_payload
from sidecar.identity import KVLayout

__all__ = ["SUPPORTED_DTYPES", "LatentKV", "PagedSpec", "Run", "StandardKV", "UnsupportedLayout", "gather", "load_",
           "save", "slots"]

SUPPORTED_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})
_PAYLOAD_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class UnsupportedLayout(ValueError):
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

    def payload_layout(self, num_layers: int) -> KVLayout:
        """The sidecar payload layout of this group's rows."""
        dtype = _PAYLOAD_DTYPES[self.dtype]
        if self.mla:
            return KVLayout.mla(num_layers=num_layers, kv_lora_rank=self.head_size - self.rope_dim,
                                qk_rope_head_dim=self.rope_dim, dtype=dtype)
        if self.head_size != self.head_size_v:
            raise UnsupportedLayout(f"head_size {self.head_size} != head_size_v {self.head_size_v}: "
                                    "the sidecar payload holds K and V of one shape")
        return KVLayout.gqa(num_layers=num_layers, num_kv_heads=self.num_heads, head_dim=self.head_size, dtype=dtype)

    def check_view(self, view: torch.Tensor) -> None:
        """Raise ``UnsupportedLayout`` unless ``view`` is this group's logical ``[B, H, N, C]``."""
        want = (self.num_heads, self.block_size, self.content)
        if view.dim() != 4 or tuple(view.shape[1:]) != want or view.dtype != self.dtype:
            raise UnsupportedLayout(f"layer view {tuple(view.shape)} {view.dtype}: expected [B, {want[0]}, "
                                    f"{want[1]}, {want[2]}] {self.dtype} (vLLM's standard [B, H, N, C] view)")

    def slices(self) -> tuple[tuple[int, int], ...]:
        """Each payload part's content slice, in payload part order."""
        if self.mla:
            return (0, self.head_size - self.rope_dim), (self.head_size - self.rope_dim, self.head_size)
        return (0, self.head_size), (self.head_size, self.content)


@dataclass(frozen=True, slots=True)
class Run:
    """Where a request's tokens ``[start, start + n)`` sit in its blocks (``block_ids``: its block
    table as an int64 tensor on the cache's device), split the way the copies move them::

        | head: a partial first block | full blocks: whole [H, N, C] cells | tail: partial |

    Whole blocks move with one ``index_copy_`` / ``index_select`` over the block axis; the partial
    ends (at most ``2 * (block_size - 1)`` tokens) by (block, offset) index pairs."""

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


def _cells(view: torch.Tensor, spec: PagedSpec, lo: int, hi: int) -> torch.Tensor:
    """The content slice ``[lo, hi)`` of every cell (still a view); MLA's single head dropped."""
    part = view[..., lo:hi]
    return part[:, 0] if spec.mla else part


def load_(views: Sequence[torch.Tensor], spec: PagedSpec, payload: object, run: Run) -> None:
    """Write a payload of ``run.n`` tokens (``spec.payload_layout(len(views))`` order, any
    bytes-like or tensor on the views' device) into the run's cells of every layer: per layer and
    part one ``index_copy_`` for the whole blocks and one indexed copy for the partial ends."""
    pv = decode_payload(payload, spec.payload_layout(len(views)), run.n)
    slices = spec.slices()
    bs = spec.block_size
    nfull = len(run.full)
    for view, layer in zip(views, _layers(pv, len(views), len(slices))):
        for (lo, hi), src in zip(slices, layer):
            cells = _cells(view, spec, lo, hi)  # [B, H, N, w] (MLA: [B, N, w])
            if nfull:
                mid = src[run.head:run.head + nfull * bs]
                if spec.mla:
                    cells.index_copy_(0, run.full, mid.view(nfull, bs, -1))
                else:
                    cells.index_copy_(0, run.full, mid.view(nfull, bs, *mid.shape[1:]).transpose(1, 2))
            if len(run.edge_tokens):
                edge = src[run.edge_tokens]
                if spec.mla:
                    cells[run.edge_blocks, run.edge_offsets] = edge
                else:
                    cells[run.edge_blocks, :, run.edge_offsets] = edge


def gather(views: Sequence[torch.Tensor], spec: PagedSpec, run: Run, out: object) -> None:
    """Read the run's cells of every layer into ``out``, a payload buffer of ``run.n`` tokens in
    ``spec.payload_layout(len(views))`` order (the inverse of ``load_``)."""
    pv = decode_payload(out, spec.payload_layout(len(views)), run.n)
    slices = spec.slices()
    bs = spec.block_size
    nfull = len(run.full)
    for view, layer in zip(views, _layers(pv, len(views), len(slices))):
        for (lo, hi), dst in zip(slices, layer):
            cells = _cells(view, spec, lo, hi)
            if nfull:
                mid = dst[run.head:run.head + nfull * bs]
                got = cells.index_select(0, run.full)  # [nfull, H, N, w] (MLA: [nfull, N, w])
                if spec.mla:
                    mid.view(nfull, bs, -1).copy_(got)
                else:
                    mid.view(nfull, bs, *mid.shape[1:]).copy_(got.transpose(1, 2))
            if len(run.edge_tokens):
                dst[run.edge_tokens] = (cells[run.edge_blocks, run.edge_offsets] if spec.mla
                                        else cells[run.edge_blocks, :, run.edge_offsets])
    pv.write_back()


def save(views: Sequence[torch.Tensor], spec: PagedSpec, run: Run) -> torch.Tensor:
    """``gather`` into a new uint8 payload tensor on the views' device."""
    layout = spec.payload_layout(len(views))
    out = torch.empty(layout.bytes_per_token * run.n, dtype=torch.uint8, device=views[0].device)
    gather(views, spec, run, out)
    return out


def _layers(pv: Any, num_layers: int, num_parts: int) -> list[list[torch.Tensor]]:
    parts = [p.tensor for p in pv.parts]
    if len(parts) != num_layers * num_parts:
        raise ValueError(f"payload has {len(parts)} parts; {num_layers} layers x {num_parts} parts expected")
    return [parts[i * num_parts:(i + 1) * num_parts] for i in range(num_layers)]


class _ViewCache:
    """A cache of vLLM's standard ``[B, H, N, C]`` layer views, addressed by (block, offset)
    index tensors on its device (one indexed copy per layer and part, no per-token Python).
    Subclasses say which cells they serve (``accepts``) and what a row is."""

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

    def _slots(self, block_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return slots(block_ids.to(self.device), positions.to(self.device), self.spec.block_size)


class StandardKV(_ViewCache):
    """The connector's view of a GQA / MHA cache in vLLM's standard layout, on any device: the
    interface of ``paged.PagedKV`` (``gather`` / ``scatter`` of ``[L, 2, n, H, D]`` rows at a
    request's token positions), for the backends whose per-layer tensor is the logical
    ``[B, H, N, K | V]`` view (flash-attn, FlashInfer, Triton on GPUs)."""

    @staticmethod
    def refuses(spec: PagedSpec) -> str:
        if spec.mla or spec.head_size != spec.head_size_v:
            return "StandardKV serves GQA / MHA caches whose K and V have one width"
        return ""

    def gather(self, block_ids: torch.Tensor, positions: torch.Tensor, host: bool = True) -> torch.Tensor:
        """KV rows of ``positions`` (int64 [n]) as ``[L, 2, n, H, D]``, a new tensor on the CPU
        (``host``) or the cache's device."""
        blk, off = self._slots(block_ids, positions)
        D = self.spec.head_size
        rows = torch.stack([torch.stack((t[blk, :, off, :D], t[blk, :, off, D:])) for t in self.layers])
        return rows.cpu() if host else rows

    def scatter(self, rows: torch.Tensor, block_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Write ``[L, 2, n, H, D]`` rows (any device) at ``positions`` (int64 [n])."""
        blk, off = self._slots(block_ids, positions)
        rows = rows.to(self.device, non_blocking=False)
        D = self.spec.head_size
        for li, t in enumerate(self.layers):
            t[..., :D][blk, :, off] = rows[li, 0]
            t[..., D:][blk, :, off] = rows[li, 1]


class LatentKV(_ViewCache):
    """An MLA cache in vLLM's standard layout (per layer the logical ``[B, 1, N, C]`` view, ``C =
    kv_lora_rank + rope_dim``, rope part last), as the worker moves it: ``gather`` / ``scatter`` of
    latent rows ``[L, n, C]`` at a request's token positions (``rows.LatentRows``), on any device."""

    @staticmethod
    def refuses(spec: PagedSpec) -> str:
        return "" if spec.mla else "LatentKV serves MLA caches (one latent row per token)"

    def gather(self, block_ids: torch.Tensor, positions: torch.Tensor, host: bool = True) -> torch.Tensor:
        """Latent rows of ``positions`` (int64 [n]) as ``[L, n, C]``, a new tensor on the CPU
        (``host``) or the cache's device."""
        blk, off = self._slots(block_ids, positions)
        rows = torch.stack([t[blk, 0, off] for t in self.layers])
        return rows.cpu() if host else rows

    def scatter(self, rows: torch.Tensor, block_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Write ``[L, n, C]`` latent rows (any device) at ``positions`` (int64 [n])."""
        blk, off = self._slots(block_ids, positions)
        rows = rows.to(self.device, non_blocking=False)
        for li, t in enumerate(self.layers):
            t[blk, 0, off] = rows[li]
