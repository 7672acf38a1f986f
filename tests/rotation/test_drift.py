"""Chained-rotation drift (numbers in docs/rotation.md, from ``./dev bench rotation``).

A stored copy rotated once from its canonical source position stays within one storage
rounding of a fresh copy; a copy rotated again and again accumulates one rounding per step.
The sidecar therefore always rotates its canonical copy (never chains), and the splice planner
proposes a refresh past a rotation count.
"""

from __future__ import annotations

import torch

from bench.rotation import chained_drift


def test_fp32_drift_is_negligible_even_when_chained():
    d = chained_drift(torch.float32, chains=(100,))
    assert d["single"] < 1e-6
    assert d["chain_100"] < 1e-5


def test_bf16_single_rotation_costs_one_rounding_and_chains_accumulate():
    d = chained_drift(torch.bfloat16, chains=(2, 100))
    unit = 2.0**-8  # bf16: 8 significant bits
    assert d["fresh"] < unit and d["single"] < unit  # stored copy + one rotation: ~1 rounding
    assert d["single"] < 2 * d["fresh"]
    assert d["chain_100"] > 3 * d["single"]  # drift is real: this is why chains are avoided
