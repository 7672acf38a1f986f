"""What the scheduler side keeps per request (``RequestState``) and what it asks of vLLM's
scheduler plug-in (``SchedulerHooks``); shared by ``scheduler_side`` and ``gap_fill``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from sidecar.sdk.kit import LoadRun

if TYPE_CHECKING:
    from sidecar.registry.lookup_plan import LookupPlan

__all__ = ["RequestState", "SchedulerHooks"]


class SchedulerHooks(Protocol):
    """What the scheduler plug-in (``scheduler.SidecarScheduler``) offers the scheduler side."""

    def add_gap_fill_request(self, parent: Any, request_id: str, prompt_token_ids: list[int],
                             kv_transfer_params: dict[str, Any]) -> None:
        """Queue an internal request ``prompt_token_ids`` (greedy, one output token, its output
        dropped) that inherits ``parent``'s arrival time, LoRA, salt and priority."""

    def kv_pool_blocks(self) -> tuple[int, int] | None:
        """``(usable, free)`` blocks of the engine's KV pool, or None if unknown."""


@dataclass(slots=True)
class RequestState:
    """Scheduler-side bookkeeping for one request."""

    req_id: str
    tenant: str | None
    tokens: np.ndarray
    gap_fill: bool = False
    local: int = -1
    plan: "LookupPlan | None" = None
    run: LoadRun | None = None
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
    #: resident-claim arbitration (admit_gate.py): None until asked, then the answer
    admission: dict | None = None
    admitted: bool = False

    @property
    def n(self) -> int:
        return len(self.tokens)
