"""Engine integrations for KV Sidecar: ``clients.transformers`` (the reference engine)."""
