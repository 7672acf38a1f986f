"""``SidecarConnector``: vLLM's KV connector (``KVConnectorBase_V1`` + ``SupportsHMA``) for the sidecar.

Load it with::

    --kv-transfer-config '{"kv_connector": "SidecarConnector",
                           "kv_connector_module_path": "clients.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"sidecar": "127.0.0.1:50051", "tenant": "team-a"}}'

and, for the gap-fill sub-requests, ``--scheduler-cls clients.vllm.scheduler.SidecarScheduler``.

vLLM builds this class once per role; it is a facade over one class per role, each importable
without vLLM (tests/clients/vllm drives them with a fake scheduler and requests):

    Scheduler side (``scheduler_side.SchedulerSide``, in the scheduler process):
        get_num_new_matched_tokens() - Lookup the prompt with vLLM's own prefix hit as
            ``engine_prefix_len``; answer the block-aligned run of hits contiguous with that
            hit (``sidecar.sdk.kit.load_run``), or None to hold the request this step (the
            admit gate, ``admit_gate.py``; a running gap-fill sub-request). Not side-effect
            free: the first call per request Lookups (and applies span directives).
        update_state_after_alloc() - vLLM took m <= the run's tokens: cut the run to m.
        build_connector_meta() - the step's ``SidecarMetadata``: a LoadJob per request whose
            blocks were just allocated, a StoreJob per request whose prefill completes (the
            chunks of ``plan.chunk_bounds`` it computed with their true left context).
        request_finished() / request_finished_all_groups() - blocks are never held; the
            output's ``kv_transfer_params["sidecar"]`` says what happened.
    Gap fill (``gap_fill.GapFill``, scheduler side, needs the scheduler plug-in):
        a run that ends at a gap followed by enough planned hits becomes an internal
        sub-request ``prompt[:A]``; after it, the parent's shifted run is contiguous.
        bind_scheduler() - the plug-in (``scheduler.SidecarScheduler``) registers itself.
    Worker side (``worker_side.WorkerSide``, in each worker):
        register_kv_caches() - learn the paged block layout (``paged.py``) or refuse.
        get_handshake_metadata() - the worker's refusal, if any, for the scheduler side.
        start_load_kv() - Fetch the LoadJobs' items (rotated by the sidecar to their target
            positions with the engine's ``RopeSpec``, pairing from vLLM's ``is_neox_style``)
            and copy their rows into the requests' paged blocks, every layer.
        wait_for_layer_load() / save_kv_layer() - nothing (loads finish in start_load_kv;
            stores gather after the whole forward).
        wait_for_save() - gather the StoreJobs' rows from the paged cache and Store them (on
            a background thread by default).
        get_block_ids_with_load_errors() - blocks of items that could not be fetched: vLLM
            recomputes them.

Refusals (``refusals.py``): an engine the connector cannot serve (a quantized cache, an unknown
cache layout, another rotary pairing, a model shape or RoPE it cannot describe) disables it,
at construction or at ``register_kv_caches``, with one WARNING line naming the setting and why;
a disabled connector behaves like no connector (0 external tokens, no jobs, no sidecar calls).

Failures never fail a request: a Lookup that errors loads nothing (prefill), a Fetch that
errors reports its blocks for recompute (the connector switches ``kv_load_failure_policy`` to
``recompute`` for that reason), a Store that errors is dropped; each outage is logged once and
counted (``stats()``), and the sidecar is skipped for ``retry_after_s`` after an error
(``sidecar.sdk.kit.FailSoftLink``).

Stats: ``stats()`` is this process's side's counters since start-up; vLLM's
``get_kv_connector_stats()`` gets what they gained since its last call, a
``stats.SidecarConnectorStats`` (vLLM's ``KVConnectorStats``), summed over the workers and the
scheduler side and logged by vLLM's stat logger.

Per-request ``kv_transfer_params`` (``SamplingParams(extra_args={"kv_transfer_params": {...}})``):
``sidecar_tenant`` (the tenant header for this request's calls), ``sidecar_directives`` /
``sidecar_session`` (Splice, see ``directives.py``); the finished request's output carries
``kv_transfer_params["sidecar"]``: its prompt length, local hit, planned and claimed tokens.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from clients.vllm import directives
from clients.vllm.refusals import Refused
from clients.vllm.settings import (
    PARAM_GAP_FILL,
    PARAM_TENANT,
    Settings,
    describe,
    engine_shape,
    sidecar_link,
    vllm_version_note,
)
from clients.vllm.stats import SidecarConnectorStats, StatsInterval, snapshot

# The role classes (and through them the SDK, the kit and numba) are imported when a role is
# built, not here: vLLM imports this module while validating its config, before a worker's
# start-up scans sys.modules for Triton kernels, and that scan crashes on llvmlite's objects
# (see settings.py). Building a role happens after the scan.
if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from clients.vllm.jobs import LoadJob, StoreJob
    from clients.vllm.requests import SchedulerHooks
    from clients.vllm.scheduler_side import SchedulerSide
    from clients.vllm.settings import EngineShape
    from clients.vllm.worker_side import WorkerSide
    from sidecar.sdk.kit import FailSoftLink

log = logging.getLogger("clients.vllm")

#: The live connectors of this process by role ("scheduler" / "worker"): tests and benchmarks
#: running vLLM in-process read ``stats()`` through it.
INSTANCES: "weakref.WeakValueDictionary[str, SidecarConnector]" = weakref.WeakValueDictionary()

PARAM_DIRECTIVES = directives.PARAM_DIRECTIVES
PARAM_SESSION = directives.PARAM_SESSION

__all__ = ["INSTANCES", "PARAM_DIRECTIVES", "PARAM_GAP_FILL", "PARAM_SESSION", "PARAM_TENANT", "SidecarConnector",
           "SidecarMetadata", "WorkerReport"]


@dataclass
class SidecarMetadata(KVConnectorMetadata):
    """One step's jobs (``jobs.py``), from the scheduler side to the workers."""

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)


