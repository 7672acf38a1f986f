"""The disk tier's index log: a restart reads it instead of every file; damage costs only the
damaged chunks; a missing index falls back to the full scan; the log stays compact."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sidecar.identity import KVLayout
from sidecar.tiers import Tier
from sidecar.tiers.disk_index import MAGIC, DiskIndex, _add_body, _frame
from sidecar.tiers.types import ChunkKey, ChunkMeta
from tests.tiers.conftest import NUM_TOKENS, key, make_payload

N = 12


def _fill(make_store, tmp_path: Path, layout: KVLayout, payload_size: int, obj_size: int):
    store = make_store(cpu_bytes=0, disk_path=str(tmp_path), disk_bytes=4 * N * obj_size)
    for i in range(N):
        store.put(key(i), make_payload(i, payload_size), layout=layout, num_tokens=NUM_TOKENS, tenant=f"t{i % 2}")
    metas = {m.key: m for m in store.list_chunks(Tier.DISK)}
    store.close()
    return store, metas


def _restart(make_store, tmp_path: Path, obj_size: int):
    return make_store(cpu_bytes=0, disk_path=str(tmp_path), disk_bytes=4 * N * obj_size)


def _index_path(tmp_path: Path, store) -> Path:
    return tmp_path / f"{store.config.namespace}.kvindex"


def _record_offsets(raw: bytes) -> list[int]:
    out, pos = [], raw.find(MAGIC)
    while pos >= 0:
        out.append(pos)
        pos = raw.find(MAGIC, pos + 1)
    return out


def test_restart_reads_the_index_not_the_files(
    make_store, tmp_path: Path, layout: KVLayout, payload_size: int, obj_size: int, monkeypatch
) -> None:
    first, metas = _fill(make_store, tmp_path, layout, payload_size, obj_size)
    opened: list[str] = []
    real_open = open

    def spy_open(path, *a, **k):
        if str(path).endswith(".data"):
            opened.append(str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", spy_open)
    second = _restart(make_store, tmp_path, obj_size)
    monkeypatch.undo()
    assert opened == []  # no object file was opened to rebuild the index
    recovered = second.list_chunks(Tier.DISK)
    assert [m.key for m in recovered] == [key(i) for i in range(N)]  # write order kept
    assert all(m == metas[m.key] for m in recovered)
    assert second.stats().recovered_chunks == N and second.tenant_usage("t0") == N // 2 * payload_size
    for i, got in enumerate(second.get_many([key(i) for i in range(N)], promote=False)):
        assert torch.equal(got.payload, make_payload(i, payload_size))


def test_damaged_records_and_files_cost_only_their_chunks(
    make_store, tmp_path: Path, layout: KVLayout, payload_size: int, obj_size: int
) -> None:
    first, metas = _fill(make_store, tmp_path, layout, payload_size, obj_size)
    first_ns = first.config.namespace
    idx = _index_path(tmp_path, first)
    raw = bytearray(idx.read_bytes())
    offs = _record_offsets(bytes(raw))
    assert len(offs) == N
    raw[offs[3] + 20] ^= 0xFF  # record of key 3: body checksum fails
    raw[offs[5]:offs[5] + 4] = b"XXXX"  # record of key 5: frame magic gone (resync on the next)
    raw += raw[offs[7]:offs[7] + 30]  # a torn record at the tail (a crash mid-append)
    idx.write_bytes(bytes(raw))
    # Files: key 8's payload flipped (its record is fine), key 9 truncated, key 10's file gone,
    # key 5's file also has a clobbered header (with its record damaged too it is unrecoverable).
    with open(first._disk.path_of(key(8)), "r+b") as f:
        f.seek(obj_size - 10)
        tail = f.read(10)
        f.seek(obj_size - 10)
        f.write(bytes(b ^ 0xFF for b in tail))
    os.truncate(first._disk.path_of(key(9)), obj_size - 100)
    first._disk.path_of(key(10)).unlink()
    with open(first._disk.path_of(key(5)), "r+b") as f:
        f.write(b"garbage!")
    (tmp_path / f"{first_ns}@0x00000000@0@beef.tmp").write_bytes(b"partial")

    second = _restart(make_store, tmp_path, obj_size)
    held = {m.key for m in second.list_chunks(Tier.DISK)}
    # key 3: damaged record, intact file -> its header is read and it is recovered;
    # key 5: damaged record and header -> removed; key 10: file gone -> dropped. Keys 8 and 9
    # (damaged behind valid records) are indexed: no file is opened at restart.
    assert held == {key(i) for i in range(N)} - {key(5), key(10)}
    assert second.stats().checksum_failures == 1
    assert not list(tmp_path.glob("*.tmp"))
    got = second.get_many([key(i) for i in range(N)], promote=False)
    for i, g in enumerate(got):
        if i in (5, 8, 9, 10):
            assert g is None, i  # clean misses (keys 8 and 9 fail on this first read)
        else:
            assert torch.equal(g.payload, make_payload(i, payload_size)), i
            assert g.meta == metas[key(i)]
    for i in (8, 9):
        assert not second._disk.path_of(key(i)).exists() and second.locate(key(i)) is None
    assert second.stats().checksum_failures == 3
    second.close()
    # The repaired index is what the next restart reads: the same chunks, nothing lost twice.
    third = _restart(make_store, tmp_path, obj_size)
    assert {m.key for m in third.list_chunks(Tier.DISK)} == held - {key(8), key(9)}
    assert third.stats().checksum_failures == 0


def test_missing_index_falls_back_to_the_scan_and_rebuilds_it(
    make_store, tmp_path: Path, layout: KVLayout, payload_size: int, obj_size: int
) -> None:
    first, metas = _fill(make_store, tmp_path, layout, payload_size, obj_size)
    _index_path(tmp_path, first).unlink()
    second = _restart(make_store, tmp_path, obj_size)
    assert [m.key for m in second.list_chunks(Tier.DISK)] == [key(i) for i in range(N)]  # mtime order
    assert all(m == metas[m.key] for m in second.list_chunks(Tier.DISK))
    assert _index_path(tmp_path, first).exists()
    second.close()
    index = DiskIndex(_index_path(tmp_path, first))
    objects, bad = index.load()
    index.close()
    assert bad == 0 and [o.meta.key for o in objects] == [key(i) for i in range(N)]


def _meta(i: int) -> ChunkMeta:
    return ChunkMeta(key=ChunkKey(key(i)), tenant="t", scope="t", layout_fingerprint="L", num_tokens=4,
                     payload_nbytes=100 + i, checksum=i * 7, created_at=1.5)


def test_index_log_compacts_and_replays_deletes(tmp_path: Path) -> None:
    path = tmp_path / "x.kvindex"
    index = DiskIndex(path)
    assert index.load() is None
    for i in range(10):
        index.add(_meta(i), 4096 + 100 + i)
    index.delete([key(2), key(4), key(99)])  # key 99 was never added: no record
    index.add(_meta(2), 4198)  # added again after its delete: now the most recent
    assert index.records == 13
    for round_ in range(700):  # churn one key: the log is compacted, never grows without bound
        index.add(_meta(50), 4096 + 150)
        index.delete([key(50)])
        assert index.records <= 2 * 10 + 1024 + 1
    index.close()
    again = DiskIndex(path)
    objects, bad = again.load()
    again.close()
    assert bad == 0
    assert [o.meta.key for o in objects] == [key(i) for i in (0, 1, 3, 5, 6, 7, 8, 9, 2)]
    assert objects[5].meta == _meta(7) and objects[5].nbytes == 4096 + 107
    assert path.stat().st_size < 200 * 1024


@pytest.mark.parametrize("cut", [1, 10, 17, 40])
def test_torn_tail_loses_only_the_last_record(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "x.kvindex"
    index = DiskIndex(path)
    index.load()
    for i in range(3):
        index.add(_meta(i), 4196 + i)
    index.close()
    raw = path.read_bytes()
    path.write_bytes(raw[: _record_offsets(raw)[2] + cut])
    again = DiskIndex(path)
    objects, bad = again.load()
    again.close()
    assert [o.meta.key for o in objects] == [key(0), key(1)] and bad == 1


def _shape(i: int) -> ChunkMeta:
    """Record shapes the batch decoder must read field by field: key lengths 1..64, non-ASCII
    and long strings, empty and maximal aux, extreme integers."""
    return ChunkMeta(key=ChunkKey(bytes([i]) * (1, 8, 33, 64)[i % 4]), tenant=("t", "ténant", "x" * 300)[i % 3],
                     scope=("s", "ŝcope")[i % 2], layout_fingerprint=f"L{i % 5}", num_tokens=(1, 2**62)[i % 2],
                     payload_nbytes=i * 4096, source_position=(0, 2**63 - 1)[i % 2],
                     aux=bytes([i]) * (0, 5, 1024)[i % 3],
                     checksum=(0, 2**64 - 1, i)[i % 3], created_at=(0.0, 1.7e9 + i / 7)[i % 2])


def test_every_record_shape_decodes_exactly_and_unparseable_frames_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "x.kvindex"
    index = DiskIndex(path)
    index.load()
    model: dict[bytes, tuple[ChunkMeta, int]] = {}
    for i in range(40):
        meta = _shape(i)
        index.add(meta, 4096 + i)
        model.pop(meta.key, None)
        model[meta.key] = (meta, 4096 + i)
        if i % 7 == 3:  # deletes, and a re-add that moves a key to the end
            index.delete([_shape(i - 1).key])
            model.pop(_shape(i - 1).key, None)
            index.add(_shape(i - 2), 7)
            model.pop(_shape(i - 2).key, None)
            model[_shape(i - 2).key] = (_shape(i - 2), 7)
    index.close()
    # Frames whose checksum holds but whose body is not a record (a writer bug, not damage):
    # each is skipped by its frame, and the records after it are read.
    good_add = _add_body(_shape(50), 1)
    unparseable = [b"", b"A", b"Z\x01\x00k", b"D\x00\x00", good_add[:-1], good_add + b"!"]
    with open(path, "ab") as f:
        f.write(b"".join(_frame(body) for body in unparseable))
    again = DiskIndex(path)
    again.load()
    again.add(_shape(60), 60)
    again.close()
    model[_shape(60).key] = (_shape(60), 60)

    third = DiskIndex(path)
    objects, bad = third.load()
    third.close()
    assert bad == len(unparseable)
    assert [(o.meta, o.nbytes) for o in objects] == list(model.values())  # write order, exact fields


def test_a_record_with_undecodable_strings_costs_only_its_record(
    make_store, tmp_path: Path, layout: KVLayout, payload_size: int, obj_size: int, monkeypatch
) -> None:
    first, metas = _fill(make_store, tmp_path, layout, payload_size, obj_size)
    idx = _index_path(tmp_path, first)
    # A checksummed record (the last one for key 4) whose tenant is not UTF-8: dropped at load,
    # so key 4's file is one the index does not name, and its header is read.
    body = bytearray(_add_body(metas[key(4)], obj_size))
    tenant_at = body.index(b"t0", 3 + len(key(4)))
    body[tenant_at:tenant_at + 2] = b"\xff\xfe"
    with open(idx, "ab") as f:
        f.write(_frame(bytes(body)))
    log = DiskIndex(idx)
    objects, bad = log.load()
    log.close()
    assert bad == 1 and key(4) not in {o.meta.key for o in objects} and len(objects) == N - 1
    second = _restart(make_store, tmp_path, obj_size)
    recovered = second.list_chunks(Tier.DISK)
    assert [m.key for m in recovered] == [key(i) for i in range(N) if i != 4] + [key(4)]  # header read last
    assert all(m == metas[m.key] for m in recovered)
    assert second.stats().checksum_failures == 0
    assert second.tenant_tier_usage("t0")[Tier.DISK] == (N // 2 * obj_size, N // 2)
    second.close()
    opened: list[str] = []
    real_open = open

    def spy_open(p, *a, **k):
        if str(p).endswith(".data"):
            opened.append(str(p))
        return real_open(p, *a, **k)

    monkeypatch.setattr("builtins.open", spy_open)
    third = _restart(make_store, tmp_path, obj_size)
    monkeypatch.undo()
    assert opened == []  # the repaired index names key 4 again
    assert {m.key for m in third.list_chunks(Tier.DISK)} == set(metas)
