"""The CPU tier: host DRAM in LMCache's ``L1Manager`` (pool allocator + staging/read-lock machine).

A ``PoolBackend`` (``sidecar.tiers.backends.base``): the store stages, fills and commits whole
stored objects in place; this class only owns the memory.
"""

from __future__ import annotations

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
from lmcache.v1.distributed.error import L1Error
from lmcache.v1.distributed.l1_manager import L1Manager

from sidecar.tiers.backends.base import PoolBackend, round_up
from sidecar.tiers.config import StoreConfig
from sidecar.tiers.types import ChunkKey, Tier

# One writer identity for every staging object: a second concurrent stage of the same key is
# refused by L1 (KEY_NOT_WRITABLE) instead of racing.
_WRITE_TAG = "kv-sidecar"


class CpuTier(PoolBackend):
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

    @classmethod
    def from_config(cls, config: StoreConfig) -> CpuTier | None:
        if config.cpu_bytes <= 0:
            return None
        return cls(capacity_bytes=config.cpu_bytes, align_bytes=config.cpu_align_bytes, namespace=config.namespace)

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

    def close(self, timeout: float) -> bool:
        self._l1.close()
        return True
