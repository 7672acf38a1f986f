"""Fixtures of the routing tests: a fleet of real sidecar processes sharing one real Redis."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import numpy as np
import pytest
import torch

from sidecar.client import SyncSidecarClient
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.process import spawn_sidecar, stop_process
from tests.conftest import ANCHORS, message

MiB = 1 << 20
LAYOUT = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32")
IDENT = CacheIdentity(model_id="tiny", kv_layout=LAYOUT.fingerprint())
#: liveness bound of waits for asynchronous publication (not a timing assertion)
DEADLINE_S = 20.0


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def flags(prefix: str, redis_url: str, replica: str, **extra) -> list[str]:
    sets = {
        "chunker.anchor_tokens": "[" + ",".join(map(str, ANCHORS)) + "]",
        "shared_registry.redis_url": redis_url,
        "shared_registry.key_prefix": prefix,
        "shared_registry.publish_interval_s": 0.02,
        "store.namespace": prefix,
        "store.cpu_bytes": 64 * MiB,
        "routing.replica_id": replica,
        "routing.heartbeat_ttl_s": 1.0,
        "auth.shared_writers": "[ops]",
        **extra,
    }
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


class FleetProcs:
    """Sidecar processes by replica id (``start``, ``kill``), stopped at the end."""

    def __init__(self, prefix: str, redis_url: str) -> None:
        self.prefix = prefix
        self.redis_url = redis_url
        self.targets: dict[str, str] = {}
        self._procs: dict = {}

    def start(self, replica: str, *argv: str, **extra) -> str:
        """Start ``replica`` with ``extra`` settings (``--set``) and ``argv`` (more CLI flags)."""
        return self.start_each({replica: extra}, {replica: argv})[replica]

    def start_all(self, replicas, *argv: str, **extra) -> dict[str, str]:
        """``start`` each of ``replicas`` with the same arguments, concurrently."""
        return self.start_each({r: extra for r in replicas}, {r: argv for r in replicas})

    def start_each(self, settings: dict[str, dict], argv: dict[str, tuple] | None = None) -> dict[str, str]:
        """Start each replica with its own settings (and CLI flags), concurrently: a sidecar
        process takes seconds to import and warm up. Returns the targets by replica."""
        argv = argv or {}
        with ThreadPoolExecutor(len(settings)) as ex:
            futs = {r: ex.submit(spawn_sidecar, *flags(self.prefix, self.redis_url, r, **kv), *argv.get(r, ()))
                    for r, kv in settings.items()}
            errors = []
            for r, fut in futs.items():
                try:
                    proc, target = fut.result()
                except Exception as exc:  # noqa: BLE001 - raised below, once every start ended
                    errors.append(exc)
                    continue
                self._procs[r] = proc
                self.targets[r] = target
        if errors:
            raise errors[0]
        return {r: self.targets[r] for r in settings}

    def stop(self, replica: str) -> None:
        """A clean stop (SIGTERM: the sidecar deletes its heartbeat)."""
        stop_process(self._procs.pop(replica))

    def kill(self, replica: str) -> None:
        proc = self._procs.pop(replica)
        proc.kill()
        proc.wait(10)

    def close(self) -> None:
        for proc in self._procs.values():
            stop_process(proc)


@pytest.fixture
def fleet(prefix: str, redis_url: str) -> Iterator[FleetProcs]:
    f = FleetProcs(prefix, redis_url)
    try:
        yield f
    finally:
        f.close()


@pytest.fixture
def clients() -> Iterator[Callable[..., SyncSidecarClient]]:
    with ExitStack() as stack:
        def open_client(target: str, tenant: str = "alice") -> SyncSidecarClient:
            return stack.enter_context(SyncSidecarClient(target, tenant=tenant))

        yield open_client


def conversation(rng: np.random.Generator, sizes=(400, 300, 350)) -> list[np.ndarray]:
    """Chat messages (an anchor each), to be concatenated in any order."""
    return [message(rng, n, ANCHORS[1 + i % 3]) for i, n in enumerate(sizes)]


def store_kv(client: SyncSidecarClient, tokens: np.ndarray, seed: int = 0, shared: bool = False) -> int:
    """Register ``tokens`` and Store a random payload for every chunk; returns the chunks stored."""
    meta = client.store(tokens, identity=IDENT, shared=shared)
    g = torch.Generator().manual_seed(seed)
    b = meta.chunk_bounds
    per_tok = LAYOUT.bytes_per_token // 4
    pl = {a: torch.randn((e - a) * per_tok, generator=g) for a, e in zip(b[:-1], b[1:])}
    res = client.store(tokens, identity=IDENT, layout=LAYOUT, payloads=pl, shared=shared)
    assert res.chunks_stored == len(pl)
    return len(pl)


def wait_until(cond: Callable[[], object], what: str, deadline_s: float = DEADLINE_S):
    """Poll ``cond`` until it returns a truthy value (returned), within a liveness bound."""
    end = time.monotonic() + deadline_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")
        time.sleep(0.02)


def command_calls(r) -> dict[str, int]:
    """Redis ``INFO commandstats``: calls per command (``cmdstat_`` stripped)."""
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in r.info("commandstats").items()}


def calls_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Commands called between two ``command_calls`` readings (the INFO calls left out)."""
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0) and k != "info"}


def keyspace_reads(r) -> tuple[int, int]:
    """``INFO stats`` ``keyspace_hits``, ``keyspace_misses``."""
    st = r.info("stats")
    return int(st["keyspace_hits"]), int(st["keyspace_misses"])
