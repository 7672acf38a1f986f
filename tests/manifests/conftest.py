"""Fixtures of the manifest tests: a real Redis (tests.redis_server) and sidecar configs."""

from __future__ import annotations

import os

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import uuid  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from tests.redis_server import redis_server  # noqa: E402


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def namespace() -> str:
    return f"m{uuid.uuid4().hex[:12]}"
