"""Prometheus metrics at the edge (docs/architecture.md, "Observability").

Every name starts with ``kv_sidecar_``. Each server owns its own ``CollectorRegistry`` so several
servers in one process (tests) do not collide. Domain objects never import prometheus_client:
the registry's gauges are read at scrape time by ``_RegistryCollector`` and counters are
incremented by the servicer after each call.

=============================================== =========================================
name                                            meaning
=============================================== =========================================
kv_sidecar_requests_total{method,code}          RPCs by method and final status
kv_sidecar_inflight_requests{method}            RPCs in flight (each holds a tenant stream slot)
kv_sidecar_lookups_total{policy,dry_run}        Lookups served
kv_sidecar_lookup_tokens_total{kind,dry_run}    prompt tokens by kind: prefix | exact |
                                                shifted | prefill
kv_sidecar_lookup_seconds                       server-side Lookup latency (histogram)
kv_sidecar_score_seconds                        server-side Score / GetPodScores latency (histogram)
kv_sidecar_routing_scores_total                 Score calls; _round_trips_total: their Redis round
                                                trips; _planned_total: candidates planned;
                                                _absent_total: candidates without a live heartbeat
kv_sidecar_routing_residency_written_total      residency fields this replica set or deleted
kv_sidecar_lookup_hit_segment_tokens            tokens per planned hit segment (histogram;
                                                coalesced, extended chunk hits)
kv_sidecar_lookup_seed_tokens_total{dry_run}    of the shifted tokens, those found through
                                                seed windows (registry.seed_interval)
kv_sidecar_store_chunks_total{outcome}          chunks registered | refreshed | stored
kv_sidecar_store_bytes_total, _seconds          KV payload bytes stored; Store latency
kv_sidecar_fetch_bytes_total, _seconds          KV payload bytes streamed; Fetch latency
kv_sidecar_fetch_shared_memory_bytes_total      of those, written into a same-host client's buffer
kv_sidecar_fetch_shared_memory_fallbacks_total  {reason} calls that named a buffer and got bytes inline
kv_sidecar_tier_bytes / _objects /              per tier {tier=gpu|cpu|disk|remote}
  _capacity_bytes / _hits / _misses
kv_sidecar_tier_promotions / _demotions         chunks moved up on hit / down instead of lost
kv_sidecar_tier_evictions{reason}               copies dropped (capacity | quota | operator | io_error)
kv_sidecar_tier_losses{reason}                  chunks found missing or corrupt
kv_sidecar_checksum_failures_total              payloads failing their checksum on read
kv_sidecar_rotation_bytes / _seconds            key bytes rotated on Fetch and time spent
kv_sidecar_registry_entries / _bytes            registry size (gauges)
kv_sidecar_registry_seeds                       seed windows indexed (gauge; 32-64 bytes each)
kv_sidecar_registry_evictions_total{reason}     evictions (capacity_entries | capacity_bytes |
                                                scope_share | copies | deleted)
kv_sidecar_registry_verify_failures_total       fingerprint hits whose tokens did not match
kv_sidecar_sessions                             mirrored engine sessions open (gauge)
kv_sidecar_splices_total{mode,outcome}          Splice plans by mode (amortize | forget: any
                                                directive forgets) and outcome (planned |
                                                committed | aborted | expired | refused)
kv_sidecar_splice_tokens_total{kind}            tokens of committed plans: prefilled | kept |
                                                moved | rotated | refreshed
kv_sidecar_splice_seconds                       server-side Splice latency: decode, plan,
                                                invariant check, encode (histogram)
kv_sidecar_manifest_entries_total{outcome}      manifest entries imported: prefetched |
                                                planned | present | malformed | refused
kv_sidecar_manifest_lines_written / _rotations  producer lines appended, file rotations
kv_sidecar_shared_registry_up                   1 while the shared (Redis) registry answers
kv_sidecar_shared_registry_errors_total{op}     Redis failures: read | publish | connect
kv_sidecar_shared_registry_reads_total          Lookups that made their one Redis round trip
kv_sidecar_shared_registry_found_total          peer chunks brought into the local registry
kv_sidecar_shared_registry_published_total      records written; _dropped_total: queue overflow
kv_sidecar_shared_registry_pending              records waiting to be published (gauge)
kv_sidecar_claims{state}                        claims by state (gauge): submitted | accepted |
                                                materialized | demoted | expired | refused |
                                                harmed | released
kv_sidecar_claim_events_total{event}            claim and arbitration events emitted, by type
kv_sidecar_active_refusals_total                AdmitActive / Store refusals attributed to claims
kv_sidecar_admit_refusals_total                 AdmitActive calls answered refused
kv_sidecar_event_watchers_dropped_total         WatchEvents streams dropped with a gap
kv_sidecar_pins_in_flight                       tier read pins held now (gauge; 0 when idle)
kv_sidecar_cache_invariant_violations_total     broken invariants: alert on any non-zero
kv_sidecar_build_info{version}                  1
=============================================== =========================================
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from sidecar.dataplane import DataPlane
    from sidecar.directives import SessionTable
    from sidecar.registry.registry import InMemoryRegistry
    from sidecar.registry.shared import SharedRegistry

logger = logging.getLogger(__name__)

_SEGMENT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)
_LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.5)


class _RegistryCollector:
    def __init__(self, registry: "InMemoryRegistry") -> None:
        self._registry = registry

    def collect(self):
        reg = self._registry
        yield GaugeMetricFamily("kv_sidecar_registry_entries", "Chunk entries in the registry", value=len(reg))
        yield GaugeMetricFamily("kv_sidecar_registry_bytes", "Bytes held by registry entries", value=reg.nbytes)
        yield GaugeMetricFamily("kv_sidecar_registry_seeds", "Seed windows indexed", value=reg.seed_windows())
        yield CounterMetricFamily(
            "kv_sidecar_registry_verify_failures", "Fingerprint hits whose tokens did not match",
            value=reg.stats.verify_failures,
        )


class _DataPlaneCollector:
    """Tier gauges and counters read from the store's own stats at scrape time."""

    def __init__(self, dataplane: "DataPlane") -> None:
        self._dp = dataplane

    def collect(self):
        st = self._dp.store.stats()
        c = self._dp.counters
        used = GaugeMetricFamily("kv_sidecar_tier_bytes", "Bytes held per tier", labels=["tier"])
        cap = GaugeMetricFamily("kv_sidecar_tier_capacity_bytes", "Capacity per tier", labels=["tier"])
        objs = GaugeMetricFamily("kv_sidecar_tier_objects", "Chunks held per tier", labels=["tier"])
        hits = CounterMetricFamily("kv_sidecar_tier_hits", "Reads served per tier", labels=["tier"])
        misses = CounterMetricFamily("kv_sidecar_tier_misses", "Reads that missed per tier", labels=["tier"])
        for tier, ts in st.tiers.items():
            used.add_metric([tier.value], ts.used_bytes)
            cap.add_metric([tier.value], ts.capacity_bytes)
            objs.add_metric([tier.value], ts.objects)
            hits.add_metric([tier.value], ts.hits)
            misses.add_metric([tier.value], ts.misses)
        yield from (used, cap, objs, hits, misses)
        yield CounterMetricFamily("kv_sidecar_tier_promotions", "Chunks promoted on hit", value=st.promotions)
        yield CounterMetricFamily("kv_sidecar_tier_demotions", "Chunks demoted (not lost)", value=st.demotions)
        ev = CounterMetricFamily("kv_sidecar_tier_evictions", "Copies dropped, by reason", labels=["reason"])
        for reason, n in st.evictions_by_reason.items():
            ev.add_metric([getattr(reason, "value", str(reason))], n)
        yield ev
        lost = CounterMetricFamily("kv_sidecar_tier_losses", "Chunks found missing or corrupt", labels=["reason"])
        for reason, n in st.losses_by_reason.items():
            lost.add_metric([getattr(reason, "value", str(reason))], n)
        yield lost
        yield CounterMetricFamily("kv_sidecar_checksum_failures", "Payloads failing their checksum", value=st.checksum_failures)
        yield CounterMetricFamily("kv_sidecar_quota_refusals", "Stores refused by tenant quota", value=st.quota_refusals)
        yield CounterMetricFamily("kv_sidecar_rotation_bytes", "Key bytes rotated on Fetch", value=c.rotated_bytes)
        yield CounterMetricFamily("kv_sidecar_rotation_seconds", "Time spent rotating on Fetch", value=c.rotation_seconds)
        yield CounterMetricFamily("kv_sidecar_fetch_chunks", "Chunks served by Fetch", value=c.fetched_chunks)
        yield CounterMetricFamily("kv_sidecar_fetch_misses", "Fetch items that missed", value=c.fetch_misses)


