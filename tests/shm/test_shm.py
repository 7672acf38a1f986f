"""The shared-memory data plane (sidecar/shm): Fetch payloads written into a buffer in /dev/shm
by a real sidecar over loopback gRPC, read in place by the real client; byte-identical to the
inline stream, every refusal names its field and changes nothing."""

from __future__ import annotations

import gc
import logging
import os
import threading

import grpc
import numpy as np
import pytest

from sidecar.api.kv import identity_to_wire, layout_to_wire, rope_to_wire
from sidecar.app import ServerThread, create_server
from sidecar.client import SidecarClient, SyncSidecarClient
from sidecar.config import AuthConfig
from sidecar.shm import HEADER_BYTES, MAGIC, SHM_DIR, Segment, SegmentPool, ShmWriter, local_peer, local_target
from sidecar.tiers import StoreConfig
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc
from tests.conftest import make_config
from tests.dataplane.test_dataplane import (
    IDENT,
    LAYOUT,
    SPEC,
    MiB,
    check_rotated,
    conversation,
    message,
    payloads_for,
    store_all,
)

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm on this host")


def sample(server, name: str, **labels) -> float:
    return server.metrics.registry.get_sample_value(name, labels) or 0.0


async def start(**kw):
    cfg = make_config(store=StoreConfig(cpu_bytes=64 * MiB), auth=AuthConfig(operators=("a",)), **kw)
    server, port = await create_server(cfg)
    return server, f"127.0.0.1:{port}"


async def stored_and_shifted(c, rng):
    """Store a conversation; the fetch items of its body moved behind a longer header."""
    first, body = conversation(rng, 60)
    second = np.concatenate([message(rng, 310), body]).astype(np.uint32)
    _, pl = await store_all(c, first)
    plan = await c.lookup(second, identity=IDENT, recompute_tokens=0)
    hits = plan.hits()
    assert hits
    return pl, [(h.chunk_hash, h.start - h.chunk_offset) for h in hits], plan.fetch_spans()


def shm_files() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("kvsc-")}


async def test_payloads_through_shared_memory_equal_the_inline_stream(rng):
    server, target = await start()
    before = shm_files()
    try:
        async with SidecarClient(target, tenant="a") as shm, SidecarClient(target, tenant="a", shared_memory=False) as inline:
            pl, items, spans = await stored_and_shifted(shm, rng)
            for kw in ({"rope": SPEC}, {"raw": True}):
                a0 = sample(server, "kv_sidecar_fetch_shared_memory_bytes_total")
                via_shm = await shm.fetch(items, identity=IDENT, layout=LAYOUT, **kw)
                wrote = sample(server, "kv_sidecar_fetch_shared_memory_bytes_total") - a0
                via_stream = await inline.fetch(items, identity=IDENT, layout=LAYOUT, **kw)
                assert wrote == sum(len(kv.data) for kv in via_shm) > 0  # every payload went through the buffer
                assert sample(server, "kv_sidecar_fetch_shared_memory_bytes_total") - a0 == wrote  # inline: none
                assert [(k.ok, k.delta, k.rotated, bytes(k.data)) for k in via_shm] == \
                    [(k.ok, k.delta, k.rotated, bytes(k.data)) for k in via_stream]
                if "rope" in kw:
                    check_rotated(via_shm, pl)
            # span items (one per hit segment, joined on the server) too
            got = await shm.fetch(spans, identity=IDENT, layout=LAYOUT, rope=SPEC)
            want = await inline.fetch(spans, identity=IDENT, layout=LAYOUT, rope=SPEC)
            assert [bytes(k.data) for k in got] == [bytes(k.data) for k in want]
            assert len(shm_files() - before) >= 1  # the buffer is a real /dev/shm object while in use
            # payloads are writable views the caller owns until it drops them
            got[0].data[:4] = b"\0\0\0\0"
            assert bytes(got[0].data[:4]) == b"\0\0\0\0"
        assert shm_files() == before  # close() removed the buffers' names
    finally:
        await server.stop(None)


