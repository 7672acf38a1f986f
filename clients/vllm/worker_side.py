"""The connector's worker side: Fetch into the paged KV cache before the forward, Store after it.

Runs in each vLLM worker (the model's process), called by the connector facade
(``connector.py``). Under tensor or pipeline parallelism each worker loads and saves its own
heads and layers as its own shard (``CacheIdentity.shard``), fetching the chunks the scheduler
side planned under rank 0 of stage 0 with ``plan_identity`` (the sidecar serves the same tokens'
chunk of this shard); a worker whose load failed reports its blocks, and vLLM recomputes them on
every worker::

    start-up      register_kv_caches(layers)  CPU backend: learn its block layout (paged.py);
                                              other devices: vLLM's standard [B, H, N, K | V]
                                              views, or MLA's [B, 1, N, c_kv | k_pe]
                                              (layouts.py); checks the rotary
                                              pairing; else ``Refused`` (refusals.py)
    each step     load(jobs.loads)            before the forward: Fetch each LoadJob's items
                                              (rotated to their target positions by the sidecar,
                                              or raw and rotated here on the cache's device:
                                              ``rotate``) and scatter their rows into the
                                              request's blocks; on a GPU through pinned memory
                                              and a side stream vLLM's stream waits for
                                              (staging.py)
                  save(jobs.stores)           after the forward: gather the StoreJobs' rows from
                                              the paged cache and Store them (background thread
                                              by default: ``store = "async"``; on a GPU the
                                              device-to-host copy is asynchronous too)
                  take_load_errors()          blocks whose Fetch failed: vLLM recomputes them

Rows are ``[L, 2, n, H, D]`` (GQA / MHA) or MLA latent rows ``[L, n, C]`` (``rows.py``). A chunk
that cannot be fetched marks its blocks failed, never the request. Imports no vLLM at module
level (the cache-write kernel and the rotary registry are imported when first used).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from clients.vllm.cache_view import CacheView
from clients.vllm.jobs import LoadJob, StoreJob
from clients.vllm.layouts import LatentKV, PagedSpec, StandardKV, UnsupportedLayout
from clients.vllm.paged import BlockLayout, PagedKV, single_threaded
from clients.vllm.placing import Scratch, place
from clients.vllm.refusals import Refused
from clients.vllm.resharding import fetch_across
from clients.vllm.rows import GqaRows, LatentRows, fetched_rows, leased_rows
from clients.vllm.staging import Staging

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from clients.vllm.settings import EngineShape, Settings
    from sidecar.rotation import RopeSpec
    from sidecar.sdk.kit import FailSoftLink
    from sidecar.sdk.pool import PoolClient

log = logging.getLogger("clients.vllm")


def check_rope_pairing(rope: "RopeSpec", embeddings: "Iterable[Any] | None" = None) -> None:
    """``Refused`` unless the model's rotary embeddings rotate keys the way ``rope`` (the
    identity's) pairs them. ``embeddings``: the model's rotary embedding modules (objects with
    vLLM's ``head_size``, ``rotary_dim``, ``is_neox_style``); by default every one vLLM built,
    from its registry ``_ROPE_DICT`` (the model is loaded before the caches are registered).
    The ones over the identity's key (``key_dim`` wide, ``rotary_dim`` rotated) must include
    its ``is_neox_style``: another embedding of the same size may rotate something else the
    other way (DeepSeek-V3.2's indexer keys), so only a set without it is a mismatch. Without
    vLLM's registry (another release) nothing is checked."""
    if embeddings is None:
        try:
            from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT
        except ImportError:
            return
        embeddings = _ROPE_DICT.values()
    embs = list(embeddings)
    if not embs:
        return
    ours = [r for r in embs
            if (getattr(r, "head_size", None), getattr(r, "rotary_dim", None)) == (rope.key_dim, rope.rotary_dim)]
    want = rope.pairing.value == "half"
    if not ours:
        sizes = sorted({(getattr(r, "rotary_dim", None), getattr(r, "head_size", None)) for r in embs}, key=str)
        raise Refused(f"rotary embedding: the model rotates (rotary dims, key dims) {sizes}, the identity's RoPE "
                      f"{rope.rotary_dim} of {rope.key_dim}")
    styles = sorted({bool(getattr(r, "is_neox_style", True)) for r in ours})
    if want not in styles:
        raise Refused(f"rope pairing (kv_connector_extra_config rope_is_neox_style): the model's rotary embeddings "
                      f"use is_neox_style={styles[0]}, the identity assumes {want}; set rope_is_neox_style to "
                      f"{styles[0]}")


class WorkerSide:
    """The worker-side primitives of ``SidecarConnector`` (see the module docstring).
    ``counters`` is shared with the facade's ``stats()``."""

    def __init__(self, settings: "Settings", shape: "EngineShape", link: "FailSoftLink",
                 counters: Counter[str] | None = None) -> None:
        self.settings = settings
        self.shape = shape
        self.block_size = shape.block_size
        self.link = link
        self.counters: Counter[str] = Counter() if counters is None else counters
        self.paged: CacheView | None = None  # PagedKV (CPU backend), StandardKV or LatentKV
        self.staging = Staging(torch.device("cpu"))  # the cache's device once registered
        #: what the cache's rows are (``rows.py``): [L, 2, n, H, D], or MLA latent rows [L, n, C]
        self.rows = LatentRows if shape.mla else GqaRows
        self._invalid: set[int] = set()
        self._pools: dict[str | None, Any] = {}  # tenant -> the sidecar's shared pool (or None)
        self._leased: Any = None  # the load's lease in flight
        self._scratch = Scratch()  # shifted rows rotated on the host (placing.py)
        self._reshard_scratch = Scratch()  # rows joined from another cut's shards (resharding.py)
        self._store_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sidecar-store")
        self._store_futures: list[Future] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ start-up

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the engine's per-layer caches; ``Refused`` (``refusals.py``) for caches or a model
        this worker cannot serve: the layer count, the cache layout, the rotary pairing."""
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        layers = [kv_caches[n] for n in names]
        if self.shape.tp_size > 1 or self.shape.pp_size > 1:  # this rank's heads and stage's layers
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            self.shape = self.shape.for_rank(get_tensor_model_parallel_rank(), get_pp_group().rank_in_group,
                                             num_layers=len(layers) if self.shape.pp_size > 1 else None)
            log.info("sidecar connector (worker): tensor-parallel rank %d of %d, pipeline stage %d of %d "
                     "(%d layers), shard %s", self.shape.tp_rank, self.shape.tp_size, self.shape.pp_rank,
                     self.shape.pp_size, len(layers), self.shape.identity.shard)
        if len(layers) != self.shape.num_layers:
            raise Refused(f"model shape: {len(layers)} KV cache tensors for {self.shape.num_layers} attention "
                          "layers (a hybrid or layer-sharing model): the cache identity covers every layer")
        check_rope_pairing(self.shape.rope)
        t = layers[0]
        H, B, D = self.shape.num_kv_heads, self.block_size, self.shape.head_size
        if self.shape.mla or t.device.type != "cpu":
            # vLLM's standard layout: each layer a logical [blocks, H, N, K | V] view (MLA:
            # [blocks, 1, N, c_kv | k_pe], on any device) whose strides carry the group's
            # KVCacheLayout (clients/vllm/layouts.py)
            mla = self.shape.mla
            try:
                spec = PagedSpec(mla=mla, num_heads=H, block_size=B, head_size=D, head_size_v=0 if mla else D,
                                 dtype=t.dtype, rope_dim=self.shape.rope_dim)
                self.paged = (LatentKV if mla else StandardKV)(layers, spec)
            except UnsupportedLayout as exc:
                raise UnsupportedLayout(f"{'MLA ' if mla else ''}KV cache layout on {t.device}: {exc}") from None
            self.staging = Staging(t.device)
            log.info("sidecar connector (worker): %d %slayers on %s, vLLM's standard layout (strides %s)",
                     len(layers), "MLA " if mla else "", t.device, tuple(t.stride()))
            return
        if t.dim() != 4 or tuple(t.shape[1:]) != (H, B, 2 * D):
            raise Refused(f"KV cache layout {tuple(t.shape)} on {t.device}: not the CPU backend's "
                          f"[blocks, {H}, {B}, {2 * D}]")
        try:
            layout = self._learn_layout(t.dtype)
        except Exception as exc:  # noqa: BLE001 - any failure of the engine's kernel is a refusal
            raise Refused(f"KV cache layout on {t.device}: could not learn the block layout "
                          f"({type(exc).__name__}: {exc})") from None
        self.paged = PagedKV(layers, layout)
        log.info("sidecar connector (worker): %d layers, block layout %s", len(layers), layout.kind)

    def _learn_layout(self, dtype: torch.dtype) -> BlockLayout:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        H, B, D = self.shape.num_kv_heads, self.block_size, self.shape.head_size
        isa = _get_attn_isa(dtype, B, D)

        def write(k, v, kc, vc, slots):
            ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)

        return BlockLayout.learn(write, H, B, D, dtype)

    # ------------------------------------------------------------------ loads

    def load(self, jobs: list[LoadJob]) -> None:
        """Before the forward: every job's rows into the paged cache (failures marked)."""
        if not jobs:
            return
        for job in jobs:
            self._load(job)
        self.staging.publish()  # vLLM's stream waits for the copies; the CPU does not

    def _fail_blocks(self, job: LoadJob, start: int, end: int) -> None:
        B = self.block_size
        for b in range(start // B, (end - 1) // B + 1):
            self._invalid.add(job.block_ids[b])
        self.counters["load_failed_tokens"] += end - start

    def _load(self, job: LoadJob) -> None:
        if self.paged is None:  # no caches registered: vLLM recomputes
            for it in job.items:
                self._fail_blocks(job, it.start, it.end)
            return
        t0 = time.perf_counter()
        across = job.plan_shard is not None and job.plan_shard != (self.shape.planned or self.shape.identity).shard
        pool = self._pool(job.tenant)
        finish_across = None
        if across:  # another tensor-parallel cut stored the chunks (resharding.py)
            with single_threaded():  # its joins are many small copies, as the placement's
                read = fetch_across(job, self.shape, lambda fn: self.link.call("fetch", job.tenant, fn),
                                    self._reshard_scratch, raw=self.engine_rotates or pool is not None, pool=pool)
            got, finish_across = read if read is not None else ([(it, None, 0, 0) for it in job.items], None)
            pool = None  # its leases end with finish_across
            self.counters["resharded_loads"] += 1
        else:
            got = self._lease(job, pool) if pool is not None else self._fetch(job)
        t1 = time.perf_counter()
        items = []
        for it, rows, delta, nbytes in got:
            if rows is None:
                self._fail_blocks(job, it.start, it.end)
                continue
            items.append((it.start, it.end, rows, delta))
            self.counters["loaded_tokens"] += len(it)
            self.counters["fetch_bytes"] += nbytes
        with single_threaded():
            self.counters["engine_rotated_tokens"] += place(
                self.paged, self.rows, items, torch.tensor(job.block_ids, dtype=torch.int64), staging=self.staging,
                rope=self.shape.rope, layout=self.shape.layout, scratch=self._scratch,
                registered=pool is not None and pool.mapped is not None and pool.mapped.pinned)
        if pool is not None:
            self._end_lease(job, pool)
        if finish_across is not None:
            self.staging.synchronize()  # CUDA: the copies out of the pool have read it
            if not finish_across():  # a leased chunk changed under the load: recomputed
                for it in job.items:
                    self._fail_blocks(job, it.start, it.end)
                self.counters["pool_torn_loads"] += 1
        self.counters["fetch_us"] += int((t1 - t0) * 1e6)
        self.counters["scatter_us"] += int((time.perf_counter() - t1) * 1e6)
        self.counters["loads"] += 1

    def _fetch(self, job: LoadJob) -> list[tuple[Any, torch.Tensor | None, int, int]]:
        """Each item's rows (None: failed), the delta still to apply here, and the bytes
        fetched: a Fetch over the stream or the caller's shared-memory buffer."""
        sh = self.shape
        engine_rotates = self.engine_rotates
        got = self.link.call("fetch", job.tenant, lambda c: c.fetch(
            [it.fetch_item for it in job.items], identity=sh.identity, layout=sh.layout, rope=sh.rope,
            raw=engine_rotates, plan_identity=sh.plan_identity))
        out = []
        for i, it in enumerate(job.items):
            f = got[i] if got is not None else None
            rows = fetched_rows(f, it, self.rows, sh.layout, engine_rotates)
            out.append((it, None, 0, 0) if rows is None else (it, *rows, len(f.data)))
        return out

    def _lease(self, job: LoadJob, pool: "PoolClient") -> list[tuple[Any, torch.Tensor | None, int, int]]:
        """``_fetch`` through the sidecar's shared pool: each item's rows are a view of the
        pool (no copy until the scatter), at their source position (rotated here)."""
        sh = self.shape
        leased = self.link.call("fetch", job.tenant, lambda c: pool.lease(
            [it.fetch_item for it in job.items], identity=sh.identity, layout=sh.layout,
            plan_identity=sh.plan_identity))
        self._leased = leased
        if leased is not None:
            self.counters["pool_loads"] += 1
        out = []
        for i, it in enumerate(job.items):
            li = leased.items[i] if leased is not None else None
            rows = leased_rows(pool, li, it, self.rows, sh.layout)
            out.append((it, None, 0, 0) if rows is None else (it, *rows, li.chunks[0].length))
        return out

    def _end_lease(self, job: LoadJob, pool: "PoolClient") -> None:
        """After the scatter: if a chunk's memory was reused meanwhile (its lease expired), its
        blocks are recomputed; the lease ends either way."""
        leased, self._leased = self._leased, None
        if leased is None:
            return
        self.staging.synchronize()  # CUDA: the copies straight from the pool have read it
        if not pool.intact(leased):
            for it in job.items:
                self._fail_blocks(job, it.start, it.end)
            self.counters["pool_torn_loads"] += 1
        def release(_client: Any) -> None:
            if not pool.release(leased):  # it expired meanwhile (the stamps were checked): not an outage
                self.counters["pool_expired_leases"] += 1

        self.link.call("release", job.tenant, release)

    def _pool(self, tenant: str | None) -> "PoolClient | None":
        """The sidecar's shared pool for ``tenant``'s calls (None: off, an MLA cache, not on the
        sidecar's host, the sidecar has none, or ``rotate = "sidecar"``), mapped on first use."""
        if not self.settings.shared_pool or self.shape.mla or self.settings.rotate == "sidecar":
            return None  # (the pool serves raw rows: this worker rotates them)
        if tenant not in self._pools:
            from sidecar.sdk.pool import PoolClient  # noqa: PLC0415 - only where a pool is used

            pool = self.link.call("map_pool", tenant, PoolClient)
            if pool is None:
                return None  # the sidecar is unreachable now: asked again next time
            self._pools[tenant] = pool if pool.available else None
        pool = self._pools[tenant]
        if pool is not None and self.staging.cuda and pool.mapped is not None:
            pool.mapped.pin()  # once per mapping: host-to-device copies straight from the pool
        return pool

    @property
    def engine_rotates(self) -> bool:
        """Whether this worker rotates shifted keys itself (``settings.rotate``; "auto": when the
        cache is on a GPU, so the sidecar's CPU is not the bottleneck)."""
        mode = self.settings.rotate
        if mode == "auto":
            return self.paged is not None and getattr(self.paged, "device", torch.device("cpu")).type == "cuda"
        return mode == "engine"

    def take_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM recomputes them)."""
        if not self._invalid:
            return set()
        out, self._invalid = self._invalid, set()
        return out

    # ------------------------------------------------------------------ stores

    def save(self, jobs: list[StoreJob]) -> None:
        """After the forward: gather every job's chunks and Store them (sync or in the
        background, per ``settings.store``)."""
        if not jobs or self.paged is None or not self.shape.stores:
            return
        if not self.link.available:
            self.counters["stores_skipped"] += len(jobs)
            return
        staging = self.staging
        for job in jobs:
            t0 = time.perf_counter()
            block_ids = torch.tensor(job.block_ids, dtype=torch.int64)
            positions = torch.from_numpy(np.concatenate([np.arange(a, b) for a, b in job.chunks]))
            with single_threaded():
                if staging.cuda:  # device-to-host into pinned memory on the side stream; the Store waits
                    rows, wait = staging.gather_async(lambda: self.paged.gather(block_ids, positions, host=False))
                    payloads = None
                else:
                    rows, wait = self.paged.gather(block_ids, positions), None
                    # through the shared pool the rows go straight into its slots (no payloads)
                    payloads = None if self._pool(job.tenant) is not None else self._payloads(job, rows)
            self.counters["gather_us"] += int((time.perf_counter() - t0) * 1e6)
            if self.settings.store == "sync":
                self._store(job, payloads, rows, wait)
            else:
                with self._lock:
                    self._store_futures = [f for f in self._store_futures if not f.done()]
                    self._store_futures.append(self._store_pool.submit(self._store, job, payloads, rows, wait))

    def _store_pooled(self, pool: "PoolClient", job: StoreJob, rows: torch.Tensor) -> Any:
        """Store the job's chunks through the sidecar's shared pool: slots reserved for the
        chunks it does not hold, each chunk's rows copied straight into its slot, committed."""
        sh = self.shape
        at, offsets = 0, {}
        for a, b in job.chunks:
            offsets[a] = (at, b - a)
            at += b - a
        w = pool.reserve(job.tokens, identity=sh.identity, layout=sh.layout, chunk_starts=list(offsets),
                         register_from=job.chunks[0][0])
        try:
            with single_threaded():
                for start in w.slots:
                    i, n = offsets[start]
                    w.write_rows(start, rows.narrow(self.rows.token_axis, i, n))
        except BaseException:
            w.abort()
            raise
        return w.commit()

    def _payloads(self, job: StoreJob, rows: torch.Tensor) -> dict[int, memoryview]:
        """Each chunk's payload from the job's gathered rows (host memory)."""
        payloads: dict[int, memoryview] = {}
        i = 0
        for a, b in job.chunks:
            payloads[a] = self.rows.payload(rows.narrow(self.rows.token_axis, i, b - a), self.shape.layout)
            i += b - a
        return payloads

    def _store(self, job: StoreJob, payloads: dict[int, memoryview] | None, rows: torch.Tensor,
               wait: "Callable[[], None] | None") -> None:
        if wait is not None:  # rows still arriving from the device: wait for that copy alone
            wait()
        sh = self.shape
        t0 = time.perf_counter()
        pool = self._pool(job.tenant)
        if pool is not None:
            res = self.link.call("store", job.tenant, lambda c: self._store_pooled(pool, job, rows))
            if res is not None:
                self.counters["pool_stores"] += 1
        else:
            if payloads is None:
                payloads = self._payloads(job, rows)
            res = self.link.call("store", job.tenant, lambda c: c.store(
                job.tokens, identity=sh.identity, layout=sh.layout, payloads=payloads, register_from=job.chunks[0][0]))
        self.counters["store_us"] += int((time.perf_counter() - t0) * 1e6)
        if res is not None:
            self.counters["stored_chunks"] += res.chunks_stored
            self.counters["stored_tokens"] += sum(b - a for a, b in job.chunks)

    def flush(self, timeout: float | None = 60.0) -> None:
        """Wait for background Stores."""
        with self._lock:
            futs = list(self._store_futures)
        for f in futs:
            try:
                f.result(timeout=timeout)
            except Exception:  # noqa: BLE001
                pass

    def shutdown(self) -> None:
        self.flush()
        self._store_pool.shutdown(wait=True)
