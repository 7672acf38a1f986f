"""The manifest consumer: import entries into a sidecar, prefetching what a shared tier holds,
and the warm-up plan for the rest.

::

    entries (parsed lines) ──merge by key──> scope rule (the caller's, see ``ScopeRule``)
       refused ──> counted, never registered            (another tenant's private chunk, ...)
       already RESIDENT here ──> present
       KV in the remote tier ──> get_many(promote) into the local tiers; registry entry
                                 from the stored metadata (source position, prefix digest,
                                 left context), tokens verified by the stored digest ──> RESIDENT
                                 (adopted by the data plane: ``DataPlane.adopt_resident``)
       otherwise ──> warm-up plan: token sequences rebuilt from (source_pos, prefix_digest)
                     chains, each a prefix of an original prompt ending at a planned chunk

An engine client prefills each plan sequence once from position 0 and Stores it
(``SidecarClient.warm_up``): the chunks land at their original positions with their original
left context, so a fresh sidecar serves the same EXACT hits a long-running one would. A chunk
whose chain is broken (its predecessor is not in the manifest) is warmed from where the chain
starts: its KV is then served as a shifted hit. Planned chunks leave the plan as soon as the
registry holds them RESIDENT.

Registry and plan are only touched on the event loop; tier reads run in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING

from sidecar.manifests.format import ManifestEntry, chunk_key, merge, next_prefix_digest
from sidecar.registry.entry import ChunkEntry, EntryState, token_digest
from sidecar.tiers import Tier
from sidecar.tiers import chunk_key as store_key

if TYPE_CHECKING:  # the data plane (torch, LMCache) is not imported by reading the config
    from sidecar.dataplane import DataPlane

logger = logging.getLogger(__name__)

#: Tier reads per worker-thread call during prefetch.
PREFETCH_BATCH = 256


class Outcome(str, Enum):
    """What happened to one manifest entry (the ``outcome`` label of the import metric)."""

    PREFETCHED = "prefetched"  # KV read from a shared tier into the local tiers: RESIDENT
    PLANNED = "planned"  # in the warm-up plan
    PRESENT = "present"  # already served here
    MALFORMED = "malformed"  # not a valid line (skipped)
    REFUSED = "refused"  # another tenant's private entry, or shared without permission


#: ``rule(entry) -> target scope`` or None to refuse the entry.
ScopeRule = Callable[[ManifestEntry], "str | None"]


@dataclass(slots=True)
class ImportResult:
    lines: int = 0
    outcomes: Counter = field(default_factory=Counter)

    def add(self, other: "ImportResult") -> None:
        self.lines += other.lines
        self.outcomes.update(other.outcomes)


class _Group:
    """Plan state of one (identity, scope): pending chunks and the chain context."""

    __slots__ = ("pending", "by_next")

    def __init__(self) -> None:
        self.pending: dict[int, ManifestEntry] = {}
        self.by_next: dict[int, ManifestEntry] = {}  # next-chunk prefix digest -> entry


class WarmUpPlan:
    """Chunks to recompute, per (identity salt, scope), and the token sequences that do it."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, str], _Group] = {}

    def context(self, e: ManifestEntry) -> None:
        """Remember ``e`` as a possible predecessor in a chain (prefetched or present chunks too)."""
        nxt = next_prefix_digest(e)
        if nxt is not None:
            self._groups.setdefault((e.identity, e.scope), _Group()).by_next.setdefault(nxt, e)

    def add(self, e: ManifestEntry) -> None:
        self.context(e)
        self._groups.setdefault((e.identity, e.scope), _Group()).pending[e.content_hash] = e

    def pending(self, salt: int, scope: str) -> int:
        g = self._groups.get((salt, scope))
        return len(g.pending) if g is not None else 0

    def pending_in_scope(self, scope: str) -> int:
        return sum(len(g.pending) for (_, s), g in self._groups.items() if s == scope)

    def sequences(self, salt: int, scope: str, is_resident: Callable[[int], bool], max_tokens: int,
                  max_sequences: int = 0) -> list[bytes]:
        """Packed LE uint32 sequences covering every still-pending chunk of the group, longest
        chains first (each covers its ancestors). Chunks now RESIDENT are dropped from the plan."""
        g = self._groups.get((salt, scope))
        if g is None:
            return []
        for k in [k for k in g.pending if is_resident(k)]:
            del g.pending[k]
        order = sorted(g.pending.values(), key=lambda e: -((e.source_pos or 0) + e.num_tokens))
        covered: set[int] = set()
        out: list[bytes] = []
        for e in order:
            if e.content_hash in covered:
                continue
            chain = [e]
            total = e.num_tokens
            cur = e
            while cur.source_pos and cur.prefix_digest is not None:
                prev = g.by_next.get(cur.prefix_digest)
                if prev is None or (prev.source_pos or 0) + prev.num_tokens != cur.source_pos:
                    break
                if total + prev.num_tokens > max_tokens:
                    break
                chain.append(prev)
                total += prev.num_tokens
                cur = prev
            covered.update(c.content_hash for c in chain)
            out.append(b"".join(c.tokens for c in reversed(chain)))
            if max_sequences and len(out) >= max_sequences:
                break
        return out