async def test_payloads_that_do_not_fit_come_inline_and_the_next_buffer_fits(rng):
    server, target = await start()
    try:
        chunk = LAYOUT.bytes_per_token * 64
        async with SidecarClient(target, tenant="a", shared_memory_bytes=HEADER_BYTES + chunk) as c, \
                SidecarClient(target, tenant="a", shared_memory=False) as inline:
            _, items, _ = await stored_and_shifted(c, rng)
            want = [bytes(k.data) for k in await inline.fetch(items, identity=IDENT, layout=LAYOUT, rope=SPEC)]
            full0 = sample(server, "kv_sidecar_fetch_shared_memory_fallbacks_total", reason="full")
            first = await c.fetch(items, identity=IDENT, layout=LAYOUT, rope=SPEC)
            assert [bytes(k.data) for k in first] == want
            assert sample(server, "kv_sidecar_fetch_shared_memory_fallbacks_total", reason="full") == full0 + 1
            del first
            gc.collect()
            assert c._shm._want >= sum(len(w) for w in want)  # the next buffer is sized for the call
            b0 = sample(server, "kv_sidecar_fetch_shared_memory_bytes_total")
            second = await c.fetch(items, identity=IDENT, layout=LAYOUT, rope=SPEC)
            assert [bytes(k.data) for k in second] == want
            assert sample(server, "kv_sidecar_fetch_shared_memory_bytes_total") - b0 == sum(len(w) for w in want)
            assert sample(server, "kv_sidecar_fetch_shared_memory_fallbacks_total", reason="full") == full0 + 1
    finally:
        await server.stop(None)


async def test_disabled_sidecar_and_missing_buffer_answer_inline(rng):
    server, target = await start(fetch_shared_memory=False)
    try:
        async with SidecarClient(target, tenant="a") as c:
            _, items, _ = await stored_and_shifted(c, rng)
            got = await c.fetch(items, identity=IDENT, layout=LAYOUT, rope=SPEC)
            assert all(k.ok for k in got)
            assert sample(server, "kv_sidecar_fetch_shared_memory_bytes_total") == 0
            assert sample(server, "kv_sidecar_fetch_shared_memory_fallbacks_total", reason="disabled") == 1
    finally:
        await server.stop(None)
    server, target = await start()
    try:
        async with SidecarClient(target, tenant="a", shared_memory=False) as c:
            _, items, _ = await stored_and_shifted(c, rng)
            name = "kvsc-" + "0" * 32  # a well-formed name nobody created: e.g. another /dev/shm
            resps = await raw_fetch(target, items, pb.SharedMemory(name=name, token=b"\1" * 16))
            assert all(r.shm_length == 0 for r in resps) and sum(len(r.data) for r in resps) > 0
            assert sample(server, "kv_sidecar_fetch_shared_memory_fallbacks_total", reason="unavailable") == 1
    finally:
        await server.stop(None)


async def raw_fetch(target, items, shm: pb.SharedMemory) -> list[pb.FetchResponse]:
    req = pb.FetchRequest(identity=identity_to_wire(IDENT), layout=layout_to_wire(LAYOUT), rope=rope_to_wire(SPEC),
                          items=[pb.FetchItem(chunk_hash=h, target_pos=t) for h, t in items], shm=shm)
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.KVSidecarStub(ch)
        return [r async for r in stub.Fetch(req, metadata=(("x-tenant-id", "a"),))]


async def test_bad_buffers_are_refused_by_field_and_nothing_is_written(rng, tmp_path):
    server, target = await start()
    seg, other = Segment(1 << 20), Segment(1 << 20)
    victim = tmp_path / "victim"
    victim.write_bytes(MAGIC + seg.token + b"x" * 100)
    links = []
    try:
        async with SidecarClient(target, tenant="a", shared_memory=False) as c:
            _, items, _ = await stored_and_shifted(c, rng)
            stats0 = await c.stats()
            symlink = os.path.join(SHM_DIR, "kvsc-" + "1" * 32)
            os.symlink(victim, symlink)
            links.append(symlink)
            hardlink = os.path.join(SHM_DIR, "kvsc-" + "2" * 32)
            os.link(other.path, hardlink)
            links.append(hardlink)
            cases = [
                (pb.SharedMemory(name="../etc/passwd", token=seg.token), grpc.StatusCode.INVALID_ARGUMENT, "shm.name"),
                (pb.SharedMemory(name=seg.name.upper(), token=seg.token), grpc.StatusCode.INVALID_ARGUMENT, "shm.name"),
                (pb.SharedMemory(name=seg.name, token=b"abc"), grpc.StatusCode.INVALID_ARGUMENT, "shm.token"),
                (pb.SharedMemory(name=seg.name, token=b"\0" * 16), grpc.StatusCode.PERMISSION_DENIED, "shm.token"),
                (pb.SharedMemory(name=os.path.basename(symlink), token=seg.token), grpc.StatusCode.INVALID_ARGUMENT, "symlink"),
                (pb.SharedMemory(name=os.path.basename(hardlink), token=other.token), grpc.StatusCode.INVALID_ARGUMENT, "one link"),
            ]
            for shm, code, words in cases:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await raw_fetch(target, items, shm)
                assert e.value.code() == code and words in e.value.details(), (shm, e.value.details())
            assert not seg.array()[HEADER_BYTES:].any() and not other.array()[HEADER_BYTES:].any()  # nothing written
            assert victim.read_bytes() == MAGIC + seg.token + b"x" * 100  # nor through the symlink
            stats1 = await c.stats()
            assert stats1.registry.entries == stats0.registry.entries
            # the sidecar still serves the same items
            assert all(k.ok for k in await c.fetch(items, identity=IDENT, layout=LAYOUT, rope=SPEC))
    finally:
        for p in links:
            os.unlink(p)
        seg.unlink()
        other.unlink()
        await server.stop(None)