class _SharedRegistryCollector:
    def __init__(self, shared: "SharedRegistry") -> None:
        self._shared = shared

    def collect(self):
        sr = self._shared
        st = sr.stats
        p = "kv_sidecar_shared_registry"
        yield GaugeMetricFamily(f"{p}_up", "1 while the shared registry's Redis answers", value=int(st.up))
        err = CounterMetricFamily(f"{p}_errors", "Shared registry Redis failures by operation", labels=["op"])
        for op, n in st.errors.items():
            err.add_metric([op], n)
        yield err
        yield CounterMetricFamily(f"{p}_reads", "Lookups that made one Redis round trip", value=st.reads)
        yield CounterMetricFamily(f"{p}_reads_skipped", "Lookups that skipped Redis while down", value=st.reads_skipped)
        yield CounterMetricFamily(f"{p}_found", "Peer chunks brought into the local registry", value=st.read_found)
        yield CounterMetricFamily(f"{p}_published", "Registry records written to Redis", value=st.published)
        yield CounterMetricFamily(f"{p}_dropped", "Queued records dropped past max_pending", value=st.dropped)
        yield GaugeMetricFamily(f"{p}_pending", "Records waiting to be published", value=sr.pending)


class _FleetCollector:
    """Routing counters (``sidecar.routing.Fleet.stats``) read at scrape time."""

    def __init__(self, fleet) -> None:
        self._fleet = fleet

    def collect(self):
        f = self._fleet
        for name, value in f.stats.items():
            yield CounterMetricFamily(f"kv_sidecar_routing_{name}", f"Routing: {name.replace('_', ' ')}", value=value)
        yield CounterMetricFamily("kv_sidecar_routing_residency_written", "Residency fields set or deleted",
                                  value=f.residency.written if f.residency is not None else 0)


