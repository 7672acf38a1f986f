"""``SidecarConnector``: vLLM's KV connector (``KVConnectorBase_V1`` + ``SupportsHMA``) for the sidecar.

Load it with::

    --kv-transfer-config '{"kv_connector": "SidecarConnector",
                           "kv_connector_module_path": "clients.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"sidecar": "127.0.0.1:50051", "tenant": "team-a"}}'

and, for the gap-fill sub-requests, ``--scheduler-cls clients.vllm.scheduler.SidecarScheduler``.

Scheduler side (``get_num_new_matched_tokens``): Lookup the prompt with vLLM's own prefix hit as
``engine_prefix_len``; claim the block-aligned run of hits contiguous with that hit
(``claim.py``); hand the Fetch items to the workers in the step's connector metadata. When the
prefill of a request completes in a step, the metadata also carries a Store job: the chunks of
``plan.chunk_bounds`` the request computed with their true left context.

Worker side: ``start_load_kv`` Fetches the items (the sidecar rotates the rotary part to the
target positions with the engine's ``RopeSpec``, pairing from vLLM's ``is_neox_style``) and
copies the rows into the request's paged blocks for every layer (``paged.py``); a chunk that
cannot be fetched marks its blocks failed (``get_block_ids_with_load_errors``) and vLLM
recomputes them. ``wait_for_save`` gathers the Store jobs' rows from the paged cache after the
forward and Stores them (on a background thread by default).

Failures never fail a request: a Lookup that errors claims nothing (prefill), a Fetch that
errors reports its blocks for recompute (the connector switches ``kv_load_failure_policy`` to
``recompute`` for that reason), a Store that errors is dropped; each outage is logged once and
counted (``stats()``), and the sidecar is skipped for ``retry_after_s`` after an error.

Per-request ``kv_transfer_params`` (``SamplingParams(extra_args={"kv_transfer_params": {...}})``):
``sidecar_tenant`` (the tenant header for this request's calls), ``sidecar_directives`` /
``sidecar_session`` (Splice, see ``directives.py``); the finished request's output carries
``kv_transfer_params["sidecar"]``: its prompt length, local hit, planned and claimed tokens.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from clients.vllm import directives
from clients.vllm.admission import Admission
from clients.vllm.claim import Claim, LoadItem, claim, store_chunks
from clients.vllm.link import SidecarLink
from clients.vllm.paged import BlockLayout, PagedKV, payload_bytes, payload_view, single_threaded
from clients.vllm.settings import Settings, describe, engine_shape

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("clients.vllm")

#: The live connectors of this process by role ("scheduler" / "worker"): tests and benchmarks
#: running vLLM in-process read ``stats()`` through it.
INSTANCES: "weakref.WeakValueDictionary[str, SidecarConnector]" = weakref.WeakValueDictionary()

PARAM_TENANT = "sidecar_tenant"
PARAM_GAP_FILL = "sidecar_gap_fill"  # set on the connector's own gap-fill sub-requests
PARAM_DIRECTIVES = directives.PARAM_DIRECTIVES
PARAM_SESSION = directives.PARAM_SESSION


@dataclass(slots=True)
class LoadJob:
    req_id: str
    tenant: str | None
    block_ids: list[int]
    items: list[LoadItem]


@dataclass(slots=True)
class StoreJob:
    req_id: str
    tenant: str | None
    tokens: np.ndarray  # uint32, the prompt
    block_ids: list[int]
    chunks: list[tuple[int, int]]


@dataclass
class SidecarMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)


@dataclass(slots=True)
class _ReqState:
    """Scheduler-side bookkeeping for one request."""

    req_id: str
    tenant: str | None
    tokens: np.ndarray
    gap_fill: bool = False
    local: int = -1
    plan: Any = None
    claim: Claim | None = None
    loaded: int = 0
    pending_load: bool = False
    block_ids: list[int] = field(default_factory=list)
    computed: int = 0
    stored: bool = False
    stored_chunks: int = 0
    lookup_s: float = 0.0
    #: the first Lookup's plan (at vLLM's own hit on arrival): tokens it says need no prefill
    first_recovered: int = -1
    first_local: int = -1
    #: prompt tokens computed by this request's gap-fill sub-requests
    sub_prefilled: int = 0
    #: span directives from kv_transfer_params (directives.py) and what the Splice did
    session: Any = None
    session_info: dict | None = None
    #: resident-claim arbitration (admission.py): None until asked, then the answer
    admission: dict | None = None
    admitted: bool = False

    @property
    def n(self) -> int:
        return len(self.tokens)


def _tenant_of(request: "Request") -> str | None:
    params = request.kv_transfer_params or {}
    t = params.get(PARAM_TENANT)
    return str(t) if t else None


class SidecarConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. Both roles are this class (vLLM builds one per role)."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped Store is a future miss, never a lost hand-off
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = Settings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.shape = engine_shape(vllm_config, self.settings)
        self.block_size = self.shape.block_size
        side = "scheduler" if role is KVConnectorRole.SCHEDULER else "worker"
        self.link = SidecarLink(self.settings, side)
        self.counters: Counter[str] = Counter()
        INSTANCES[side] = self
        if role is KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                # a chunk evicted between Lookup and Fetch must cost a recompute, never the request
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
                log.info("sidecar connector: kv_load_failure_policy set to 'recompute' (a missed fetch is prefilled)")
            self._reqs: dict[str, _ReqState] = {}
            self._scheduler: Any = None  # bound by clients.vllm.scheduler.SidecarScheduler
            self._gap_fills: dict[str, str] = {}  # gap-fill sub-request id -> parent id
            self._waiting_gap: dict[str, str] = {}  # parent id -> its running gap-fill id
            self._gap_rounds: Counter[str] = Counter()
            self._admission = Admission(self) if self.settings.admission else None
        else:
            self._paged: PagedKV | None = None
            self._disabled: str = ""
            self._invalid: set[int] = set()
            self._store_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sidecar-store")
            self._store_futures: list[Future] = []
            self._lock = threading.Lock()
        log.info("sidecar connector (%s) -> %s, identity %s", side, self.settings.target, describe(self.shape))

    # ================================================================== shared

    def stats(self) -> dict[str, int]:
        """Counters of this process's side (tokens, calls, errors)."""
        out = dict(self.counters)
        out.update({f"error:{k}": v for k, v in self.link.errors.items()})
        return out

    # ================================================================== worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        layers = [kv_caches[n] for n in names]
        if len(layers) != self.shape.num_layers:
            self._disable(f"{len(layers)} KV cache tensors for {self.shape.num_layers} layers")
            return
        t = layers[0]
        H, B, D = self.shape.num_kv_heads, self.block_size, self.shape.head_size
        if t.device.type != "cpu" or t.dim() != 4 or tuple(t.shape[1:]) != (H, B, 2 * D):
            self._disable(f"KV cache layout {tuple(t.shape)} on {t.device} is not the CPU backend's "
                          f"[blocks, {H}, {B}, {2 * D}] (only vLLM's CPU backend is supported yet)")
            return
        try:
            layout = self._learn_layout(t.dtype)
        except Exception as exc:  # noqa: BLE001
            self._disable(f"could not learn the KV block layout ({type(exc).__name__}: {exc})")
            return
        self._paged = PagedKV(layers, layout)
        log.info("sidecar connector (worker): %d layers, block layout %s", len(layers), layout.kind)

    def _learn_layout(self, dtype: torch.dtype) -> BlockLayout:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        H, B, D = self.shape.num_kv_heads, self.block_size, self.shape.head_size
        isa = _get_attn_isa(dtype, B, D)

        def write(k, v, kc, vc, slots):
            ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)

        return BlockLayout.learn(write, H, B, D, dtype)

    def _check_rope(self) -> None:
        """The keys vLLM caches are rotated with its rotary embeddings' ``is_neox_style``;
        the identity's RopeSpec must pair dims the same way."""
        try:
            from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT
        except ImportError:
            return
        styles = {bool(getattr(r, "is_neox_style", True)) for r in _ROPE_DICT.values()}
        want = self.shape.rope.pairing.value == "half"
        if styles and styles != {want}:
            self._disable(f"the model's rotary embeddings use is_neox_style={sorted(styles)}, the identity "
                          f"assumes {want}; set kv_connector_extra_config rope_is_neox_style")

    def _disable(self, why: str) -> None:
        if not self._disabled:
            log.error("sidecar connector (worker) disabled: %s", why)
        self._disabled = why
        self.counters["disabled"] = 1

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SidecarMetadata) or not meta.loads:
            return
        if "rope_checked" not in self.counters:
            self.counters["rope_checked"] = 1
            self._check_rope()
        for job in meta.loads:
            self._load(job)

    def _fail_blocks(self, job: LoadJob, start: int, end: int) -> None:
        B = self.block_size
        for b in range(start // B, (end - 1) // B + 1):
            self._invalid.add(job.block_ids[b])
        self.counters["load_failed_tokens"] += end - start

    def _load(self, job: LoadJob) -> None:
        if self._paged is None or self._disabled:
            for it in job.items:
                self._fail_blocks(job, it.start, it.end)
            return
        t0 = time.perf_counter()
        sh = self.shape
        got = self.link.call("fetch", job.tenant, lambda c: c.fetch(
            [(it.chunk_hash, it.target_pos) for it in job.items], identity=sh.identity, layout=sh.layout, rope=sh.rope))
        t1 = time.perf_counter()
        # the fetched rows of each run of contiguous items, copied into the paged cache at once
        runs: list[tuple[int, int, list[torch.Tensor]]] = []
        for i, it in enumerate(job.items):
            f = got[i] if got is not None else None
            n = len(it)
            if f is None or not f.ok or f.num_tokens < it.row + n or not (f.rotated or f.delta == 0):
                self._fail_blocks(job, it.start, it.end)
                continue
            rows = payload_view(f.data, sh.num_layers, f.num_tokens, sh.num_kv_heads, sh.head_size,
                                self._paged.dtype)[:, :, it.row : it.row + n]
            if runs and runs[-1][1] == it.start:
                runs[-1] = (runs[-1][0], it.end, runs[-1][2] + [rows])
            else:
                runs.append((it.start, it.end, [rows]))
            self.counters["loaded_tokens"] += n
            self.counters["fetch_bytes"] += len(f.data)
        block_ids = torch.tensor(job.block_ids, dtype=torch.int64)
        with single_threaded():
            for start, end, parts in runs:
                rows = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
                self._paged.scatter(rows, block_ids, torch.arange(start, end, dtype=torch.int64))
        self.counters["fetch_us"] += int((t1 - t0) * 1e6)
        self.counters["scatter_us"] += int((time.perf_counter() - t1) * 1e6)
        self.counters["loads"] += 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # rows are gathered from the paged cache after the whole forward (wait_for_save)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, SidecarMetadata) or not meta.stores or self._paged is None or self._disabled:
            return
        if not self.link.available:
            self.counters["stores_skipped"] += len(meta.stores)
            return
        for job in meta.stores:
            t0 = time.perf_counter()
            pos = np.concatenate([np.arange(a, b) for a, b in job.chunks])
            payloads: dict[int, memoryview] = {}
            with single_threaded():
                rows = self._paged.gather(torch.tensor(job.block_ids, dtype=torch.int64), torch.from_numpy(pos))
                i = 0
                for a, b in job.chunks:
                    payloads[a] = payload_bytes(rows[:, :, i : i + (b - a)])
                    i += b - a
            self.counters["gather_us"] += int((time.perf_counter() - t0) * 1e6)
            if self.settings.store == "sync":
                self._store(job, payloads)
            else:
                with self._lock:
                    self._store_futures = [f for f in self._store_futures if not f.done()]
                    self._store_futures.append(self._store_pool.submit(self._store, job, payloads))

    def _store(self, job: StoreJob, payloads: dict[int, memoryview]) -> None:
        sh = self.shape
        t0 = time.perf_counter()
        res = self.link.call("store", job.tenant, lambda c: c.store(
            job.tokens, identity=sh.identity, layout=sh.layout, payloads=payloads, register_from=job.chunks[0][0]))
        self.counters["store_us"] += int((time.perf_counter() - t0) * 1e6)
        if res is not None:
            self.counters["stored_chunks"] += res.chunks_stored
            self.counters["stored_tokens"] += sum(b - a for a, b in job.chunks)

    def flush(self, timeout: float | None = 60.0) -> None:
        """Wait for background Stores (worker side)."""
        with self._lock:
            futs = list(self._store_futures)
        for f in futs:
            try:
                f.result(timeout=timeout)
            except Exception:  # noqa: BLE001
                pass

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._role is not KVConnectorRole.WORKER or not self._invalid:
            return set()
        out, self._invalid = self._invalid, set()
        return out

    def shutdown(self) -> None:
        if self._role is KVConnectorRole.WORKER:
            self.flush()
            self._store_pool.shutdown(wait=True)
        self.link.close()

    # ================================================================== scheduler side

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None:
            params = request.kv_transfer_params or {}
            st = _ReqState(rid, _tenant_of(request), np.asarray(request.prompt_token_ids or [], dtype=np.uint32),
                           gap_fill=bool(params.get(PARAM_GAP_FILL)))
            self._reqs[rid] = st
            if not st.gap_fill:
                try:
                    st.session = directives.parse(params)
                except (ValueError, KeyError, TypeError) as exc:
                    st.session_info = {"error": f"bad directives: {exc}"}
                    self.counters["bad_directives"] += 1
            if st.session is not None:
                st.session_info = directives.apply(self.link, st.tenant, self.shape.identity, self.block_size,
                                                   st.session, st.tokens)
                self.counters["splices" if st.session.directives else "sessions"] += 1
        if rid in self._waiting_gap:
            return None, False  # its gap-fill sub-request is still running
        if self._admission is not None and not st.admitted and not st.gap_fill:
            if st.n < self.settings.admit_min_tokens:
                st.admitted = True
            else:
                st.admitted, answer = self._admission.admit(request, st.n, st.tenant)
                if answer is not None:
                    st.admission = answer
                if not st.admitted:
                    return None, False  # deferred or refused: vLLM keeps it waiting, asks next step
        if st.local != num_computed_tokens:
            self._lookup(st, num_computed_tokens)
        cl = st.claim
        if cl is not None and self._scheduler is not None and not st.gap_fill and self.settings.gap_fill:
            if self._maybe_gap_fill(request, st):
                return None, False
        return (cl.tokens if cl is not None else 0), False

    def _lookup(self, st: _ReqState, local: int) -> None:
        st.local, st.plan, st.claim = local, None, None
        n = st.n
        if n < 2 or local >= n - 1:
            return
        s = self.settings
        kw: dict[str, Any] = {"policy": s.policy}
        if s.policy != "exact":
            kw["left_context_window"] = s.left_context_window
            kw["recompute_tokens"] = s.recompute_tokens
        t0 = time.perf_counter()
        plan = self.link.call("lookup", st.tenant, lambda c: c.lookup(
            st.tokens, identity=self.shape.identity, engine_prefix_len=local, **kw))
        st.lookup_s += time.perf_counter() - t0
        self.counters["lookups"] += 1
        if plan is None:
            return
        st.plan = plan
        if st.first_recovered < 0:
            st.first_recovered, st.first_local = plan.summary.recovered_tokens, local
        limit = st.session.forget_from if st.session is not None else None
        st.claim = claim(plan, local=local, n=n, block_size=self.block_size, bridge_recompute=s.bridge_recompute,
                         min_tokens=s.min_hit_tokens or self.block_size, limit=limit)

    def _maybe_gap_fill(self, request: "Request", st: _ReqState) -> bool:
        from clients.vllm.scheduler import spawn_gap_fill

        return spawn_gap_fill(self, request, st)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0 or st.claim is None:
            return
        cl = st.claim
        if num_external_tokens != cl.tokens:  # vLLM took fewer (never more) than claimed
            end = cl.local + num_external_tokens
            items = [LoadItem(it.chunk_hash, it.target_pos, it.row, it.start, min(it.end, end), it.exact)
                     for it in cl.items if it.start < end]
            st.claim = cl = Claim(cl.local, end, items, cl.planned, cl.gap_start, cl.gap_end, min(cl.bridged, end - cl.local))
        st.loaded = num_external_tokens
        st.pending_load = True

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = SidecarMetadata()
        for nr in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(nr.req_id)
            if st is None:
                continue
            st.block_ids = list(nr.block_ids[0])
            st.computed = nr.num_computed_tokens
            self._take_load(st, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            st.computed = cached.num_computed_tokens[i]
            self._take_load(st, meta)
        if self.settings.store != "off":
            for rid, num in scheduler_output.num_scheduled_tokens.items():
                st = self._reqs.get(rid)
                if st is None or st.stored or st.plan is None or st.computed + num < st.n:
                    continue
                st.stored = True
                chunks = store_chunks(st.plan, st.claim if st.loaded else None, n=st.n, skip_tail=st.gap_fill)
                if chunks:
                    meta.stores.append(StoreJob(rid, st.tenant, st.tokens, list(st.block_ids), chunks))
                    st.stored_chunks = len(chunks)
                    self.counters["store_jobs"] += 1
        return meta

    def _take_load(self, st: _ReqState, meta: SidecarMetadata) -> None:
        if not st.pending_load or st.claim is None:
            return
        st.pending_load = False
        meta.loads.append(LoadJob(st.req_id, st.tenant, list(st.block_ids), list(st.claim.items)))
        self.counters["claimed_tokens"] += st.loaded
        self.counters["load_jobs"] += 1

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def _finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        st = self._reqs.pop(rid, None)
        parent = self._gap_fills.pop(rid, None)
        if parent is not None:
            self._waiting_gap.pop(parent, None)
            pst = self._reqs.get(parent)
            if pst is not None and st is not None:
                pst.sub_prefilled += st.n - max(st.local, 0) - st.loaded + st.sub_prefilled
        self._waiting_gap.pop(rid, None)
        if self._admission is not None:
            self._admission.forget(rid)
        rounds = self._gap_rounds.pop(rid, 0)
        if st is None:
            return False, None
        if st.gap_fill:
            self.counters["gap_fill_requests"] += 1
            return False, None
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += st.n
        cl = st.claim
        local = max(st.local, 0)
        prefilled = st.n - local - st.loaded + st.sub_prefilled
        info = {
            "prompt_tokens": st.n,
            "local_tokens": local,
            "planned_tokens": cl.planned if cl is not None else 0,
            "claimed_tokens": st.loaded,
            "bridged_tokens": cl.bridged if (cl is not None and st.loaded) else 0,
            # the plan of the first Lookup (vLLM's own hit on arrival + the sidecar's hits) ...
            "plan_recovered_tokens": max(st.first_recovered, 0),
            "first_local_tokens": max(st.first_local, 0),
            # ... and what vLLM realized: prompt tokens neither this request nor its gap-fill
            # sub-requests computed
            "prefilled_tokens": prefilled,
            "reused_tokens": st.n - prefilled,
            "plan_ok": st.plan is not None,
            "store_chunks": st.stored_chunks,
            "lookup_ms": round(st.lookup_s * 1e3, 3),
            "gap_fills": rounds,
        }
        if st.session_info is not None:
            info["session"] = st.session_info
        if st.admission is not None:
            info["admission"] = st.admission
        self.counters["planned_tokens"] += info["planned_tokens"]
        self.counters["claimed_tokens_finished"] += st.loaded
        self.counters["local_tokens"] += info["local_tokens"]
        self.counters["reused_tokens"] += info["reused_tokens"]
        self.counters["plan_recovered_tokens"] += info["plan_recovered_tokens"]
        params = dict(request.kv_transfer_params or {})
        params["sidecar"] = info
        return False, params
