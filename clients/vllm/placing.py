"""Fetched rows into the paged cache: one load's items moved to the cache's device,
re-positioned where shifted, and scattered.

An item is ``(start, end, rows, delta)``: its rows (``rows.py``: a view of a Fetch's payload or
of the sidecar's shared pool, never written here; GQA rows may be a ``rows.HeadParts``, head
ranges of several such views) belong at token positions ``[start, end)`` of the request whose
block table is ``block_ids``, and ``delta`` is the RoPE shift still to apply (0: exact, or
rotated by the sidecar already).

* **CPU, GQA / MHA rows** (the CPU backend's cache is host memory): an exact item is scattered
  straight from its view (from the shared pool: no intermediate copy; a ``HeadParts`` item
  each part into its head range, ``CacheView.scatter``); a shifted item is copied once into a reused
  scratch buffer as a payload (a ``HeadParts`` item's parts at their head offsets), all of
  the load's shifted items rotated there by one serial call of the fused kernel (no thread
  pool: vLLM's OpenMP team stays as it is, see ``rows.rotate_keys``), and scattered from there.
* **CUDA**: a ``HeadParts`` item is first joined on the host (into the scratch buffer: one
  copy); the items go host-to-device in one step (``Staging.to_device``: straight from the
  shared pool where it is registered as pinned memory, else through the pinned buffer), runs
  of consecutive positions are joined and rotated on the device, and scattered.
* **MLA latent rows** (already a copy: ``rows.LatentRows.of``): per run, joined, rotated in
  place, scattered.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from clients.vllm.rows import GqaRows, HeadParts, head_parts

if TYPE_CHECKING:
    from clients.vllm.cache_view import CacheView
    from clients.vllm.staging import Staging
    from sidecar.identity import KVLayout
    from sidecar.rotation import RopeSpec

Item = tuple[int, int, "torch.Tensor | HeadParts", int]


class Scratch:
    """One host buffer reused by every load (grown to the largest; its pages are faulted once,
    not per load)."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)

    def take(self, nbytes: int) -> torch.Tensor:
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._buf[:nbytes]

    @property
    def size(self) -> int:
        """The bytes held: the largest ``take`` so far (0: never taken)."""
        return self._buf.numel()


def runs_of(items: list[Item]) -> list[tuple[int, int, list[torch.Tensor], list[tuple[int, int]]]]:
    """Items grouped into runs of consecutive positions: ``(start, end, rows, [(tokens,
    delta)])`` per run, in order."""
    runs: list[tuple[int, int, list[torch.Tensor], list[tuple[int, int]]]] = []
    for start, end, rows, delta in items:
        d = (end - start, delta)
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end, runs[-1][2] + [rows], runs[-1][3] + [d])
        else:
            runs.append((start, end, [rows], [d]))
    return runs


def place(cache: "CacheView", rows_kind: Any, items: list[Item], block_ids: torch.Tensor, *, staging: "Staging",
          rope: "RopeSpec | None", layout: "KVLayout", scratch: Scratch, registered: bool = False) -> int:
    """Write ``items`` into ``cache`` (``PagedKV`` / ``StandardKV`` / ``LatentKV``); how many
    tokens were rotated here. ``registered``: the rows are views of memory CUDA knows as pinned
    (the shared pool once ``MappedPool.pin`` held)."""
    if not items:
        return 0
    if staging.cuda:
        return _place_on_device(cache, rows_kind, _joined(items, layout, scratch), block_ids, staging, rope,
                                registered)
    if rows_kind is GqaRows:
        return _place_on_host(cache, items, block_ids, rope, layout, scratch)
    return _place_runs(cache, rows_kind, runs_of(items), block_ids, rope)


def _positions(start: int, end: int) -> torch.Tensor:
    return torch.arange(start, end, dtype=torch.int64)


def _place_on_host(cache: "CacheView", items: list[Item], block_ids: torch.Tensor, rope: "RopeSpec | None",
                   layout: "KVLayout", scratch: Scratch) -> int:
    from sidecar.rotation.batch import rotate_payloads_  # noqa: PLC0415 - numba loads only when rotating

    shifted = [(s, e, r, d) for s, e, r, d in items if d]
    for start, end, rows, delta in items:
        if not delta:
            cache.scatter(rows, block_ids, _positions(start, end))
    if not shifted:
        return 0
    per_token = layout.bytes_per_token
    buf = scratch.take(sum(e - s for s, e, _, _ in shifted) * per_token)
    copies, at = [], 0
    for start, end, rows, delta in shifted:
        n = end - start
        payload = buf[at:at + n * per_token]
        dest = GqaRows.of(payload, layout, n)
        for part, first in head_parts(rows):
            dest[:, :, :, first:first + part.shape[3]].copy_(part)
        copies.append((payload, n, int(delta)))
        at += n * per_token
    rotate_payloads_(copies, layout, rope, parallel=False)
    for (start, end, _, _), (payload, n, _) in zip(shifted, copies):
        cache.scatter(GqaRows.of(payload, layout, n), block_ids, _positions(start, end))
    return sum(n for _, n, _ in copies)


def _joined(items: list[Item], layout: "KVLayout", scratch: Scratch) -> list[Item]:
    """``items`` with every ``HeadParts`` joined into ``scratch`` (the CUDA path sends one
    tensor an item); the others as they are."""
    split = [(s, e) for s, e, r, _ in items if isinstance(r, HeadParts)]
    if not split:
        return items
    per_token = layout.bytes_per_token
    buf = scratch.take(sum(e - s for s, e in split) * per_token)
    out, at = [], 0
    for start, end, rows, delta in items:
        if isinstance(rows, HeadParts):
            n = end - start
            rows = rows.join(GqaRows.of(buf[at:at + n * per_token], layout, n))
            at += n * per_token
        out.append((start, end, rows, delta))
    return out


def _place_on_device(cache: "CacheView", rows_kind: Any, items: list[Item], block_ids: torch.Tensor, staging: "Staging",
                     rope: "RopeSpec | None", registered: bool) -> int:
    moved = staging.to_device([rows for _, _, rows, _ in items], registered=registered)
    return _place_runs(cache, rows_kind, runs_of([(s, e, m, d) for (s, e, _, d), m in zip(items, moved)]),
                       block_ids, rope, context=staging.context())


def _place_runs(cache: "CacheView", rows_kind: Any, runs: list, block_ids: torch.Tensor, rope: "RopeSpec | None",
                context: Any = None) -> int:
    """Per run: its rows joined (one copy where there are several), rotated in place, scattered.
    The rows must be the caller's own (a device copy, or latent rows built by ``LatentRows.of``)."""
    axis = rows_kind.token_axis
    rotated = 0
    with context if context is not None else nullcontext():
        for start, end, parts, deltas in runs:
            rows = torch.cat(parts, dim=axis) if len(parts) > 1 else parts[0]
            if any(d for _, d in deltas):
                per_token = torch.cat([torch.full((n,), d, dtype=torch.int64) for n, d in deltas]).to(rows.device)
                rows = rows_kind.rotate(rows, per_token, rope)
                rotated += sum(n for n, d in deltas if d)
            cache.scatter(rows, block_ids, _positions(start, end))
    return rotated
