"""The CPU tier: host DRAM in LMCache's ``L1Manager`` (pool allocator + staging/read-lock machine).

A ``PoolBackend`` (``sidecar.tiers.backends.base``): the store stages, fills and commits whole
stored objects in place; this class only owns the memory.

With ``shared`` the pool is a POSIX shared-memory file (``sidecar.shm.pool``) that engines on
this host map: they read hits and write Stores in place, by offset (``offset``). Two things keep
those readers safe: objects staged for an engine's Store live under a slot id of their own until
committed (``stage_slot`` / ``commit_slot``), and an object's header stamp is zeroed before its
memory is freed (``remove``), so a reader that still finds the stamp after its copy read that
object's bytes and no other.
"""

from __future__ import annotations

import logging
import secrets

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
from lmcache.v1.distributed.error import L1Error
from lmcache.v1.distributed.l1_manager import L1Manager

from sidecar.shm.pool import PoolFile
from sidecar.tiers.backends.base import PoolBackend, round_up
from sidecar.tiers.config import StoreConfig
from sidecar.tiers.types import ChunkKey, Tier

# One writer identity for every staging object: a second concurrent stage of the same key is
# refused by L1 (KEY_NOT_WRITABLE) instead of racing.
_WRITE_TAG = "kv-sidecar"
#: bytes of a stored object's header a reader checks after its copy (magic .. header checksum)
STAMP_BYTES = 40

