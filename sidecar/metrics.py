"""Prometheus metrics at the edge (ARCHITECTURE.md, "Observability").

Every name starts with ``kv_sidecar_``. Each server owns its own ``CollectorRegistry`` so several
servers in one process (tests) do not collide. Domain objects never import prometheus_client:
the registry's gauges are read at scrape time by ``_RegistryCollector`` and counters are
incremented by the servicer after each call.

=============================================== =========================================
name                                            meaning
=============================================== =========================================
kv_sidecar_requests_total{method,code}          RPCs by method and final status
kv_sidecar_lookups_total{policy,dry_run}        Lookups served
kv_sidecar_lookup_tokens_total{kind,dry_run}    prompt tokens by kind: prefix | exact |
                                                shifted | prefill
kv_sidecar_lookup_seconds                       server-side Lookup latency (histogram)
kv_sidecar_store_chunks_total{outcome}          chunks registered | refreshed
kv_sidecar_registry_entries / _bytes            registry size (gauges)
kv_sidecar_registry_evictions_total{reason}     evictions (capacity_entries | capacity_bytes |
                                                deleted)
kv_sidecar_registry_verify_failures_total       fingerprint hits whose tokens did not match
kv_sidecar_cache_invariant_violations_total     broken invariants: alert on any non-zero
kv_sidecar_build_info{version}                  1
=============================================== =========================================
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from sidecar.registry.registry import InMemoryRegistry

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.5)


class _RegistryCollector:
    def __init__(self, registry: "InMemoryRegistry") -> None:
        self._registry = registry

    def collect(self):
        reg = self._registry
        yield GaugeMetricFamily("kv_sidecar_registry_entries", "Chunk entries in the registry", value=len(reg))
        yield GaugeMetricFamily("kv_sidecar_registry_bytes", "Bytes held by registry entries", value=reg.nbytes)
        yield CounterMetricFamily(
            "kv_sidecar_registry_verify_failures", "Fingerprint hits whose tokens did not match",
            value=reg.stats.verify_failures,
        )


class Metrics:
    def __init__(self, version: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kv_sidecar_requests", "RPCs by method and status", ["method", "code"], registry=r)
        self.lookups = Counter("kv_sidecar_lookups", "Lookups served", ["policy", "dry_run"], registry=r)
        self.lookup_tokens = Counter(
            "kv_sidecar_lookup_tokens", "Prompt tokens by how a Lookup plans them", ["kind", "dry_run"], registry=r
        )
        self.lookup_seconds = Histogram(
            "kv_sidecar_lookup_seconds", "Server-side Lookup latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.store_chunks = Counter("kv_sidecar_store_chunks", "Chunks seen by Store", ["outcome"], registry=r)
        self.evictions = Counter("kv_sidecar_registry_evictions", "Registry evictions", ["reason"], registry=r)
        self.invariant_violations = Counter(
            "kv_sidecar_cache_invariant_violations", "Broken cache invariants (alert on any)", registry=r
        )
        self.build_info = Gauge("kv_sidecar_build_info", "Build information", ["version"], registry=r)
        self.build_info.labels(version=version).set(1)
        self._http = None

    def watch_registry(self, registry: "InMemoryRegistry") -> None:
        self.registry.register(_RegistryCollector(registry))

    def serve_http(self, host: str, port: int) -> int:
        """Start the /metrics endpoint in a daemon thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        bound = server.server_address[1]
        logger.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
