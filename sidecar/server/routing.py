"""The routing RPCs: ``Score`` (KVSidecar) and llm-d's ``indexer.v1.IndexerService/GetPodScores``.

Thin handlers over ``sidecar.routing.Fleet``: the prompt is validated exactly as a Lookup's
(``KVHandlers.lookup_query``: tokens, identity, policy, guards), the tenant comes from the call's
headers as for every RPC, and a score changes nothing (no recency, no counters of Lookup).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc

from sidecar.api.routing import (
    GetPodScoresRequest,
    ScoreRequest,
    candidates_from_wire,
    pod_scores_to_wire,
    score_result_to_wire,
)
from sidecar.config import SidecarConfig
from sidecar.errors import InvalidArgument
from sidecar.identity import CacheIdentity
from sidecar.registry.chunk_index import LookupQuery
from sidecar.routing.fleet import Fleet
from sidecar.routing.models import ModelCatalog
from sidecar.server.edge import Edge, rpc
from sidecar.server.kv import KVHandlers

#: how long GetPodScores reuses the identity it found for a model (seconds)
_IDENTITY_TTL_S = 5.0
#: llm-d's score unit when the identity names no block size (its default block size)
_LLMD_BLOCK = 16


class RoutingHandlers:
    """Score and GetPodScores. ``models``: the tokenizers of ``routing.models``."""

    def __init__(self, edge: Edge, config: SidecarConfig, kv: KVHandlers, fleet: Fleet, models: ModelCatalog) -> None:
        self.edge = edge
        self.config = config
        self.kv = kv
        self.fleet = fleet
        self.models = models
        self.metrics = edge.metrics
        self._identities: dict[str, tuple[CacheIdentity, float]] = {}

    async def _candidates(self, values, field: str) -> list[str]:
        limit = self.config.routing.max_candidates
        cands = candidates_from_wire(values, limit, field)
        if not cands:
            cands = (await self.fleet.live_replicas())[:limit]
        return cands

    @rpc
    async def Score(self, request: ScoreRequest, context: grpc.aio.ServicerContext):
        t0 = time.perf_counter()
        tenant = self.edge.tenancy.resolve(context)
        if not request.HasField("lookup"):
            raise InvalidArgument("lookup: required (the prompt, its identity and guards, as a Lookup sends them)")
        query = self.kv.lookup_query(request.lookup, tenant)
        query = dataclasses.replace(query, engine_prefix_len=0, dry_run=True)
        cands = await self._candidates(request.candidates, "candidates")
        res = await self.fleet.score_any_cut(query, cands, self.kv.dataplane.cuts.others(query.identity))
        self.metrics.score_seconds.observe(time.perf_counter() - t0)
        return score_result_to_wire(res)

    @rpc
    async def GetPodScores(self, request: GetPodScoresRequest, context: grpc.aio.ServicerContext):
        t0 = time.perf_counter()
        tenant = self.edge.tenancy.resolve(context)
        cfg = self.config
        name = request.model_name
        self.models.config(name)  # NOT_FOUND naming model_name before any work
        pods = candidates_from_wire(request.pod_identifiers, cfg.routing.max_candidates, "pod_identifiers")
        tokens = await asyncio.to_thread(self.models.tokenize, name, request.prompt, cfg.max_prompt_tokens)
        self.edge.limits.check_tokens(tenant, len(tokens))
        if not pods:
            pods = (await self.fleet.live_replicas())[: cfg.routing.max_candidates]
        identity, beats = await self._identity(name, pods)
        if identity is None:  # no engine of this model stored anything yet: nothing cached anywhere
            if beats is None:
                beats = await self.fleet.beats([p for p in pods if p != self.fleet.replica])
            live = [p for p in pods if p == self.fleet.replica or p in beats]
            return pod_scores_to_wire([(p, 0.0) for p in live])
        query = LookupQuery(
            tokens=tokens, data=tokens.tobytes(), identity=identity, scope=tenant, policy=cfg.default_policy,
            left_context_window=cfg.default_left_context_window, recompute_tokens=cfg.default_recompute_tokens,
            repair_scope=cfg.default_repair_scope, dry_run=True,
        )
        res = await self.fleet.score_any_cut(query, pods, self.kv.dataplane.cuts.others(identity))
        block = identity.block_size or _LLMD_BLOCK
        self.metrics.score_seconds.observe(time.perf_counter() - t0)
        return pod_scores_to_wire([(s.replica, s.saved_tokens / block) for s in res.scores])

    async def _identity(self, model_name: str, pods: list[str]) -> tuple[CacheIdentity | None, dict | None]:
        """The identity ``model_name``'s engines store under (this replica's first, then the
        candidates' heartbeats), reused for a few seconds; and the heartbeats of ``pods`` when
        they were read for it (None when not)."""
        now = time.monotonic()
        hit = self._identities.get(model_name)
        if hit is not None and hit[1] > now:
            return hit[0], None
        beats = None
        found = self.models.identity(model_name, self.fleet.own_identities())
        if found is None:
            beats = await self.fleet.beats([p for p in pods if p != self.fleet.replica])
            found = self.models.identity(model_name, (i for b in beats.values() for i in b.identities))
        if found is not None:
            if len(self._identities) > 1024:
                self._identities.clear()
            self._identities[model_name] = (found, now + _IDENTITY_TTL_S)
        return found, beats
