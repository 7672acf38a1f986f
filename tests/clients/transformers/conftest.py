"""Engine fixtures: tiny GQA and MLA models (random weights, batch-invariant attention) and a
real sidecar in-process over loopback gRPC (one per test module; each test gets its own
identity namespace, so tests never see each other's chunks)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from clients.transformers import INVARIANT_ATTENTION, Engine, build_model, deepseek_v2_config, llama_config
from sidecar.app import ServerThread
from sidecar.client import SyncSidecarClient
from tests.conftest import ANCHOR_BASE, make_config

#: Ordinary ids stay below this (a small range keeps the models' embeddings hot in cache).
TEXT_VOCAB = 5000

MODEL_CONFIGS = {
    "gqa": lambda: llama_config(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2),
    "mla": lambda: deepseek_v2_config(hidden_size=128, num_layers=2, num_heads=4),
}


@pytest.fixture(scope="module")
def sidecar_target() -> Iterator[str]:
    with ServerThread(make_config()) as st:
        yield st.target


@pytest.fixture(scope="module")
def client(sidecar_target: str) -> Iterator[SyncSidecarClient]:
    with SyncSidecarClient(sidecar_target, tenant="engine-tests") as c:
        yield c


_MODELS: dict[str, object] = {}


def get_model(kind: str):
    """Build each tiny model once per session (they are read-only)."""
    if kind not in _MODELS:
        _MODELS[kind] = build_model(MODEL_CONFIGS[kind](), seed=1, attn_implementation=INVARIANT_ATTENTION)
    return _MODELS[kind]


@pytest.fixture(params=sorted(MODEL_CONFIGS))
def kind(request) -> str:
    return request.param


@pytest.fixture
def model(kind: str):
    return get_model(kind)


@pytest.fixture
def make_engine(model, client):
    """``make_engine()`` -> a fresh engine (empty own prefix cache) on this test's namespace."""
    ns = uuid.uuid4().hex

    def make(**kwargs) -> Engine:
        return Engine(model, sidecar=client, namespace=ns, **kwargs)

    return make


class Prompts:
    """Chat-like prompts: each message is an anchor token then ordinary ids."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def msg(self, n: int) -> np.ndarray:
        return np.concatenate([[ANCHOR_BASE], self.rng.integers(0, TEXT_VOCAB, n)]).astype(np.uint32)

    @staticmethod
    def join(*parts: np.ndarray) -> np.ndarray:
        return np.concatenate(parts).astype(np.uint32)


@pytest.fixture
def prompts() -> Prompts:
    return Prompts(7)
