"""Several worker processes on one port (``workers``; sidecar/workers).

A real ``kv-sidecar serve --set workers=2`` with the shared registry and the remote tier on a
real redis-server: both workers take connections, every client finds and Fetches (exact bytes)
what any other client stored, whichever worker holds it; a killed worker is restarted; SIGTERM
stops them all. The configuration refuses what cannot work.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import deque

import pytest

from sidecar.client import SidecarClient
from sidecar.config import load_config
from sidecar.process import OWN_CONNECTION, child_pids, spawn_sidecar, stop_process
from tests.faults.helpers import IDENT, LAYOUT, payloads, prompt, store_prompt
from tests.redis_server import free_port

CHANNELS = 16  # all on one worker: p = 2 / 2**16


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"workers": 0}, "workers must be >= 1"),
        ({"workers": 2}, "shared_registry.redis_url"),
        ({"workers": 2, "shared_registry.redis_url": "redis://127.0.0.1:1"}, "store.remote_url"),
        ({"workers": 2, "shared_registry.redis_url": "redis://127.0.0.1:1", "store.remote_url": "redis://127.0.0.1:1",
          "store.remote_bytes": 1 << 20, "shared_registry.publish_payloads": False}, "publish_payloads"),
        ({"workers": 2, "worker_index": 2}, "worker_index"),
    ],
)
def test_config_refuses(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        load_config(None, overrides=overrides, env={})


def test_cli_refuses_workers_without_shared_registry() -> None:
    out = subprocess.run([sys.executable, "-m", "sidecar.cli", "serve", "--set", "workers=2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "shared_registry.redis_url" in out.stderr


def _children(pid: int) -> set[int]:
    return set(child_pids(pid))


def _stores_ok(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith('kv_sidecar_requests_total{') and 'method="Store"' in line and 'code="OK"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _everyone_reads_everything(targets: list[str]) -> None:
    """Each channel stores its own prompt; then every channel finds and Fetches every prompt."""
    clients = [SidecarClient(t, tenant="t", timeout_s=60, channel_options=OWN_CONNECTION) for t in targets]
    try:
        for k, c in enumerate(clients):
            assert await store_prompt(c, k) > 0
        deadline = time.monotonic() + 30
        for c in clients:
            for k in range(len(clients)):
                tokens = prompt(k)
                while True:  # a peer's record shows within publish_interval_s
                    plan = await c.lookup(tokens, identity=IDENT)
                    if len(plan.hits()) == len(plan.chunk_bounds) - 1:
                        break
                    assert time.monotonic() < deadline, f"prompt {k} not found through every channel"
                    await asyncio.sleep(0.05)
                pl = payloads(k, list(plan.chunk_bounds))
                got = await c.fetch([(s.chunk_hash, s.start) for s in plan.hits()], identity=IDENT, layout=LAYOUT,
                                    raw=True)
                for s, kv in zip(plan.hits(), got, strict=True):
                    assert kv.ok, f"prompt {k}: chunk at {s.start} missed"
                    assert bytes(kv.data) == pl[s.start].numpy().tobytes(), f"prompt {k}: chunk at {s.start} corrupted"
    finally:
        for c in clients:
            await c.close()


def test_two_workers_one_port(tmp_path, redis_url) -> None:
    metrics = free_port()
    disk = tmp_path / "disk"
    flags = ["--metrics-port", str(metrics), "--set", "workers=2",
             "--set", f"shared_registry.redis_url={redis_url}", "--set", "shared_registry.key_prefix=workers",
             "--set", "shared_registry.publish_interval_s=0.02",
             "--set", f"store.remote_url={redis_url}", "--set", f"store.remote_bytes={64 << 20}",
             "--set", "store.namespace=workers", "--set", f"store.disk_path={json.dumps(str(disk))}",
             "--set", f"store.disk_bytes={64 << 20}", "--set", "grace_period_s=0.5"]
    log: deque[str] = deque(maxlen=2000)
    proc, target = spawn_sidecar(*flags, log=log)
    try:
        deadline = time.monotonic() + 60
        while len(_children(proc.pid)) < 2 or sum(bool(re.search(r" serving \S+ on ", ln)) for ln in log) < 2:
            assert time.monotonic() < deadline, "".join(log)
            time.sleep(0.1)
        workers = _children(proc.pid)
        assert len(workers) == 2
        # Each worker owns its disk directory (one store per disk_path, enforced by a lock file).
        assert disk.is_dir() and (tmp_path / "disk.worker-1").is_dir()

        # Separate channels are separate connections, which the kernel spreads over the workers.
        asyncio.run(_everyone_reads_everything([target] * CHANNELS))
        stores = [_stores_ok(metrics), _stores_ok(metrics + 1)]
        assert sum(stores) == 2 * CHANNELS  # store_prompt: a metadata Store, then a payload Store
        assert min(stores) > 0, f"one worker took every connection: {stores}"

        # A killed worker is restarted on the same port; the service keeps answering.
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while len(_children(proc.pid) - {victim}) < 2:
            assert time.monotonic() < deadline, "the killed worker was not restarted:\n" + "".join(log)
            time.sleep(0.1)
        asyncio.run(_everyone_reads_everything([target] * 4))
        assert any("exited with -9; restarting" in ln for ln in log)
    finally:
        children = _children(proc.pid)
        stop_process(proc, timeout=60)
    assert proc.returncode == 0, "".join(log)
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert not [ln for ln in log if " ERROR " in ln and "restarting" not in ln], "".join(log)
