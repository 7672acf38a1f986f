"""Concurrent puts and gets: atomic visibility, no torn reads, consistent accounting."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import pytest
import torch

from sidecar.identity import KVLayout
from sidecar.tiers import Tier
from tests.tiers.conftest import NUM_TOKENS, key, make_payload


def _run_threads(n: int, target) -> list[BaseException]:
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def wrapped(i: int) -> None:
        try:
            start.wait()
            target(i)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


def test_concurrent_puts_and_gets_of_one_chunk(make_store, tmp_path: Path, layout: KVLayout, payload_size: int) -> None:
    store = make_store(cpu_bytes=1 << 20, disk_path=str(tmp_path), disk_bytes=1 << 20)
    data = make_payload(7, payload_size)
    stored: list[bool] = []
    seen: list[bool] = []

    def worker(i: int) -> None:
        for _ in range(20):
            if i % 2 == 0:
                stored.append(store.put(key(1), data, layout=layout, num_tokens=NUM_TOKENS, tenant="a").stored)
            got = store.get(key(1))
            if got is not None:  # visible only once complete: never a torn or partial payload
                seen.append(torch.equal(got.payload, data))
            if i == 1:
                store.evict([key(1)])  # keep it moving between CPU and disk under the readers

    assert _run_threads(6, worker) == []
    assert stored.count(True) >= 1 and all(seen) and len(seen) > 0
    assert store.tenant_usage("a") in (0, payload_size)


async def test_concurrent_same_chunk_with_asyncio(make_store, layout: KVLayout, payload_size: int) -> None:
    store = make_store(cpu_bytes=1 << 20)
    data = make_payload(3, payload_size)
    puts = [
        asyncio.to_thread(store.put, key(1), data, layout=layout, num_tokens=NUM_TOKENS, tenant="a") for _ in range(8)
    ]
    gets = [asyncio.to_thread(store.get, key(1)) for _ in range(8)]
    results = await asyncio.gather(*puts, *gets)
    assert sum(r.stored for r in results[:8]) == 1
    assert all(g is None or torch.equal(g.payload, data) for g in results[8:])
    assert torch.equal(store.get(key(1)).payload, data) and store.stats().duplicate_puts == 7


@pytest.mark.parametrize("lower", ["disk", "disk+remote"])
def test_churn_keeps_payloads_and_accounting_exact(
    make_store, request, tmp_path: Path, layout: KVLayout, payload_size: int, obj_size: int, lower: str
) -> None:
    extra = {}
    if "remote" in lower:
        extra = dict(remote_url=request.getfixturevalue("redis_url"), remote_bytes=4 * obj_size)
    store = make_store(cpu_bytes=3 * obj_size, disk_path=str(tmp_path), disk_bytes=6 * obj_size, **extra)
    keys = range(12)
    expected = {i: make_payload(i, payload_size) for i in keys}
    bad: list[int] = []

    def worker(t: int) -> None:
        rng = random.Random(t)
        for _ in range(60):
            i = rng.choice(keys)
            if rng.random() < 0.4:
                store.put(key(i), expected[i], layout=layout, num_tokens=NUM_TOKENS, tenant=f"t{i % 3}")
            else:
                batch = rng.sample(list(keys), 3)
                for j, got in zip(batch, store.get_many([key(j) for j in batch])):
                    if got is not None and not torch.equal(got.payload, expected[j]):
                        bad.append(j)

    assert _run_threads(4, worker) == []
    assert bad == []
    # Exact accounting after the dust settles: the index, the per-tier bytes and LMCache agree.
    st = store.stats()
    chunks = store.list_chunks()
    local = st.tiers[Tier.CPU].objects + st.tiers[Tier.DISK].objects
    assert local == sum(1 for m in chunks if store.tiers_of(m.key) - {Tier.REMOTE})
    if Tier.REMOTE in st.tiers:
        assert st.tiers[Tier.REMOTE].used_bytes == st.tiers[Tier.REMOTE].objects * obj_size <= 4 * obj_size
    assert st.tiers[Tier.CPU].used_bytes == st.tiers[Tier.CPU].objects * obj_size <= 3 * obj_size
    assert st.tiers[Tier.DISK].used_bytes == st.tiers[Tier.DISK].objects * obj_size <= 6 * obj_size
    assert store._mem[Tier.CPU].allocator_usage()[0] == st.tiers[Tier.CPU].used_bytes
    assert len(list(tmp_path.glob("*.data"))) == st.tiers[Tier.DISK].objects
    assert sum(store.tenant_usage(f"t{i}") for i in range(3)) == len(chunks) * payload_size
    for m in chunks:
        assert torch.equal(store.get(m.key, promote=False).payload, expected[int(m.key[-4:])])
    st = store.stats()
    assert st.checksum_failures == 0 and st.io_errors == 0 and st.hits + st.misses == st.gets


def test_put_with_room_does_not_wait_for_a_mover(make_store, layout: KVLayout, payload_size: int, obj_size: int) -> None:
    """Stores of new chunks into free room run while a demotion holds the mover lock."""
    store = make_store(cpu_bytes=4 * obj_size)
    done = threading.Event()

    def put() -> None:
        store.put(key(1), make_payload(1, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant="a")
        done.set()

    with store._core.mover:  # a long demotion or eviction in progress
        t = threading.Thread(target=put)
        t.start()
        assert done.wait(30)
    t.join()
    assert torch.equal(store.get(key(1)).payload, make_payload(1, payload_size))


def test_many_writers_storing_and_evicting_overlapping_chunks(
    make_store, tmp_path: Path, layout: KVLayout, payload_size: int, obj_size: int
) -> None:
    """8 threads put, evict, delete and read 24 overlapping chunks of 3 tenants (one with a
    quota) through CPU -> disk; afterwards every byte count is exact and every payload intact."""
    from sidecar.tiers import QuotaExceededError, TenantQuota

    quota = TenantQuota(max_bytes=5 * payload_size)
    store = make_store(cpu_bytes=4 * obj_size, disk_path=str(tmp_path), disk_bytes=10 * obj_size,
                       tenant_quotas={"t2": quota})
    keys = range(24)
    expected = {i: make_payload(i, payload_size) for i in keys}
    bad: list[int] = []
    refusals: list[str] = []

    def worker(t: int) -> None:
        rng = random.Random(100 + t)
        for _ in range(80):
            i = rng.choice(keys)
            r = rng.random()
            try:
                if r < 0.5:
                    store.put(key(i), expected[i], layout=layout, num_tokens=NUM_TOKENS, tenant=f"t{i % 3}")
                elif r < 0.6:
                    store.evict([key(i)])
                elif r < 0.65:
                    store.delete([key(i)])
                else:
                    got = store.get(key(i), promote=rng.random() < 0.5)
                    if got is not None and not torch.equal(got.payload, expected[i]):
                        bad.append(i)
            except QuotaExceededError:
                refusals.append("quota")

    assert _run_threads(8, worker) == []
    assert bad == []
    st = store.stats()
    chunks = store.list_chunks()
    cpu, disk = (store.list_chunks(t) for t in (Tier.CPU, Tier.DISK))
    assert len(cpu) + len(disk) == len(chunks)  # one local copy each, no orphan index entries
    assert st.tiers[Tier.CPU].used_bytes == len(cpu) * obj_size <= 4 * obj_size
    assert st.tiers[Tier.DISK].used_bytes == len(disk) * obj_size <= 10 * obj_size
    assert store._mem[Tier.CPU].allocator_usage()[0] == st.tiers[Tier.CPU].used_bytes
    assert sorted(p.name for p in tmp_path.glob("*.data")) == sorted(store._disk.name_of(m.key) for m in disk)
    for t in range(3):
        mine = [m for m in chunks if m.tenant == f"t{t}"]
        assert store.tenant_usage(f"t{t}") == len(mine) * payload_size
        assert store.tenant_tier_usage(f"t{t}") == {
            tier: (sum(1 for m in mine if store.locate(m.key) == tier) * obj_size,
                   sum(1 for m in mine if store.locate(m.key) == tier)) for tier in (Tier.CPU, Tier.DISK)
        }
    assert store.tenant_usage("t2") <= quota.max_bytes
    for m in chunks:
        assert torch.equal(store.get(m.key, promote=False).payload, expected[int(m.key[-4:])])
    st = store.stats()
    assert st.checksum_failures == 0 and st.io_errors == 0 and store.pins_in_flight() == 0
    # The disk index agrees with the files: a restart recovers exactly the disk chunks.
    held_on_disk = {m.key for m in store.list_chunks(Tier.DISK)}
    store.close()
    again = make_store(cpu_bytes=4 * obj_size, disk_path=str(tmp_path), disk_bytes=10 * obj_size)
    assert {m.key for m in again.list_chunks(Tier.DISK)} == held_on_disk
    assert again.stats().checksum_failures == 0
