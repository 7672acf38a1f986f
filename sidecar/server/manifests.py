"""Manifests in the server: producer wiring, startup import, ImportManifest / GetWarmUpPlan /
ExportManifest (``ManifestService`` works in domain types; ``ManifestHandlers`` convert the wire).

Scope rules (docs/architecture.md, "Tenancy and security"): an import by tenant T puts entries into
T's scope (lines without a scope, or scoped T); with ``shared`` into the shared scope, which
needs the operator permission (``auth.shared_writers``; PERMISSION_DENIED for the whole call,
nothing imported). A line scoped ``shared`` is imported into ``shared`` only with that
permission; a line scoped to another tenant is refused (counted, never registered, never
planned): a tenant's private entries never enter another tenant's view. The startup import
(``manifests.import_paths`` / ``import_redis_stream``) is the operator's: entries keep the scope
their line names (``manifests.import_scope`` for lines without one).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily

import grpc

import sidecar.api.manifests as wire
from sidecar.api.manifests import import_result_to_wire, warm_up_plan_to_wire
from sidecar.dataplane import DataPlane
from sidecar.errors import InvalidArgument
from sidecar.server.edge import Edge, rpc, streaming
from sidecar.identity import SHARED_SCOPE, CacheIdentity
from sidecar.manifests import (
    ImportResult,
    ManifestEntry,
    ManifestImporter,
    ManifestProducer,
    ManifestsConfig,
    Outcome,
    WarmUpPlan,
    chunk_key,
    encode_line,
    read_lines,
    rotated_paths,
)
from sidecar.manifests.importer import ScopeRule
from sidecar.server.metrics import Metrics
from sidecar.registry.chunk_index import ChunkIndex
from sidecar.server.tenancy import Tenancy

logger = logging.getLogger(__name__)

#: Lines per ExportManifest message.
EXPORT_BATCH = 512


class _ProducerCollector:
    def __init__(self, producer: ManifestProducer) -> None:
        self._p = producer

    def collect(self):
        w = self._p.writer
        yield CounterMetricFamily("kv_sidecar_manifest_lines_written", "Manifest lines appended", value=w.lines_written)
        yield CounterMetricFamily("kv_sidecar_manifest_rotations", "Manifest file rotations", value=w.rotations)
        yield CounterMetricFamily("kv_sidecar_manifest_write_errors", "Manifest writes that failed", value=self._p.errors)


class ManifestService:
    def __init__(
        self, config: ManifestsConfig, index: ChunkIndex, dataplane: DataPlane, tenancy: Tenancy, metrics: Metrics,
        max_prompt_tokens: int,
    ) -> None:
        self.config = config
        self.index = index
        self.dataplane = dataplane
        self.tenancy = tenancy
        self.metrics = metrics
        self.max_prompt_tokens = max_prompt_tokens
        self.plan = WarmUpPlan()
        self.importer = ManifestImporter(dataplane, self.plan)
        self.producer: ManifestProducer | None = None
        if config.path:
            self.producer = ManifestProducer(config)
            index.on_new_chunks = self.producer.observe
            metrics.registry.register(_ProducerCollector(self.producer))
        self._counters = {o: metrics.manifest_entries.labels(o.value) for o in Outcome}

    # ---------------------------------------------------------------- import

    async def _apply(self, entries: Iterable[ManifestEntry | None], rule: ScopeRule, prefetch: bool) -> ImportResult:
        res, new = await self.importer.apply(entries, rule, prefetch=prefetch)
        if self.producer is not None:
            for salt, added in new:
                self.producer.observe(_Salted(salt), added)
        for outcome, n in res.outcomes.items():
            self._counters[outcome].inc(n)
        return res

    def tenant_rule(self, tenant: str, shared: bool) -> ScopeRule:
        """The scope rule of an import by ``tenant`` (module docstring)."""
        may_shared = self.tenancy.may_write_shared(tenant)
        target = SHARED_SCOPE if shared else tenant

        def rule(e: ManifestEntry) -> str | None:
            if e.scope == SHARED_SCOPE:
                return SHARED_SCOPE if may_shared else None
            if e.scope == tenant:
                return target
            return None

        return rule

    def operator_rule(self) -> ScopeRule:
        default = self.config.import_scope

        def rule(e: ManifestEntry) -> str | None:
            return e.scope or default

        return rule

    async def import_lines(self, tenant: str, lines: bytes, *, shared: bool, prefetch: bool) -> ImportResult:
        if shared:
            self.tenancy.check_shared_write(tenant)
        return await self._apply(read_lines(lines.splitlines()), self.tenant_rule(tenant, shared), prefetch)

    def pending(self, tenant: str, shared: bool) -> int:
        scope = SHARED_SCOPE if shared else tenant
        return self.plan.pending_in_scope(scope)

    async def import_startup(self) -> ImportResult:
        """The configured startup import (files, then the Redis stream). Never fatal: an
        unreadable file or an unreachable Redis is logged and skipped."""
        cfg = self.config
        total = ImportResult()
        rule = self.operator_rule()
        for path in cfg.import_paths:
            files = rotated_paths(path, cfg.keep) or [Path(path)]
            for f in files:
                try:
                    with open(f, "rb") as fh:
                        for batch in _batches(fh, cfg.import_batch):
                            total.add(await self._apply(read_lines(batch), rule, cfg.prefetch))
                except OSError as exc:
                    logger.warning("manifest import: cannot read %s: %s", f, exc)
        if cfg.import_redis_url:
            total.add(await self._import_stream(rule))
        if total.lines:
            logger.info("manifest import: %d lines: %s", total.lines,
                        ", ".join(f"{o.value} {n}" for o, n in sorted(total.outcomes.items())))
        return total

    async def _import_stream(self, rule: ScopeRule) -> ImportResult:
        import redis

        from sidecar.manifests import stream

        cfg = self.config
        total = ImportResult()
        client = redis.Redis.from_url(cfg.import_redis_url, socket_timeout=10)
        try:
            it = stream.read(client, cfg.import_redis_stream, batch=cfg.import_batch)
            while True:
                batch = await asyncio.to_thread(next, it, None)
                if batch is None:
                    break
                total.add(await self._apply(read_lines(batch), rule, cfg.prefetch))
        except redis.RedisError as exc:
            logger.warning("manifest import: Redis stream %s unavailable: %s", cfg.import_redis_stream, exc)
        finally:
            client.close()
        return total

    # ---------------------------------------------------------------- warm-up plan

    def warm_up_plan(self, tenant: str, identity: CacheIdentity, *, shared: bool, max_sequences: int) -> tuple[list[bytes], int]:
        if shared:
            self.tenancy.check_shared_write(tenant)
        scope = SHARED_SCOPE if shared else tenant
        seqs = self.plan.sequences(identity.salt, scope, self.importer.is_resident, self.max_prompt_tokens, max_sequences)
        return seqs, self.plan.pending(identity.salt, scope)

    # ---------------------------------------------------------------- export

    def export(self, tenant: str, identity: CacheIdentity, *, include_shared: bool) -> Iterator[bytes]:
        """The caller's chunks (and the shared scope's) registered under ``identity``, as
        manifest lines in batches. Entries whose key is not the hash of their tokens under
        ``identity`` belong to another identity and are skipped (keys are salted with it)."""
        scopes = (tenant, SHARED_SCOPE) if include_shared else (tenant,)
        salt = identity.salt
        buf: list[bytes] = []
        for e in self.index.registry.entries():
            if e.scope not in scopes or not e.tokens or chunk_key(salt, e.scope, e.tokens) != e.key:
                continue
            buf.append(encode_line(ManifestEntry(
                content_hash=e.key, identity=salt, scope=e.scope, tokens=e.tokens, count=e.hits + 1,
                source_pos=e.source_pos, prefix_digest=e.prefix_digest, first_seen=e.first_seen,
                last_seen=e.last_seen or e.first_seen,
            )))
            if len(buf) >= EXPORT_BATCH:
                yield b"".join(buf)
                buf = []
        if buf:
            yield b"".join(buf)

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()


class _Salted:
    """Stands in for a ``CacheIdentity`` where only the salt is known (imported chunks)."""

    __slots__ = ("salt",)

    def __init__(self, salt: int) -> None:
        self.salt = salt


def _batches(lines: Iterable[bytes], n: int) -> Iterator[list[bytes]]:
    buf: list[bytes] = []
    for line in lines:
        buf.append(line)
        if len(buf) >= n:
            yield buf
            buf = []
    if buf:
        yield buf


class ManifestHandlers:
    """ImportManifest / GetWarmUpPlan / ExportManifest: wire <-> ``ManifestService``."""

    def __init__(self, edge: Edge, manifests: ManifestService) -> None:
        self.edge = edge
        self.manifests = manifests


    @rpc
    async def ImportManifest(
        self, request: wire.ImportManifestRequest, context: grpc.aio.ServicerContext
    ) -> wire.ImportManifestResponse:
        tenant = self.edge.tenancy.resolve(context)
        svc = self.manifests
        res = await svc.import_lines(tenant, request.lines, shared=request.shared, prefetch=not request.no_prefetch)
        return import_result_to_wire(res, svc.pending(tenant, request.shared))

    @rpc
    async def GetWarmUpPlan(self, request: wire.WarmUpPlanRequest, context: grpc.aio.ServicerContext) -> wire.WarmUpPlan:
        tenant = self.edge.tenancy.resolve(context)
        if not request.HasField("identity"):
            raise InvalidArgument("identity: required (the plan holds the chunks of one identity)")
        identity = self.edge.identities.get(request.identity, True)
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
