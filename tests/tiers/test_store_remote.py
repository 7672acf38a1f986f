"""Remote tier (LMCache RESP adapter on a real Redis): sharing, eviction, delete, resync."""

from __future__ import annotations

import pytest
import torch

from sidecar.identity import KVLayout
from sidecar.tiers import EventKind, Reason, Tier
from sidecar.tiers.envelope import HEADER_NBYTES
from tests.tiers.conftest import NUM_TOKENS, key, make_payload


def _after_backoff(fn):
    """Run ``fn`` once the remote tier's breaker lets calls through again (it opened when Redis
    failed: sidecar/tiers/breaker.py), retrying within a bounded deadline (liveness only)."""
    import time

    from sidecar.tiers import breaker

    deadline = time.monotonic() + 2 * breaker.MAX_S + 5
    while True:
        try:
            out = fn()
        except Exception:
            if time.monotonic() > deadline:
                raise
        else:
            if out is not None or time.monotonic() > deadline:
                return out
        time.sleep(0.1)


def _put(store, i: int, layout: KVLayout, size: int, **kw):
    return store.put(key(i), make_payload(i, size), layout=layout, num_tokens=NUM_TOKENS, tenant="a", **kw)


def _remote_keys(client, namespace: str) -> list[bytes]:
    return sorted(client.keys(f"{namespace}@*"))


def test_remote_round_trip(make_store, redis_url, redis_client, namespace, layout: KVLayout, payload_size: int) -> None:
    store = make_store(cpu_bytes=0, remote_url=redis_url, remote_bytes=1 << 20)
    assert store.tiers == (Tier.REMOTE,)
    res = _put(store, 1, layout, payload_size)
    assert (res.tier, res.published) == (Tier.REMOTE, True)
    got = store.get(key(1))
    assert got.tier == Tier.REMOTE and torch.equal(got.payload, make_payload(1, payload_size))
    assert len(_remote_keys(redis_client, namespace)) == 2  # object + header copy
    assert store.get(key(2)) is None
    assert store.stats().tiers[Tier.REMOTE].hits == 1


def test_published_chunk_is_served_to_another_sidecar(
    make_store, redis_url, layout: KVLayout, payload_size: int, obj_size: int
) -> None:
    producer = make_store(cpu_bytes=1 << 20, remote_url=redis_url, remote_bytes=1 << 20)
    res = _put(producer, 1, layout, payload_size, publish=True)
    assert (res.tier, res.published) == (Tier.CPU, True)
    assert producer.tiers_of(key(1)) == {Tier.CPU, Tier.REMOTE}

    consumer = make_store(cpu_bytes=1 << 20, remote_url=redis_url, remote_bytes=1 << 20)
    assert consumer.locate(key(1)) is None
    got = consumer.get(key(1))  # never seen here: header copy, then the object
    assert got.tier == Tier.REMOTE and torch.equal(got.payload, make_payload(1, payload_size))
    assert got.meta == producer.meta(key(1))
    (ev,) = consumer.take_events()
    assert (ev.kind, ev.source, ev.target) == (EventKind.PROMOTED, Tier.REMOTE, Tier.CPU)
    assert ev.tiers_after == {Tier.CPU, Tier.REMOTE}  # the shared copy stays for other sidecars
    assert consumer.get(key(1)).tier == Tier.CPU
    assert consumer.tenant_usage("a") == payload_size


