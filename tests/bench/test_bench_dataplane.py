"""The data-plane benchmark (bench/dataplane.py) in ``--quick`` mode on a real sidecar process:
every row is measured, and the pool path's staging equals the old paths' bit for bit (the bench
raises otherwise)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bench import dataplane


def test_quick_run_measures_every_row():
    out = dataplane.main(["--quick"])
    (size,) = out["sizes"].values()
    assert size["tokens"] == 1024 and size["chunks"] == 8
    assert size["copy_"]["gbps"] > 0
    assert set(size["fetch"]) == {"exact", "shifted"}
    assert set(size["vllm_load"]) == {"cpu_backend", "standard"}  # each load checked against read_into
    rows = [*(size["fetch"][k][p] for k in ("exact", "shifted") for p in dataplane.FETCH_PATHS),
            *(size["store"][p] for p in dataplane.STORE_PATHS),
            *(size["vllm_load"][c][k] for c in ("cpu_backend", "standard") for k in ("exact", "shifted"))]
    for r in rows:
        assert r["ms"] > 0 and r["gbps"] > 0 and r["x_copy"] > 0
        assert r["x_break_even"] == pytest.approx(r["gbps"] / dataplane.BREAK_EVEN_GBPS)
    assert out["settings"]["sidecar"]["1024"]["pool_lease_ttl_s"] > 0  # per size: its own sidecar


def test_a_staging_difference_is_raised():
    a = torch.zeros((1, 2, 4, 2, 8), dtype=torch.bfloat16)
    b = a.clone()
    case = SimpleNamespace(staging={"pool": a, "old": b})
    dataplane.Case.check(case, "shifted", "segment")  # equal: no error
    b[0, 0, 3, 1, 7] = torch.tensor(-0.0, dtype=torch.bfloat16)  # == 0.0, but other bits
    with pytest.raises(RuntimeError, match="shifted: the pool path's staging differs from the segment path's in 1"):
        dataplane.Case.check(case, "shifted", "segment")
