"""The connector's scheduler side: what to load for a request, what to store after its prefill.

Runs in vLLM's scheduler process (one instance per engine), called by the connector facade
(``connector.py``) at these points of a request's life::

    arrival ... get_num_new_matched_tokens(request, local)    Lookup -> LoadRun (``runs``), or
                  |                                            None: held (admission) / waiting
                  |                                            for a gap-fill sub-request
                update_state_after_alloc(request, m)           vLLM took m <= run.tokens
    each step   build_jobs(scheduler_output) -> StepJobs       LoadJob once, StoreJob when the
                  |                                            prefill completes
    finish      request_finished(request) -> kv_transfer_params["sidecar"] (what happened)

Per request it keeps a ``RequestState``. Lookup answers ``engine_prefix_len = local`` (vLLM's
own prefix hit); the loadable run is ``load_run`` of the plan; the Store job covers the chunks
of ``plan.chunk_bounds`` the request computed with their true left context (``store_chunks``).
Every sidecar call goes through the fail-soft link: a failed Lookup loads nothing.

Imports no vLLM: requests and scheduler outputs are read by attribute (``request_id``,
``prompt_token_ids``, ``kv_transfer_params``, ``max_tokens``; ``scheduled_new_reqs``,
``scheduled_cached_reqs``, ``num_scheduled_tokens``), and the scheduler plug-in is reached
through ``SchedulerHooks`` (tests drive it with fakes: tests/clients/vllm).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import numpy as np

from clients.vllm import directives
from clients.vllm.admit_gate import AdmitGate
from clients.vllm.gap_fill import GapFill
from clients.vllm.jobs import LoadJob, StepJobs, StoreJob
from clients.vllm.requests import RequestState, SchedulerHooks
from clients.vllm.settings import PARAM_GAP_FILL, PARAM_TENANT
from sidecar.sdk.kit import load_run, store_chunks

if TYPE_CHECKING:
    from clients.vllm.settings import EngineShape, Settings
    from sidecar.sdk.kit import FailSoftLink

log = logging.getLogger("clients.vllm")


def _tenant_of(request: Any) -> str | None:
    params = request.kv_transfer_params or {}
    t = params.get(PARAM_TENANT)
    return str(t) if t else None


class SchedulerSide:
    """The scheduler-side primitives of ``SidecarConnector`` (see the module docstring).
    ``counters`` is shared with the facade's ``stats()``."""

    def __init__(self, settings: "Settings", shape: "EngineShape", link: "FailSoftLink",
                 counters: Counter[str] | None = None) -> None:
        self.settings = settings
        self.shape = shape
        self.block_size = shape.block_size
        self.link = link
        self.counters: Counter[str] = Counter() if counters is None else counters
        self.hooks: SchedulerHooks | None = None
        self.reqs: dict[str, RequestState] = {}
        self.gap_fill = GapFill(settings, self.block_size, self.counters)
        self.admit_gate = (AdmitGate(settings, link, self.block_size, self.counters, self._pool)
                           if settings.admission else None)

    def bind(self, hooks: SchedulerHooks) -> None:
        """Called once by the scheduler plug-in: enables gap fill and the pool report."""
        self.hooks = hooks

    def _pool(self) -> tuple[int, int] | None:
        return self.hooks.kv_pool_blocks() if self.hooks is not None else None

    # ------------------------------------------------------------------ admission of a request

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """External tokens for ``request`` after vLLM's own hit ``num_computed_tokens``: the
        loadable run's length, or None ("ask again next step": held by the admit gate, or
        waiting for a gap-fill sub-request). Loads are synchronous (never ``True``)."""
        rid = request.request_id
        st = self.reqs.get(rid)
        if st is None:
            st = self._new_request(request)
        if self.gap_fill.is_waiting(rid):
            return None, False  # its gap-fill sub-request is still running
        if self.admit_gate is not None and not st.admitted and not st.gap_fill:
            if st.n < self.settings.admit_min_tokens:
                st.admitted = True
            else:
                st.admitted, answer = self.admit_gate.admit(request, st.n, st.tenant)
                if answer is not None:
                    st.admission = answer
                if not st.admitted:
                    return None, False  # deferred or refused: vLLM keeps it waiting, asks next step
        if st.local != num_computed_tokens:
            self._lookup(st, num_computed_tokens)
        run = st.run
        if run is not None and self.hooks is not None and not st.gap_fill and self.settings.gap_fill:
            if self.gap_fill.maybe_spawn(self.hooks, request, st):
                return None, False
        return (run.tokens if run is not None else 0), False

    def _new_request(self, request: Any) -> RequestState:
        params = request.kv_transfer_params or {}
        st = RequestState(request.request_id, _tenant_of(request),
                          np.asarray(request.prompt_token_ids or [], dtype=np.uint32),
                          gap_fill=bool(params.get(PARAM_GAP_FILL)))
        self.reqs[st.req_id] = st
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
        return st

    def _lookup(self, st: RequestState, local: int) -> None:
        st.local, st.plan, st.run = local, None, None
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
        st.run = load_run(plan, local=local, n=n, block_size=self.block_size, bridge_recompute=s.bridge_recompute,
                          min_tokens=s.min_hit_tokens or self.block_size, limit=limit)

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        """vLLM allocated blocks for ``num_external_tokens`` external tokens (<= the run)."""
        st = self.reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0 or st.run is None:
            return
        if num_external_tokens != st.run.tokens:  # vLLM took fewer (never more) than offered
            st.run = st.run.truncated(num_external_tokens)
        st.loaded = num_external_tokens
        st.pending_load = True

    # ------------------------------------------------------------------ each step

    def build_jobs(self, scheduler_output: Any) -> StepJobs:
        """The step's loads (requests whose blocks were just allocated) and Stores (requests
        whose prefill completes in this step)."""
        jobs = StepJobs()
        for nr in scheduler_output.scheduled_new_reqs:
            st = self.reqs.get(nr.req_id)
            if st is None:
                continue
            st.block_ids = list(nr.block_ids[0])
            st.computed = nr.num_computed_tokens
            self._take_load(st, jobs)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self.reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            st.computed = cached.num_computed_tokens[i]
            self._take_load(st, jobs)
        if self.settings.store != "off":
            for rid, num in scheduler_output.num_scheduled_tokens.items():
                st = self.reqs.get(rid)
                if st is None or st.stored or st.plan is None or st.computed + num < st.n:
                    continue
                st.stored = True
                approx = st.run.approximate if (st.loaded and st.run is not None) else ()
                chunks = store_chunks(st.plan, n=st.n, approximate=approx, skip_tail=st.gap_fill)
                if chunks:
                    jobs.stores.append(StoreJob(rid, st.tenant, st.tokens, list(st.block_ids), chunks))
                    st.stored_chunks = len(chunks)
                    self.counters["store_jobs"] += 1
        return jobs

    def _take_load(self, st: RequestState, jobs: StepJobs) -> None:
        if not st.pending_load or st.run is None:
            return
        st.pending_load = False
        jobs.loads.append(LoadJob(st.req_id, st.tenant, list(st.block_ids), list(st.run.items),
                                  st.plan.plan_shard if st.plan is not None else None))
        self.counters["claimed_tokens"] += st.loaded
        self.counters["load_jobs"] += 1

    # ------------------------------------------------------------------ finish

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its ``kv_transfer_params`` with ``"sidecar"``: what it planned,
        loaded, computed and stored. Blocks are never held (``False``)."""
        rid = request.request_id
        st = self.reqs.pop(rid, None)
        parent, rounds = self.gap_fill.finished(rid)
        if parent is not None:
            pst = self.reqs.get(parent)
            if pst is not None and st is not None:
                pst.sub_prefilled += st.n - max(st.local, 0) - st.loaded + st.sub_prefilled
        if self.admit_gate is not None:
            self.admit_gate.forget(rid)
        if st is None:
            return False, None
        if st.gap_fill:
            self.counters["gap_fill_requests"] += 1
            return False, None
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += st.n
        run = st.run
        local = max(st.local, 0)
        prefilled = st.n - local - st.loaded + st.sub_prefilled
        info = {
            "prompt_tokens": st.n,
            "local_tokens": local,
            "planned_tokens": run.planned if run is not None else 0,
            "claimed_tokens": st.loaded,
            "bridged_tokens": run.bridged if (run is not None and st.loaded) else 0,
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