def test_a_buffer_is_lent_again_only_after_its_payloads_are_dropped(caplog):
    pool = SegmentPool(size=1 << 20, max_segments=2)
    try:
        a = pool.lease()
        view = a.payload(HEADER_BYTES, 128)
        name = a.segment.name
        del a
        gc.collect()
        assert pool.lent == 1 and pool.idle == 0  # a payload view still holds the buffer
        b = pool.lease()
        assert b.segment.name != name
        with caplog.at_level(logging.WARNING, logger="sidecar.shm.segment"):
            assert pool.lease() is None  # max_segments lent: the call goes inline, it does not wait
            assert pool.lease() is None
        assert sum("held by payloads still referenced" in r.message for r in caplog.records) == 1  # said once
        del view
        gc.collect()
        assert pool.lent == 1 and pool.idle == 1
        c = pool.lease()
        assert c.segment.name == name  # reused
        with pytest.raises(ValueError, match="shm_offset"):
            c.payload(0, 16)  # the header is not a payload
        with pytest.raises(ValueError, match="shm_offset"):
            c.payload(HEADER_BYTES, 1 << 20)  # past the end
        kept = c.payload(HEADER_BYTES, 8)
        kept[:] = b"12345678"
        path = c.segment.path
    finally:
        pool.close()
    assert not os.path.exists(path)  # close() removed the name ...
    assert bytes(kept) == b"12345678"  # ... and views handed out stay valid


def test_a_grown_want_drops_smaller_idle_buffers():
    pool = SegmentPool(size=1 << 20, max_bytes=8 << 20)
    try:
        lease = pool.lease()
        small = lease.segment.path
        lease.inline = 3 << 20
        pool.done(lease)
        del lease
        gc.collect()
        assert not os.path.exists(small) and pool.idle == 0
        assert pool.lease().segment.size == 4 << 20  # used + inline, rounded up to MiB
    finally:
        pool.close()


def test_writer_survives_a_truncated_buffer_and_a_failing_write(tmp_path):
    seg = Segment(1 << 16)
    try:
        fd = os.open(seg.path, os.O_RDWR)
        w = ShmWriter(fd, seg.size)
        assert w.put(memoryview(b"a" * 100)) == (HEADER_BYTES, 100)
        assert w.put(memoryview(b"b" * 10)) == (HEADER_BYTES + 128, 10)  # 64-byte aligned
        os.truncate(seg.path, 0)  # a client shrinking its buffer under the writer: no SIGBUS here
        assert w.put(memoryview(b"c" * 10)) == (HEADER_BYTES + 192, 10)
        assert w.put(memoryview(b"d" * seg.size)) is None and w.spilled == 1
        w.close()
        ro = ShmWriter(os.open(seg.path, os.O_RDONLY), seg.size)
        assert ro.put(memoryview(b"e" * 10)) is None and ro.failed  # EBADF: the rest goes inline
        assert ro.put(memoryview(b"f")) is None
        ro.close()
    finally:
        seg.unlink()


@pytest.mark.parametrize("target,local", [
    ("127.0.0.1:50051", True), ("localhost:1", True), ("[::1]:50051", True), ("unix:/tmp/s.sock", True),
    ("dns:///localhost:50051", True), ("ipv4:127.0.0.2:5", True), ("10.0.0.5:50051", False),
    ("sidecar.default.svc:50051", False), ("[2001:db8::1]:50051", False),
])
def test_local_target(target, local):
    assert local_target(target) is local


