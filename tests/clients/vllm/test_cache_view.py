"""Every cache the worker moves rows through is a ``CacheView`` (``clients.vllm.cache_view``): the
CPU backend's ``PagedKV`` and the standard-layout ``StandardKV`` / ``LatentKV``, by their members
and by the exact signatures of ``scatter`` / ``gather``, so ``placing.place`` and the worker call
all three the same way."""

from __future__ import annotations

import inspect

import pytest
import torch

from clients.vllm.cache_view import CacheView
from clients.vllm.layouts import LatentKV, PagedSpec, StandardKV
from clients.vllm.paged import BlockLayout, PagedKV

L, NB, H, B, D, C = 3, 6, 2, 4, 8, 12


def make(kind: str) -> CacheView:
    if kind == "paged":
        return PagedKV([torch.zeros((NB, H, B, 2 * D), dtype=torch.bfloat16) for _ in range(L)],
                       BlockLayout.vec(H, B, D))
    if kind == "standard":
        spec = PagedSpec(mla=False, num_heads=H, block_size=B, head_size=D, head_size_v=D, dtype=torch.bfloat16)
        return StandardKV([torch.zeros((NB, H, B, 2 * D), dtype=torch.bfloat16) for _ in range(L)], spec)
    spec = PagedSpec(mla=True, num_heads=1, block_size=B, head_size=C, head_size_v=0, dtype=torch.bfloat16, rope_dim=4)
    return LatentKV([torch.zeros((NB, 1, B, C), dtype=torch.bfloat16) for _ in range(L)], spec)


KINDS = ("paged", "standard", "latent")


@pytest.mark.parametrize("kind", KINDS)
def test_each_cache_is_a_cache_view_with_its_signatures(kind):
    cache = make(kind)
    assert isinstance(cache, CacheView)
    for name in ("scatter", "gather"):
        ours, theirs = inspect.signature(getattr(CacheView, name)), inspect.signature(getattr(type(cache), name))
        assert theirs == ours, f"{type(cache).__name__}.{name}{theirs} is not CacheView.{name}{ours}"
    assert cache.num_layers == len(cache.layers) == L
    assert cache.dtype == torch.bfloat16 and cache.device == torch.device("cpu")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("host", [True, False])
def test_rows_scattered_are_gathered_back_on_the_host(kind, host):
    """The same call on each view: rows written at positions spanning partial and whole blocks
    come back equal, a new CPU tensor whether ``host`` or not (a CPU cache's device is the host)."""
    cache = make(kind)
    table = torch.tensor([5, 2, 0, 4], dtype=torch.int64)
    positions = torch.arange(3, 13, dtype=torch.int64)
    shape = (L, len(positions), C) if kind == "latent" else (L, 2, len(positions), H, D)
    rows = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).remainder(251).view(shape).to(torch.bfloat16)
    cache.scatter(rows, table, positions)
    got = cache.gather(table, positions, host=host)
    assert got.device.type == "cpu" and torch.equal(got, rows)
    assert got.data_ptr() not in {t.data_ptr() for t in cache.layers}
