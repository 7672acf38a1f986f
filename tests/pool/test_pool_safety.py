"""The shared pool under attack: races at full pressure (readers, writers, Evict/Delete of leased
chunks, a small CPU tier and a disk tier below it), leases and reservations that outlive their
engine (expired, or the engine SIGKILLed), a restarted sidecar, tenants, bad input and forged
descriptors. A real sidecar over loopback gRPC, its CPU tier in /dev/shm, real LMCache tiers.

Every read a reader accepted (``PoolClient.intact`` said the stamps were still there) is checked
byte for byte against the payload stored for its tokens and against the slot's xxh3 checksum: a
mismatch is a torn read, and there must be none. Reads the stamps caught are counted, not failed.

Over 600 lines: the pool's safety cases share one harness (a payload that is a function of its
tokens, Store by either path, hit items, a bounded wait), kept in one file beside its tests.
"""

from __future__ import annotations

import os
import random
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager

import grpc
import numpy as np
import pytest
import torch
import xxhash

from sidecar.api import pool as wire
from sidecar.api.kv import TENANT_HEADER, layout_to_wire
from sidecar.app import ServerThread
from sidecar.client import SyncSidecarClient
from sidecar.config import AuthConfig
from sidecar.errors import NotFound, ResourceExhausted
from sidecar.sdk.pool import PoolClient
from sidecar.shm.pool import FILE_PATTERN, FILE_PREFIX, REAP_AFTER_S, MappedPool
from sidecar.shm.segment import SHM_DIR
from sidecar.tiers import StoreConfig, chunk_key
from sidecar.tiers.types import Tier
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc
from tests.conftest import make_config
from tests.dataplane.test_dataplane import IDENT, LAYOUT, MiB, conversation, message

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm on this host")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config(*, cpu_bytes: int = 16 * MiB, lease_ttl_s: float = 2.0, reservation_ttl_s: float = 30.0,
           io_timeout_s: float = 5.0, **store_kw):
    store = StoreConfig(cpu_bytes=cpu_bytes, io_timeout_s=io_timeout_s, **store_kw)
    return make_config(store=store, auth=AuthConfig(operators=("a",)), pool_lease_ttl_s=lease_ttl_s,
                       pool_reservation_ttl_s=reservation_ttl_s)


@contextmanager
def served(cfg):
    with ServerThread(cfg) as st, SyncSidecarClient(st.target, tenant="a") as c:
        yield st, c


def expected(tokens: np.ndarray) -> torch.Tensor:
    """The payload every Store of a chunk of these tokens writes (a function of the tokens, so
    any reader can check any chunk it was served, whoever stored it)."""
    seed = xxhash.xxh3_64_intdigest(np.ascontiguousarray(tokens, dtype="<u4").tobytes()) >> 1
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(tokens) * LAYOUT.bytes_per_token // 4, generator=g)


def payloads(tokens: np.ndarray, bounds) -> dict[int, torch.Tensor]:
    return {a: expected(tokens[a:b]) for a, b in zip(bounds[:-1], bounds[1:])}


def store_stream(c, tokens) -> None:
    bounds = c.lookup(tokens, identity=IDENT).chunk_bounds
    c.store(tokens, identity=IDENT, layout=LAYOUT, payloads=payloads(tokens, bounds))


def store_pool(pool: PoolClient, tokens) -> None:
    w = pool.reserve(tokens, identity=IDENT, layout=LAYOUT)
    b = w.chunk_bounds
    try:
        for start, slot in w.slots.items():
            end = b[b.index(start) + 1]
            slot.copy_(expected(tokens[start:end]).view(torch.uint8))
    except BaseException:
        w.abort()
        raise
    w.commit()


def hit_items(c, tokens) -> list[tuple[int, int]]:
    plan = c.lookup(tokens, identity=IDENT, recompute_tokens=0)
    return [(h.chunk_hash, h.start - h.chunk_offset) for h in plan.hits()]


