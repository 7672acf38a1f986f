"""The GPU tier: one pre-allocated device tensor carved by LMCache's ``TensorMemoryAllocator``.

LMCache has no GPU-resident tier of its own; this ``PoolBackend``
(``sidecar.tiers.backends.base``) is the sidecar's. Host staging goes through the CPU tier.
"""

from __future__ import annotations

import logging
import threading

import torch
from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from sidecar.tiers.backends.base import PoolBackend, round_up
from sidecar.tiers.config import StoreConfig
from sidecar.tiers.types import ChunkKey, Tier

logger = logging.getLogger(__name__)


class GpuTier(PoolBackend):
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

    @classmethod
    def from_config(cls, config: StoreConfig) -> GpuTier | None:
        if config.gpu_bytes <= 0:
            return None
        device = torch.device(config.gpu_device)
        if device.type == "cuda" and not torch.cuda.is_available():
            logger.warning("store.gpu_bytes=%d but CUDA is not available: GPU tier disabled", config.gpu_bytes)
            return None
        return cls(capacity_bytes=config.gpu_bytes, device=config.gpu_device)

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

    def close(self, timeout: float) -> bool:
        with self._lock:
            for obj in (*self._staged.values(), *self._ready.values()):
                self._alloc.free(obj)
            self._staged.clear()
            self._ready.clear()
            self._pool = torch.empty(0, dtype=torch.uint8)
        return True
