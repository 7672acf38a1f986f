"""The fleet as one sidecar sees it: publish this replica's residency, score candidates.

``Fleet.score(query, candidates)``::

    chunk the prompt (own scope, + shared)              one compiled pass
    one pipelined Redis round trip (read pool, timeout_s):
        records of the chunks not RESIDENT here (all of them, and of their copies computed
            after the prompt's left context, with a shared remote tier)
        HMGET <chunk's residency hash> <peer ids> <peer id>@<the chunk's prefix digest>
                                                        per chunk and scope: each peer's
                                                        canonical copy and its copy computed
                                                        after this very left context
        GET <peer's heartbeat>                          per peer
    absorb the records (as a Lookup's near-cache fill does)
    per live candidate: plan over its view (``score``)

No candidates named: two more round trips first list the replicas that beat (the members set,
then which of them have a heartbeat).
Redis down or slow: peers are reported ``absent`` (never an error); the own replica is scored
from the local registry. Tenancy: every key read is derived from the caller's scope and
``shared`` (the chunk keys are scope-salted), so another tenant's content changes neither a
score nor the work done to compute it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from sidecar.cuts import other_leads
from sidecar.identity import SHARED_SCOPE, CacheIdentity
from sidecar.registry.chunk_index import ChunkIndex, LookupQuery
from sidecar.registry.chunker import variant_keys
from sidecar.registry.entry import EntryState
from sidecar.registry.shared import SharedRegistry
from sidecar.registry.shared_keys import beat_key, members_key, residency_keys
from sidecar.routing.config import RoutingConfig
from sidecar.routing.residency import Beat, Holding, Residency, copy_field, decode_holding
from sidecar.routing.score import Holdings, ReplicaScore, ScoreResult, best_per_replica, own_view, score_of
from sidecar.tiers import Tier


def _live(replicas: Sequence[str], raw: Sequence[bytes | None]) -> dict[str, Beat]:
    """The replicas whose heartbeat ``raw`` (read in their order) is there and readable."""
    out = {}
    for p, v in zip(replicas, raw):
        b = Beat.decode(v)
        if b is not None:
            out[p] = b
    return out


class Fleet:
    """Routing for one sidecar: its ``Residency`` (when it has a replica id and a shared
    registry) and ``score``. ``stats``: score calls, Redis round trips, candidates planned."""

    def __init__(self, config: RoutingConfig, index: ChunkIndex, shared: SharedRegistry | None) -> None:
        self.config = config
        self.index = index
        self.shared = shared
        self.replica = config.replica_id
        self.residency: Residency | None = None
        self.stats = {"scores": 0, "round_trips": 0, "planned": 0, "absent": 0}
        self._copies: dict = {}  # Holdings' re-positioned entries, shared across calls
        if self.replica and shared is not None:
            self.residency = Residency(shared.keys, self.replica, ttl_s=config.heartbeat_ttl_s,
                                       entry_ttl_s=shared.config.entry_ttl_s, shared_tier=shared.shared_tier)
            shared.residency = self.residency
            index.registry.observer = self.residency.changed

    def saw_identity(self, identity: CacheIdentity) -> None:
        if self.residency is not None:
            self.residency.saw_identity(identity)

    def own_identities(self) -> tuple[CacheIdentity, ...]:
        """The identities this replica's engine stored under, newest first."""
        return self.residency.identities() if self.residency is not None else ()

    def republish(self) -> int:
        """Queue this replica's whole residency again, with the records of its chunks (written
        only where missing), loop thread, O(entries): after Redis came back without its data.
        Returns the chunks queued."""
        res = self.residency
        if res is None or self.shared is None:
            return 0
        held = [e for e in self.index.registry.entries() if e.state is EntryState.RESIDENT]
        remote = Tier.REMOTE.value
        self.shared.publish(held, {e.key for e in held if e.tier == remote}, only_missing=True)
        for e in held:
            res.changed(e, None, None, False)
        return len(held)

    # ------------------------------------------------------------------ members

    async def live_replicas(self) -> list[str]:
        """Every replica beating now (one Redis round trip; [] while Redis is down)."""
        shared = self.shared
        if shared is None:
            return [self.replica] if self.replica else []
        keys = shared.keys

        def read(r: Any) -> list[str]:
            members = sorted(m.decode() for m in r.smembers(members_key(keys)))
            pipe = r.pipeline(transaction=False)
            for m in members:
                pipe.exists(beat_key(keys, m))
            return [m for m, alive in zip(members, pipe.execute()) if alive]

        live = await shared.run_read(read)
        out = list(live or ())
        if self.replica and self.replica not in out:
            out.insert(0, self.replica)
        return out

    async def beats(self, replicas: Sequence[str]) -> dict[str, Beat]:
        """The live beats of ``replicas`` (one round trip)."""
        shared = self.shared
        if shared is None or not replicas:
            return {}
        keys = shared.keys
        raw = await shared.run_read(lambda r: r.mget([beat_key(keys, p) for p in replicas]) if not shared.config.cluster
                                    else [r.get(beat_key(keys, p)) for p in replicas])
        return _live(replicas, raw or ())

    # ------------------------------------------------------------------ Score

    async def score_any_cut(self, q: LookupQuery, candidates: Sequence[str],
                            known: Iterable[CacheIdentity] = ()) -> ScoreResult:
        """``score`` under ``q``'s identity and under each other tensor-parallel size of its
        model that this replica's engines, a live candidate's (their heartbeats) or ``known``
        stored under (``sidecar.cuts``): per replica the best, so a chunk counts as held for
        every cut it can serve (re-sharding)."""
        res, beats = await self._score(q, candidates)
        leads = other_leads(q.identity, [*self.own_identities(), *known,
                                         *(i for b in beats.values() for i in b.identities)])
        if not leads:
            return res
        more = [(await self._score(replace(q, identity=lead), candidates))[0] for lead in leads]
        return best_per_replica([res, *more])

    async def score(self, q: LookupQuery, candidates: Sequence[str]) -> ScoreResult:
        """Per live candidate (in ``candidates``' order) what it could serve of ``q``."""
        return (await self._score(q, candidates))[0]

    async def _score(self, q: LookupQuery, candidates: Sequence[str]) -> tuple[ScoreResult, dict[str, Beat]]:
        """``score``, and the live candidates' beats it read on the way."""
        self.stats["scores"] += 1
        index = self.index
        reg = index.registry
        shared = self.shared
        peers = [c for c in candidates if c != self.replica]
        scopes: tuple[str, ...] = (q.scope,)
        if q.scope != SHARED_SCOPE and (reg.scope_entries(SHARED_SCOPE) > 0 or (shared is not None and shared.shared_nonempty)):
            scopes = (q.scope, SHARED_SCOPE)
        chunks = index.chunk(q.tokens, q.identity, scopes)
        held: dict[str, dict[int, Holding]] = {p: {} for p in peers}
        alive: dict[str, Beat] = {}
        remote: set[int] = set()
        base_of: dict[int, int] = {}
        if peers and shared is not None:
            got = await self._read(chunks, scopes, peers)
            if got is not None:
                alive, held, remote, base_of = got
        scores: list[ReplicaScore] = []
        absent: list[str] = []
        n = len(q.tokens)
        if len(self._copies) > 1 << 16:
            self._copies.clear()
        for c in candidates:
            if c == self.replica:
                view, tier_of = own_view(reg.peek)
            elif c in alive:
                beat = alive[c]
                same_tier = bool(shared.shared_tier) and beat.shared_tier == shared.shared_tier
                h = Holdings(reg.peek, held[c], remote if same_tier else frozenset(), self._copies, base_of)
                if not h:
                    scores.append(ReplicaScore(replica=c, prefill_tokens=n))
                    continue
                view, tier_of = h, h.tier
            else:
                absent.append(c)
                continue
            # chunk hits only, the same estimate for every candidate (``sidecar.routing.score``)
            plan = index.lookup_reference(q, chunks, view=view, seeds=False, extend=False)
            self.stats["planned"] += 1
            scores.append(score_of(plan, c, tier_of))
        self.stats["absent"] += len(absent)
        return ScoreResult(total_tokens=n, scores=scores, absent=absent), alive

    async def _read(self, chunks: Any, scopes: tuple[str, ...], peers: list[str]
                    ) -> tuple[dict[str, Beat], dict[str, dict[int, Holding]], set[int], dict[int, int]] | None:
        """The one pipelined round trip, then the records absorbed (loop thread). Returns the
        live beats, each peer's holdings (by the key of the copy: the chunk key, or the key of
        its copy computed after the prompt's left context), the keys servable from the shared
        remote tier, and each such copy key's chunk key."""
        shared = self.shared
        assert shared is not None
        reg = self.index.registry
        space = shared.keys
        everything = bool(shared.shared_tier)  # which chunks a remote copy serves: every record
        resident = EntryState.RESIDENT
        rec_keys: list[bytes] = []
        rec_chunk: list[int] = []
        rec_scope: list[str] = []
        res_keys: list[bytes] = []
        res_chunk: list[int] = []
        res_copy: list[int] = []
        res_fields: list[list[bytes]] = []
        fields = [p.encode() for p in peers]
        prefix = chunks.prefix_digests.tolist()
        vks = variant_keys(chunks)
        base_of: dict[int, int] = {}
        for row, scope in enumerate(scopes):
            fps = chunks.fingerprints[row].tolist()
            vs = vks[row].tolist()
            res_keys += residency_keys(space, scope, fps)
            res_chunk += fps
            res_copy += vs
            res_fields += [fields + [copy_field(f, p) for f in fields] for p in prefix]
            base_of.update(zip(vs, fps))
            if everything:
                need = fps + vs
            else:
                need = [k for k, e in zip(fps, reg.get_many(fps)) if e is None or e.state is not resident]
            if need:
                rec_keys += space.chunk_keys(scope, need)
                rec_chunk += need
                rec_scope += [scope] * len(need)
        beats = [beat_key(space, p) for p in peers]
        cluster = shared.config.cluster

        def read(r: Any) -> list[Any]:
            pipe = r.pipeline(transaction=False)
            if cluster:  # one GET per key: redis-py routes a cluster pipeline's commands per slot
                for k in rec_keys:
                    pipe.get(k)
            elif rec_keys:
                pipe.mget(rec_keys)
            for k, f in zip(res_keys, res_fields):
                pipe.hmget(k, f)
            for k in beats:
                pipe.get(k)
            return pipe.execute()

        out = await shared.run_read(read)
        if out is None:
            return None
        self.stats["round_trips"] += 1
        if cluster:
            records, rest = out[: len(rec_keys)], out[len(rec_keys):]
        elif rec_keys:
            records, rest = out[0], out[1:]
        else:
            records, rest = [], out
        hm, bt = rest[: len(res_keys)], rest[len(res_keys):]
        remote = shared.absorb(reg, rec_chunk, rec_scope, records) if rec_keys else set()
        alive = _live(peers, bt)
        held: dict[str, dict[int, Holding]] = {p: {} for p in peers}
        incs = [(i, p, alive[p].incarnation) for i, p in enumerate(peers) if p in alive]
        n = len(peers)
        for key, vkey, values in zip(res_chunk, res_copy, hm):
            for i, p, inc in incs:
                for k, v in ((key, values[i]), (vkey, values[n + i])):
                    if v is not None:
                        h = decode_holding(v, inc)
                        if h is not None:
                            held[p][k] = h
        return alive, held, remote, base_of