@pytest.mark.parametrize("peer,local", [
    ("ipv4:127.0.0.1:40000", True), ("ipv6:[::1]:40000", True), ("unix:", True), ("ipv6:[::ffff:127.0.0.1]:1", True),
    ("ipv4:10.1.2.3:40000", False), ("ipv6:[2001:db8::1]:1", False),
])
def test_local_peer(peer, local):
    assert local_peer(peer) is local


def test_gathered_pieces_land_back_to_back_even_after_a_short_write(monkeypatch):
    import sidecar.shm.writer as writer

    seg = Segment(1 << 16)
    real = os.pwritev
    calls = []

    def short_once(fd, parts, off):  # the first call writes only 5 bytes, as a signal might cause
        calls.append(len(parts))
        if len(calls) == 1:
            return os.pwrite(fd, bytes(parts[0][:5]), off)
        return real(fd, parts, off)

    try:
        monkeypatch.setattr(writer.os, "pwritev", short_once)
        monkeypatch.setattr(writer, "_IOV_MAX", 2)
        w = ShmWriter(os.open(seg.path, os.O_RDWR), seg.size)
        pieces = [memoryview(b"abcdefg"), memoryview(b"hi"), memoryview(b"jklm"), memoryview(b"n")]
        assert w.put(pieces) == (HEADER_BYTES, 14)
        assert bytes(seg.array()[HEADER_BYTES : HEADER_BYTES + 14]) == b"abcdefghijklmn"
        assert calls[:2] == [2, 2]  # two iovecs per call; the short write resumed from byte 5
        w.close()
    finally:
        seg.unlink()


def test_a_call_that_says_what_it_needs_gets_a_buffer_that_fits():
    pool = SegmentPool(size=1 << 20, max_bytes=16 << 20)
    try:
        a = pool.lease()
        assert a.segment.size == 1 << 20
        small = a.segment.path
        del a
        gc.collect()
        b = pool.lease(need=5 << 20)  # the idle 1 MiB buffer is too small: replaced
        assert b.segment.size == 6 << 20 and not os.path.exists(small)
        assert pool.lease(need=1 << 40).segment.size == 16 << 20  # capped at max_bytes
    finally:
        pool.close()


def test_concurrent_calls_on_one_client_never_share_a_buffer(rng):
    """Threads fetching through one client: each call has its own buffer while its payloads
    are alive, so every thread reads exactly its own items' bytes (more calls in flight than
    buffers: the rest come inline)."""
    cfg = make_config(store=StoreConfig(cpu_bytes=64 * MiB), auth=AuthConfig(operators=("a",)))
    with ServerThread(cfg) as st, SyncSidecarClient(st.target, tenant="a") as c, \
            SyncSidecarClient(st.target, tenant="a", shared_memory=False) as inline:
        first, body = conversation(rng, 60)
        meta = c.store(first, identity=IDENT)
        c.store(first, identity=IDENT, layout=LAYOUT, payloads=payloads_for(meta.chunk_bounds))
        second = np.concatenate([message(rng, 310), body]).astype(np.uint32)
        hits = c.lookup(second, identity=IDENT, recompute_tokens=0).hits()
        items = [(h.chunk_hash, h.start - h.chunk_offset) for h in hits]
        want = {i: bytes(inline.fetch([it], identity=IDENT, layout=LAYOUT, rope=SPEC)[0].data) for i, it in enumerate(items)}
        errors: list[str] = []
        held = []

        def worker(seed: int) -> None:
            r = np.random.default_rng(seed)
            for _ in range(15):
                order = r.permutation(len(items))
                got = c.fetch([items[i] for i in order], identity=IDENT, layout=LAYOUT, rope=SPEC)
                for i, kv in zip(order, got):
                    if bytes(kv.data) != want[i]:
                        errors.append(f"thread {seed}: item {i} differs")
                if r.random() < 0.3:
                    held.append((order, got))  # some calls keep their payloads: their buffers stay lent

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors[:5]
        assert st.server.metrics.registry.get_sample_value("kv_sidecar_fetch_shared_memory_bytes_total") > 0
        for order, got in held:  # payloads kept alive stayed intact while other calls ran
            assert [bytes(kv.data) for kv in got] == [want[i] for i in order]