class _ClaimsCollector:
    """Claim states and event counts read from the ledger at scrape time."""

    def __init__(self, ledger, store) -> None:
        self._ledger = ledger
        self._store = store

    def collect(self):
        ledger = self._ledger
        states = GaugeMetricFamily("kv_sidecar_claims", "Claims by state", labels=["state"])
        for state, n in ledger.states().items():
            states.add_metric([state], n)
        yield states
        events = CounterMetricFamily("kv_sidecar_claim_events", "Claim and arbitration events by type", labels=["event"])
        for event, n in sorted(ledger.events.counts.items()):
            events.add_metric([event], n)
        yield events
        yield CounterMetricFamily(
            "kv_sidecar_active_refusals", "Active work refused because of accepted claims", value=ledger.active_refusals
        )
        yield GaugeMetricFamily("kv_sidecar_pins_in_flight", "Tier read pins held now", value=self._store.pins_in_flight())


class _SessionCollector:
    def __init__(self, table: "SessionTable") -> None:
        self._table = table

    def collect(self):
        yield GaugeMetricFamily("kv_sidecar_sessions", "Mirrored engine sessions open", value=len(self._table))


class BatchHistogram(Histogram):
    """A ``Histogram`` (same samples, same exposition) that also takes many observations in one
    call: ``observe`` costs two locked increments per value, and a Lookup can plan hundreds of
    hit segments. Unlabelled only (as used here)."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._bounds = np.asarray(self._upper_bounds, dtype=np.float64)

    def observe_many(self, amounts: Sequence[float]) -> None:
        """``observe`` each of ``amounts``: one increment per bucket that gains any, one of the sum."""
        n = len(amounts)
        if not n:
            return
        self._raise_if_not_observable()
        # observe() counts a value in the first bucket whose upper bound is >= it
        if n < 16:
            first = [bisect_left(self._upper_bounds, a) for a in amounts]
            per_bucket = {i: first.count(i) for i in set(first)}
        else:  # numpy's fixed cost (~4 us) pays off
            counts = np.bincount(self._bounds.searchsorted(np.fromiter(amounts, np.float64, n)),
                                 minlength=len(self._bounds))
            per_bucket = {i: int(counts[i]) for i in np.flatnonzero(counts).tolist()}
        self._sum.inc(float(sum(amounts)))
        for i, k in per_bucket.items():
            self._buckets[i].inc(k)


class Metrics:
    def __init__(self, version: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kv_sidecar_requests", "RPCs by method and status", ["method", "code"], registry=r)
        self.lookups = Counter("kv_sidecar_lookups", "Lookups served", ["policy", "dry_run"], registry=r)
        self.lookup_tokens = Counter(
            "kv_sidecar_lookup_tokens", "Prompt tokens by how a Lookup plans them", ["kind", "dry_run"], registry=r
        )
        self.lookup_seed_tokens = Counter(
            "kv_sidecar_lookup_seed_tokens", "Shifted tokens found through seed windows", ["dry_run"], registry=r
        )
        self.lookup_seconds = Histogram(
            "kv_sidecar_lookup_seconds", "Server-side Lookup latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.score_seconds = Histogram(
            "kv_sidecar_score_seconds", "Server-side Score / GetPodScores latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.lookup_hit_segment_tokens = BatchHistogram(
            "kv_sidecar_lookup_hit_segment_tokens", "Tokens per planned hit segment", buckets=_SEGMENT_BUCKETS,
            registry=r,
        )
        self.store_chunks = Counter("kv_sidecar_store_chunks", "Chunks seen by Store", ["outcome"], registry=r)
        self.store_bytes = Counter("kv_sidecar_store_bytes", "KV payload bytes stored", registry=r)
        self.store_seconds = Histogram("kv_sidecar_store_seconds", "Store with payloads, server side", registry=r)
        self.fetch_bytes = Counter("kv_sidecar_fetch_bytes", "KV payload bytes streamed by Fetch", registry=r)
        self.fetch_seconds = Histogram("kv_sidecar_fetch_seconds", "Fetch, server side", registry=r)
        self.shm_bytes = Counter(
            "kv_sidecar_fetch_shared_memory_bytes",
            "Fetch / FetchSession payload bytes written into the caller's shared-memory buffer (part of fetch_bytes)",
            registry=r,
        )
        self.shm_fallbacks = Counter(
            "kv_sidecar_fetch_shared_memory_fallbacks",
            "Calls that named a shared-memory buffer and got payloads inline, by reason "
            "(disabled | remote_peer | unavailable | full | write_failed)",
            ["reason"], registry=r,
        )
        self.evictions = Counter("kv_sidecar_registry_evictions", "Registry evictions", ["reason"], registry=r)
        self.splices = Counter("kv_sidecar_splices", "Splice plans by mode and outcome", ["mode", "outcome"], registry=r)
        self.splice_tokens = Counter(
            "kv_sidecar_splice_tokens", "Tokens of committed Splice plans by what happens to them", ["kind"], registry=r
        )
        self.splice_seconds = Histogram(
            "kv_sidecar_splice_seconds", "Server-side Splice latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.manifest_entries = Counter(
            "kv_sidecar_manifest_entries", "Manifest entries imported, by outcome", ["outcome"], registry=r
        )
        self.inflight = Gauge("kv_sidecar_inflight_requests", "RPCs in flight, by method", ["method"], registry=r)
        self.invariant_violations = Counter(
            "kv_sidecar_cache_invariant_violations", "Broken cache invariants (alert on any)", registry=r
        )
        self.active_refusals = Counter(  # counted here by AdmitActive; the collector reports the ledger's total
            "kv_sidecar_admit_refusals", "AdmitActive calls answered refused", registry=r
        )
        self.event_watchers_dropped = Counter(
            "kv_sidecar_event_watchers_dropped", "WatchEvents streams dropped with a counted gap", registry=r
        )
        self.build_info = Gauge("kv_sidecar_build_info", "Build information", ["version"], registry=r)
        self.build_info.labels(version=version).set(1)
        self._http = None

    def watch_registry(self, registry: "InMemoryRegistry") -> None:
        self.registry.register(_RegistryCollector(registry))

    def watch_dataplane(self, dataplane: "DataPlane") -> None:
        self.registry.register(_DataPlaneCollector(dataplane))

    def watch_shared_registry(self, shared: "SharedRegistry") -> None:
        self.registry.register(_SharedRegistryCollector(shared))

    def watch_fleet(self, fleet) -> None:
        self.registry.register(_FleetCollector(fleet))

    def watch_claims(self, ledger, store) -> None:
        self.registry.register(_ClaimsCollector(ledger, store))

    def watch_sessions(self, table: "SessionTable") -> None:
        self.registry.register(_SessionCollector(table))

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
