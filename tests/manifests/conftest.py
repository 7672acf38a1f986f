"""Fixtures of the manifest tests: a real Redis (tests.redis_server) and sidecar configs."""

from __future__ import annotations

import os

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import uuid  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def namespace() -> str:
    return f"m{uuid.uuid4().hex[:12]}"
