"""The GPU check's correctness parts (``bench/gpu_check.py``), skipped without CUDA; without one,
the check itself says so and measures nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_check

ROOT = Path(__file__).resolve().parents[2]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_rotation_matches_the_reference():
    rows, ok = gpu_check.check_rotation(tokens=256)
    assert ok, rows


@cuda
def test_the_workers_staged_copies_match_the_cpu_cells_in_every_layout():
    rows, ok = gpu_check.check_layouts(tokens=300, timed=False)
    assert ok, [r for r in rows if not r["correct"]]


def test_the_workers_copy_check_holds_on_the_cpu_path():
    """The same check through the CPU path (no pinned buffer, no stream): the caches, the rows
    and the check itself are right before a GPU runs them."""
    rows, ok = gpu_check.check_layouts(tokens=300, device="cpu")
    assert ok and len(rows) == 12 and {r["kind"] for r in rows} == {"gqa", "mla"}, rows


def test_the_pool_check_holds_on_the_cpu_path(monkeypatch):
    """Part 3 without CUDA: a pool file mapped as an engine maps it, copied chunk by chunk, equal;
    no registration; its file is gone afterwards (other processes' pool files are theirs)."""
    import os
    import secrets

    from sidecar.shm.pool import FILE_PATTERN, FILE_PREFIX

    mark = secrets.token_hex(16)
    monkeypatch.setattr(secrets, "token_hex", lambda n: mark)  # the check's file name, known here
    name = FILE_PREFIX + mark
    assert FILE_PATTERN.fullmatch(name) and not os.path.exists(os.path.join("/dev/shm", name))
    row, ok = gpu_check.check_pool(chunk_bytes=1 << 20, chunks=4, device="cpu")
    assert ok and row["correct"] and not row["registered"], row
    assert not os.path.exists(os.path.join("/dev/shm", name))


@cuda
def test_the_registered_pool_copies_to_the_device():
    row, ok = gpu_check.check_pool(chunk_bytes=1 << 20, chunks=4)
    assert ok and row["registered"], row


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-device answer")
def test_without_a_device_the_check_says_so():
    out = subprocess.run([sys.executable, "-m", "bench.gpu_check"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "no CUDA device" in out.stderr
