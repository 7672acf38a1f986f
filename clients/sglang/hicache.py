"""A HiCache L3 storage backend whose pages live in the sidecar's tiers.

Selected through SGLang's own dynamic factory (``StorageBackendFactory``)::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kv_sidecar",
            "module_path": "clients.sglang.hicache", "class_name": "SidecarHiCacheStorage",
            "sidecar_target": "10.0.0.5:50051", "tenant": "team-a"}'

Page mapping (the sidecar's Store / Lookup / Fetch API is token-based and has no keyed blob
put; see docs/sglang.md): a HiCache page key (SGLang's chained page hash, a string) becomes a
deterministic 8-token **page name** (sha256 of the key, eight 32-bit words with the top bit
set, so no tokenizer's anchor or marker ids can cut it: 8 < ``chunker.min_size``, so it is
exactly one chunk). The page bytes are that chunk's payload under a one-part ``uint8`` layout
(``page_bytes / 8`` bytes per "token"); the identity is ``model_id = model_name`` with the
namespace ``sglang-hicache`` + the shard suffix SGLang's own file backend uses (TP rank/size
unless MLA, PP, CP). Every engine of the same model and parallel layout, on any host, computes
the same names and identity, so pages one engine stored are found by another through the
sidecar's registry and served from its tiers (CPU / disk / Redis remote tier).

* ``exists`` / ``batch_exists`` / ``batch_exists_v2``: an exact-policy Lookup of each page
  name (issued concurrently); a hit also yields the chunk hash, cached for the next get.
* ``get`` / ``batch_get`` / ``batch_get_v1`` / ``batch_get_v2``: one Fetch RPC for the whole
  batch (``raw``: nothing is rotated); ``*_v1`` / ``*_v2`` write each page straight into the
  host pool with ``set_from_flat_data_page`` from a tensor viewing the received buffer.
* ``set`` / ``batch_set`` / ``batch_set_v1`` / ``batch_set_v2``: one Store per page (issued
  concurrently), the payload read from the host pool's page view without a staging copy.

Failures never reach the engine: a sidecar that is down, a timeout or a refused request is a
miss (``False`` / ``None`` / 0 hits) and is logged (once per minute at warning level).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, List, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from sidecar.api.kv import lookup_plan_from_wire, lookup_request, store_messages
from sidecar.client import RetryPolicy, SyncSidecarClient
from sidecar.identity import CacheIdentity, KVLayout, KVPart
from sidecar.registry.lookup_plan import SegmentKind
from sidecar.sdk.kit import as_byte_tensor
from sidecar.sdk.pool import PoolClient

logger = logging.getLogger(__name__)

#: Tokens in a page name (8 x 32 bits = the sha256 digest of the key).
PAGE_NAME_TOKENS = 8
_TOP_BIT = np.uint32(0x80000000)
DEFAULT_NAMESPACE = "sglang-hicache"


def page_name(key: str) -> np.ndarray:
    """The 8-token name a HiCache key is stored under (uint32, top bit set)."""
    words = np.frombuffer(hashlib.sha256(key.encode()).digest(), dtype="<u4")
    return (words | _TOP_BIT).astype(np.uint32)


def page_layout(page_bytes: int) -> KVLayout:
    """The payload layout of one page of ``page_bytes`` bytes (one uint8 part)."""
    if page_bytes <= 0 or page_bytes % PAGE_NAME_TOKENS:
        raise ValueError(f"page_bytes: {page_bytes} is not a positive multiple of {PAGE_NAME_TOKENS}")
    return KVLayout(
        num_layers=1, parts=(KVPart(name="page", shape=(page_bytes // PAGE_NAME_TOKENS,), dtype="uint8"),)
    )


def shard_suffix(cfg: HiCacheStorageConfig) -> str:
    """The parallel-layout part of the namespace (as SGLang's HiCacheFile suffixes its keys)."""
    parts = [] if cfg.is_mla_model else [f"tp{cfg.tp_rank}of{cfg.tp_size}"]
    if cfg.pp_size > 1:
        parts.append(f"pp{cfg.pp_rank}of{cfg.pp_size}")
    if cfg.attn_cp_size > 1:
        parts.append(f"cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}")
    if getattr(cfg, "dcp_size", 1) > 1:
        parts.append(f"dcp{cfg.dcp_rank}of{cfg.dcp_size}p{cfg.logical_page_size}")
    return "/".join(parts) or "mla"


def _as_bytes_view(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().view(-1).view(torch.uint8)


class SidecarHiCacheStorage(HiCacheStorage):
    """``HiCacheStorage`` on the KV sidecar. Built by SGLang as
    ``SidecarHiCacheStorage(storage_config, kwargs)`` (the dynamic factory's call).

    ``storage_config.extra_config`` keys (all optional but the target):
      ``sidecar_target`` (or ``$KV_SIDECAR_TARGET``, default ``127.0.0.1:50051``), ``tenant``,
      ``token`` (bearer), ``namespace`` (default ``sglang-hicache``), ``model_id`` (default
      ``storage_config.model_name``), ``shared`` (store into the shared scope; the tenant must
      be a shared writer), ``timeout_s`` (default 5), ``page_bytes`` (else read from the host
      pool, else learned from the first page seen), ``retry_attempts`` (default 2),
      ``shared_pool`` (default true: on the sidecar's host, pages move through its shared pool).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.storage_config = storage_config
        self.target = str(extra.get("sidecar_target") or os.environ.get("KV_SIDECAR_TARGET", "127.0.0.1:50051"))
        self.model_id = str(extra.get("model_id") or storage_config.model_name or "sglang-model")
        self.namespace = f"{extra.get('namespace', DEFAULT_NAMESPACE)}/{shard_suffix(storage_config)}"
        self.shared = bool(extra.get("shared", False))
        self.timeout_s = float(extra.get("timeout_s", 5.0))
        self._page_bytes: Optional[int] = int(extra["page_bytes"]) if extra.get("page_bytes") else None
        self.client = SyncSidecarClient(
            self.target, tenant=extra.get("tenant"), token=extra.get("token"), timeout_s=self.timeout_s,
            retry=RetryPolicy(attempts=int(extra.get("retry_attempts", 2)), base_s=0.02, cap_s=0.2),
        )
        #: on the sidecar's host, pages move through its shared pool (``shared_pool``, default on)
        self._use_pool = bool(extra.get("shared_pool", True))
        self._sidecar_pool: Optional[PoolClient] = None
        self._pool_checked = False
        self._idents: dict[int, tuple[CacheIdentity, KVLayout]] = {}
        self._hashes: OrderedDict[tuple[int, str], int] = OrderedDict()  # (page bytes, key) -> chunk hash
        self._max_cached = int(extra.get("hash_cache_entries", 1 << 20))
        self._lock = threading.Lock()
        self._last_warn = 0.0
        self.stats = {"set": 0, "set_failed": 0, "get_hit": 0, "get_miss": 0, "exists_hit": 0, "exists_miss": 0,
                      "errors": 0}

    # ------------------------------------------------------------------ identity / names

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self._page_bytes is None:
            try:
                page = mem_pool_host.get_dummy_flat_data_page()
                self._page_bytes = page.numel() * page.element_size()
            except Exception:  # noqa: BLE001 - a pool without a flat page API: learn it from the data
                pass

    def _ident(self, page_bytes: int) -> tuple[CacheIdentity, KVLayout]:
        got = self._idents.get(page_bytes)
        if got is None:
            layout = page_layout(page_bytes)
            ident = CacheIdentity(
                model_id=self.model_id, kv_layout=layout.fingerprint(), namespace=self.namespace,
            )
            got = self._idents[page_bytes] = (ident, layout)
        return got

    def _warn(self, what: str, exc: BaseException) -> None:
        self.stats["errors"] += 1
        now = time.monotonic()
        if now - self._last_warn > 60:
            self._last_warn = now
            logger.warning("kv-sidecar HiCache %s failed (%s: %s); treated as a miss", what, type(exc).__name__, exc)
        else:
            logger.debug("kv-sidecar HiCache %s failed: %s", what, exc)

    def _remember(self, page_bytes: int, key: str, h: int) -> None:
        with self._lock:
            self._hashes[(page_bytes, key)] = h
            self._hashes.move_to_end((page_bytes, key))
            while len(self._hashes) > self._max_cached:
                self._hashes.popitem(last=False)

    def _forget(self, page_bytes: int, key: str) -> None:
        with self._lock:
            self._hashes.pop((page_bytes, key), None)

    # ------------------------------------------------------------------ RPC batches

    def _lookup_many(self, keys: Sequence[str], page_bytes: int) -> list[Optional[int]]:
        """Chunk hash of each key's page if the sidecar holds its KV, else None (concurrent
        Lookups; any failure is a miss)."""
        ident, _ = self._ident(page_bytes)
        stub, md = self.client.stub, self.client.metadata  # the SDK's sync stub: concurrent futures
        futs = []
        for k in keys:
            req = lookup_request(page_name(k), ident, 0, "exact")
            futs.append(stub.Lookup.future(req, metadata=md, timeout=self.timeout_s))
        out: list[Optional[int]] = []
        for k, f in zip(keys, futs):
            try:
                plan = lookup_plan_from_wire(f.result())
            except Exception as exc:  # noqa: BLE001 - grpc.RpcError and anything else: a miss
                self._warn("lookup", exc)
                out.append(None)
                continue
            h = None
            for seg in plan.segments:
                if seg.kind is SegmentKind.CHUNK_HIT and seg.start == 0 and seg.end == PAGE_NAME_TOKENS:
                    h = int(seg.chunk_hash)
            if h is None:
                self._forget(page_bytes, k)
            else:
                self._remember(page_bytes, k, h)
            out.append(h)
        return out

    def _hashes_for(self, keys: Sequence[str], page_bytes: int) -> list[Optional[int]]:
        with self._lock:
            known = [self._hashes.get((page_bytes, k)) for k in keys]
        missing = [i for i, h in enumerate(known) if h is None]
        if missing:
            for i, h in zip(missing, self._lookup_many([keys[i] for i in missing], page_bytes)):
                known[i] = h
        return known

    def _fetch_many(self, keys: Sequence[str], page_bytes: int) -> list[Optional[bytearray]]:
        """Each key's page bytes (None: a miss). One Fetch RPC for the batch."""
        hashes = self._hashes_for(keys, page_bytes)
        want = [(i, h) for i, h in enumerate(hashes) if h is not None]
        out: list[Optional[bytearray]] = [None] * len(keys)
        if not want:
            return out
        ident, layout = self._ident(page_bytes)
        try:
            pool = self._shared_pool()
            if pool is not None:  # copied once, out of the sidecar's pool (pages sit at position 0)
                got = pool.fetch([(h, 0) for _, h in want], identity=ident, layout=layout)
            else:
                got = self.client.fetch([(h, 0) for _, h in want], identity=ident, layout=layout, raw=True)
        except Exception as exc:  # noqa: BLE001
            self._warn("fetch", exc)
            return out
        for (i, _), kv in zip(want, got):
            if kv.ok and len(kv.data) == page_bytes:
                out[i] = kv.data
            else:
                self._forget(page_bytes, keys[i])  # evicted or lost since the Lookup: a miss
        return out

    def _shared_pool(self) -> Optional[PoolClient]:
        """The sidecar's shared pool, mapped on first use (None: off, or not on its host)."""
        if self._use_pool and not self._pool_checked:
            self._pool_checked = True
            try:
                pool = PoolClient(self.client)
                self._sidecar_pool = pool if pool.available else None
            except Exception as exc:  # noqa: BLE001 - an older sidecar, or none: Fetch and Store
                self._warn("map_pool", exc)
        return self._sidecar_pool

    def _page(self, page: torch.Tensor) -> tuple[torch.Tensor, int, CacheIdentity, KVLayout]:
        """A page to store: its bytes, their count (learned as the page size), identity, layout."""
        view = _as_bytes_view(page)
        nbytes = view.numel()
        if self._page_bytes is None:
            self._page_bytes = nbytes
        ident, layout = self._ident(nbytes)
        return view, nbytes, ident, layout

    def _store_pooled(self, pool: PoolClient, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        ok: list[bool] = []
        for k, page in zip(keys, pages):
            good = False
            try:
                view, nbytes, ident, layout = self._page(page)
                res = pool.store(page_name(k), identity=ident, layout=layout, payloads={0: view}, shared=self.shared)
                good = res.chunks_total == 1 and res.chunks_stored + res.chunks_refreshed >= 1
            except Exception as exc:  # noqa: BLE001
                self._warn("store", exc)
            self.stats["set" if good else "set_failed"] += 1
            if good:
                self._forget(nbytes, k)
            ok.append(good)
        return ok

    def _store_many(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        pool = self._shared_pool()
        if pool is not None:  # each page copied once, into its slot in the sidecar's pool
            return self._store_pooled(pool, keys, pages)
        stub, md = self.client.stub, self.client.metadata  # the SDK's sync stub: concurrent futures
        futs = []
        for k, page in zip(keys, pages):
            try:
                view, nbytes, ident, layout = self._page(page)
                msgs = store_messages(page_name(k), ident, 0, self.shared, layout, {0: view})
                futs.append((k, nbytes, stub.Store.future(iter(msgs), metadata=md, timeout=self.timeout_s)))
            except Exception as exc:  # noqa: BLE001
                self._warn("store", exc)
                futs.append((k, 0, None))
        ok: list[bool] = []
        for k, nbytes, f in futs:
            good = False
            if f is not None:
                try:
                    resp = f.result()
                    # one chunk (the page name), its payload stored now or already held
                    good = resp.chunks_total == 1 and resp.chunks_stored + resp.chunks_refreshed >= 1
                    if not good:
                        logger.debug("kv-sidecar HiCache store of %s: %s", k, resp)
                except Exception as exc:  # noqa: BLE001
                    self._warn("store", exc)
            self.stats["set" if good else "set_failed"] += 1
            if good:
                self._forget(nbytes, k)  # re-resolved on the next get (the hash is the server's)
            ok.append(good)
        return ok

    # ------------------------------------------------------------------ legacy API

    def _page_bytes_or(self, t: Optional[torch.Tensor]) -> Optional[int]:
        if t is not None:
            return t.numel() * t.element_size()
        return self._page_bytes

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        res = self.batch_get([key], [target_location] if target_location is not None else None, target_sizes)
        return res[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None):
        try:
            targets = list(target_locations) if target_locations is not None else [None] * len(keys)
            out: list[Optional[torch.Tensor]] = [None] * len(keys)
            groups: dict[int, list[int]] = {}
            for i, t in enumerate(targets):
                pb = self._page_bytes_or(t)
                if pb is not None:
                    groups.setdefault(pb, []).append(i)
            for pb, idx in groups.items():
                datas = self._fetch_many([keys[i] for i in idx], pb)
                for i, data in zip(idx, datas):
                    if data is None:
                        continue
                    src = as_byte_tensor(data)
                    t = targets[i]
                    if t is None:
                        pool = getattr(self, "mem_pool_host", None)
                        dtype = getattr(pool, "dtype", torch.uint8)
                        out[i] = src.view(dtype) if pb % torch.empty((), dtype=dtype).element_size() == 0 else src
                    else:
                        as_byte_tensor(t, field="target_location").copy_(src)
                        out[i] = t
            for r in out:
                self.stats["get_hit" if r is not None else "get_miss"] += 1
            return out
        except Exception as exc:  # noqa: BLE001
            self._warn("get", exc)
            return [None] * len(keys)

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        if value is None:
            return False
        try:
            return self._store_many([key], [value])[0]
        except Exception as exc:  # noqa: BLE001
            self._warn("set", exc)
            return False

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if values is None:
            return False
        try:
            return all(self._store_many(list(keys), list(values)))
        except Exception as exc:  # noqa: BLE001
            self._warn("batch_set", exc)
            return False

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Number of consecutive keys from the start whose pages the sidecar holds."""
        if not keys or self._page_bytes is None:
            return 0
        try:
            hits = self._lookup_many(list(keys), self._page_bytes)
        except Exception as exc:  # noqa: BLE001
            self._warn("exists", exc)
            return 0
        n = next((i for i, h in enumerate(hits) if h is None), len(hits))
        self.stats["exists_hit"] += n
        self.stats["exists_miss"] += len(keys) - n
        return n

    # ------------------------------------------------------------------ zero-copy v1

    def _host_pages(self, host_pool, host_indices: torch.Tensor, n: int) -> Optional[list[int]]:
        ps = int(getattr(host_pool, "page_size", 1) or 1)
        if host_indices is None or host_indices.numel() != n * ps:
            logger.error("kv-sidecar HiCache: host_indices has %s entries for %d pages of %d",
                         None if host_indices is None else host_indices.numel(), n, ps)
            return None
        return host_indices.view(-1)[::ps][:n].tolist()

    def _read_pages(self, keys: Sequence[str], host_pool, starts: Sequence[int]) -> list[bool]:
        probe = host_pool.get_dummy_flat_data_page()
        pb = probe.numel() * probe.element_size()
        datas = self._fetch_many(list(keys), pb)
        ok = []
        for start, data in zip(starts, datas):
            if data is None:
                ok.append(False)
                continue
            # a tensor over the received buffer (no copy), written into the pool in place
            host_pool.set_from_flat_data_page(start, as_byte_tensor(data).view(probe.dtype))
            ok.append(True)
        for g in ok:
            self.stats["get_hit" if g else "get_miss"] += 1
        return ok

    def _write_pages(self, keys: Sequence[str], host_pool, starts: Sequence[int]) -> list[bool]:
        pages = [host_pool.get_data_page(s, flat=True) for s in starts]
        return self._store_many(list(keys), pages)

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        try:
            pool = self.mem_pool_host
            starts = self._host_pages(pool, host_indices, len(keys))
            return [False] * len(keys) if starts is None else self._read_pages(keys, pool, starts)
        except Exception as exc:  # noqa: BLE001
            self._warn("batch_get_v1", exc)
            return [False] * len(keys)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        try:
            pool = self.mem_pool_host
            starts = self._host_pages(pool, host_indices, len(keys))
            return [False] * len(keys) if starts is None else self._write_pages(keys, pool, starts)
        except Exception as exc:  # noqa: BLE001
            self._warn("batch_set_v1", exc)
            return [False] * len(keys)

    # ------------------------------------------------------------------ v2 (per-pool transfers)

    @staticmethod
    def _pool_key(name: Any, key: str) -> str:
        return key if str(name) == PoolName.KV.value else f"{key}.{name}"

    def _pool(self, name: Any):
        pools = getattr(self, "registered_pools", {}) or {}
        return pools.get(name) or pools.get(str(name)) or (
            self.mem_pool_host if str(name) == PoolName.KV.value else None
        )

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        try:
            kv_pages = self.batch_exists(keys, extra_info)
            hit: dict[str, int] = {PoolName.KV.value: kv_pages} if kv_pages else {}
            restorable = set(range(1, kv_pages + 1))
            for tr in pool_transfers or []:
                if not restorable:
                    break
                pool = self._pool(tr.name)
                if pool is None:
                    restorable = set()
                    break
                probe = pool.get_dummy_flat_data_page()
                pb = probe.numel() * probe.element_size()
                present = [h is not None for h in self._lookup_many([self._pool_key(tr.name, k) for k in keys[:kv_pages]], pb)]
                if tr.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                    trailing = max(1, len(tr.keys) if tr.keys else 1)
                    ok = {p for p in range(1, kv_pages + 1) if all(present[max(0, p - trailing):p])}
                else:  # ALL_PAGES (BLOCK_GROUPS reported as a plain prefix)
                    b = next((i for i, x in enumerate(present) if not x), kv_pages)
                    ok = set(range(1, b + 1))
                if ok:
                    hit[str(tr.name)] = max(ok)
                restorable &= ok
            final = max(restorable) if restorable else 0
            return PoolTransferResult(final, hit, sorted(restorable))
        except Exception as exc:  # noqa: BLE001
            self._warn("batch_exists_v2", exc)
            return PoolTransferResult.empty()

    def _io_v2(self, transfers: List[PoolTransfer], write: bool) -> dict[str, List[bool]]:
        results: dict[str, List[bool]] = {}
        for tr in transfers:
            keys = list(tr.keys or [])
            try:
                pool = self._pool(tr.name)
                starts = None if pool is None else self._host_pages(pool, tr.host_indices, len(keys))
                if starts is None:
                    results[str(tr.name)] = [False] * len(keys)
                    continue
                pkeys = [self._pool_key(tr.name, k) for k in keys]
                fn = self._write_pages if write else self._read_pages
                results[str(tr.name)] = fn(pkeys, pool, starts)
            except Exception as exc:  # noqa: BLE001
                self._warn("batch_set_v2" if write else "batch_get_v2", exc)
                results[str(tr.name)] = [False] * len(keys)
        return results

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        return self._io_v2(transfers, write=False)

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        return self._io_v2(transfers, write=True)

    # ------------------------------------------------------------------ misc

    def clear(self) -> bool:
        """Forget the local hash cache. Pages in the sidecar stay (other engines share them;
        an operator removes them with the sidecar's Evict/Delete)."""
        with self._lock:
            self._hashes.clear()
        return True

    def get_stats(self):
        return dict(self.stats)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001
            pass


__all__ = ["SidecarHiCacheStorage", "page_layout", "page_name", "shard_suffix", "PAGE_NAME_TOKENS"]
