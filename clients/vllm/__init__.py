"""vLLM integration: ``clients.vllm.connector.SidecarConnector`` (a ``KVConnectorBase_V1``) and the
gap-fill scheduler plug-in ``clients.vllm.scheduler.SidecarScheduler``. See docs/vllm.md.

Importing this package does not import vLLM; the connector module does."""
