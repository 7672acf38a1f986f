"""The sidecar both fidelity benchmarks run against: ``bench.fidelity`` (random-weight models)
and ``bench.quality`` (a real model, which ``bench.fidelity --model`` hands over to). Kept apart
so the two share it without importing each other."""

from __future__ import annotations


def sidecar_config(template):
    """An in-process sidecar on a free port, metrics off, chunk anchors from ``template``'s
    special tokens (``anchor_token_ids``), a 2 GiB CPU tier."""
    from sidecar.config import SidecarConfig
    from sidecar.registry.chunker import ChunkerConfig
    from sidecar.tiers import StoreConfig

    return SidecarConfig(port=0, metrics_port=-1, log_level="WARNING",
                         chunker=ChunkerConfig(anchor_tokens=tuple(template.anchor_token_ids)),
                         store=StoreConfig(cpu_bytes=2 << 30))