def test_demotion_to_remote_then_eviction(
    make_store, redis_url, redis_client, namespace, layout: KVLayout, payload_size: int, obj_size: int
) -> None:
    store = make_store(cpu_bytes=obj_size, remote_url=redis_url, remote_bytes=2 * obj_size)
    for i in range(4):
        _put(store, i, layout, payload_size)
    assert [(e.kind, e.key, e.source, e.target) for e in store.take_events()] == [
        (EventKind.DEMOTED, key(0), Tier.CPU, Tier.REMOTE),
        (EventKind.DEMOTED, key(1), Tier.CPU, Tier.REMOTE),
        (EventKind.EVICTED, key(0), Tier.REMOTE, None),
        (EventKind.DEMOTED, key(2), Tier.CPU, Tier.REMOTE),
    ]
    assert _remote_keys(redis_client, namespace) == sorted(
        f"{namespace}@00000000@{group}@{key(i).hex()}".encode() for i in (1, 2) for group in (0, 1)
    )  # chunks 1 and 2: the object (group 0) and its header copy (group 1)
    assert store.get(key(0)) is None
    assert torch.equal(store.get(key(1), promote=False).payload, make_payload(1, payload_size))


def test_foreign_chunk_not_promoted_while_a_put_of_it_is_placing(
    make_store, redis_url, layout: KVLayout, payload_size: int
) -> None:
    """A get of a chunk another sidecar published (not in this store's index) promotes it into
    the CPU tier; a put of the same key placing it at that moment stages the key there too. The
    put holds its key's stripe, and the promotion is skipped while it is taken (the churn test
    once failed with the CPU tier refusing the second stage, KEY_NOT_WRITABLE)."""
    producer = make_store(cpu_bytes=1 << 20, remote_url=redis_url, remote_bytes=1 << 20)
    _put(producer, 1, layout, payload_size, publish=True)
    consumer = make_store(cpu_bytes=1 << 20, remote_url=redis_url, remote_bytes=1 << 20)
    with consumer._stripe(key(1)):  # a put of key 1 between "is it new?" and "attached"
        got = consumer.get(key(1))
        assert got.tier == Tier.REMOTE and torch.equal(got.payload, make_payload(1, payload_size))
        assert consumer.locate(key(1)) is None and consumer.take_events() == []
    res = _put(consumer, 1, layout, payload_size)
    assert res.stored and res.tier == Tier.CPU
    assert consumer.get(key(1)).tier == Tier.CPU


def test_delete_removes_the_remote_copy(
    make_store, redis_url, redis_client, namespace, layout: KVLayout, payload_size: int
) -> None:
    store = make_store(cpu_bytes=1 << 20, remote_url=redis_url, remote_bytes=1 << 20)
    _put(store, 1, layout, payload_size, publish=True)
    assert len(_remote_keys(redis_client, namespace)) == 2
    assert store.delete([key(1)]) == 1
    assert _remote_keys(redis_client, namespace) == []
    other = make_store(cpu_bytes=1 << 20, remote_url=redis_url, remote_bytes=1 << 20)
    assert other.get(key(1)) is None
    # A store that never saw a published chunk can still purge it (e.g. a "forget" request).
    _put(store, 2, layout, payload_size, publish=True)
    assert other.delete([key(2)]) == 0
    assert _remote_keys(redis_client, namespace) == []
    assert store.locate(key(2)) == Tier.CPU  # the producer's local copy is its own business


def test_remote_bytes_gone_behind_our_back_is_a_miss_and_the_connection_recovers(
    make_store, redis_url, redis_client, namespace, layout: KVLayout, payload_size: int
) -> None:
    # LMCache's RESP client breaks its connection on a GET of a missing key or a size mismatch;
    # the store must turn both into misses, not lose the good chunk queued behind them on the same
    # connection (one worker: one connection), and keep serving.
    store = make_store(cpu_bytes=0, remote_url=redis_url, remote_bytes=1 << 20, remote_workers=1)
    for i in range(3):
        _put(store, i, layout, payload_size)
    body = lambda i: f"{namespace}@00000000@0@{key(i).hex()}".encode()
    assert redis_client.delete(body(0)) == 1
    redis_client.set(body(1), b"short")  # same key, wrong size
    got = store.get_many([key(0), key(1), key(2)])
    assert got[0] is None and got[1] is None
    assert torch.equal(got[2].payload, make_payload(2, payload_size))
    lost = {e.key: e.reason for e in store.take_events()}
    assert lost == {key(0): Reason.MISSING, key(1): Reason.CORRUPTION}
    assert store.stats().remote_reconnects >= 1
    # Still healthy afterwards: new writes and reads go through.
    _put(store, 3, layout, payload_size)
    assert torch.equal(store.get(key(3)).payload, make_payload(3, payload_size))
    assert torch.equal(store.get(key(2)).payload, make_payload(2, payload_size))