def cpu_used(st) -> int:
    return st.server.dataplane.store.stats().tiers[Tier.CPU].used_bytes


def wait_until(cond, what, limit_s: float = 30.0) -> None:
    """Poll ``cond`` (a liveness bound, not a timing assertion: it only fails when ``cond``
    never holds)."""
    end = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"never happened: {what() if callable(what) else what}")
        time.sleep(0.05)


def pools() -> set[str]:
    return {f for f in os.listdir(SHM_DIR) if FILE_PATTERN.fullmatch(f)}


# ---------------------------------------------------------------------------------------- races


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reads = self.torn = self.detected = self.leases = self.expired_releases = 0
        self.stored = self.refused = self.evicted = self.deleted = 0
        self.errors: list[BaseException] = []

    def add(self, **kw) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)


def _reader(target: str, prompts: list, leased: deque, done: threading.Event, t: Tally, seed: int,
            ttl_s: float) -> None:
    rnd = random.Random(seed)
    rng = np.random.default_rng(seed)
    with SyncSidecarClient(target, tenant="a", timeout_s=60) as c:  # a loaded CI host: liveness, not speed
        pool = PoolClient(c)
        while not done.is_set():
            tokens = rnd.choice(prompts)
            if rnd.random() < 0.5:  # the same body after another header: shifted hits
                tokens = np.concatenate([message(rng, rnd.randint(10, 120)), tokens[61:]]).astype(np.uint32)
            items = hit_items(c, tokens)
            if not items:
                continue
            fetched = pool.lease(items, identity=IDENT, layout=LAYOUT)
            chunks = [ch for it in fetched.items if it.ok for ch in it.chunks]
            leased.extend(ch_hash for (ch_hash, _), it in zip(items, fetched.items) if it.ok)
            if rnd.random() < 0.05:
                time.sleep(ttl_s * 1.5)  # a stalled engine: its lease expires before it reads
            copies = [pool.chunk_view(ch).clone() for ch in chunks]
            ok = pool.intact(fetched)
            if not pool.release(fetched):
                t.add(expired_releases=1)
            if not chunks:
                continue
            if not ok:
                t.add(detected=1, leases=1)
                continue
            torn = 0
            for ch, got in zip(chunks, copies):
                at = ch.source_pos + ch.delta - ch.row_offset
                want = expected(tokens[at : at + ch.num_tokens]).view(torch.uint8)
                if xxhash.xxh3_64_intdigest(got.numpy()) != ch.checksum or not torch.equal(got, want):
                    torn += 1
            t.add(reads=len(chunks), torn=torn, leases=1)


def _writer(target: str, prompts: list, rounds: int, readers_done: threading.Event, t: Tally, seed: int) -> None:
    """At least ``rounds`` Stores, and on (at most 20x as many) while the readers still read:
    the evictor keeps emptying the tier, and readers need something to find."""
    rng = np.random.default_rng(seed)
    with SyncSidecarClient(target, tenant="a", timeout_s=60) as c:  # a loaded CI host: liveness, not speed
        pool = PoolClient(c)
        for i in range(20 * rounds):
            if i >= rounds and readers_done.is_set():
                break
            tokens, _ = conversation(rng, 60)
            if i % 3 == 2 and prompts:  # again: chunks evicted meanwhile are stored again
                tokens = prompts[int(rng.integers(len(prompts)))]
            try:
                if i % 2:
                    store_stream(c, tokens)
                else:
                    store_pool(pool, tokens)
            except ResourceExhausted:
                t.add(refused=1)  # every victim was leased at that moment
                continue
            prompts.append(tokens)
            t.add(stored=1)


def _evictor(target: str, leased: deque, done: threading.Event, t: Tally, seed: int) -> None:
    rnd = random.Random(seed)
    with SyncSidecarClient(target, tenant="a", timeout_s=60) as c:  # a loaded CI host: liveness, not speed
        while not done.is_set():
            picked = []
            while leased and len(picked) < 4:
                picked.append(leased.popleft())
            if not picked:
                time.sleep(0.01)
                continue
            if rnd.random() < 0.5:
                t.add(evicted=c.evict(picked))
            else:
                t.add(deleted=c.delete(picked))


