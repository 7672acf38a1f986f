"""The shared pool end to end: a real sidecar over loopback gRPC, its CPU tier in /dev/shm, an
engine (the SDK's ``PoolClient``) that Fetches by lease and Stores by reservation. What it reads
equals what the stream Fetch serves, bit for bit; what it stores is served to the next Lookup."""

from __future__ import annotations

import os

import numpy as np
import pytest

from sidecar.app import ServerThread
from sidecar.client import SyncSidecarClient
from sidecar.config import AuthConfig
from sidecar.errors import InvalidArgument, NotFound
from sidecar.sdk.pool import PoolClient
from sidecar.shm.pool import FILE_PATTERN
from sidecar.tiers import StoreConfig
from tests.conftest import make_config
from tests.dataplane.test_dataplane import IDENT, LAYOUT, SPEC, MiB, conversation, message, payloads_for

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this host")


def pools() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if FILE_PATTERN.fullmatch(f)}


@pytest.fixture
def served():
    cfg = make_config(store=StoreConfig(cpu_bytes=64 * MiB), auth=AuthConfig(operators=("a",)))
    with ServerThread(cfg) as st, SyncSidecarClient(st.target, tenant="a") as c:
        yield st, c


def store_by_pool(c, pool, tokens, seed=0):
    meta = c.store(tokens, identity=IDENT)
    pl = payloads_for(meta.chunk_bounds, seed)
    res = pool.store(tokens, identity=IDENT, layout=LAYOUT, payloads=pl)
    return res, pl


def test_store_by_reservation_and_fetch_by_lease_equal_the_stream(served, rng):
    st, c = served
    pool = PoolClient(c)
    assert pool.available and pool.name in pools()
    first, body = conversation(rng, 60)
    res, pl = store_by_pool(c, pool, first)
    assert res.chunks_stored == len(pl)
    second = np.concatenate([message(rng, 310), body]).astype(np.uint32)
    plan = c.lookup(second, identity=IDENT, recompute_tokens=0)
    spans = plan.fetch_spans()
    assert spans and any(s.target_pos != 0 for s in spans)
    streamed = c.fetch(spans, identity=IDENT, layout=LAYOUT, rope=SPEC)
    pooled = pool.fetch(spans, identity=IDENT, layout=LAYOUT, rope=SPEC)
    assert [f.ok for f in pooled] == [f.ok for f in streamed] and all(f.ok for f in pooled)
    for a, b in zip(streamed, pooled):
        assert a.num_tokens == b.num_tokens and a.delta == b.delta
        assert bytes(a.data) == bytes(b.data)  # rotated by the engine == rotated by the sidecar, bit for bit
    assert st.server.dataplane.store.leased == 0  # fetch released its lease


def test_a_lease_pins_and_its_stamp_catches_reuse(served, rng):
    st, c = served
    pool = PoolClient(c)
    tokens, _ = conversation(rng, 60)
    store_by_pool(c, pool, tokens)
    plan = c.lookup(tokens, identity=IDENT)
    fetched = pool.lease(plan.fetch_spans(), identity=IDENT, layout=LAYOUT)
    store = st.server.dataplane.store
    assert store.leased == sum(len(it.chunks) for it in fetched.items) > 0
    assert pool.intact(fetched)
    pool.release(fetched)
    assert store.leased == 0
    with pytest.raises(NotFound, match="lease"):
        c.release_lease("0" * 32)
    # bytes freed after the lease: the stamp says so
    fetched = pool.lease(plan.fetch_spans(), identity=IDENT, layout=LAYOUT)
    lease = fetched.lease
    pool.release(fetched)
    c.delete([s.chunk_hash for s in plan.fetch_spans()])
    fetched.lease = lease
    assert not pool.intact(fetched)


def test_reservations_count_and_refuse_whole(served, rng):
    st, c = served
    pool = PoolClient(c)
    tokens, _ = conversation(rng, 60)
    meta = c.store(tokens, identity=IDENT)
    w = pool.reserve(tokens, identity=IDENT, layout=LAYOUT)
    assert set(w.slots) == set(meta.chunk_bounds[:-1])
    with pytest.raises(InvalidArgument, match="commit.chunks"):
        c.commit_store(w.reservation, len(w.slots) + 1, 0)
    with pytest.raises(NotFound, match="reservation"):  # refused whole: the reservation is gone
        w.commit()
    store = st.server.dataplane.store
    assert store.stats().tiers["cpu"].objects == 0 if hasattr(store.stats(), "tiers") else True
    plan = c.lookup(tokens, identity=IDENT)
    assert not plan.hits()
    w = pool.reserve(tokens, identity=IDENT, layout=LAYOUT)
    assert w.abort() == len(w.slots)
    with pytest.raises(InvalidArgument, match="chunk_starts"):
        pool.reserve(tokens, identity=IDENT, layout=LAYOUT, chunk_starts=[1])


def test_the_pool_file_goes_with_its_sidecar():
    cfg = make_config(store=StoreConfig(cpu_bytes=16 * MiB))
    before = pools()
    with ServerThread(cfg) as st:
        name = st.server.dataplane.pool.name
        assert name in pools() - before
    assert name not in pools()


def resident_kib(address: int) -> int:
    """The resident size (kB) of this process's mapping that starts at ``address``."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        head = line.split(" ", 1)[0]
        if "-" in head and int(head.split("-")[0], 16) == address:
            for row in lines[i + 1:]:
                if row.startswith("Rss:"):
                    return int(row.split()[1])
    raise AssertionError(f"no mapping starts at {address:#x}")


def test_an_engine_maps_the_pool_with_its_pages_in_place(served):
    """The engine's mapping is populated when made, so no Fetch or Store faults a page in."""
    st, c = served
    pool = PoolClient(c)
    assert pool.available
    mapped = pool.mapped
    assert resident_kib(mapped.tensor.data_ptr()) * 1024 == mapped.size