class ManifestImporter:
    """Applies parsed manifest entries to one sidecar's registry, tiers and warm-up plan."""

    def __init__(self, dataplane: DataPlane, plan: WarmUpPlan) -> None:
        self.dataplane = dataplane
        self.plan = plan

    @property
    def _registry(self):
        return self.dataplane.index.registry

    def is_resident(self, key: int) -> bool:
        e = self._registry.peek(key)
        return e is not None and e.state is EntryState.RESIDENT

    async def apply(
        self, entries: Iterable[ManifestEntry | None], rule: ScopeRule, *, prefetch: bool
    ) -> tuple[ImportResult, list[tuple[int, list[ChunkEntry]]]]:
        """Import ``entries`` (None = a malformed line). Returns the counts and the registry
        entries that are new here, per identity salt (for the manifest producer)."""
        res = ImportResult()
        valid: list[ManifestEntry] = []
        for e in entries:
            res.lines += 1
            if e is None:
                res.outcomes[Outcome.MALFORMED] += 1
            else:
                valid.append(e)
        todo: list[ManifestEntry] = []
        for e in merge(valid):
            target = rule(e)
            if target is None:
                res.outcomes[Outcome.REFUSED] += 1
                continue
            if target != e.scope:
                e = replace(e, scope=target, content_hash=chunk_key(e.identity, target, e.tokens))
            old = self._registry.peek(e.content_hash)
            if old is not None and old.state is EntryState.RESIDENT and self._registry.matches(old, e.tokens):
                res.outcomes[Outcome.PRESENT] += 1
                self.plan.context(e)
                continue
            todo.append(e)
        new: dict[int, list[ChunkEntry]] = {}
        store = self.dataplane.store
        chained: list[tuple[ChunkEntry, int]] = []  # neighbour links, rebuilt from the digests
        if prefetch and todo and Tier.REMOTE in store.tiers:
            for i in range(0, len(todo), PREFETCH_BATCH):
                batch = todo[i : i + PREFETCH_BATCH]
                got = await asyncio.to_thread(store.get_many, [store_key(e.content_hash) for e in batch], promote=True)
                for e, fetched in zip(batch, got):
                    entry = self._resident_entry(e, fetched)
                    if entry is None:
                        self.plan.add(e)
                        res.outcomes[Outcome.PLANNED] += 1
                        continue
                    self.plan.context(e)
                    res.outcomes[Outcome.PREFETCHED] += 1
                    if self.dataplane.adopt_resident(entry):  # the data plane writes RESIDENT
                        new.setdefault(e.identity, []).append(entry)
                    live = self._registry.peek(entry.key)
                    if live is not None:
                        chained.append((live, next_prefix_digest(e) or 0))
            self._registry.link(chained)
            await self.dataplane.synced()
        else:
            for e in todo:
                self.plan.add(e)
                res.outcomes[Outcome.PLANNED] += 1
        return res, list(new.items())

    def _resident_entry(self, e: ManifestEntry, fetched) -> ChunkEntry | None:
        """A RESIDENT registry entry for a chunk read from the tiers, or None when the stored
        copy does not belong to ``e`` (scope, size, or token digest differ)."""
        if fetched is None:
            return None
        meta = fetched.meta
        from sidecar.dataplane.records import decode_aux

        entry = decode_aux(meta)
        if entry is None or meta.scope != e.scope or meta.num_tokens != e.num_tokens:
            return None
        if entry.digest != token_digest(e.tokens):
            return None
        entry.tokens = e.tokens
        tier = self.dataplane.store.locate(meta.key)
        entry.tier = tier.value if tier is not None else fetched.tier.value
        entry.hits = max(0, e.count - 1)
        entry.first_seen = e.first_seen or entry.first_seen
        return entry
