"""Resident claims on vLLM: report the KV pool, ask ``AdmitActive`` before a large prefill.

With ``admission`` on (``kv_connector_extra_config``; needs ``--scheduler-cls
clients.vllm.scheduler.SidecarScheduler`` for the pool's free-block count), the scheduler-side
connector, before it plans a request of at least ``admit_min_tokens`` prompt tokens, passes it
through the ``AdmitGate``:

1. ``ReportPool``: usable blocks (the KV cache config), free blocks (vLLM's block pool: cached
   but unreferenced blocks count as free, as the arbitration expects), the block size, and
   ``hard_protection=False``: vLLM's block pool evicts any unreferenced block by LRU, and no
   connector hook can exclude blocks from its victims (the seed's C1 classification: a hard
   claim is at best a soft priority on vLLM's own pool; the sidecar's tiers still enforce it);
2. ``AdmitActive(request_id, ceil((prompt + max_tokens) / block_size))``.

How vLLM lets a connector act on the answer: ``get_num_new_matched_tokens`` may return
``None`` ("not ready, ask again"), which makes the scheduler skip the request for this step and
keep it waiting. So **deferred** and **refused** both hold the request back and re-ask after the
answer's ``retry_after_s`` hint (no RPC in between). vLLM has no connector API to reject a
request, so a request still held after ``admit_max_wait_s`` is served with a warning (counted:
``admission_overridden``); an operator who wants refusals to stick sets the wait long and
watches ``active_refused`` events. A sidecar that does not answer admits (a request never fails
or waits because the sidecar is down).

Imports no vLLM: the pool comes from a callable (the scheduler plug-in's ``kv_pool_blocks``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from clients.vllm.settings import Settings
    from sidecar.sdk.kit import FailSoftLink

log = logging.getLogger("clients.vllm")


@dataclass(slots=True)
class Hold:
    """A request the sidecar deferred or refused: when it was first held, when to ask again."""

    since: float
    retry_at: float
    decision: str
    blocking: tuple[str, ...] = ()
    reason: str = ""


class AdmitGate:
    """Holds requests the sidecar's resident-claim arbitration does not admit yet (see the
    module docstring). ``pool()`` answers ``(usable, free)`` blocks of the engine's KV pool, or
    ``None`` when unknown (no scheduler plug-in): then no ``ReportPool`` is sent."""

    def __init__(
        self,
        settings: "Settings",
        link: "FailSoftLink",
        block_size: int,
        counters: Counter[str],
        pool: Callable[[], tuple[int, int] | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.link = link
        self.block_size = block_size
        self.counters = counters
        self.pool = pool
        self.clock = clock
        self.holds: dict[str, Hold] = {}
        self._reported_at = 0.0

    def report_pool(self, tenant: str | None) -> None:
        pool = self.pool()
        if pool is None:
            return
        usable, free = pool
        bs = self.block_size
        if self.link.call("report_pool", tenant, lambda c: c.report_pool(
                usable_blocks=usable, free_blocks=free, block_size=bs, hard_protection=False,
                engine_id=self.settings.engine_id)) is not None:
            self._reported_at = self.clock()

    def admit(self, request: Any, n: int, tenant: str | None) -> tuple[bool, dict[str, Any] | None]:
        """(proceed?, what to report in the output). ``False``: hold the request this step.
        ``request``: vLLM's ``Request`` (``request_id``, ``max_tokens``); ``n``: prompt tokens."""
        rid = request.request_id
        now = self.clock()
        hold = self.holds.get(rid)
        if hold is not None and now < hold.retry_at:
            return False, None
        max_tokens = int(getattr(request, "max_tokens", 0) or 0)
        blocks = -(-(n + max_tokens) // self.block_size)
        self.report_pool(tenant)
        resp = self.link.call("admit_active", tenant, lambda c: c.admit_active(rid, blocks))
        counters = self.counters
        if resp is None:
            self.holds.pop(rid, None)
            counters["admission_unanswered"] += 1
            return True, {"decision": "unanswered", "blocks": blocks}
        decision = resp.decision.value  # sidecar.claims.Admit: "admitted" | "deferred" | "refused"
        waited = now - hold.since if hold is not None else 0.0
        info = {"decision": decision, "blocks": blocks, "waited_s": round(waited, 3),
                "blocking_claim_ids": list(resp.blocking_claim_ids), "reason": resp.reason}
        if decision == "admitted":
            self.holds.pop(rid, None)
            counters["admission_admitted"] += 1
            return True, info
        counters[f"admission_{decision}"] += 1
        if waited >= self.settings.admit_max_wait_s:
            self.holds.pop(rid, None)
            counters["admission_overridden"] += 1
            log.warning("sidecar: request %s still %s after %.1f s (%s); serving it (vLLM has no connector "
                        "API to reject a request)", rid, decision, waited, resp.reason)
            info["overridden"] = True
            return True, info
        retry = max(float(resp.retry_after_s or 0.0), self.settings.admit_retry_s)
        self.holds[rid] = Hold(since=hold.since if hold is not None else now, retry_at=now + retry, decision=decision,
                               blocking=tuple(resp.blocking_claim_ids), reason=resp.reason)
        return False, info

    def forget(self, rid: str) -> None:
        self.holds.pop(rid, None)