def _run_with_errors(fn, t: Tally, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        t.errors.append(exc)


@pytest.mark.parametrize("disk", [False, True], ids=["cpu", "cpu+disk"])
def test_races_at_full_pressure_never_tear_a_read(disk, tmp_path, rng):
    ttl = 0.5
    kw = dict(disk_path=str(tmp_path / "kv"), disk_bytes=8 * MiB) if disk else {}
    with served(config(cpu_bytes=3 * MiB, lease_ttl_s=ttl, io_timeout_s=4.0, **kw)) as (st, c):
        prompts: list = []
        for _ in range(2):
            tokens, _ = conversation(rng, 60)
            store_stream(c, tokens)
            prompts.append(tokens)
        t = Tally()
        done = threading.Event()
        leased: deque = deque(maxlen=64)
        enough = threading.Event()  # the readers finished their leases: writers may stop
        writers = [threading.Thread(target=_run_with_errors,
                                    args=(_writer, t, st.target, prompts, 10, enough, t, 100 + i))
                   for i in range(2)]
        others = [threading.Thread(target=_run_with_errors,
                                   args=(_reader, t, st.target, prompts, leased, done, t, 200 + i, ttl))
                  for i in range(3)]
        others.append(threading.Thread(target=_run_with_errors, args=(_evictor, t, st.target, leased, done, t, 7)))
        for th in writers + others:
            th.start()
        wait_until(lambda: t.leases >= 20 or t.errors, "readers finished 20 leases", limit_s=180)
        enough.set()
        for th in writers:
            th.join()
        done.set()
        for th in others:
            th.join()
        assert not t.errors, t.errors
        store = st.server.dataplane.store
        wait_until(lambda: store.leased == 0, "every lease released or expired")
        stats = store.stats()
        evictions = sum(stats.evictions_by_reason.values())
        print(f"\n[{'cpu+disk' if disk else 'cpu'}] reads={t.reads} torn={t.torn} detected={t.detected} "
              f"leases={t.leases} expired_releases={t.expired_releases} stored={t.stored} refused={t.refused} "
              f"evict_rpc={t.evicted} delete_rpc={t.deleted} tier_evictions={evictions} "
              f"demotions={stats.demotions} promotions={stats.promotions}")
        assert t.torn == 0
        assert t.reads > 0 and t.stored > 0
        assert evictions > 0 and t.evicted + t.deleted > 0
        if disk:
            assert stats.demotions > 0
        assert st.server.dataplane.pool.reservations == 0


# ---------------------------------------------------------------------------------------- leases


def test_a_live_lease_keeps_its_bytes_through_delete_and_evict(rng):
    """Delete and Evict do not wait for leases: the chunk leaves the registry and the tier at
    once (a new lease misses it, the key may be stored again), and its memory is freed only
    when the last lease on it ends."""
    with served(config(lease_ttl_s=3.0, io_timeout_s=6.0)) as (st, c):
        pool = PoolClient(c)
        tokens, _ = conversation(rng, 60)
        store_pool(pool, tokens)
        items = hit_items(c, tokens)
        reg = st.server.dataplane.index.registry
        store = st.server.dataplane.store
        cpu = store._mem[Tier.CPU]
        for op in ("delete", "evict"):
            fetched = pool.lease(items[:2], identity=IDENT, layout=LAYOUT)
            chunks = [ch for it in fetched.items for ch in it.chunks]
            assert store.leased == len(chunks) == 2
            before = [pool.chunk_view(ch).clone() for ch in chunks]
            used = cpu.allocator_usage()[0]
            assert getattr(c, op)([h for h, _ in items[:2]]) == 2  # no wait for the lease
            first = chunk_key(items[0][0])
            assert not store.contains(first)
            if op == "delete":
                assert all(reg.peek(h) is None for h, _ in items[:2])
            assert not any(it.ok for it in pool.lease(items[:2], identity=IDENT, layout=LAYOUT).items)
            assert pool.intact(fetched)  # the leased bytes are still there, untouched
            assert all(torch.equal(pool.chunk_view(ch), b) for ch, b in zip(chunks, before))
            assert cpu.allocator_usage()[0] == used  # not freed under the lease
            pool.release(fetched)
            assert cpu.allocator_usage()[0] < used  # freed with the last lease
            fetched.lease = "x"  # as if still held: the stamps say the memory is gone
            assert not pool.intact(fetched)
            items = items[2:]


def test_an_expired_lease_is_reaped(rng):
    with served(config(lease_ttl_s=0.3, io_timeout_s=2.0)) as (st, c):
        pool = PoolClient(c)
        tokens, _ = conversation(rng, 60)
        store_pool(pool, tokens)
        items = hit_items(c, tokens)
        store = st.server.dataplane.store
        fetched = pool.lease(items, identity=IDENT, layout=LAYOUT)
        assert store.leased == len(items) > 0
        wait_until(lambda: store.leased == 0, "the reaper released the expired lease")
        assert st.server.dataplane.pool.leases == 0 and st.server.dataplane.pool.expired_leases == 1
        lease = fetched.lease
        with pytest.raises(NotFound, match="^lease"):
            c.release_lease(lease)
        assert pool.release(fetched) is False  # the SDK says it had expired, nothing to end
        fetched.lease = lease
        assert pool.intact(fetched)  # unpinned, but nothing reused the memory yet
        assert c.delete([h for h, _ in items]) == len(items)  # nothing to wait for
        assert not pool.intact(fetched)


# ---------------------------------------------------------------------------------------- a killed engine


def test_a_killed_engine_leaves_no_pin_reservation_or_bytes(rng, tmp_path):
    with served(config(lease_ttl_s=0.5, reservation_ttl_s=1.0, io_timeout_s=3.0)) as (st, c):
        leased_tokens, _ = conversation(rng, 60)
        store_stream(c, leased_tokens)
        reserved_tokens, _ = conversation(rng, 60)
        np.save(tmp_path / "leased.npy", leased_tokens)
        np.save(tmp_path / "reserved.npy", reserved_tokens)
        store, plane = st.server.dataplane.store, st.server.dataplane
        used = cpu_used(st)
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.pool.engine_proc", st.target, str(tmp_path / "leased.npy"),
             str(tmp_path / "reserved.npy")],
            cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        try:
            ready = select.select([proc.stdout], [], [], 120)[0]
            line = proc.stdout.readline() if ready else ""
            assert line.startswith("ready"), (line, proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
            _, chunks, slots = line.split()
            assert int(chunks) > 0 and int(slots) > 0
            assert store.leased == int(chunks) and plane.pool.reservations == 1
            assert cpu_used(st) > used
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        wait_until(lambda: store.leased == 0 and plane.pool.reservations == 0, "the dead engine's lease and "
                   "reservation expired")
        assert plane.pool.expired_leases == 1 and plane.pool.expired_reservations == 1
        assert not c.lookup(reserved_tokens, identity=IDENT).hits()
        assert cpu_used(st) == used
        # its leased chunks are served and deletable without waiting for anyone
        assert len(hit_items(c, leased_tokens)) == int(chunks)
        assert c.delete([h for h, _ in hit_items(c, leased_tokens)]) == int(chunks)


def _deadlines(call, reqs, md) -> int:
    """Send each request with deadlines from 1 ms up (cancelled mid-handler, as when an engine
    dies or gives up during the call); how many were cancelled."""
    cancelled = 0
    for i, req in enumerate(reqs):
        try:
            call(req, metadata=md, timeout=(0.001, 0.003, 0.01, 0.03, 0.1)[i % 5])
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
            cancelled += 1
    return cancelled


def test_a_lease_fetch_cancelled_mid_call_leaves_no_pin(rng, tmp_path):
    cfg = config(cpu_bytes=8 * MiB, lease_ttl_s=0.5, io_timeout_s=3.0, disk_path=str(tmp_path / "kv"),
                 disk_bytes=64 * MiB)
    with served(cfg) as (st, c), grpc.insecure_channel(st.target) as ch:
        items = []
        for _ in range(12):  # more than the CPU tier holds: some hits are promoted from disk
            tokens, _ = conversation(rng, 60)
            store_stream(c, tokens)
            items += hit_items(c, tokens)
        stub = sidecar_pb2_grpc.KVSidecarStub(ch)
        md = ((TENANT_HEADER, "a"),)
        cancelled = _deadlines(stub.LeaseFetch, [wire.lease_fetch_request(IDENT, LAYOUT, items)] * 30, md)
        assert cancelled > 0
        store, plane = st.server.dataplane.store, st.server.dataplane
        wait_until(lambda: plane.pool.leases == 0, "every granted lease expired")
        # a pin whose lease was never recorded would never end: victims never chosen, Deletes wait
        wait_until(lambda: store.leased == 0, "no pin outlives its call's lease", limit_s=10)


def test_a_reserve_store_cancelled_mid_call_leaves_no_slot(rng):
    with served(config(cpu_bytes=64 * MiB, reservation_ttl_s=0.5)) as (st, c), grpc.insecure_channel(st.target) as ch:
        stub = sidecar_pb2_grpc.KVSidecarStub(ch)
        md = ((TENANT_HEADER, "a"),)
        used = cpu_used(st)
        prompts = [np.concatenate([conversation(rng, 60)[0] for _ in range(4)]).astype(np.uint32) for _ in range(30)]
        cancelled = _deadlines(stub.ReserveStore, [wire.reserve_store_request(p, IDENT, LAYOUT) for p in prompts], md)
        assert cancelled > 0
        plane = st.server.dataplane
        wait_until(lambda: plane.pool.reservations == 0, "every granted reservation expired")
        wait_until(lambda: cpu_used(st) == used, lambda: f"no staged slot outlives its call's reservation (CPU bytes used {used} -> {cpu_used(st)})", limit_s=10)
        assert not any(c.lookup(p, identity=IDENT).hits() for p in prompts)


def test_a_stalled_engine_writing_an_expired_reservation_is_never_served(rng):
    """An engine that stalls past ``pool_reservation_ttl_s`` and then writes its slots writes
    memory the sidecar has reused for another chunk. The SDK refuses to write or commit past
    the TTL; a process that writes anyway (stalled mid-copy, or hostile) is caught by a leased
    read's ``verify`` (the stamps are untouched: only the checksum tells) and by the sidecar's
    own reads."""
    with served(config(cpu_bytes=4 * MiB, reservation_ttl_s=0.5)) as (st, c):
        pool = PoolClient(c)
        tokens, _ = conversation(rng, 60)
        w = pool.reserve(tokens, identity=IDENT, layout=LAYOUT)
        base = pool.mapped.tensor.data_ptr()
        stale = [(v.data_ptr() - base, v.data_ptr() - base + v.numel()) for v in w.slots.values()]
        wait_until(lambda: st.server.dataplane.pool.reservations == 0, "the reservation expired")
        store_stream(c, tokens)  # the same chunks, stored over the stream into the freed memory
        items = hit_items(c, tokens)
        fetched = pool.lease(items, identity=IDENT, layout=LAYOUT)
        chunks = [ch for it in fetched.items for ch in it.chunks]
        assert any(a < ch.offset + ch.length and ch.offset < b for ch in chunks for a, b in stale)  # reused
        for v in w.slots.values():
            v.fill_(0xAB)  # the stalled engine wakes up and writes its Store
        bad = [ch for ch in chunks if xxhash.xxh3_64_intdigest(pool.chunk_view(ch).numpy()) != ch.checksum]
        assert bad
        assert pool.intact(fetched)  # the stamps alone do not see it
        assert not pool.intact(fetched, verify=True)
        pool.release(fetched)
        with pytest.raises(ValueError, match="reservation"):  # the SDK itself never writes late
            w.write(next(iter(w.slots)), bytes(w.slots[next(iter(w.slots))].numel()))
        with pytest.raises(ValueError, match="reservation"):
            w.commit()
        for r, (_, pos) in zip(pool.fetch(items, identity=IDENT, layout=LAYOUT, verify=True), items):
            if r.ok:
                want = expected(tokens[pos : pos + r.num_tokens]).view(torch.uint8)
                assert torch.equal(torch.frombuffer(bytearray(r.data), dtype=torch.uint8), want)
        assert not any(r.ok for r in c.fetch(items, identity=IDENT, layout=LAYOUT))  # the sidecar's own check


# ---------------------------------------------------------------------------------------- restarts


def test_a_restarted_sidecar_has_a_new_pool_and_the_client_remaps(rng):
    st1 = ServerThread(config()).start()
    port = st1.port
    c = SyncSidecarClient(st1.target, tenant="a")
    try:
        pool = PoolClient(c)
        first = pool.name
        tokens, _ = conversation(rng, 60)
        store_pool(pool, tokens)
        old = pool.lease(hit_items(c, tokens), identity=IDENT, layout=LAYOUT)
        assert old.pool == first and pool.intact(old)
        st1.stop()
        assert first not in pools()
        st2 = ServerThread(make_config(port=port, store=StoreConfig(cpu_bytes=16 * MiB),
                                       auth=AuthConfig(operators=("a",)))).start()
        try:
            second = c.map_pool().name
            assert second and second != first and second in pools()
            assert pool.name == first and old.pool != second
            # the old mapping outlives its sidecar: nobody reuses that memory, the stamps hold
            assert pool.intact(old)
            with pytest.raises(NotFound, match="^lease"):
                c.release_lease(old.lease)  # sidecar 2 never granted it
            store_stream(c, tokens)
            items = hit_items(c, tokens)
            fetched = pool.lease(items, identity=IDENT, layout=LAYOUT)
            assert fetched.pool == second and pool.name == second  # remapped on the way
            old.lease = "x" * 32
            with pytest.raises(ValueError, match="^pool"):
                pool.intact(old)  # offsets of the old pool are never trusted in the new one
            chunks = [ch for it in fetched.items for ch in it.chunks]
            assert len(chunks) == len(items)
            for ch in chunks:
                want = expected(tokens[ch.source_pos : ch.source_pos + ch.num_tokens]).view(torch.uint8)
                assert torch.equal(pool.chunk_view(ch), want)
            assert pool.intact(fetched)
            pool.release(fetched)
        finally:
            st2.stop()
    finally:
        c.close()
        st1.stop()


def test_a_dead_sidecars_pool_file_is_reaped_and_a_live_one_kept():
    import fcntl

    dead = os.path.join(SHM_DIR, FILE_PREFIX + secrets.token_hex(16))
    alive = os.path.join(SHM_DIR, FILE_PREFIX + secrets.token_hex(16))
    other = os.path.join(SHM_DIR, FILE_PREFIX + "not-hex-" + secrets.token_hex(4))
    young = os.path.join(SHM_DIR, FILE_PREFIX + secrets.token_hex(16))  # being created by a sidecar starting now
    old = time.time() - 2 * REAP_AFTER_S
    for p in (dead, alive, other, young):
        with open(p, "wb") as f:
            f.write(b"\0" * 4096)
        if p != young:
            os.utime(p, (old, old))
    fd = os.open(alive, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a live sidecar's lock
    try:
        with ServerThread(config()) as st:
            assert st.server.dataplane.pool.name
            assert not os.path.exists(dead)
            assert os.path.exists(alive) and os.path.exists(other) and os.path.exists(young)
    finally:
        os.close(fd)
        for p in (dead, alive, other, young):
            if os.path.exists(p):
                os.unlink(p)


# ---------------------------------------------------------------------------------------- tenancy


def test_another_tenant_can_neither_lease_nor_end_what_is_not_its_own(rng):
    with served(config()) as (st, a), SyncSidecarClient(st.target, tenant="b") as b:
        pa, pb_ = PoolClient(a), PoolClient(b)
        tokens, _ = conversation(rng, 60)
        store_pool(pa, tokens)
        items = hit_items(a, tokens)
        store, plane = st.server.dataplane.store, st.server.dataplane
        theirs = pb_.lease(items, identity=IDENT, layout=LAYOUT)
        assert not theirs.lease and not any(it.ok for it in theirs.items) and store.leased == 0
        mine = pa.lease(items, identity=IDENT, layout=LAYOUT)
        assert store.leased == len(items)
        with pytest.raises(NotFound, match="^lease"):
            b.release_lease(mine.lease)
        other, _ = conversation(rng, 60)
        w = pa.reserve(other, identity=IDENT, layout=LAYOUT)
        with pytest.raises(NotFound, match="^reservation"):
            b.commit_store(w.reservation, len(w.slots), sum(s.numel() for s in w.slots.values()))
        with pytest.raises(NotFound, match="^reservation"):
            b.abort_store(w.reservation)
        assert store.leased == len(items) and plane.pool.reservations == 1  # untouched
        pa.release(mine)
        assert w.abort() == len(w.slots)
        mode = os.stat(os.path.join(SHM_DIR, pa.name)).st_mode & 0o777
        assert mode == 0o600, oct(mode)


# ---------------------------------------------------------------------------------------- bad input


def _code(fn, req, md) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn(req, metadata=md, timeout=10)
    return info.value.code(), info.value.details()


def test_bad_input_is_refused_naming_the_field_and_changes_nothing(rng):
    with served(config()) as (st, c), grpc.insecure_channel(st.target) as ch:
        stub = sidecar_pb2_grpc.KVSidecarStub(ch)
        md = ((TENANT_HEADER, "a"),)
        pool = PoolClient(c)
        tokens, _ = conversation(rng, 60)
        store_pool(pool, tokens)
        items = hit_items(c, tokens)
        store, plane = st.server.dataplane.store, st.server.dataplane
        used = cpu_used(st)

        def unchanged() -> None:
            assert store.leased == 0 and plane.pool.reservations == 0 and plane.pool.leases == 0
            assert cpu_used(st) == used

        INV, NF = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
        for bad in ("", "xyz", "A" * 32, "0" * 31, "0" * 33, "g" * 32):
            code, msg = _code(stub.ReleaseLease, pb.ReleaseLeaseRequest(lease=bad), md)
            assert code == INV and msg.startswith("lease:"), (bad, code, msg)
            for rpc, req in ((stub.CommitStore, pb.CommitStoreRequest(reservation=bad, commit=pb.StoreCommit())),
                             (stub.AbortStore, pb.AbortStoreRequest(reservation=bad))):
                code, msg = _code(rpc, req, md)
                assert code == INV and msg.startswith("reservation:"), (bad, code, msg)
        unchanged()

        fetched = pool.lease(items, identity=IDENT, layout=LAYOUT)
        lease = fetched.lease
        pool.release(fetched)
        code, msg = _code(stub.ReleaseLease, pb.ReleaseLeaseRequest(lease=lease), md)
        assert code == NF and msg.startswith("lease:")
        for rpc, req in ((stub.CommitStore, pb.CommitStoreRequest(reservation="0" * 32, commit=pb.StoreCommit())),
                         (stub.AbortStore, pb.AbortStoreRequest(reservation="0" * 32))):
            code, msg = _code(rpc, req, md)
            assert code == NF and msg.startswith("reservation:")
        unchanged()

        other, _ = conversation(rng, 60)
        for field, wrong in (("commit.chunks", lambda n, b: (n + 1, b)), ("commit.payload_bytes", lambda n, b: (n, b - 1))):
            w = pool.reserve(other, identity=IDENT, layout=LAYOUT)
            n, nbytes = len(w.slots), sum(s.numel() for s in w.slots.values())
            for s in w.slots.values():
                s.fill_(1)
            chunks, payload_bytes = wrong(n, nbytes)
            req = pb.CommitStoreRequest(reservation=w.reservation,
                                        commit=pb.StoreCommit(chunks=chunks, payload_bytes=payload_bytes))
            code, msg = _code(stub.CommitStore, req, md)
            assert code == INV and msg.startswith(field + ":"), (code, msg)
            assert not c.lookup(other, identity=IDENT).hits()  # nothing stored
            code, msg = _code(stub.AbortStore, pb.AbortStoreRequest(reservation=w.reservation), md)
            assert code == NF and msg.startswith("reservation:")  # the reservation is gone
            unchanged()
        code, msg = _code(stub.CommitStore, pb.CommitStoreRequest(reservation="0" * 32), md)
        assert code == INV and msg.startswith("commit"), msg  # no counts: refused before the lookup

        header = wire.reserve_store_request(other, IDENT, LAYOUT).header
        for starts in ([1], [0, 0], [len(other) + 5]):
            code, msg = _code(stub.ReserveStore, pb.ReserveStoreRequest(header=header, chunk_starts=starts), md)
            assert code == INV and msg.startswith("chunk_starts:"), (starts, code, msg)
            unchanged()
        no_layout = pb.StoreHeader()
        no_layout.CopyFrom(header)
        no_layout.ClearField("layout")
        code, msg = _code(stub.ReserveStore, pb.ReserveStoreRequest(header=no_layout), md)
        assert code == INV and msg.startswith("header.layout"), msg

        req = wire.lease_fetch_request(IDENT, LAYOUT, items)
        req.fetch.ClearField("layout")
        code, msg = _code(stub.LeaseFetch, req, md)
        assert code == INV and msg.startswith("fetch.layout"), msg
        bad_layout = wire.lease_fetch_request(IDENT, LAYOUT, items)
        bad_layout.fetch.layout.CopyFrom(layout_to_wire(LAYOUT))
        bad_layout.fetch.layout.num_layers = 0
        code, msg = _code(stub.LeaseFetch, bad_layout, md)
        assert code == INV and msg.startswith("fetch.layout"), msg
        unchanged()
        assert len(hit_items(c, tokens)) == len(items)  # the stored chunks are all still served


# ---------------------------------------------------------------------------------------- forged descriptors


def test_a_forged_descriptor_cannot_reach_outside_the_pool():
    with served(config(cpu_bytes=4 * MiB)) as (st, c):
        info = c.map_pool()
        m = MappedPool(info.name, info.size, info.header_bytes)
        size, hb = info.size, info.header_bytes
        assert m.view(hb, 8).numel() == 8 and m.view(size - 8, 8).numel() == 8
        for offset, length in ((size, 1), (size - 8, 9), (-8, 8), (0, 8), (hb - 1, 8), (hb, 0), (hb, -1),
                               (2**63, 8), (hb, size)):
            with pytest.raises(ValueError, match="^slot.offset"):
                m.view(offset, length)
        for name in ("../../etc/passwd", "kvsc-" + "0" * 32, info.name + "/x", FILE_PREFIX + "0" * 31):
            with pytest.raises(ValueError, match="^pool.name"):
                MappedPool(name, info.size, info.header_bytes)
        with pytest.raises(ValueError, match="^pool.size"):
            MappedPool(info.name, info.size + 4096, info.header_bytes)
        m.close()