@dataclass(frozen=True)
class WorkerReport(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler side after registering its caches (vLLM's connector
    handshake): ``refused``, why it disabled itself, or "" when it serves."""

    refused: str = ""


class SidecarConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. Both roles are this class (vLLM builds one per role); each
    delegates to its role's object: ``scheduler_side`` or ``worker_side`` (the other is None).
    ``disabled`` is why the connector refused this engine ("" while it serves; ``refusals.py``):
    then neither role object exists or is called, and vLLM serves alone."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped Store is a future miss, never a lost hand-off

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = Settings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        import vllm

        note = vllm_version_note(getattr(vllm, "__version__", "unknown"))
        if note is not None:
            log.warning("sidecar connector: %s", note)
        self.side = "scheduler" if role is KVConnectorRole.SCHEDULER else "worker"
        self.counters: Counter[str] = Counter()
        self._interval = StatsInterval()  # what get_kv_connector_stats reported last
        self.disabled = ""
        self.link: FailSoftLink | None = None
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        self.shape: EngineShape | None = None  # None when refused at construction
        INSTANCES[self.side] = self
        try:
            self.shape = engine_shape(vllm_config, self.settings)
        except Refused as exc:
            # both roles find it; the scheduler side (one per engine) says it at WARNING
            self._disable(str(exc), warn=role is KVConnectorRole.SCHEDULER)
            return
        self.block_size = self.shape.block_size
        self.link = sidecar_link(self.settings, self.side)
        if role is KVConnectorRole.SCHEDULER:
            from clients.vllm.scheduler_side import SchedulerSide

            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                # a chunk evicted between Lookup and Fetch must cost a recompute, never the request
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
                log.info("sidecar connector: kv_load_failure_policy set to 'recompute' (a missed fetch is prefilled)")
            self.scheduler_side = SchedulerSide(self.settings, self.shape, self.link, self.counters)
        else:
            from clients.vllm.worker_side import WorkerSide

            self.worker_side = WorkerSide(self.settings, self.shape, self.link, self.counters)
        log.info("sidecar connector (%s) -> %s, identity %s", self.side, self.settings.target, describe(self.shape))

    # ================================================================== shared

    def _disable(self, why: str, *, warn: bool) -> None:
        """Stop serving (``refusals.py``): from now on this role behaves like no connector."""
        if self.disabled:
            return
        self.disabled = why
        self.counters["disabled"] = 1
        (log.warning if warn else log.info)("sidecar connector disabled (%s): %s; vLLM serves every request alone",
                                            self.side, why)
        if self.worker_side is not None:
            self.worker_side.shutdown()
            self.worker_side = None
        self.scheduler_side = None
        if self.link is not None:
            self.link.close()
            self.link = None

    def stats(self) -> dict[str, int]:
        """Counters of this process's side since it started (tokens, calls, errors; ``disabled``:
        1 when refused)."""
        return snapshot(self.counters, self.link.errors if self.link is not None else None)

    def get_kv_connector_stats(self) -> SidecarConnectorStats | None:
        """What ``stats()`` gained since the last call (None: nothing), for vLLM's metrics
        (``stats.py``). vLLM calls it after each step, on each worker and on the scheduler side."""
        return self._interval.take(self.stats())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> SidecarConnectorStats:
        """A report back from its ``to_dict()`` form (vLLM's stat logger, in the front-end)."""
        return SidecarConnectorStats.build(data)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        if self.link is not None:
            self.link.close()

    # ================================================================== worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker_side is None:
            return
        try:
            self.worker_side.register_kv_caches(kv_caches)
        except Refused as exc:  # the scheduler side hears it in the handshake and says it at WARNING
            self._disable(str(exc), warn=False)

    def get_handshake_metadata(self) -> WorkerReport:
        """This worker's refusal for the scheduler side (vLLM calls it after ``register_kv_caches``)."""
        return WorkerReport(refused=self.disabled)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self.worker_side is None:
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, SidecarMetadata):
            self.worker_side.load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # rows are gathered from the paged cache after the whole forward (wait_for_save)

    def wait_for_save(self) -> None:
        if self.worker_side is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, SidecarMetadata):
            self.worker_side.save(meta.stores)

    def flush(self, timeout: float | None = 60.0) -> None:
        """Wait for background Stores (worker side; a no-op on the scheduler side)."""
        if self.worker_side is not None:
            self.worker_side.flush(timeout)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.worker_side is None:
            return set()
        return self.worker_side.take_load_errors()

    # ================================================================== scheduler side

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Every worker's ``WorkerReport`` by (pipeline stage, tensor-parallel rank), once at
        start-up: a worker that refused its caches disables the scheduler side too, so no
        request is planned for loads it would not do. (vLLM's default refuses stages > 0.)"""
        refused = {(pp, tp): getattr(r, "refused", "") for (pp, tp), r in sorted(metadata.items())}
        refused = {k: why for k, why in refused.items() if why}
        if refused and self.scheduler_side is not None:
            whys = sorted(set(refused.values()))
            ranks = ", ".join(f"pp{pp}/tp{tp}" for pp, tp in refused)
            self._disable(f"worker {ranks}: {'; '.join(whys)}", warn=True)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): r for tp, r in metadata.items()})

    def bind_scheduler(self, hooks: SchedulerHooks) -> None:
        """Called by ``clients.vllm.scheduler.SidecarScheduler`` (gap fill, the pool report)."""
        if self.scheduler_side is not None:
            self.scheduler_side.bind(hooks)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.scheduler_side is None:
            return 0, False
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if self.scheduler_side is None:
            return SidecarMetadata()
        jobs = self.scheduler_side.build_jobs(scheduler_output)
        return SidecarMetadata(loads=jobs.loads, stores=jobs.stores)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler_side is None:
            return False, None
        return self.scheduler_side.request_finished(request)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])
