"""Disk tier (LMCache fs_native): demotion order, promotion, corruption, restart recovery."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from sidecar.identity import KVLayout
from sidecar.tiers import CapacityError, EventKind, Reason, Tier
from sidecar.tiers.store import Guard
from tests.tiers.conftest import NUM_TOKENS, key, make_payload


def _put(store, i: int, layout: KVLayout, size: int, tenant: str = "a"):
    return store.put(key(i), make_payload(i, size), layout=layout, num_tokens=NUM_TOKENS, tenant=tenant)


def _moves(events) -> list[tuple]:
    return [(e.kind, e.key, e.source, e.target) for e in events]


def test_disk_round_trip_without_memory_tier(make_store, tmp_path: Path, layout: KVLayout, payload_size: int) -> None:
    store = make_store(cpu_bytes=0, disk_path=str(tmp_path), disk_bytes=1 << 20)
    assert store.tiers == (Tier.DISK,)
    assert _put(store, 1, layout, payload_size).tier == Tier.DISK
    got = store.get(key(1))
    assert got.tier == Tier.DISK and torch.equal(got.payload, make_payload(1, payload_size))
    files = [p.name for p in tmp_path.iterdir() if p.suffix == ".data"]
    assert files == [store._disk.path_of(key(1)).name]
    assert store.stats().tiers[Tier.DISK].hits == 1


def test_eviction_is_demotion_in_lru_order(
    make_store, tmp_path: Path, layout: KVLayout, payload_size: int, obj_size: int
) -> None:
    store = make_store(cpu_bytes=2 * obj_size, disk_path=str(tmp_path), disk_bytes=2 * obj_size)
    for i in range(5):
        assert _put(store, i, layout, payload_size).tier == Tier.CPU
    events = store.take_events()
    assert _moves(events) == [
        (EventKind.DEMOTED, key(0), Tier.CPU, Tier.DISK),
        (EventKind.DEMOTED, key(1), Tier.CPU, Tier.DISK),
        (EventKind.EVICTED, key(0), Tier.DISK, None),  # the last tier evicts its LRU chunk
        (EventKind.DEMOTED, key(2), Tier.CPU, Tier.DISK),
    ]
    assert [e.tiers_after for e in events] == [
        frozenset({Tier.DISK}),
        frozenset({Tier.DISK}),
        frozenset(),
        frozenset({Tier.DISK}),
    ]
    assert [store.locate(key(i)) for i in range(5)] == [None, Tier.DISK, Tier.DISK, Tier.CPU, Tier.CPU]
    assert [m.key for m in store.list_chunks(Tier.DISK)] == [key(1), key(2)]
    st = store.stats()
    assert (st.demotions, st.evictions_by_reason[Reason.CAPACITY]) == (3, 1)
    assert st.tiers[Tier.DISK].used_bytes == 2 * obj_size and st.tiers[Tier.CPU].used_bytes == 2 * obj_size
    for i in range(1, 5):  # every chunk that was not evicted is intact wherever it went
        assert torch.equal(store.get(key(i), promote=False).payload, make_payload(i, payload_size))


def test_disk_hit_promotes_and_demotes_the_cpu_victim(
    make_store, tmp_path: Path, layout: KVLayout, payload_size: int, obj_size: int
) -> None:
    store = make_store(cpu_bytes=2 * obj_size, disk_path=str(tmp_path), disk_bytes=4 * obj_size)
    for i in range(3):
        _put(store, i, layout, payload_size)
    store.take_events()
    got = store.get(key(0))
    assert got.tier == Tier.DISK and torch.equal(got.payload, make_payload(0, payload_size))
    assert _moves(store.take_events()) == [
        (EventKind.DEMOTED, key(1), Tier.CPU, Tier.DISK),
        (EventKind.PROMOTED, key(0), Tier.DISK, Tier.CPU),
    ]
    assert [store.locate(key(i)) for i in range(3)] == [Tier.CPU, Tier.DISK, Tier.CPU]
    assert not store._disk.path_of(key(0)).exists()  # exclusive: the disk copy was dropped
    assert store.get(key(0)).tier == Tier.CPU
    assert store.stats().promotions == 1


def test_operator_evict_moves_one_tier_down(make_store, tmp_path: Path, layout: KVLayout, payload_size: int) -> None:
    store = make_store(cpu_bytes=1 << 20, disk_path=str(tmp_path), disk_bytes=1 << 20)
    _put(store, 1, layout, payload_size)
    assert store.evict([key(1), key(7)]) == 1
    assert store.locate(key(1)) == Tier.DISK
    assert store.evict([key(1)]) == 1
    assert store.locate(key(1)) is None
    assert [(e.kind, e.reason) for e in store.take_events()] == [
        (EventKind.DEMOTED, Reason.OPERATOR),
        (EventKind.EVICTED, Reason.OPERATOR),
    ]


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_damaged_disk_file_is_a_counted_removed_miss(
    make_store, tmp_path: Path, layout: KVLayout, payload_size: int, damage: str
) -> None:
    store = make_store(cpu_bytes=0, disk_path=str(tmp_path), disk_bytes=1 << 20)
    _put(store, 1, layout, payload_size)
    _put(store, 2, layout, payload_size)
    path = store._disk.path_of(key(1))
    if damage == "flip":
        with open(path, "r+b") as f:
            f.seek(path.stat().st_size - 10)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
    elif damage == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    else:
        path.unlink()
    got = store.get_many([key(1), key(2)])
    assert got[0] is None and torch.equal(got[1].payload, make_payload(2, payload_size))
    (ev,) = store.take_events()
    reason = Reason.MISSING if damage == "remove" else Reason.CORRUPTION
    assert (ev.kind, ev.key, ev.source, ev.reason, ev.present) == (EventKind.LOST, key(1), Tier.DISK, reason, False)
    assert not path.exists() and store.locate(key(1)) is None
    st = store.stats()
    assert st.checksum_failures == (0 if damage == "remove" else 1)
    assert st.losses_by_reason[reason] == 1 and st.tiers[Tier.DISK].objects == 1
    assert store.get(key(1)) is None  # stays a plain miss


def test_restart_recovers_the_disk_tier(
    make_store, tmp_path: Path, layout: KVLayout, payload_size: int, obj_size: int
) -> None:
    first = make_store(cpu_bytes=obj_size, disk_path=str(tmp_path), disk_bytes=8 * obj_size)
    for i in range(4):
        first.put(
            key(i),
            make_payload(i, payload_size),
            layout=layout,
            num_tokens=NUM_TOKENS,
            tenant=f"t{i % 2}",
            scope="shared",
            source_position=32 * i,
            aux=bytes([i]),
        )
    on_disk = {m.key: m for m in first.list_chunks(Tier.DISK)}
    assert sorted(on_disk) == [key(0), key(1), key(2)]  # key 3 is in (volatile) CPU
    with pytest.raises(ValueError, match="in use"):
        make_store(cpu_bytes=obj_size, disk_path=str(tmp_path), disk_bytes=8 * obj_size)
    first.close()
    (tmp_path / f"{first.config.namespace}@0x00000000@0@dead.tmp").write_bytes(b"partial")

    second = make_store(cpu_bytes=obj_size, disk_path=str(tmp_path), disk_bytes=8 * obj_size)
    recovered = second.list_chunks(Tier.DISK)
    assert [m.key for m in recovered] == [key(0), key(1), key(2)]  # oldest first
    for m in recovered:
        assert m == on_disk[m.key]  # key, tenant, scope, layout, tokens, position, aux, checksum
        assert (m.layout_fingerprint, m.num_tokens, m.payload_nbytes) == (
            layout.fingerprint(),
            NUM_TOKENS,
            payload_size,
        )
    assert second.stats().recovered_chunks == 3 and second.tenant_usage("t0") == 2 * payload_size
    assert not list(tmp_path.glob("*.tmp"))
    got = second.get_many([key(2), key(3), key(0)])
    assert got[1] is None
    assert torch.equal(got[0].payload, make_payload(2, payload_size)) and got[0].tier == Tier.DISK
    assert torch.equal(got[2].payload, make_payload(0, payload_size))


@pytest.mark.parametrize("index", [True, False], ids=["index", "scan"])
def test_restart_drops_corrupt_files_and_respects_capacity(
    make_store, tmp_path: Path, layout: KVLayout, payload_size: int, obj_size: int, index: bool
) -> None:
    first = make_store(cpu_bytes=0, disk_path=str(tmp_path), disk_bytes=8 * obj_size)
    for i in range(4):
        _put(first, i, layout, payload_size)
    first.close()
    with open(first._disk.path_of(key(1)), "r+b") as f:
        f.write(b"garbage!")  # clobbers the header magic
    os.truncate(first._disk.path_of(key(2)), obj_size - 1)
    if not index:
        (tmp_path / f"{first.config.namespace}.kvindex").unlink()  # the full scan reads every header
    second = make_store(cpu_bytes=0, disk_path=str(tmp_path), disk_bytes=1 * obj_size)
    assert [m.key for m in second.list_chunks(Tier.DISK)] == [key(3)]  # key 0 evicted: over capacity
    st = second.stats()
    # The scan reads every header and size; with the index no file is opened at restart, so
    # damage behind a valid record is found when read (keys 1 and 2 are evicted for capacity first).
    assert st.checksum_failures == (0 if index else 2)
    assert st.evictions_by_reason[Reason.CAPACITY] == (3 if index else 1)
    assert sorted(p.name for p in tmp_path.glob("*.data")) == [second._disk.path_of(key(3)).name]
    assert torch.equal(second.get(key(3)).payload, make_payload(3, payload_size))


def test_failed_demotion_drops_the_lru_chunk_not_the_new_write(
    make_store, tmp_path: Path, layout: KVLayout, payload_size: int, obj_size: int
) -> None:
    """A failing lower tier (here: its directory removed) is treated as absent: the LRU chunk is
    dropped (reason io_error) so the new write lands, and the tier is backed off from."""
    disk = tmp_path / "disk"
    store = make_store(cpu_bytes=2 * obj_size, disk_path=str(disk), disk_bytes=8 * obj_size, io_timeout_s=5.0)
    _put(store, 0, layout, payload_size)
    _put(store, 1, layout, payload_size)
    store.take_events()
    shutil.rmtree(disk)  # the disk tier now fails every write
    _put(store, 2, layout, payload_size)
    events = store.take_events()
    assert [(ev.kind, ev.key, ev.reason) for ev in events if ev.kind is EventKind.EVICTED] == [
        (EventKind.EVICTED, key(0), Reason.IO_ERROR)]
    assert store.locate(key(0)) is None
    for i in (1, 2):
        assert torch.equal(store.get(key(i)).payload, make_payload(i, payload_size))
    st = store.stats()
    assert st.io_errors >= 1 and st.evictions_by_reason[Reason.IO_ERROR] == 1


def test_failed_demotion_of_a_claimed_chunk_is_backpressure_not_loss(
    make_store, tmp_path: Path, layout: KVLayout, payload_size: int, obj_size: int
) -> None:
    disk = tmp_path / "disk"
    store = make_store(cpu_bytes=2 * obj_size, disk_path=str(disk), disk_bytes=8 * obj_size, io_timeout_s=5.0)
    store.set_guards({key(0): Guard.NO_DROP, key(1): Guard.NO_DROP})
    _put(store, 0, layout, payload_size)
    _put(store, 1, layout, payload_size)
    shutil.rmtree(disk)
    with pytest.raises(CapacityError) as info:
        _put(store, 2, layout, payload_size)
    assert info.value.tier == Tier.CPU and "cannot demote" in info.value.reason
    assert store.take_events() == []
    for i in (0, 1):  # nothing claimed was dropped to make room
        assert torch.equal(store.get(key(i)).payload, make_payload(i, payload_size))
    assert store.stats().io_errors >= 1 and store.locate(key(2)) is None
