"""LMCache 0.5.6 behaviours the store is built around (see ``sidecar/tiers/__init__.py``).

These pin the upstream behaviour: if one starts failing after an LMCache upgrade, the matching
workaround in ``sidecar.tiers`` may be removable (or must change).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
from lmcache.v1.distributed.error import L1Error
from lmcache.v1.distributed.l1_manager import L1Manager
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import RESPL2AdapterConfig

from sidecar.tiers.backends.l2_driver import L2Driver
from sidecar.tiers.config import RemoteEndpoint

MiB = 1 << 20


_COMMIT_PROBE = """
import os
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
from lmcache.v1.distributed.l1_manager import L1Manager
before = rss()
l1 = L1Manager(L1ManagerConfig(memory_config=L1MemoryManagerConfig(size_in_bytes=32 << 20, use_lazy=False, shm_name="")))
print(rss() - before)
l1.close()
"""


def test_l1_pool_is_committed_up_front_and_bursts_fail_without_eviction() -> None:
    # RSS is measured in a fresh process: in this one, memory freed by earlier tests (a model)
    # may still be resident in the allocator and absorb the pool without RSS growing.
    probe = subprocess.run([sys.executable, "-c", _COMMIT_PROBE], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "LMCACHE_TRACK_USAGE": "false"})
    assert probe.returncode == 0, probe.stderr
    assert int(probe.stdout.strip().splitlines()[-1]) > 24 * MiB  # touched at creation, not on first use
    l1 = L1Manager(
        L1ManagerConfig(memory_config=L1MemoryManagerConfig(size_in_bytes=32 * MiB, use_lazy=False, shm_name=""))
    )
    try:
        layout = MemoryLayoutDesc(shapes=[torch.Size([12 * MiB])], dtypes=[torch.uint8])
        keys = [ObjectKey(chunk_hash=bytes([i]), model_name="pitfall", kv_rank=0) for i in range(3)]
        # A batch that does not fit is refused as a whole (no eviction happens inline).
        assert {e for e, _ in l1.reserve_write(keys, [False] * 3, layout).values()} == {L1Error.OUT_OF_MEMORY}
        # Reads do not refresh recency by themselves (only touch_keys does); nothing to assert
        # on the manager itself: the store keeps its own LRU.
    finally:
        l1.close()


def test_importing_the_distributed_layer_has_no_process_side_effects() -> None:
    assert multiprocessing.get_start_method(allow_none=True) in (None, "fork")


def test_resp_client_loses_sync_after_a_failed_get(redis_url: str, namespace: str) -> None:
    ep = RemoteEndpoint.parse(redis_url)
    k = lambda b: ObjectKey(chunk_hash=b, model_name=namespace, kv_rank=0)
    buf = lambda n: torch.empty(n, dtype=torch.uint8)
    for failing_get in ("missing key", "wrong size"):
        io = L2Driver(
            create_l2_adapter(RESPL2AdapterConfig(host=ep.host, port=ep.port, num_workers=1), None), "pitfall"
        )
        try:
            assert io.store([k(b"present")], [torch.ones(1000, dtype=torch.uint8)], 5.0)
            if failing_get == "missing key":
                # The client waits for 1000 bytes that never come: the GET hangs (here until our
                # 1 s timeout), then the connection is dead.
                assert io.load([k(b"absent")], [buf(1000)], 1.0) is None  # no answer at all
            else:
                assert io.load([k(b"present")], [buf(500)], 5.0) == [False]
            # The connection is now unusable even for the key that exists with the right size.
            assert io.load([k(b"present")], [buf(1000)], 1.0) in (None, [False]), failing_get
        finally:
            io.close(2.0)


def test_resp_batched_get_of_objects_of_different_sizes_fails(redis_url: str, namespace: str) -> None:
    # Why the remote tier is not on this adapter: content-defined chunks all differ in size,
    # and a batch of them read in one GET call fails past the first size.
    ep = RemoteEndpoint.parse(redis_url)
    k = lambda b: ObjectKey(chunk_hash=b, model_name=namespace, kv_rank=0)
    io = L2Driver(create_l2_adapter(RESPL2AdapterConfig(host=ep.host, port=ep.port, num_workers=1), None), "pitfall")
    try:
        sizes = (1000, 1700)
        for name, n in zip((b"a", b"b"), sizes):  # (a batched SET of the two fails already)
            assert io.store([k(name)], [torch.full((n,), 7, dtype=torch.uint8)], 5.0)
        got = io.load([k(b"a"), k(b"b")], [torch.empty(n, dtype=torch.uint8) for n in sizes], 2.0)
        assert got is None or not all(got), got
    finally:
        io.close(2.0)


def test_fs_native_store_of_an_existing_key_keeps_the_old_file(tmp_path) -> None:
    from lmcache.v1.distributed.l2_adapters.fs_native_l2_adapter import FSNativeL2AdapterConfig

    io = L2Driver(create_l2_adapter(FSNativeL2AdapterConfig(base_path=str(tmp_path), num_workers=1), None), "pitfall")
    try:
        k = ObjectKey(chunk_hash=b"x", model_name="pitfall", kv_rank=0)
        assert io.store([k], [torch.ones(100, dtype=torch.uint8)], 5.0)
        assert io.store([k], [torch.zeros(200, dtype=torch.uint8)], 5.0)  # "succeeds"...
        (path,) = tmp_path.glob("*.data")
        assert path.stat().st_size == 100  # ...but the first object is still there
        # fs_native has no index and no listing: a restarted store must scan the directory.
        from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface

        assert type(io._adapter).list_l2_keys is L2AdapterInterface.list_l2_keys
    finally:
        io.close(5.0)
