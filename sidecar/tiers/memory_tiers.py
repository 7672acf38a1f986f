"""Pool-backed tiers: host DRAM (LMCache ``L1Manager``) and a device pool (GPU).

Both hold whole stored objects (``envelope``) in a pre-allocated pool and expose the same
staging protocol the store drives::

    buf = tier.stage(key, n)   # invisible write buffer (None: the allocator is full/fragmented)
    ... fill buf ...
    tier.commit(key)           # now readable       | tier.abort(key): discarded
    view = tier.acquire(key)   # read-locked view   | tier.release(key)
    tier.remove(key)           # free it (never while acquired)

The store owns placement, accounting and recency; these classes only own memory.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
from lmcache.v1.distributed.error import L1Error
from lmcache.v1.distributed.l1_manager import L1Manager
from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from sidecar.tiers.types import ChunkKey, Tier

logger = logging.getLogger(__name__)

# One writer identity for every staging object: a second concurrent stage of the same key is
# refused by L1 (KEY_NOT_WRITABLE) instead of racing.
_WRITE_TAG = "kv-sidecar"


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class MemoryTier(Protocol):
    tier: Tier
    capacity_bytes: int

    def footprint(self, nbytes: int) -> int: ...
    def stage(self, key: ChunkKey, nbytes: int) -> torch.Tensor | None: ...
    def commit(self, key: ChunkKey) -> None: ...
    def abort(self, key: ChunkKey) -> None: ...
    def acquire(self, key: ChunkKey) -> torch.Tensor | None: ...
    def release(self, key: ChunkKey) -> None: ...
    def remove(self, key: ChunkKey) -> bool: ...
    def close(self) -> None: ...


class CpuTier:
    """Host DRAM tier on LMCache's ``L1Manager`` (pool allocator + staging/read-lock machine).

    The pool is committed up front (``MixedMemoryAllocator`` touches every page when lazy
    allocation is unavailable, which is always the case without CUDA pinning), so it is sized
    to exactly ``capacity_bytes`` rounded to the alignment. SHM is disabled: LMCache names the
    segment after the pid and unlinks a same-named "stale" one on creation, so two stores in one
    process would destroy each other's pool. LMCache's own eviction controller is not started:
    it drops (never demotes) at a watermark on a 1 s timer and learns recency only from
    explicit touches; the store does placement synchronously instead.
    """

    tier = Tier.CPU

    def __init__(self, *, capacity_bytes: int, align_bytes: int, namespace: str) -> None:
        self.capacity_bytes = round_up(capacity_bytes, align_bytes)
        self._align = align_bytes
        self._namespace = namespace
        self._l1 = L1Manager(
            L1ManagerConfig(
                memory_config=L1MemoryManagerConfig(
                    size_in_bytes=self.capacity_bytes,
                    use_lazy=False,
                    align_bytes=align_bytes,
                    shm_name="",
                ),
                tag=f"kv-sidecar-{id(self):x}",
            )
        )

    def _okey(self, key: ChunkKey) -> ObjectKey:
        return ObjectKey(chunk_hash=key, model_name=self._namespace, kv_rank=0)

    def footprint(self, nbytes: int) -> int:
        return round_up(nbytes, self._align)

    def stage(self, key: ChunkKey, nbytes: int) -> torch.Tensor | None:
        okey = self._okey(key)
        layout = MemoryLayoutDesc(shapes=[torch.Size([nbytes])], dtypes=[torch.uint8])
        err, obj = self._l1.reserve_write([okey], [False], layout, tag=_WRITE_TAG)[okey]
        if err == L1Error.OUT_OF_MEMORY:
            return None
        assert err == L1Error.SUCCESS and obj is not None, (
            f"L1 refused to stage {key.hex()}: {err}; the store stages a key only when it is absent "
            "from the CPU tier, so this indicates a bug in the store's placement bookkeeping"
        )
        return obj.tensor

    def commit(self, key: ChunkKey) -> None:
        err = self._l1.finish_write([self._okey(key)], tag=_WRITE_TAG)[self._okey(key)]
        assert err == L1Error.SUCCESS, f"L1 finish_write({key.hex()}) failed: {err}"

    def abort(self, key: ChunkKey) -> None:
        self._l1.finish_write_and_delete([self._okey(key)], tag=_WRITE_TAG)

    def acquire(self, key: ChunkKey) -> torch.Tensor | None:
        okey = self._okey(key)
        err, obj = self._l1.reserve_read([okey])[okey]
        return obj.tensor if err == L1Error.SUCCESS and obj is not None else None

    def release(self, key: ChunkKey) -> None:
        self._l1.finish_read([self._okey(key)])

    def remove(self, key: ChunkKey) -> bool:
        err = self._l1.delete([self._okey(key)])[self._okey(key)]
        return err == L1Error.SUCCESS

    def allocator_usage(self) -> tuple[int, int]:
        """(used, total) bytes as LMCache's allocator sees them (includes alignment)."""
        return self._l1.get_memory_usage()

    def close(self) -> None:
        self._l1.close()


