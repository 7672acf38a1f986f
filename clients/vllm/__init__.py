"""vLLM integration: ``clients.vllm.connector.SidecarConnector`` (a ``KVConnectorBase_V1``) and the
scheduler plug-in ``clients.vllm.scheduler.SidecarScheduler``. See docs/vllm.md.

The connector is a facade over one class per role: ``scheduler_side.SchedulerSide``,
``worker_side.WorkerSide`` and ``gap_fill.GapFill`` (with ``admit_gate.AdmitGate``); those, and
``jobs``, ``settings``, ``paged``, ``directives``, import no vLLM. Importing this package does
not import vLLM; ``connector`` and ``scheduler`` do."""
