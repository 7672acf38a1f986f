"""``SidecarScheduler``: vLLM's scheduler plus what the connector's scheduler side asks of it.

``--scheduler-cls clients.vllm.scheduler.SidecarScheduler`` enables, for a
``SidecarConnector``:

* **gap-fill sub-requests** (``gap_fill.py``): the connector splits a request at its plan's
  gap by having an internal sub-request ``prompt[:A]`` computed first; this class builds and
  queues it (``add_gap_fill_request``) and drops its output (``update_from_output``), so it
  never reaches the client;
* **the pool report** of resident-claim arbitration (``admit_gate.py``): usable and free blocks
  of vLLM's block pool (``kv_pool_blocks``);
* **honest prefix-cache metrics**: a sub-request's lookup is not recorded (its prompt is part of
  the parent's), and the tokens it computed or loaded are not recorded as the parent's local
  prefix-cache hits when the parent then finds them in vLLM's cache (``docs/vllm.md``, "What
  vLLM's metrics count").

It implements ``scheduler_side.SchedulerHooks`` and registers itself with the connector
(``SidecarConnector.bind_scheduler``); the connector never imports this module.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from clients.vllm.connector import SidecarConnector
from clients.vllm.gap_fill import GAP_SUFFIX

log = logging.getLogger("clients.vllm")

__all__ = ["GAP_SUFFIX", "SidecarScheduler"]


class SidecarScheduler(Scheduler):
    """vLLM's scheduler, plus the connector's gap-fill sub-requests (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._internal: set[str] = set()
        self._prompt_len: dict[str, int] = {}  # sub-request id -> its prompt length
        self._sub_hits: dict[str, int] = {}  # sub-request id -> its own local prefix-cache hit
        self._owed: dict[str, int] = {}  # parent id -> tokens its sub-requests computed or loaded
        if isinstance(self.connector, SidecarConnector):
            self.connector.bind_scheduler(self)
            log.info("sidecar scheduler: gap-fill sub-requests enabled")
            kvm = self.kv_cache_manager
            if getattr(kvm, "record_prefix_cache_stats", None) is not None:
                self._record_stats = kvm.record_prefix_cache_stats
                kvm.record_prefix_cache_stats = self._record_prefix_cache_stats

    # ------------------------------------------------------------------ SchedulerHooks

    def add_gap_fill_request(self, parent: Request, request_id: str, prompt_token_ids: list[int],
                             kv_transfer_params: dict[str, Any]) -> None:
        sub = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=SamplingParams(max_tokens=1, temperature=0.0,
                                           extra_args={"kv_transfer_params": kv_transfer_params}),
            pooling_params=None,
            arrival_time=parent.arrival_time,
            lora_request=parent.lora_request,
            cache_salt=getattr(parent, "cache_salt", None),
            priority=parent.priority,
            block_hasher=getattr(parent, "_block_hasher", None),
        )
        self._prompt_len[request_id] = len(prompt_token_ids)
        self.add_internal_request(sub)

    def kv_pool_blocks(self) -> tuple[int, int] | None:
        pool = self.kv_cache_manager.block_pool
        usable = int(getattr(pool, "num_gpu_blocks", 0)) - 1  # block 0 is vLLM's null block
        return (usable, min(usable, int(pool.get_num_free_blocks()))) if usable > 0 else None

    # ------------------------------------------------------------------ metrics

    def _record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """vLLM's prefix-cache statistics without the gap-fill's own work: a sub-request's
        lookup is not a client request's (its prompt is the parent's prefix, queried with the
        parent), and what it computed or loaded is not a local hit of the parent."""
        rid = request.request_id
        if rid in self._internal:
            self._sub_hits[rid] = num_hits
            return
        owed = self._owed.pop(rid, 0)
        self._record_stats(request, max(0, num_hits - owed))

    def _sub_finished(self, rid: str) -> None:
        self._internal.discard(rid)
        n = self._prompt_len.pop(rid, 0)
        own = self._sub_hits.pop(rid, 0)
        parent = rid.partition(GAP_SUFFIX)[0]
        self._owed[parent] = self._owed.get(parent, 0) + max(0, n - own)

    # ------------------------------------------------------------------ internal requests

    def add_internal_request(self, request: Request) -> None:
        self._internal.add(request.request_id)
        self.add_request(request)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if not self._internal:
            return outputs
        for eco in outputs.values():
            if eco.outputs:
                keep = []
                for o in eco.outputs:
                    if o.request_id in self._internal:
                        if o.finish_reason is not None:
                            self._sub_finished(o.request_id)
                        continue
                    keep.append(o)
                eco.outputs = keep
            if eco.finished_requests:
                for r in eco.finished_requests:
                    self._owed.pop(r, None)  # a parent aborted before it was scheduled again
                eco.finished_requests = {r for r in eco.finished_requests if r not in self._internal}
        return outputs