logger = logging.getLogger(__name__)


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

    def __init__(self, *, capacity_bytes: int, align_bytes: int, namespace: str, shared: bool = False) -> None:
        self.capacity_bytes = round_up(capacity_bytes, align_bytes)
        self._align = align_bytes
        self._namespace = namespace
        #: the shared-memory file engines map (None: a private pool)
        self.pool: PoolFile | None = None
        lmcache_name = ""
        if shared:
            lmcache_name = PoolFile.prepare()
        self._l1 = L1Manager(
            L1ManagerConfig(
                memory_config=L1MemoryManagerConfig(
                    size_in_bytes=self.capacity_bytes,
                    use_lazy=False,
                    align_bytes=align_bytes,
                    shm_name=lmcache_name,
                ),
                tag=f"kv-sidecar-{id(self):x}",
            )
        )
        buffer = self._l1._memory_manager._allocator.buffer  # the pool's memory: offsets are from its start
        self._base = buffer.data_ptr()
        if lmcache_name:
            self.pool = PoolFile.adopt(self._l1._memory_manager._allocator.shm_name, buffer.numel())
        # Objects not under their key's default L1 name (L1 cannot rename): committed from an
        # engine's slot, or staged while the key's previous object was retired but still read.
        self._alias: dict[ChunkKey, ObjectKey] = {}
        self._staging: dict[ChunkKey, ObjectKey] = {}
        self._retired: set[ObjectKey] = set()

    @classmethod
    def from_config(cls, config: StoreConfig) -> CpuTier | None:
        if config.cpu_bytes <= 0:
            return None
        shared = config.cpu_shared
        if shared and not PoolFile.room_for(round_up(config.cpu_bytes, config.cpu_align_bytes)):
            logger.warning("store.cpu_shared: /dev/shm has no room for a %d-byte pool; the CPU tier is private "
                           "and engines on this host move KV over the stream", config.cpu_bytes)
            shared = False
        return cls(capacity_bytes=config.cpu_bytes, align_bytes=config.cpu_align_bytes, namespace=config.namespace,
                   shared=shared)

    def _okey(self, key: ChunkKey) -> ObjectKey:
        alias = self._alias.get(key)
        return alias if alias is not None else self._default_okey(key)

    def _default_okey(self, key: ChunkKey) -> ObjectKey:
        return ObjectKey(chunk_hash=key, model_name=self._namespace, kv_rank=0)

    def _slot_okey(self, slot: bytes) -> ObjectKey:
        return ObjectKey(chunk_hash=slot, model_name=self._namespace + "/slot", kv_rank=0)

    def offset(self, view: torch.Tensor) -> int:
        """Where ``view`` (a view of this pool, from ``stage``/``acquire``) starts in the pool."""
        return view.data_ptr() - self._base

    def stage_slot(self, slot: bytes, nbytes: int) -> torch.Tensor | None:
        """``stage`` under a slot id instead of a chunk key: an engine writes the payload in
        place while a Store of the same chunk over the stream may stage it too."""
        return self._stage(self._slot_okey(slot), nbytes, slot.hex())

    def commit_slot(self, slot: bytes, key: ChunkKey) -> None:
        """Make the slot's object readable as ``key`` (once per successful ``stage_slot``)."""
        okey = self._slot_okey(slot)
        err = self._l1.finish_write([okey], tag=_WRITE_TAG)[okey]
        assert err == L1Error.SUCCESS, f"L1 finish_write(slot {slot.hex()}) failed: {err}"
        self._alias[key] = okey

    def abort_slot(self, slot: bytes) -> None:
        self._l1.finish_write_and_delete([self._slot_okey(slot)], tag=_WRITE_TAG)

    def footprint(self, nbytes: int) -> int:
        return round_up(nbytes, self._align)

    def stage(self, key: ChunkKey, nbytes: int) -> torch.Tensor | None:
        okey = self._default_okey(key)
        if okey in self._retired:  # the key's last object is still read by offset: another name
            okey = ObjectKey(chunk_hash=key + secrets.token_bytes(8), model_name=self._namespace, kv_rank=0)
            self._staging[key] = okey
        view = self._stage(okey, nbytes, key.hex())
        if view is None:
            self._staging.pop(key, None)
        return view

    def _stage(self, okey: ObjectKey, nbytes: int, what: str) -> torch.Tensor | None:
        layout = MemoryLayoutDesc(shapes=[torch.Size([nbytes])], dtypes=[torch.uint8])
        err, obj = self._l1.reserve_write([okey], [False], layout, tag=_WRITE_TAG)[okey]
        if err == L1Error.OUT_OF_MEMORY:
            return None
        assert err == L1Error.SUCCESS and obj is not None, (
            f"L1 refused to stage {what}: {err}; the store stages a key only when it is absent "
            "from the CPU tier, so this indicates a bug in the store's placement bookkeeping"
        )
        return obj.tensor

    def commit(self, key: ChunkKey) -> None:
        okey = self._staging.pop(key, None) or self._default_okey(key)
        err = self._l1.finish_write([okey], tag=_WRITE_TAG)[okey]
        assert err == L1Error.SUCCESS, f"L1 finish_write({key.hex()}) failed: {err}"
        if okey != self._default_okey(key):
            self._alias[key] = okey

    def abort(self, key: ChunkKey) -> None:
        okey = self._staging.pop(key, None) or self._default_okey(key)
        self._l1.finish_write_and_delete([okey], tag=_WRITE_TAG)

    def acquire(self, key: ChunkKey) -> torch.Tensor | None:
        okey = self._okey(key)
        err, obj = self._l1.reserve_read([okey])[okey]
        return obj.tensor if err == L1Error.SUCCESS and obj is not None else None

    def release(self, key: ChunkKey) -> None:
        self._l1.finish_read([self._okey(key)])

    def remove(self, key: ChunkKey) -> bool:
        okey = self._okey(key)
        ok = self._free(okey)
        if ok:
            self._alias.pop(key, None)
        return ok

    def retire(self, key: ChunkKey) -> ObjectKey:
        """Unname ``key``'s object but keep its memory (engines still read it by offset under a
        lease): ``free`` it when they are done. The key may be stored again meanwhile."""
        okey = self._alias.pop(key, None) or self._default_okey(key)
        self._retired.add(okey)
        return okey

    def free(self, okey: ObjectKey) -> None:
        """Free a ``retire``d object."""
        self._free(okey)
        self._retired.discard(okey)

    def _free(self, okey: ObjectKey) -> bool:
        if self.pool is not None:
            # Zero the stamp first: an engine still reading this object by offset (its lease
            # expired) sees it gone before the memory can hold anything else.
            err, obj = self._l1.reserve_read([okey])[okey]
            if err == L1Error.SUCCESS and obj is not None:
                obj.tensor[:STAMP_BYTES].zero_()
                self._l1.finish_read([okey])
        return self._l1.delete([okey])[okey] == L1Error.SUCCESS

    def allocator_usage(self) -> tuple[int, int]:
        """(used, total) bytes as LMCache's allocator sees them (includes alignment)."""
        return self._l1.get_memory_usage()

    def close(self, timeout: float) -> bool:
        self._l1.close()
        if self.pool is not None:
            self.pool.close()
        return True
