"""Several sidecar processes on one port: ``kv-sidecar serve --set workers=N``.

One Python process serves from one event loop, so a sidecar saturates one core whatever the
host has (``./dev bench load``: the mixed workload flattens at one client). The supervisor
starts ``N`` ordinary ``kv-sidecar serve`` processes that bind the same port with
SO_REUSEPORT; the kernel spreads connections over them, and every call of a connection (its
Splice sessions included) stays with the worker that accepted it. Each worker keeps its own
registry and tiers and finds the others' chunks through the shared registry and the remote
tier, as sidecars on different hosts do (``SidecarConfig._check_workers`` requires both).

Per worker ``i`` the supervisor changes only what two processes cannot share: ``--port`` (the
same, fixed before the workers start), ``--metrics-port`` (``metrics_port + i``), and, for
``i >= 1``, ``store.disk_path`` and ``manifests.path`` (suffixed ``.worker-<i>``; worker 0
keeps the configured paths, so going from 1 to N workers keeps its disk tier warm). A worker
that dies is restarted with a growing delay (1 s doubling to 30 s); SIGTERM/SIGINT stop every
worker gracefully (each spills and drains within ``grace_period_s``); SIGUSR1 is forwarded
(thread stacks, ``sidecar.cli``).
"""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from sidecar.config import SidecarConfig

logger = logging.getLogger("sidecar.workers")

RESTART_DELAY_S = (1.0, 30.0)  # first delay, cap (doubling); reset after a worker ran STABLE_S
STABLE_S = 60.0
READY_TIMEOUT_S = 300.0
_SERVING = re.compile(r" serving \S+ on \S+:\d+")  # a worker's start-up line (``SidecarServer.start``)


def worker_path(path: str, index: int) -> str:
    """Worker ``index``'s copy of a per-process file or directory path (worker 0 keeps it)."""
    if index == 0:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.worker-{index}{p.suffix}"))


def worker_flags(config: SidecarConfig, index: int, port: int) -> list[str]:
    """Command-line flags (appended last, so they win) that make a copy of the supervisor's
    command line into worker ``index``."""
    flags = ["--port", str(port), "--set", f"worker_index={index}"]
    if config.metrics_port > 0:
        flags += ["--metrics-port", str(config.metrics_port + index)]
    for key, path in (("store.disk_path", config.store.disk_path), ("manifests.path", config.manifests.path)):
        if path and index:
            flags += ["--set", f"{key}={json.dumps(worker_path(path, index))}"]  # JSON strings are YAML
    return flags


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _Worker:
    def __init__(self, index: int, cmd: list[str], out: TextIO) -> None:
        self.index, self.cmd, self.out = index, cmd, out
        self.proc: subprocess.Popen | None = None
        self.ready = threading.Event()
        self.started_at = 0.0
        self.delay = RESTART_DELAY_S[0]
        self.restart_at: float | None = None

    def start(self) -> None:
        self.ready.clear()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, errors="replace")
        threading.Thread(target=self._relay, args=(self.proc,), daemon=True,
                         name=f"worker-{self.index}-log").start()

    def _relay(self, proc: subprocess.Popen) -> None:
        """The worker's log into the supervisor's stderr, line by line; notes its start-up line."""
        assert proc.stderr is not None
        for line in proc.stderr:
            if not self.ready.is_set() and _SERVING.search(line):
                self.ready.set()
            self.out.write(line)
            self.out.flush()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)


class Supervisor:
    """Runs ``config.workers`` worker processes until SIGTERM/SIGINT (see the module docstring)."""

    def __init__(self, config: SidecarConfig, argv: list[str], *, out: TextIO | None = None) -> None:
        self.config = config
        self.argv = list(argv)
        self.out = out or sys.stderr
        self.port = config.port or _free_port(config.bind_host)
        self.workers = [
            _Worker(i, [sys.executable, "-m", "sidecar.cli", *self.argv, *worker_flags(config, i, self.port)], self.out)
            for i in range(config.workers)
        ]
        self._stop = threading.Event()

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop.set())
        signal.signal(signal.SIGUSR1, lambda *_: [w.signal(signal.SIGUSR1) for w in self.workers])
        for w in self.workers:
            w.start()
        try:
            if not self._await_ready():
                return 1
            logger.info("supervising %d workers on %s:%d (pids %s)", len(self.workers), self.config.bind_host,
                        self.port, ", ".join(str(w.proc.pid) for w in self.workers if w.proc))
            while not self._stop.wait(0.2):
                self._watch()
            logger.info("signal received: stopping %d workers", len(self.workers))
            return 0
        finally:
            self._stop_all()

    def _await_ready(self) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for w in self.workers:
            while not w.ready.wait(0.1):
                assert w.proc is not None
                if w.proc.poll() is not None:
                    logger.error("worker %d exited with %s before serving; stopping", w.index, w.proc.returncode)
                    return False
                if time.monotonic() > deadline:
                    logger.error("worker %d not serving after %.0f s; stopping", w.index, READY_TIMEOUT_S)
                    return False
                if self._stop.is_set():
                    return False
        return True

    def _watch(self) -> None:
        now = time.monotonic()
        for w in self.workers:
            if w.restart_at is not None:
                if now >= w.restart_at:
                    w.restart_at = None
                    w.start()
                continue
            assert w.proc is not None
            rc = w.proc.poll()
            if rc is None:
                continue
            if now - w.started_at >= STABLE_S:
                w.delay = RESTART_DELAY_S[0]
            logger.error("worker %d (pid %d) exited with %s; restarting it in %.0f s",
                         w.index, w.proc.pid, rc, w.delay)
            w.restart_at = now + w.delay
            w.delay = min(w.delay * 2, RESTART_DELAY_S[1])

    def _stop_all(self) -> None:
        for w in self.workers:
            w.signal(signal.SIGTERM)
        # Each worker drains within grace_period_s and then spills what its memory tiers hold.
        deadline = time.monotonic() + self.config.grace_period_s + 60.0
        for w in self.workers:
            if w.proc is None:
                continue
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.error("worker %d did not stop in time; killing it", w.index)
                w.proc.kill()
                w.proc.wait()
