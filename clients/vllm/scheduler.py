"""The gap problem, solved with a scheduler plug-in: gap-fill sub-requests.

vLLM loads external KV only as one run right after its own prefix hit (``claim.py``). A new
header before a long shared body (agent_meta), an edited message, a reordered document: the
sidecar's plan is ``PREFILL [0, g) | CHUNK_HIT ... [g, ...)``, and nothing after the gap is
claimable as is.

``SidecarScheduler`` (``--scheduler-cls clients.vllm.scheduler.SidecarScheduler``) lets the
connector split such a request at the plan's gap, inside the engine:

1. the connector's ``get_num_new_matched_tokens`` sees a claim that ends at a gap followed by
   at least ``min_gap_run`` planned hit tokens; it adds an internal **gap-fill sub-request**
   ``prompt[:A]`` (``A``: the end of the gap rounded up to a whole block, ``max_tokens=1``) to
   the scheduler and answers ``None`` for the parent ("ask me again"), which vLLM skips for
   this step;
2. the sub-request runs like any other: its own claim (the run before the gap) is loaded, the
   gap is computed by vLLM, its new chunks are Stored, and vLLM's prefix cache now holds
   ``prompt[:A]`` in whole blocks;
3. when it finishes, the parent is asked again: vLLM's local hit is now ``A``, so the shifted run
   after the gap is contiguous with it and claimed. Several gaps take several rounds (at most
   ``max_gap_fills``).

The sub-request's output never reaches the client (``update_from_output`` drops it). Cost: per
gap, one extra scheduler step for the sub-request (it is scheduled in the same step the parent
is skipped) and the block rounding (< one block of the hit is recomputed).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from sidecar.registry.plan import SegmentKind

log = logging.getLogger("clients.vllm")

GAP_SUFFIX = "::sidecar-gap"


class SidecarScheduler(Scheduler):
    """vLLM's scheduler, plus the connector's gap-fill sub-requests (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._internal: set[str] = set()
        from clients.vllm.connector import SidecarConnector

        if isinstance(self.connector, SidecarConnector):
            self.connector._scheduler = self
            log.info("sidecar scheduler: gap-fill sub-requests enabled")

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


def spawn_gap_fill(connector: Any, request: Request, st: Any) -> bool:
    """Add a gap-fill sub-request for ``request`` if its plan has a gap worth filling; True if
    one was added (the parent then waits for it)."""
    s = connector.settings
    cl, plan, n, B = st.claim, st.plan, st.n, connector.block_size
    rid = request.request_id
    if plan is None or connector._gap_rounds[rid] >= s.max_gap_fills or cl.gap_end >= n - 1:
        return False
    after = sum(min(int(seg.end), n - 1) - max(int(seg.start), cl.gap_end) for seg in plan.segments
                if seg.kind is SegmentKind.CHUNK_HIT and seg.end > cl.gap_end)
    if after < s.min_gap_run:
        return False
    a = -(-cl.gap_end // B) * B
    if a >= n - 1 or a <= cl.local:
        return False
    k = connector._gap_rounds[rid]
    sub_id = f"{rid}{GAP_SUFFIX}{k}"
    params = {"sidecar_gap_fill": True}
    if st.tenant:
        params["sidecar_tenant"] = st.tenant
    sub = Request(
        request_id=sub_id,
        prompt_token_ids=[int(t) for t in np.asarray(st.tokens[:a])],
        sampling_params=SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": params}),
        pooling_params=None,
        arrival_time=request.arrival_time,
        lora_request=request.lora_request,
        cache_salt=getattr(request, "cache_salt", None),
        priority=request.priority,
        block_hasher=getattr(request, "_block_hasher", None),
    )
    connector._scheduler.add_internal_request(sub)
    connector._gap_fills[sub_id] = rid
    connector._waiting_gap[rid] = sub_id
    connector._gap_rounds[rid] += 1
    connector.counters["gap_fills"] += 1
    connector.counters["gap_fill_tokens"] += a - cl.local
    return True
