"""Resident claims on vLLM: report the KV pool, ask ``AdmitActive`` before a large prefill.

With ``admission`` on (``kv_connector_extra_config``; needs ``--scheduler-cls
clients.vllm.scheduler.SidecarScheduler`` for the pool's free-block count), the scheduler-side
connector, before it plans a request of at least ``admit_min_tokens`` prompt tokens:

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
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("clients.vllm")

_DECISIONS = {1: "admitted", 2: "deferred", 3: "refused"}


@dataclass(slots=True)
class Hold:
    """A request the sidecar deferred or refused: when it was first held, when to ask again."""

    since: float
    retry_at: float
    decision: str
    blocking: tuple[str, ...] = ()
    reason: str = ""


class Admission:
    def __init__(self, connector: Any) -> None:
        self.connector = connector
        self.settings = connector.settings
        self.holds: dict[str, Hold] = {}
        self._reported_at = 0.0

    def _pool(self) -> tuple[int, int] | None:
        sched = self.connector._scheduler
        if sched is None:
            return None
        pool = sched.kv_cache_manager.block_pool
        usable = int(getattr(pool, "num_gpu_blocks", 0)) - 1  # block 0 is vLLM's null block
        return (usable, min(usable, int(pool.get_num_free_blocks()))) if usable > 0 else None

    def report_pool(self, tenant: str | None) -> None:
        pool = self._pool()
        if pool is None:
            return
        usable, free = pool
        bs = self.connector.block_size
        if self.connector.link.call("report_pool", tenant, lambda c: c.report_pool(
                usable_blocks=usable, free_blocks=free, block_size=bs, hard_protection=False,
                engine_id=self.settings.engine_id)) is not None:
            self._reported_at = time.monotonic()

    def admit(self, request: "Request", n: int, tenant: str | None) -> tuple[bool, dict[str, Any] | None]:
        """(proceed?, what to report in the output). ``False``: hold the request this step."""
        rid = request.request_id
        now = time.monotonic()
        hold = self.holds.get(rid)
        if hold is not None and now < hold.retry_at:
            return False, None
        max_tokens = int(getattr(request, "max_tokens", 0) or 0)
        blocks = -(-(n + max_tokens) // self.connector.block_size)
        self.report_pool(tenant)
        resp = self.connector.link.call("admit_active", tenant, lambda c: c.admit_active(rid, blocks))
        counters = self.connector.counters
        if resp is None:
            self.holds.pop(rid, None)
            counters["admission_unanswered"] += 1
            return True, {"decision": "unanswered", "blocks": blocks}
        decision = _DECISIONS.get(int(resp.decision), "admitted")
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