class DeviceTier:
    """Device-pool tier (the GPU tier when CUDA exists): one pre-allocated device tensor carved
    by LMCache's ``TensorMemoryAllocator``; host staging goes through the CPU tier.

    Written device-agnostic so its logic runs on ``device="cpu"`` in CI; with CUDA it is the only
    GPU-resident tier the sidecar has (LMCache has none of its own). Copies in and out are
    synchronous ``Tensor.copy_`` calls on the current stream.
    """

    tier = Tier.GPU

    def __init__(self, *, capacity_bytes: int, device: str, align_bytes: int = 256) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("store.gpu_device is a CUDA device but CUDA is not available")
        self.capacity_bytes = round_up(capacity_bytes, align_bytes)
        self._align = align_bytes
        self._pool = torch.empty(self.capacity_bytes, dtype=torch.uint8, device=self.device)
        self._alloc = TensorMemoryAllocator(self._pool, align_bytes=align_bytes)
        self._lock = threading.Lock()
        self._staged: dict[ChunkKey, MemoryObj] = {}
        self._ready: dict[ChunkKey, MemoryObj] = {}
        self._readers: dict[ChunkKey, int] = {}

    def footprint(self, nbytes: int) -> int:
        return round_up(nbytes, self._align)

    def stage(self, key: ChunkKey, nbytes: int) -> torch.Tensor | None:
        with self._lock:
            assert key not in self._staged and key not in self._ready, (
                f"device tier already holds {key.hex()}; this indicates a bug in the store's placement"
            )
            obj = self._alloc.allocate(torch.Size([nbytes]), torch.uint8, MemoryFormat.BINARY_BUFFER)
            if obj is None:
                return None
            self._staged[key] = obj
            return obj.tensor

    def commit(self, key: ChunkKey) -> None:
        with self._lock:
            self._ready[key] = self._staged.pop(key)

    def abort(self, key: ChunkKey) -> None:
        with self._lock:
            obj = self._staged.pop(key, None)
            if obj is not None:
                self._alloc.free(obj)

    def acquire(self, key: ChunkKey) -> torch.Tensor | None:
        with self._lock:
            obj = self._ready.get(key)
            if obj is None:
                return None
            self._readers[key] = self._readers.get(key, 0) + 1
            return obj.tensor

    def release(self, key: ChunkKey) -> None:
        with self._lock:
            n = self._readers.get(key, 0) - 1
            if n > 0:
                self._readers[key] = n
            else:
                self._readers.pop(key, None)

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            if self._readers.get(key):
                return False
            obj = self._ready.pop(key, None)
            if obj is None:
                return False
            self._alloc.free(obj)
            return True

    def close(self) -> None:
        with self._lock:
            for obj in (*self._staged.values(), *self._ready.values()):
                self._alloc.free(obj)
            self._staged.clear()
            self._ready.clear()
            self._pool = torch.empty(0, dtype=torch.uint8)
