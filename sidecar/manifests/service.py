"""Manifests of one sidecar: producer wiring, the startup import, imports, warm-up plans, export
(docs/manifests.md). ``ManifestService`` works in domain types; the server's handlers
(``sidecar/server/manifests.py``) convert the wire around it.

Scope rules (docs/architecture.md, "Tenancy and security"): an import by tenant T puts entries into
T's scope (lines without a scope, or scoped T); with ``shared`` into the shared scope, which
needs the operator permission (``auth.shared_writers``; the edge refuses the whole call with
PERMISSION_DENIED before this service is asked, nothing imported). A line scoped ``shared`` is
imported into ``shared`` only with that permission (``may_write_shared``); a line scoped to
another tenant is refused (counted, never registered, never planned): a tenant's private
entries never enter another tenant's view. The startup import (``manifests.import_paths`` /
``import_redis_stream``) is the operator's: entries keep the scope their line names
(``manifests.import_scope`` for lines without one).

Each entry's outcome is counted in plain ints (``ManifestCounters``); after each import the
service calls ``on_count``, with which the server's edge drains them into its metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sidecar.identity import SHARED_SCOPE, CacheIdentity
from sidecar.manifests.config import ManifestsConfig
from sidecar.manifests.format import ManifestEntry, chunk_key, encode_line, read_lines
from sidecar.manifests.importer import ImportResult, ManifestImporter, Outcome, ScopeRule, WarmUpPlan
from sidecar.manifests.producer import ManifestProducer, rotated_paths
from sidecar.registry.chunk_index import ChunkIndex

if TYPE_CHECKING:  # the data plane (torch, LMCache) is not imported by reading the config
    from sidecar.dataplane import DataPlane

logger = logging.getLogger(__name__)

#: Lines per ExportManifest message.
EXPORT_BATCH = 512


@dataclass(slots=True)
class ManifestCounters:
    """What a ``ManifestService`` counted since the edge last took the counts (``take``)."""

    #: outcome -> manifest entries imported
    entries: dict[Outcome, int] = field(default_factory=dict)

    def take(self) -> ManifestCounters:
        """The counts so far; they start again from zero here."""
        out = ManifestCounters(self.entries)
        self.entries = {}
        return out


def _nothing() -> None:
    return None


class ManifestService:
    """Imports into one sidecar (its registry, tiers and warm-up plan), and its manifest producer
    when ``config.path`` is set. ``max_prompt_tokens`` bounds each warm-up sequence."""

    def __init__(
        self, config: ManifestsConfig, index: ChunkIndex, dataplane: DataPlane, max_prompt_tokens: int,
    ) -> None:
        self.config = config
        self.index = index
        self.dataplane = dataplane
        self.max_prompt_tokens = max_prompt_tokens
        self.plan = WarmUpPlan()
        self.importer = ManifestImporter(dataplane, self.plan)
        self.producer: ManifestProducer | None = None
        if config.path:
            self.producer = ManifestProducer(config)
            index.on_new_chunks = self.producer.observe
        #: counts not yet drained by the edge
        self.counters = ManifestCounters()
        #: called after every import's counts (the edge drains ``counters`` into its metrics)
        self.on_count: Callable[[], None] = _nothing

    # ---------------------------------------------------------------- import

    async def _apply(self, entries: Iterable[ManifestEntry | None], rule: ScopeRule, prefetch: bool) -> ImportResult:
        res, new = await self.importer.apply(entries, rule, prefetch=prefetch)
        if self.producer is not None:
            for salt, added in new:
                self.producer.observe(_Salted(salt), added)
        counts = self.counters.entries
        for outcome, n in res.outcomes.items():
            counts[outcome] = counts.get(outcome, 0) + n
        self.on_count()
        return res

    def tenant_rule(self, tenant: str, shared: bool, may_write_shared: bool) -> ScopeRule:
        """The scope rule of an import by ``tenant`` (module docstring); ``may_write_shared``:
        the tenant holds the operator grant of the shared scope."""
        target = SHARED_SCOPE if shared else tenant

        def rule(e: ManifestEntry) -> str | None:
            if e.scope == SHARED_SCOPE:
                return SHARED_SCOPE if may_write_shared else None
            if e.scope == tenant:
                return target
            return None

        return rule

    def operator_rule(self) -> ScopeRule:
        default = self.config.import_scope

        def rule(e: ManifestEntry) -> str | None:
            return e.scope or default

        return rule

    async def import_lines(self, tenant: str, lines: bytes, *, shared: bool, may_write_shared: bool,
                           prefetch: bool) -> ImportResult:
        """Import manifest ``lines`` as ``tenant`` (into the shared scope with ``shared``, which
        the edge has granted: ``may_write_shared``)."""
        rule = self.tenant_rule(tenant, shared, may_write_shared)
        return await self._apply(read_lines(lines.splitlines()), rule, prefetch)

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
        """The token sequences that warm ``tenant``'s (or, with ``shared``, which the edge has
        granted, the shared scope's) planned chunks of ``identity``, and how many are pending."""
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
