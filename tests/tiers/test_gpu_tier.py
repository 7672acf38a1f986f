"""GPU tier: the device-pool code runs on host memory in CI and on CUDA when present."""

from __future__ import annotations

import pytest
import torch

from sidecar.identity import KVLayout
from sidecar.tiers import EventKind, Tier
from tests.tiers.conftest import NUM_TOKENS, key, make_payload

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]),
]


@pytest.mark.parametrize("device", DEVICES)
def test_device_tier_round_trip_demotion_promotion(
    make_store, layout: KVLayout, payload_size: int, obj_size: int, device: str
) -> None:
    store = make_store(gpu_bytes=2 * obj_size, gpu_device=device, cpu_bytes=4 * obj_size)
    assert store.tiers == (Tier.GPU, Tier.CPU)
    src = make_payload(1, payload_size)
    res = store.put(key(1), src.to(device), layout=layout, num_tokens=NUM_TOKENS, tenant="a")
    assert res.tier == Tier.GPU
    got = store.get(key(1))
    assert got.tier == Tier.GPU and got.payload.device.type == "cpu" and torch.equal(got.payload, src)
    for i in (2, 3):
        store.put(key(i), make_payload(i, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="a")
    assert [(e.kind, e.key, e.source, e.target) for e in store.take_events()] == [
        (EventKind.DEMOTED, key(1), Tier.GPU, Tier.CPU)
    ]
    got = store.get(key(1))  # a CPU hit is promoted back into the device pool
    assert got.tier == Tier.CPU and torch.equal(got.payload, src)
    assert store.locate(key(1)) == Tier.GPU and store.locate(key(2)) == Tier.CPU
    assert torch.equal(store.get(key(1)).payload, src)
    assert store.stats().tiers[Tier.GPU].used_bytes == 2 * obj_size


def test_gpu_tier_is_skipped_without_cuda(make_store, obj_size: int) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    store = make_store(gpu_bytes=2 * obj_size, gpu_device="cuda", cpu_bytes=obj_size)
    assert store.tiers == (Tier.CPU,)
