"""The rows the worker moves between sidecar payloads and vLLM's cache, per attention kind.

A cache object (``paged.PagedKV``, ``layouts.StandardKV``, ``layouts.LatentKV``) ``scatter``s and
``gather``s rows at a request's token positions; a ``Rows`` format says what those rows are and
how a payload becomes rows and back::

    GqaRows     [L, 2, n, H, D]   K then V per layer; a payload view, no copy
    LatentRows  [L, n, C]         MLA: one latent row per token, [c_kv | k_pe], rope part last

GQA rows may also come as ``HeadParts``: head ranges of several buffers (a re-sharded load's
source ranks in the shared pool), each placed into its own heads of the cache, never joined on
the CPU path.

``rotate`` re-positions the rows' keys by a per-token delta (``sidecar.rotation.rotate_keys``,
the same kernels as the sidecar's: fused CPU, Triton on CUDA); values and MLA latents stay
bit-identical. No per-token Python: one call per run of rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sidecar.identity import KVLayout
from sidecar.sdk.kit import TORCH_DTYPES, as_byte_tensor, payload_nbytes, stacked_payload, stacked_view

if TYPE_CHECKING:
    from sidecar.rotation import RopeSpec


def rotate_keys(k: torch.Tensor, delta: torch.Tensor, rope: "RopeSpec") -> torch.Tensor:
    # imported when first used: sidecar.rotation loads numba, which must not happen in vLLM's
    # processes before its workers start (docs/vllm.md)
    from sidecar.rotation import rotate_keys as rotate
    from sidecar.rotation import rotate_keys_native

    if k.device.type == "cpu":
        # torch ops, bit-equal to the fused kernel: numba's parallel kernels would reset the
        # OpenMP team vLLM's CPU attention checks its thread count against (docs/vllm.md)
        return rotate_keys_native(k, delta, rope)
    return rotate(k, delta, rope)


class GqaRows:
    """``[L, 2, n, H, D]``: ``KVLayout.gqa`` payloads viewed in place."""

    token_axis = 2

    @staticmethod
    def of(data: object, layout: KVLayout, num_tokens: int) -> torch.Tensor:
        return stacked_view(data, layout, num_tokens)

    @staticmethod
    def payload(rows: torch.Tensor, layout: KVLayout) -> memoryview:
        return stacked_payload(rows)

    @staticmethod
    def rotate(rows: torch.Tensor, delta: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
        """Keys ``rows[:, 0]`` (``[L, n, H, D]``) by ``delta`` (int64 ``[n]``), in place."""
        rows[:, 0] = rotate_keys(rows[:, 0], delta.view(1, -1, 1), rope)
        return rows


@dataclass(frozen=True, slots=True)
class HeadParts:
    """One item's GQA rows ``[L, 2, n, H, D]`` held as head ranges of other buffers: ``parts``
    are ``(rows [L, 2, n, h, D], first head)``, together covering heads ``[0, H)`` once. A
    cache writes each straight into its heads (``CacheView.scatter``'s ``first_head``)."""

    parts: tuple[tuple[torch.Tensor, int], ...]

    @property
    def num_heads(self) -> int:
        return max(first + rows.shape[3] for rows, first in self.parts)

    def join(self, out: torch.Tensor) -> torch.Tensor:
        """The parts copied into ``out`` (``[L, 2, n, H, D]``) at their head offsets; ``out``."""
        for rows, first in self.parts:
            out[:, :, :, first:first + rows.shape[3]].copy_(rows)
        return out


def head_parts(rows: "torch.Tensor | HeadParts") -> tuple[tuple[torch.Tensor, int], ...]:
    """``rows`` as ``(rows, first head)`` parts: a ``HeadParts``' own, else one part of every head."""
    return rows.parts if isinstance(rows, HeadParts) else ((rows, 0),)


class LatentRows:
    """``[L, n, C]``: ``KVLayout.mla`` payloads (per layer ``c_kv [n, r]`` then ``k_pe [n, d]``)
    joined into latent rows, the cell content of vLLM's MLA cache (one copy each way)."""

    token_axis = 1

    @staticmethod
    def of(data: object, layout: KVLayout, num_tokens: int) -> torch.Tensor:
        c_kv, k_pe = layout.parts
        flat = stacked_flat(data, layout, num_tokens)  # [L, n * (r + d)]
        r = c_kv.shape[0] * num_tokens
        return torch.cat((flat[:, :r].view(layout.num_layers, num_tokens, -1),
                          flat[:, r:].view(layout.num_layers, num_tokens, -1)), dim=-1)

    @staticmethod
    def payload(rows: torch.Tensor, layout: KVLayout) -> memoryview:
        """``rows`` (``[L, n, C]``, CPU) as a ``KVLayout.mla`` payload."""
        layers, rank = rows.shape[0], layout.parts[0].shape[0]
        flat = torch.cat((rows[..., :rank].reshape(layers, -1), rows[..., rank:].reshape(layers, -1)), dim=1)
        return memoryview(flat.contiguous().view(torch.uint8).numpy()).cast("B")

    @staticmethod
    def rotate(rows: torch.Tensor, delta: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
        """The rope tail ``rows[..., -key_dim:]`` (``k_pe``) by ``delta`` (int64 ``[n]``), in place."""
        d = rope.key_dim
        rows[..., -d:] = rotate_keys(rows[..., -d:], delta.view(1, -1), rope)
        return rows


def stacked_flat(data: object, layout: KVLayout, num_tokens: int) -> torch.Tensor:
    """A payload of one dtype as ``[L, per-layer elements]`` without a copy."""
    buf = as_byte_tensor(data)
    if buf.numel() != payload_nbytes(layout, num_tokens):
        raise ValueError(f"payload is {buf.numel()} bytes; the layout x {num_tokens} tokens needs "
                         f"{payload_nbytes(layout, num_tokens)}")
    return buf.view(TORCH_DTYPES[layout.parts[0].dtype]).view(layout.num_layers, -1)


def fetched_rows(f: Any, item: Any, rows_kind: Any, layout: KVLayout, raw: bool) -> tuple[torch.Tensor, int] | None:
    """The rows of a Fetch answer ``f`` (``FetchedKV``, None when the call failed) that load
    ``item`` (a ``LoadItem``: rows ``[row, row + len(item))``), and the delta still to apply
    here; None when the answer cannot serve it (a miss, too short, or shifted and not rotated
    while the caller does not rotate: ``raw``)."""
    n = len(item)
    if f is None or not f.ok or f.num_tokens < item.row + n or not (f.rotated or f.delta == 0 or raw):
        return None
    return rows_kind.of(f.data, layout, f.num_tokens).narrow(rows_kind.token_axis, item.row, n), 0 if f.rotated else f.delta


def leased_rows(pool: Any, leased: Any, item: Any, rows_kind: Any, layout: KVLayout) -> tuple[torch.Tensor, int] | None:
    """``fetched_rows`` of a lease's item ``leased`` (``LeasedItem``, None when the call failed):
    a view of the shared pool (``pool``'s mapping, no copy) at the chunk's source position, and
    its delta; None for a miss or too short an answer."""
    n = len(item)
    if leased is None or not leased.ok or leased.num_tokens < item.row + n:
        return None
    c = leased.chunks[0]  # a plain item is one chunk
    return rows_kind.of(pool.chunk_view(c), layout, c.num_tokens).narrow(rows_kind.token_axis, item.row, n), c.delta

