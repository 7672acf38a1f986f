"""Shared pieces of the fault tests: prompts with deterministic KV, a sidecar process that can be
SIGKILLed, and the check that every acknowledged chunk is served exactly or is a clean miss."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections import deque
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from sidecar.client import RetryPolicy, SidecarClient
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.process import spawn_sidecar, stop_process
from tests.conftest import ANCHORS, message

LAYOUT = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")
IDENT = CacheIdentity(model_id="faults", kv_layout=LAYOUT.fingerprint())
FLOATS_PER_TOKEN = LAYOUT.bytes_per_token // 4
NO_RETRY = RetryPolicy(attempts=1)
#: A dead server answers UNAVAILABLE (connection refused/reset) or, mid-call, CANCELLED/UNKNOWN
#: from the transport; anything else (INVALID_ARGUMENT, INTERNAL, ...) is a defect.
TRANSPORT_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                   grpc.StatusCode.DEADLINE_EXCEEDED}


def prompt(i: int) -> np.ndarray:
    """Prompt ``i``: three chat messages of random tokens, the same for the same ``i``."""
    rng = np.random.default_rng(10_000 + i)
    return np.concatenate([message(rng, 220, ANCHORS[0]), message(rng, 160, ANCHORS[1]), message(rng, 90, ANCHORS[2])])


def payloads(i: int, bounds: list[int]) -> dict[int, torch.Tensor]:
    """Deterministic KV of prompt ``i``, one tensor per chunk start (``KVLayout`` order)."""
    g = torch.Generator().manual_seed(i)
    return {a: torch.randn((b - a) * FLOATS_PER_TOKEN, generator=g) for a, b in zip(bounds[:-1], bounds[1:])}


async def store_prompt(c: SidecarClient, i: int) -> int:
    """Register prompt ``i`` then store its KV; returns the number of chunks stored."""
    tokens = prompt(i)
    bounds = list((await c.store(tokens, identity=IDENT)).chunk_bounds)
    pl = payloads(i, bounds)
    res = await c.store(tokens, identity=IDENT, layout=LAYOUT, payloads=pl)
    return res.chunks_stored


async def check_exact_or_miss(c: SidecarClient, ids: list[int]) -> tuple[int, int]:
    """For every prompt in ``ids``: each hit the sidecar plans is Fetched (raw) and must be the
    exact bytes that were stored for that chunk; a chunk it no longer has is a clean miss (not
    planned, or ``ok=False``). Returns (chunks served exactly, chunks missed)."""
    served = missed = 0
    for i in ids:
        tokens = prompt(i)
        plan = await c.lookup(tokens, identity=IDENT)
        bounds = list(plan.chunk_bounds)
        pl = payloads(i, bounds)
        hits = plan.hits()
        starts = [s.start - s.chunk_offset for s in hits]
        got = await c.fetch([(s.chunk_hash, a) for s, a in zip(hits, starts)], identity=IDENT, layout=LAYOUT,
                            raw=True) if hits else []
        for a, kv in zip(starts, got):
            if kv.ok:
                assert bytes(kv.data) == pl[a].numpy().tobytes(), f"prompt {i}: chunk at {a} served corrupted bytes"
                served += 1
            else:
                missed += 1
        missed += len(bounds) - 1 - len(hits)
    return served, missed


class SidecarProc:
    """A ``kv-sidecar serve`` process with a JSON config file, restartable on the same disk."""

    def __init__(self, workdir: Path, config: dict[str, Any]) -> None:
        self.config_path = workdir / "sidecar.json"
        self.config_path.write_text(json.dumps(config))
        self.log: deque[str] = deque(maxlen=2000)
        self.proc: subprocess.Popen | None = None
        self.target = ""

    def start(self) -> str:
        self.proc, self.target = spawn_sidecar("--config", str(self.config_path), log=self.log)
        return self.target

    def sigkill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=15)
            self.proc = None

    def dump_stacks(self) -> str:
        """Every thread's stack (``kill -USR1``, see ``sidecar.cli``) and the log before it."""
        if self.proc is None:
            return ""
        self.proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        return "".join(self.log)

    def errors(self) -> list[str]:
        """Log lines at ERROR or worse, and tracebacks (with the 12 lines after each)."""
        lines = list(self.log)
        out = []
        for i, ln in enumerate(lines):
            if " ERROR " in ln or " CRITICAL " in ln:
                out.append(ln)
            elif "Traceback" in ln:
                out.append("".join(lines[i:i + 12]))
        return out


def base_config(disk: Path, **store: Any) -> dict[str, Any]:
    """Small CPU tier in front of a disk tier, so most acknowledged chunks live on disk."""
    return {
        "grace_period_s": 0.5,
        "chunker": {"anchor_tokens": list(ANCHORS)},
        "store": {"cpu_bytes": 1 << 20, "disk_path": str(disk), "disk_bytes": 256 << 20, **store},
    }
