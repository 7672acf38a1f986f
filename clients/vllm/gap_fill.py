"""The gap problem, solved with gap-fill sub-requests (the connector's third role).

vLLM loads external KV only as one run right after its own prefix hit
(``sidecar.sdk.kit.runs``). A new header before a long shared body (agent_meta), an edited
message, a reordered document: the sidecar's plan is ``PREFILL [0, g) | CHUNK_HIT ... [g, ...)``,
and nothing after the gap is loadable as is.

With the scheduler plug-in (``--scheduler-cls clients.vllm.scheduler.SidecarScheduler``), the
connector splits such a request at the plan's gap, inside the engine::

    parent   | header (new) | body (stored, shifted) ..................... | query |
    round 1  | sub-request prompt[:A]   |        A = gap_end rounded up to a block
             | loaded | computed | (stored)
    round 2  | vLLM's own hit [0, A)    | loaded: the shifted run ..       | computed |

1. the scheduler side's ``get_num_new_matched_tokens`` sees a run that ends at a gap followed by
   at least ``min_gap_run`` planned hit tokens; ``GapFill.maybe_spawn`` asks the scheduler to
   add an internal **gap-fill sub-request** ``prompt[:A]`` (``max_tokens=1``) and the parent
   answers ``None`` ("ask me again"), which vLLM skips for this step;
2. the sub-request runs like any other: its own run (before the gap) is loaded, the gap is
   computed by vLLM, its new chunks are Stored, and vLLM's prefix cache now holds
   ``prompt[:A]`` in whole blocks;
3. when it finishes, the parent is asked again: vLLM's local hit is now ``A``, so the shifted run
   after the gap is contiguous with it and loaded. Several gaps take several rounds (at most
   ``max_gap_fills``).

The sub-request's output never reaches the client (the plug-in drops it). Cost: per gap, one
extra scheduler step for the sub-request (it is scheduled in the same step the parent is
skipped) and the block rounding (< one block of the hit is recomputed).

Imports no vLLM: the sub-request is built and queued by the scheduler (``SchedulerHooks``).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import numpy as np

from clients.vllm.settings import PARAM_GAP_FILL, PARAM_TENANT
from sidecar.registry.lookup_plan import SegmentKind

if TYPE_CHECKING:
    from clients.vllm.requests import RequestState, SchedulerHooks
    from clients.vllm.settings import Settings

#: A gap-fill sub-request's id is ``<parent id><GAP_SUFFIX><round>``.
GAP_SUFFIX = "::sidecar-gap"


class GapFill:
    """Which requests wait for a gap-fill sub-request, and which sub-request is whose."""

    def __init__(self, settings: "Settings", block_size: int, counters: Counter[str]) -> None:
        self.settings = settings
        self.block_size = block_size
        self.counters = counters
        self.parents: dict[str, str] = {}  # gap-fill sub-request id -> parent id
        self.waiting: dict[str, str] = {}  # parent id -> its running gap-fill id
        self.rounds: Counter[str] = Counter()  # parent id -> sub-requests spawned

    def is_waiting(self, rid: str) -> bool:
        """True while ``rid``'s gap-fill sub-request is running (ask again later)."""
        return rid in self.waiting

    def maybe_spawn(self, hooks: "SchedulerHooks", request: Any, st: "RequestState") -> bool:
        """Add a gap-fill sub-request for ``request`` if its plan has a gap worth filling; True if
        one was added (the parent then waits for it). ``st.run`` must be set."""
        s = self.settings
        run, plan, n, B = st.run, st.plan, st.n, self.block_size
        rid = request.request_id
        if plan is None or self.rounds[rid] >= s.max_gap_fills or run.gap_end >= n - 1:
            return False
        after = sum(min(int(seg.end), n - 1) - max(int(seg.start), run.gap_end) for seg in plan.segments
                    if seg.kind is SegmentKind.CHUNK_HIT and seg.end > run.gap_end)
        if after < s.min_gap_run:
            return False
        a = -(-run.gap_end // B) * B
        if a >= n - 1 or a <= run.local:
            return False
        k = self.rounds[rid]
        sub_id = f"{rid}{GAP_SUFFIX}{k}"
        params: dict[str, Any] = {PARAM_GAP_FILL: True}
        if st.tenant:
            params[PARAM_TENANT] = st.tenant
        hooks.add_gap_fill_request(request, sub_id, [int(t) for t in np.asarray(st.tokens[:a])], params)
        self.parents[sub_id] = rid
        self.waiting[rid] = sub_id
        self.rounds[rid] += 1
        self.counters["gap_fills"] += 1
        self.counters["gap_fill_tokens"] += a - run.local
        return True

    def finished(self, rid: str) -> tuple[str | None, int]:
        """Forget ``rid`` (a parent or a sub-request). Returns (its parent if ``rid`` is a
        gap-fill sub-request, else None; the gap-fill rounds ``rid`` itself ran)."""
        parent = self.parents.pop(rid, None)
        if parent is not None:
            self.waiting.pop(parent, None)
        self.waiting.pop(rid, None)
        return parent, self.rounds.pop(rid, 0)