def test_lost_local_copy_falls_back_to_the_remote_copy(
    make_store, redis_url, layout: KVLayout, payload_size: int
) -> None:
    store = make_store(cpu_bytes=1 << 20, remote_url=redis_url, remote_bytes=1 << 20)
    _put(store, 1, layout, payload_size, publish=True)
    cpu = store._mem[Tier.CPU]
    view = cpu.acquire(key(1))
    view[HEADER_NBYTES] ^= 0x01
    cpu.release(key(1))
    got = store.get(key(1), promote=False)
    assert got.tier == Tier.REMOTE and torch.equal(got.payload, make_payload(1, payload_size))
    (ev,) = store.take_events()
    assert (ev.kind, ev.source, ev.reason, ev.tiers_after) == (
        EventKind.LOST,
        Tier.CPU,
        Reason.CORRUPTION,
        frozenset({Tier.REMOTE}),
    )
    assert store.locate(key(1)) == Tier.REMOTE


def test_redis_killed_and_restarted(make_store, tmp_path, layout: KVLayout, payload_size: int) -> None:
    """Redis down: reads are misses, a write that no tier
    takes is TierUnavailableError (UNAVAILABLE on the wire, which clients retry); back up at the
    same address: the same store serves again without a restart."""
    from sidecar.tiers import TierUnavailableError
    from tests.redis_server import RedisProcess

    server = RedisProcess(tmp_path).start()
    try:
        store = make_store(cpu_bytes=0, remote_url=server.url, remote_bytes=1 << 20, io_timeout_s=1.0)
        _put(store, 1, layout, payload_size)
        server.stop()
        assert store.get(key(1)) is None  # a miss, not an exception (the RESP client cannot
        # tell "down" from "missing": the chunk is reported LOST and forgotten)
        assert [(e.kind, e.key) for e in store.take_events()] == [(EventKind.LOST, key(1))]
        with pytest.raises(TierUnavailableError):
            _put(store, 2, layout, payload_size)
        assert store.locate(key(2)) is None and store.tenant_usage("a") == 0  # key 1 was forgotten too
        server.start()  # empty: the old copy is gone with the process
        assert store.get(key(1)) is None and store.locate(key(1)) is None
        _after_backoff(lambda: _put(store, 3, layout, payload_size))
        assert torch.equal(store.get(key(3)).payload, make_payload(3, payload_size))
    finally:
        server.stop()


def test_redis_that_stops_answering_times_out_as_a_miss(make_store, tmp_path, layout: KVLayout,
                                                        payload_size: int) -> None:
    import os
    import signal
    import time

    from tests.redis_server import RedisProcess

    server = RedisProcess(tmp_path).start()
    try:
        store = make_store(cpu_bytes=0, remote_url=server.url, remote_bytes=1 << 20, io_timeout_s=0.3)
        _put(store, 1, layout, payload_size)
        os.kill(server.proc.pid, signal.SIGSTOP)  # alive but silent
        try:
            t0 = time.monotonic()
            assert store.get(key(1)) is None
            assert time.monotonic() - t0 < 10  # bounded by io_timeout_s per attempt, 3 attempts
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert store.locate(key(1)) == Tier.REMOTE  # a timeout is a miss: nothing was forgotten
        assert torch.equal(_after_backoff(lambda: store.get(key(1))).payload, make_payload(1, payload_size))
    finally:
        server.stop()


