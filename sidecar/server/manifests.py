"""Manifests at the edge: ImportManifest / GetWarmUpPlan / ExportManifest (``ManifestHandlers``).

Each handler decodes its request (``sidecar.api.manifests``), checks the caller's grant of the
shared scope where the request names it (``Tenancy``; PERMISSION_DENIED for the whole call,
nothing imported), makes one call to the domain ``ManifestService``
(``sidecar.manifests.service``, where the scope rules live) and encodes the answer. The
service counts each imported entry's outcome in plain ints; ``ManifestHandlers`` drains them
into ``kv_sidecar_manifest_entries_total`` each time the service counts (the startup import's
included), and exports the producer's counters.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from prometheus_client.core import CounterMetricFamily

import sidecar.api.manifests as wire
from sidecar.api.manifests import import_result_to_wire, warm_up_plan_to_wire
from sidecar.errors import InvalidArgument
from sidecar.manifests import ManifestProducer, Outcome
from sidecar.manifests.service import ManifestService
from sidecar.server.edge import Edge, rpc, streaming
from sidecar.server.metrics import Metrics


class _ProducerCollector:
    def __init__(self, producer: ManifestProducer) -> None:
        self._p = producer

    def collect(self):
        w = self._p.writer
        yield CounterMetricFamily("kv_sidecar_manifest_lines_written", "Manifest lines appended", value=w.lines_written)
        yield CounterMetricFamily("kv_sidecar_manifest_rotations", "Manifest file rotations", value=w.rotations)
        yield CounterMetricFamily("kv_sidecar_manifest_write_errors", "Manifest writes that failed", value=self._p.errors)


class ManifestMetrics:
    """The Prometheus side of a ``ManifestService``: ``drain`` adds its counts to ``metrics``;
    its producer's counters are read at scrape time."""

    def __init__(self, service: ManifestService, metrics: Metrics) -> None:
        self.service = service
        self._entries = {o: metrics.manifest_entries.labels(o.value) for o in Outcome}
        if service.producer is not None:
            metrics.registry.register(_ProducerCollector(service.producer))

    def drain(self) -> None:
        for outcome, n in self.service.counters.take().entries.items():
            self._entries[outcome].inc(n)


class ManifestHandlers:
    """ImportManifest / GetWarmUpPlan / ExportManifest: wire <-> ``ManifestService``."""

    def __init__(self, edge: Edge, manifests: ManifestService) -> None:
        self.edge = edge
        self.manifests = manifests
        # the service's counts reach the metrics as soon as it counts (the startup import's too)
        self.manifest_metrics = ManifestMetrics(manifests, edge.metrics)
        manifests.on_count = self.manifest_metrics.drain

    @rpc
    async def ImportManifest(
        self, request: wire.ImportManifestRequest, context: grpc.aio.ServicerContext
    ) -> wire.ImportManifestResponse:
        tenancy = self.edge.tenancy
        tenant = tenancy.resolve(context)
        if request.shared:
            tenancy.check_shared_write(tenant)
        svc = self.manifests
        res = await svc.import_lines(tenant, request.lines, shared=request.shared,
                                     may_write_shared=tenancy.may_write_shared(tenant), prefetch=not request.no_prefetch)
        return import_result_to_wire(res, svc.pending(tenant, request.shared))

    @rpc
    async def GetWarmUpPlan(self, request: wire.WarmUpPlanRequest, context: grpc.aio.ServicerContext) -> wire.WarmUpPlan:
        tenant = self.edge.tenancy.resolve(context)
        if not request.HasField("identity"):
            raise InvalidArgument("identity: required (the plan holds the chunks of one identity)")
        identity = self.edge.identities.get(request.identity, True)
        if request.shared:
            self.edge.tenancy.check_shared_write(tenant)
        seqs, pending = self.manifests.warm_up_plan(
            tenant, identity, shared=request.shared, max_sequences=request.max_sequences
        )
        return warm_up_plan_to_wire(seqs, pending)

    @streaming
    async def ExportManifest(
        self, request: wire.ExportManifestRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wire.ExportManifestResponse]:
        try:
            tenant = self.edge.tenancy.resolve(context)
            if not request.HasField("identity"):
                raise InvalidArgument("identity: required (chunk keys are salted with it)")
            identity = self.edge.identities.get(request.identity, True)
            batches = list(self.manifests.export(tenant, identity, include_shared=request.include_shared))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error leaves through _abort
            await self.edge.abort("ExportManifest", exc, context)
        for lines in batches:
            yield wire.ExportManifestResponse(lines=lines)
        self.edge.ok["ExportManifest"].inc()
