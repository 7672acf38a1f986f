"""Remote tier (redis-py with hiredis on a real Redis): sharing, eviction, delete, variable-size
batches in one round trip, and a Redis that goes away and comes back."""

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
    return sorted(client.keys(f"kvsidecar:{namespace}:*"))


def test_remote_round_trip(make_store, redis_url, redis_client, namespace, layout: KVLayout, payload_size: int) -> None:
    store = make_store(cpu_bytes=0, remote_url=redis_url, remote_bytes=1 << 20)
    assert store.tiers == (Tier.REMOTE,)
    res = _put(store, 1, layout, payload_size)
    assert (res.tier, res.published) == (Tier.REMOTE, True)
    got = store.get(key(1))
    assert got.tier == Tier.REMOTE and torch.equal(got.payload, make_payload(1, payload_size))
    assert len(_remote_keys(redis_client, namespace)) == 1  # one object: header and payload
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
    got = consumer.get(key(1))  # never seen here: the object says what it is
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
        f"kvsidecar:{namespace}:{key(i).hex()}".encode() for i in (1, 2)
    )  # chunks 1 and 2
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
    with consumer._core.stripe(key(1)):  # a put of key 1 between "is it new?" and "attached"
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
    assert len(_remote_keys(redis_client, namespace)) == 1
    assert store.delete([key(1)]) == 1
    assert _remote_keys(redis_client, namespace) == []
    other = make_store(cpu_bytes=1 << 20, remote_url=redis_url, remote_bytes=1 << 20)
    assert other.get(key(1)) is None
    # A store that never saw a published chunk can still purge it (e.g. a "forget" request).
    _put(store, 2, layout, payload_size, publish=True)
    assert other.delete([key(2)]) == 0
    assert _remote_keys(redis_client, namespace) == []
    assert store.locate(key(2)) == Tier.CPU  # the producer's local copy is its own business


def test_remote_bytes_gone_behind_our_back_is_a_miss_and_the_rest_is_served(
    make_store, redis_url, redis_client, namespace, layout: KVLayout, payload_size: int
) -> None:
    # A deleted object and one of the wrong size in the same batch as a good one (one worker:
    # one connection): both are misses, the good one is served, nothing reconnects.
    store = make_store(cpu_bytes=0, remote_url=redis_url, remote_bytes=1 << 20, remote_workers=1)
    for i in range(3):
        _put(store, i, layout, payload_size)
    body = lambda i: f"kvsidecar:{namespace}:{key(i).hex()}".encode()
    assert redis_client.delete(body(0)) == 1
    redis_client.set(body(1), b"short")  # same key, wrong size
    got = store.get_many([key(0), key(1), key(2)])
    assert got[0] is None and got[1] is None
    assert torch.equal(got[2].payload, make_payload(2, payload_size))
    lost = {e.key: e.reason for e in store.take_events()}
    assert lost == {key(0): Reason.MISSING, key(1): Reason.CORRUPTION}
    assert store.stats().remote_reconnects == 0
    _put(store, 3, layout, payload_size)
    assert torch.equal(store.get(key(3)).payload, make_payload(3, payload_size))
    assert torch.equal(store.get(key(2)).payload, make_payload(2, payload_size))


def test_variable_size_chunks_are_read_in_one_round_trip_without_reconnecting(
    make_store, redis_url, redis_client, layout: KVLayout
) -> None:
    """Content-defined chunks all differ in size: a batch of them, read by the sidecar that wrote
    them and by a peer that only shares the server, is one MGET each and opens no connection."""
    producer = make_store(cpu_bytes=0, remote_url=redis_url, remote_bytes=8 << 20)
    peer = make_store(cpu_bytes=1 << 20, remote_url=redis_url, remote_bytes=8 << 20)
    sizes = [layout.bytes_per_token * n for n in (13, 64, 7, 129, 40, 1, 77, 250)]
    keys = [key(100 + i) for i in range(len(sizes))]
    for i, (k, n) in enumerate(zip(keys, sizes)):
        producer.put(k, make_payload(100 + i, n), layout=layout, num_tokens=n // layout.bytes_per_token, tenant="a")

    def counts() -> tuple[int, int]:
        mget = redis_client.info("commandstats").get("cmdstat_mget", {}).get("calls", 0)
        return mget, redis_client.info("stats")["total_connections_received"]

    assert peer.get(key(99)) is None  # the peer's first call opens its connection
    for store in (producer, peer):
        before = counts()
        got = store.get_many(keys, promote=False)
        assert [g.payload.numel() if g is not None else None for g in got] == sizes
        assert all(torch.equal(g.payload, make_payload(100 + i, n)) for i, (g, n) in enumerate(zip(got, sizes)))
        mget, conns = counts()
        assert (mget - before[0], conns - before[1]) == (1, 0)
        assert store.stats().remote_reconnects == 0


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
        assert store.get(key(1)) is None  # a miss, not an exception
        assert store.take_events() == [] and store.locate(key(1)) == Tier.REMOTE  # down is not lost
        with pytest.raises(TierUnavailableError):
            _put(store, 2, layout, payload_size)
        assert store.locate(key(2)) is None
        server.start()  # empty: the old copy is gone with the process
        assert _after_backoff(lambda: store.get(key(1)) is None and store.locate(key(1)) is None or None)
        assert [(e.kind, e.key, e.reason) for e in store.take_events()] == [(EventKind.LOST, key(1), Reason.MISSING)]
        assert store.tenant_usage("a") == 0
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


def test_a_redis_that_comes_back_is_used_again_without_waiting_out_the_back_off(
    restartable_redis, make_store, layout: KVLayout, payload_size: int
) -> None:
    """Down long enough for the breaker's back-off to reach its maximum, then back: the
    breaker's probe re-admits the tier once Redis answers a PING, not when the back-off ends."""
    import time

    from sidecar.tiers import breaker

    store = make_store(cpu_bytes=0, remote_url=restartable_redis.url, remote_bytes=1 << 20, io_timeout_s=0.5)
    _put(store, 1, layout, payload_size)
    restartable_redis.kill()
    trip = store._core.io.breakers[Tier.REMOTE]
    while trip._backoff < breaker.MAX_S:  # each failed call doubles the back-off
        trip._until = 0.0
        assert store.get(key(9)) is None
    assert trip.is_open()
    restartable_redis.start()
    deadline = time.monotonic() + breaker.MAX_S / 2  # well inside the back-off now in force
    while trip.is_open():
        assert time.monotonic() < deadline, "the breaker waited out its back-off"
        time.sleep(0.05)
    _put(store, 2, layout, payload_size)
    assert torch.equal(store.get(key(2)).payload, make_payload(2, payload_size))