def test_a_replaced_connection_is_closed_before_the_next_one_opens(redis_url, namespace, monkeypatch) -> None:
    # LMCache 0.5.6's native client can write to its eventfd while it closes; a connection opened
    # meanwhile may get that fd number for its socket and be desynced by the write (the Redis-kill
    # fault test once reconnected for 30 s). So the old connection is closed completely first, and
    # calls made meanwhile fail at once instead of waiting on the close.
    import threading

    from sidecar.tiers.backends.l2_driver import L2Driver
    from sidecar.tiers.backends.remote import RemoteTier

    events: list[tuple[str, int]] = []
    release = threading.Event()
    real_close, real_connect = L2Driver.close, RemoteTier._connect

    def close(self, timeout: float) -> bool:
        events.append(("close", id(self)))
        release.wait(30)
        ok = real_close(self, timeout)
        events.append(("closed", id(self)))
        return ok

    def connect(self) -> L2Driver:
        io = real_connect(self)
        events.append(("open", id(io)))
        return io

    monkeypatch.setattr(L2Driver, "close", close)
    monkeypatch.setattr(RemoteTier, "_connect", connect)
    tier = RemoteTier(url=redis_url, capacity_bytes=1 << 20, namespace=namespace, workers=1, timeout_s=5.0)
    obj = torch.randint(0, 256, (HEADER_NBYTES + 4096,), dtype=torch.uint8)
    try:
        assert tier.store(key(1), obj)
        first = events[0][1]
        tier.suspect()  # a read failed verification: replace the connection
        assert not tier.store(key(2), obj)  # while the old one closes: refused at once
        with pytest.raises(TimeoutError):
            tier.load_many([key(1)], [obj.numel()])
        assert tier.reconnects == 1
        release.set()
        second = id(tier._next_io())
        assert events == [("open", first), ("close", first), ("closed", first), ("open", second)]
        assert tier.store(key(2), obj)
        got = tier.load_many([key(1), key(2)], [obj.numel()] * 2)
        assert all(torch.equal(g, obj) for g in got)
    finally:
        release.set()
        assert tier.close(5.0)


def test_the_native_client_never_connects_to_a_redis_that_is_down(restartable_redis, monkeypatch) -> None:
    # LMCache 0.5.6's WorkerConn::connect closes its socket on a refused connect and its destructor
    # closes the same fd number again, possibly another connection's by then (the Redis-kill fault
    # test saw the shared registry read a chunk header a native GET asked for). So the tier opens a
    # native connection only after a PING from Python succeeds, and retries in the background.
    import redis

    from sidecar.tiers.backends.remote import RemoteTier

    url = restartable_redis.url
    opened_while: list[bool] = []
    real_connect = RemoteTier._connect

    def connect(self):
        try:
            up = bool(redis.Redis.from_url(url, socket_timeout=1).ping())
        except redis.ConnectionError:
            up = False
        opened_while.append(up)
        return real_connect(self)

    monkeypatch.setattr(RemoteTier, "_connect", connect)
    restartable_redis.kill()
    tier = RemoteTier(url=url, capacity_bytes=1 << 20, namespace="down", workers=2, timeout_s=5.0)
    obj = torch.randint(0, 256, (HEADER_NBYTES + 1024,), dtype=torch.uint8)
    try:
        assert not tier.store(key(1), obj)  # refused at once: no connection yet
        with pytest.raises(TimeoutError):
            tier.load_many([key(1)], [obj.numel()])
        assert opened_while == []
        restartable_redis.start()
        tier._next_io()  # the background connect, once Redis answers
        assert tier.store(key(1), obj)
        assert torch.equal(tier.load_many([key(1)], [obj.numel()])[0], obj)
        restartable_redis.kill()  # down again: the connection fails and is replaced in the background
        assert not tier.store(key(2), obj)
        assert tier.reconnects == 1
        restartable_redis.start()
        tier._next_io()
        assert tier.store(key(2), obj)
        assert opened_while == [True, True]
    finally:
        assert tier.close(5.0)
