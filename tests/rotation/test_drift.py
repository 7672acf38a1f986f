"""Chained-rotation drift (numbers in docs/rotation.md, from ``./dev bench rotation``).

A stored copy rotated once from its canonical source position stays within one storage
rounding of a fresh copy; a copy rotated again and again accumulates one rounding per step.
The sidecar therefore always rotates its canonical copy (never chains), and the splice planner
proposes a refresh past a rotation count.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sidecar.rotation import Pairing, RopeSpec
from sidecar.rotation.drift import chained_drift
from tests.rotation.families import FAMILIES


@pytest.fixture(scope="module")
def llama31() -> RopeSpec:
    """Llama-3.1's rotary table (head_dim 128, llama3 scaling), the one the benchmark uses."""
    return RopeSpec.from_hf_config(FAMILIES["llama3.1"].make_config())


def test_fp32_drift_is_negligible_even_when_chained(llama31):
    d = chained_drift(llama31, torch.float32, chains=(100,))
    assert d["single"] < 1e-6
    assert d["chain_100"] < 1e-5


def test_bf16_single_rotation_costs_one_rounding_and_chains_accumulate(llama31):
    d = chained_drift(llama31, torch.bfloat16, chains=(2, 100))
    unit = 2.0**-8  # bf16: 8 significant bits
    assert d["fresh"] < unit and d["single"] < unit  # stored copy + one rotation: ~1 rounding
    assert d["single"] < 2 * d["fresh"]
    assert d["chain_100"] > 3 * d["single"]  # drift is real: this is why chains are avoided


def test_report_names_every_chain_with_its_worst_key(llama31):
    d = chained_drift(llama31, torch.float32, chains=(2, 5), rows=8)
    assert set(d) == {"fresh", "fresh_worst", "single", "single_worst", "chain_2", "chain_2_worst",
                      "chain_5", "chain_5_worst"}
    assert all(d[k] <= d[f"{k}_worst"] for k in ("fresh", "single", "chain_2", "chain_5"))


@pytest.mark.parametrize(("field", "value"), [("chains", (0,)), ("rows", 0), ("dtype", torch.int32)])
def test_bad_arguments_are_refused_by_name(llama31, field, value):
    kwargs = {"chains": (2,), "rows": 4, "dtype": torch.float32, field: value}
    dtype = kwargs.pop("dtype")
    with pytest.raises(ValueError, match=f"^{field}"):
        chained_drift(llama31, dtype, **kwargs)


def test_a_spec_the_reference_does_not_cover_is_refused(llama31):
    with pytest.raises(ValueError, match="^spec: .*pairing interleaved"):
        chained_drift(dataclasses.replace(llama31, pairing=Pairing.INTERLEAVED), torch.float32, chains=(2,), rows=4)
