"""The vLLM connector's role classes against a real sidecar over loopback gRPC (one per module);
each test gets its own identity namespace, so tests never see each other's chunks."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from clients.vllm.paged import BlockLayout, PagedKV
from clients.vllm.scheduler_side import SchedulerSide
from clients.vllm.settings import EngineShape, Settings, sidecar_link
from clients.vllm.worker_side import WorkerSide
from sidecar.app import ServerThread
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.rotation import Pairing, RopeSpec, RotaryLayout
from tests.conftest import ANCHOR_BASE, make_config

BLOCK = 16
LAYERS, HEADS, HEAD = 2, 2, 16


@pytest.fixture(scope="module")
def sidecar_target() -> Iterator[str]:
    with ServerThread(make_config()) as st:
        yield st.target


@pytest.fixture
def closed_target() -> str:
    """An address where nothing listens (the sidecar is down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def shape() -> EngineShape:
    """A tiny bf16 GQA engine (2 layers, 2 KV heads of 16 dims, blocks of 16) on this test's
    namespace."""
    layout = KVLayout.gqa(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD, dtype="bfloat16")
    inv = (1.0 / (10000.0 ** (torch.arange(0, HEAD, 2, dtype=torch.float32) / HEAD))).tolist()
    rope = RopeSpec(rotary_dim=HEAD, key_dim=HEAD, layout=RotaryLayout.LEADING, pairing=Pairing.HALF,
                    inv_freq=tuple(inv))
    identity = CacheIdentity(model_id="fake-vllm", kv_layout=layout.fingerprint(), rope_fingerprint=rope.fingerprint,
                             block_size=BLOCK, namespace=uuid.uuid4().hex)
    return EngineShape(LAYERS, HEADS, HEAD, BLOCK, "bfloat16", layout, rope, identity)


@pytest.fixture
def new_engine(sidecar_target: str):
    """``new_engine(planned, workers, cache, **extra)`` -> (scheduler side, worker sides), as vLLM
    builds them per role from ``kv_connector_extra_config`` (``extra``: more keys; ``sidecar``
    defaults to this module's sidecar, ``tenant`` to "vllm-tests", ``store`` to "sync"): the
    scheduler side plans under ``planned``, one worker per shape of ``workers``, each with the
    cache ``cache(shape)``. All are shut down after the test."""
    made: list[tuple[SchedulerSide, list[WorkerSide]]] = []

    def make(planned: EngineShape, workers: list[EngineShape], cache: Callable[[EngineShape], Any],
             **extra: Any) -> tuple[SchedulerSide, list[WorkerSide]]:
        settings = Settings.from_extra({"sidecar": sidecar_target, "tenant": "vllm-tests", "store": "sync", **extra})
        side = SchedulerSide(settings, planned, sidecar_link(settings, "scheduler"))
        sides = []
        for ws in workers:
            w = WorkerSide(settings, ws, sidecar_link(settings, "worker"))
            w.paged = cache(ws)
            sides.append(w)
        made.append((side, sides))
        return side, sides

    yield make
    for side, workers in made:  # the workers' background Stores first, then the links
        for w in workers:
            w.shutdown()
            w.link.close()
        side.link.close()


@pytest.fixture
def engine(new_engine, shape: EngineShape):
    """``engine(**extra)`` -> a fresh (scheduler side, worker side) pair of ``shape``; the worker
    side has a CPU paged cache of 512 blocks in the ``vec`` layout and Stores synchronously unless
    told otherwise."""

    def cpu_cache(ws: EngineShape) -> PagedKV:
        layers = [torch.zeros((512, HEADS, BLOCK, 2 * HEAD), dtype=torch.bfloat16) for _ in range(LAYERS)]
        return PagedKV(layers, BlockLayout.vec(HEADS, BLOCK, HEAD))

    def make(**extra: Any) -> tuple[SchedulerSide, WorkerSide]:
        side, [worker] = new_engine(shape, [shape], cpu_cache, **extra)
        return side, worker

    return make


class Prompts:
    """Chat-like prompts: each message is an anchor token (a chunk boundary) then ordinary ids."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def msg(self, n: int) -> list[int]:
        return [ANCHOR_BASE] + [int(t) for t in self.rng.integers(0, 5000, n)]


@pytest.fixture
def prompts() -> Prompts:
    return Prompts(11)
