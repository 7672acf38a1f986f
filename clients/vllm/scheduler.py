"""``SidecarScheduler``: vLLM's scheduler plus what the connector's scheduler side asks of it.

``--scheduler-cls clients.vllm.scheduler.SidecarScheduler`` enables, for a
``SidecarConnector``:

* **gap-fill sub-requests** (``gap_fill.py``): the connector splits a request at its plan's
  gap by having an internal sub-request ``prompt[:A]`` computed first; this class builds and
  queues it (``add_gap_fill_request``) and drops its output (``update_from_output``), so it
  never reaches the client;
* **the pool report** of resident-claim arbitration (``admit_gate.py``): usable and free blocks
  of vLLM's block pool (``kv_pool_blocks``).

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
        if isinstance(self.connector, SidecarConnector):
            self.connector.bind_scheduler(self)
            log.info("sidecar scheduler: gap-fill sub-requests enabled")

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
        self.add_internal_request(sub)

    def kv_pool_blocks(self) -> tuple[int, int] | None:
        pool = self.kv_cache_manager.block_pool
        usable = int(getattr(pool, "num_gpu_blocks", 0)) - 1  # block 0 is vLLM's null block
        return (usable, min(usable, int(pool.get_num_free_blocks()))) if usable > 0 else None

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
                            self._internal.discard(o.request_id)
                        continue
                    keep.append(o)
                eco.outputs = keep
            if eco.finished_requests:
                eco.finished_requests = {r for r in eco.finished_requests if r not in self._internal}
        return outputs
