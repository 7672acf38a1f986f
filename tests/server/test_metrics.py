"""Metric helpers: ``BatchHistogram.observe_many`` is ``observe`` per value, sample for sample."""

from __future__ import annotations

import re

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from sidecar.server.metrics import _SEGMENT_BUCKETS, BatchHistogram


def _exposition(registry: CollectorRegistry) -> bytes:
    return re.sub(rb"(?m)^\w+_created \S+$", b"", generate_latest(registry))  # creation times differ


@pytest.mark.parametrize("batch", [1, 3, 15, 16, 300])
def test_observe_many_equals_observe_each(batch):
    rng = np.random.default_rng(batch)
    plain_reg, batch_reg = CollectorRegistry(), CollectorRegistry()
    plain = Histogram("h", "doc", buckets=_SEGMENT_BUCKETS, registry=plain_reg)
    batched = BatchHistogram("h", "doc", buckets=_SEGMENT_BUCKETS, registry=batch_reg)
    edges = [0, *_SEGMENT_BUCKETS, *(b + 1 for b in _SEGMENT_BUCKETS), 10**6]
    for _ in range(4):
        values = [int(v) for v in rng.choice(edges + rng.integers(0, 70_000, 50).tolist(), batch)]
        for v in values:
            plain.observe(v)
        batched.observe_many(values)
    batched.observe_many([])
    assert _exposition(batch_reg) == _exposition(plain_reg)
