"""Tiered chunk-KV store on LMCache: GPU / CPU / disk / remote, placement, integrity.

Public API (no gRPC here; the server maps it): ``TieredStore(StoreConfig)`` with ``put``,
``get``/``get_many``, ``locate``/``tiers_of``/``meta``/``list_chunks``, ``evict``/``delete``,
``take_events``, ``stats``, ``close``; the payload codec ``decode_payload``/``encode_payload``/
``rotary_views``; typed refusals ``QuotaExceededError``/``CapacityError``/``TierUnavailableError``.

What is wrapped, and why not LMCache's ``StorageManager``
---------------------------------------------------------
The store drives LMCache's storage *components* from ``lmcache.v1.distributed`` directly:

* CPU tier: ``L1Manager`` (DRAM pool allocator + staging/read-lock state machine: a staged
  object is invisible until ``finish_write``, a read-locked one cannot be deleted);
* disk tier: the ``fs_native`` L2 adapter (C++ file connector, tmp file + rename);
* remote tier: not LMCache's ``resp`` adapter (pitfall 7) but redis-py with the hiredis
  parser (``backends.remote``), one object per chunk, one round trip per batched call;
* GPU tier: LMCache has none; a device tensor carved by LMCache's ``TensorMemoryAllocator``,
  with the L1 as host staging (``backends.gpu.GpuTier``).

Each is one subclass of ``backends.base.TierBackend`` (the primitives a backend provides),
registered per ``Tier`` in ``backends.BACKENDS``. The tier list itself is the ``Tier`` enum
(``sidecar.tiers.types``), with ``TIER_ORDER``/``TIER_NAMES``/``TIER_RANK`` derived from it.

``StorageManager`` itself (with its store, prefetch and eviction controllers) is not used: it
writes every L1 object through to every L2 asynchronously (no tiering, every chunk hits disk),
evicts L1 on a 1 s timer at an 80% watermark by dropping (``DISCARD`` is the only destination),
refuses writes into a full L1 until then, serves reads through prefix-bitmap prefetch tasks, and
reports nothing per object. The sidecar needs the opposite: synchronous, exclusive placement
with demotion, and an exact answer to "which tier holds this chunk". The engine-level API
(``LMCacheEngine``) is not used either.

LMCache 0.5.6 pitfalls (verified here) and how the store handles them
----------------------------------------------------------------------
1. The CPU pool is committed up front: a 512 MiB ``L1Manager`` raised RSS by 512 MiB at
   creation (lazy allocation needs CUDA pinning). The pool is sized to exactly ``cpu_bytes``.
   Its default SHM name is per pid and a "stale" same-named segment is unlinked on creation
   (source), so two pools in one process would clash: SHM is disabled.
2. CPU-tier reads do not refresh recency (``L1EvictionPolicy`` learns it only from
   ``touch_keys``): the store keeps its own LRU per tier (and per tenant and tier),
   ``move_to_end`` on every hit.
3. Eviction drops instead of demoting (observed with ``StorageManager``; source: DISCARD only):
   the store demotes LRU victims one tier down *before* writing (GPU->CPU->disk->remote) and
   drops only from the last tier, reporting every move in ``take_events()``.
4. Bursts into a full tier fail until the evictor runs (observed: 3 of 8 writes refused with
   OUT_OF_MEMORY; a batch reserve is all or nothing): room is made synchronously before each
   write, an allocator refusal (fragmentation) demotes one more victim and retries, pinned
   victims are waited for up to ``pin_wait_s``; when nothing can move the put is refused with
   ``CapacityError`` (backpressure), and a lower tier that fails its write (disk gone, I/O
   error) also refuses the put instead of dropping the victim.
5. ``close()`` hanging with a Redis remote: the legacy ``RemoteBackend.close`` waits on
   ``future.result()`` without a timeout (source); not reproduced with the ``resp`` adapter,
   whose close joins a thread for up to 0.5 s. Every adapter is closed in a helper thread
   joined with ``close_timeout_s``, in-flight waiters are released as failed, and memory pools
   are freed only after readers drained.
6. Redis ``remove`` is not implemented in the legacy ``RedisConnector`` (no ``remove_sync``).
7. (found here) The ``resp`` adapter's RESP client loses protocol sync on any failed GET: a GET
   of a missing key kills the connection; a batched GET whose objects differ in size (every
   batch of content-defined chunks) fails each object whose size differs from the batch's
   first and shifts the reply stream; a refused connect closes one fd number twice. So the
   remote tier does not use it: it is redis-py with hiredis (``sidecar.tiers.backends.remote``),
   one MGET per batched read of any sizes, one SET per object, and a failed call costs only
   its own connection. Keys this store is deleting are not looked up meanwhile.
   Run the remote Redis with ``maxmemory-policy noeviction`` (capacity is ``remote_bytes``).
8. (found here) ``fs_native`` keeps no index and cannot list keys; storing an existing key
   "succeeds" but keeps the old file; a GET into a smaller buffer succeeds with a prefix. The
   metadata (key, tenant, scope, layout fingerprint, tokens, position, checksum) lives in each
   object's 4 KiB header and in the tier's own index log (``disk_index``: a restart reads it
   instead of every header; without it, the directory is scanned: headers verified, sizes
   checked, LRU order from strictly increasing stamped mtimes); ``.tmp`` leftovers are
   removed, a file is unlinked before it is written, and every read uses the exact size and a
   checksum.
9. Telemetry and ``multiprocessing.set_start_method("spawn", force=True)`` come with the
   engine-level API (``LMCacheEngine``), which is not used; importing the distributed layer has
   neither side effect (tested). Processes that import LMCache should still set
   ``LMCACHE_TRACK_USAGE=false`` (the CLI's job: nothing here reads or writes the environment;
   LMCache's RESP factory does read ``LMCACHE_RESP_*`` for fields left empty).

Integrity: every object carries an xxh3-64 of its payload (and of its header) and is verified on
every read, memory tiers included (``verify_memory_reads``); a corrupt, truncated or missing
object is counted, removed, reported as ``LOST`` and served as a miss (or from the remote copy
when one exists). ``tests/tiers/test_lmcache_pitfalls.py`` pins the upstream behaviours above.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Names resolve on first use (PEP 562): the configuration, the wire layer, the registry and the
# supervisor need ``StoreConfig``, ``Tier``, the tier list or ``chunk_key``, not torch and
# LMCache (~1.5 s to import), which only the store and the codec pull in.
_SOURCES = {
    "sidecar.payload": (
        "KVPayloadView", "PartView", "as_byte_tensor", "decode_payload", "encode_payload", "payload_nbytes",
        "rotary_views",
    ),
    "sidecar.tiers.config": ("RemoteEndpoint", "StoreConfig", "TenantQuota"),
    "sidecar.tiers.errors": ("CapacityError", "QuotaExceededError", "TierStoreError", "TierUnavailableError"),
    "sidecar.tiers.events": ("EventKind", "Reason", "TierEvent"),
    "sidecar.tiers.placement": ("Guard",),
    "sidecar.tiers.stats": ("StoreStats", "TierStats"),
    "sidecar.tiers.store": ("TieredStore",),
    "sidecar.tiers.types": (
        "ChunkKey", "ChunkMeta", "FetchedChunk", "PutResult", "TIER_NAMES", "TIER_ORDER", "TIER_RANK", "Tier",
        "chunk_key",
    ),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'sidecar.tiers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from sidecar.payload import (
        KVPayloadView,
        PartView,
        as_byte_tensor,
        decode_payload,
        encode_payload,
        payload_nbytes,
        rotary_views,
    )
    from sidecar.tiers.config import RemoteEndpoint, StoreConfig, TenantQuota
    from sidecar.tiers.errors import CapacityError, QuotaExceededError, TierStoreError, TierUnavailableError
    from sidecar.tiers.events import EventKind, Reason, TierEvent
    from sidecar.tiers.placement import Guard
    from sidecar.tiers.stats import StoreStats, TierStats
    from sidecar.tiers.store import TieredStore
    from sidecar.tiers.types import (
        TIER_NAMES,
        TIER_ORDER,
        TIER_RANK,
        ChunkKey,
        ChunkMeta,
        FetchedChunk,
        PutResult,
        Tier,
        chunk_key,
    )

__all__ = [
    "TIER_NAMES",
    "TIER_ORDER",
    "TIER_RANK",
    "CapacityError",
    "ChunkKey",
    "ChunkMeta",
    "EventKind",
    "FetchedChunk",
    "Guard",
    "KVPayloadView",
    "PartView",
    "PutResult",
    "QuotaExceededError",
    "Reason",
    "RemoteEndpoint",
    "StoreConfig",
    "StoreStats",
    "TenantQuota",
    "Tier",
    "TierEvent",
    "TierStats",
    "TierStoreError",
    "TierUnavailableError",
    "TieredStore",
    "as_byte_tensor",
    "chunk_key",
    "decode_payload",
    "encode_payload",
    "payload_nbytes",
    "rotary_views",
]
