"""In-memory content-hash chunk registry: capacity-bounded LRU with token verification.

Keys are ``ChunkHash`` fingerprints (xxh64 salted with the cache identity and the scope, see
``chunker``). An entry remembers the chunk's tokens (every hit is verified against them: a
64-bit hash is never trusted alone), where it was computed (``source_pos``), the digest of its
whole left context (``prefix_digest``, for exact reuse) and up to ``left_context_tokens`` of
the tokens right before it (for the left-context-window admission guard).

Recency is an ``OrderedDict`` (``move_to_end`` on hit or refresh, ``popitem(last=False)`` to
evict): O(1), no allocation on the hit path. Capacity is bounded in entries and in bytes; the
byte count is what an entry holds in memory (token bytes + left context + a fixed overhead).

Copies of one chunk (docs/architecture.md, "Copies of one chunk"): an entry with ``base_key``
is another stored copy of that chunk, computed after another left context, under its own key.
The registry keeps each chunk's other copies in recency order and bounds them
(``copies_per_chunk``, more for short chunks: ``copy_tokens_per_chunk``): past the bound the least recently used other copy is evicted (reason
``copies``); the canonical copy is never evicted for it.

Resident claims: keys in ``protected`` (maintained by ``sidecar.claims``) are skipped by LRU
eviction (a skipped entry moves to the most-recent end, so each eviction stays O(1) amortized);
when only protected entries are left the registry stays over capacity rather than break a claim.

Planner mirror: with ``compiled_lookup`` (the default) every mutation a Lookup can see (new
and deleted entries, state, canonical position, links, tokens a recovered entry adopts) is also
recorded in an ``entry_table.EntryTable``, the flat arrays the compiled planner reads. Registered
entries must therefore change only through this class (``update``, ``set_state``, ``link``,
``matches``): a field assigned elsewhere is invisible to the compiled planner.

Thread-safety: the registry is owned by the server's event loop; callers serialise access.
Events (evictions) are a buffer the caller drains with ``take_events``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.registry.entry import ChunkEntry, ChunkHash, EntryState
from sidecar.registry.entry_table import EntryTable
from sidecar.registry.seeds import interval_bits


@dataclass(frozen=True, kw_only=True)
class RegistryConfig:
    """``scope_share``: the fraction of ``capacity_entries`` one scope (tenant) may hold once
    the registry is full. A scope over its share that inserts evicts its OWN least recently
    used entries, never another tenant's; below its share the global LRU order applies. With
    one tenant the victims are the same as plain LRU's; 1.0 turns the rule off."""

    capacity_entries: int = 1_000_000
    capacity_bytes: int = 1 << 30
    left_context_tokens: int = 128
    scope_share: float = 0.5
    #: Lookup: a hit segment (adjacent chunk hits continuing one stored sequence at one delta,
    #: plus their extensions) shorter than this many tokens is folded into the neighbouring
    #: prefill. 0 keeps every hit.
    min_hit_tokens: int = 16
    #: Lookup: extend every hit segment token by token into the stored chunks next to it (same
    #: stored sequence, same delta), so a hit reaches the true edges of the reused text.
    extend_hits: bool = True
    #: Lookup: one seed window per this many stored tokens on average (a power of two; 0 turns
    #: seeds off): entry points finer than a chunk, so text moved without a chunk cut of its own
    #: is still found and extended (``seeds``). Needs ``compiled_lookup`` (the seed map lives in
    #: the mirror); 1-2 bytes a stored token at 32.
    seed_interval: int = 32
    #: Lookup: a hit segment found through a seed that is shorter than this is folded into the
    #: prefill (``min_hit_tokens`` applies to chunk hits): seeds are for moved documents, not
    #: for the short phrases that recur everywhere.
    seed_min_tokens: int = 64
    #: Lookup: plan in one compiled call over a flat mirror of the registry (``entry_table``,
    #: ``lookup_kernel``; ~4 bytes a token and ~130 bytes a chunk more memory, outside
    #: ``capacity_bytes``). False: the Python planner only, no mirror. Plans are identical.
    compiled_lookup: bool = True
    #: Stored copies of one chunk computed after different left contexts (the same text at
    #: several positions of one history, or after another header): the first stored copy
    #: (canonical: every rotated hit is served from it) and up to ``copies_per_chunk - 1`` more,
    #: each under its own key (``entry.variant_key``) with its own payload, so that a Lookup
    #: plans EXACT wherever an exact copy is held. Past the bound the least recently used other
    #: copy (stored or served longest ago) goes, payload included; the canonical copy and
    #: claimed copies stay. 1: the first stored copy only.
    copies_per_chunk: int = 4
    #: ... and a short chunk keeps more other copies while they hold at most this many tokens
    #: together: the pieces a chat template repeats in every message (a 3-token turn opener)
    #: recur at as many positions as a history has messages, and each is needed for the exact
    #: prefix; a 128-token chunk keeps max(copies_per_chunk - 1, 512 // 128) = 4 other copies, a
    #: 3-token one 170. 0: ``copies_per_chunk`` alone.
    copy_tokens_per_chunk: int = 512

    def __post_init__(self) -> None:
        if self.capacity_entries <= 0:
            raise ValueError("registry.capacity_entries must be positive")
        if not 0.0 < self.scope_share <= 1.0:
            raise ValueError(f"registry.scope_share: {self.scope_share} is not in (0, 1]")
        if self.capacity_bytes <= 0:
            raise ValueError("registry.capacity_bytes must be positive")
        if self.left_context_tokens < 0:
            raise ValueError("registry.left_context_tokens must be >= 0")
        if self.min_hit_tokens < 0:
            raise ValueError("registry.min_hit_tokens must be >= 0")
        interval_bits(self.seed_interval)  # raises on a bad value
        if self.seed_min_tokens < 0:
            raise ValueError("registry.seed_min_tokens must be >= 0")
        if not 1 <= self.copies_per_chunk <= 64:
            raise ValueError(f"registry.copies_per_chunk must be in [1, 64], got {self.copies_per_chunk}")
        if not 0 <= self.copy_tokens_per_chunk <= 1 << 20:
            raise ValueError(f"registry.copy_tokens_per_chunk must be in [0, 1048576], got {self.copy_tokens_per_chunk}")

    def max_copies(self, num_tokens: int) -> int:
        """How many other copies (besides its canonical one) a chunk of ``num_tokens`` keeps."""
        if self.copies_per_chunk <= 1:
            return 0
        return max(self.copies_per_chunk - 1, self.copy_tokens_per_chunk // max(num_tokens, 1))


@dataclass(frozen=True, slots=True)
class RegistryEvent:
    kind: str  # "evicted"
    key: ChunkHash
    scope: str
    reason: str  # "capacity_entries" | "capacity_bytes" | "scope_share" | "copies" | "deleted"


@dataclass(slots=True)
class RegistryStats:
    entries: int = 0
    bytes: int = 0
    evictions: int = 0
    hits: int = 0
    verify_failures: int = 0
    inserts: int = 0


class InMemoryRegistry:
    """Capacity-bounded LRU map ``ChunkHash -> ChunkEntry``."""

    def __init__(self, config: RegistryConfig) -> None:
        self.config = config
        # Hand-written LRU on purpose: it bounds two capacities at once (entries and
        # bytes) plus a per-scope share, skips protected (claimed) entries and reports each
        # eviction's reason; functools.lru_cache / cachetools bound one quantity and evict blindly.
        self._entries: OrderedDict[int, ChunkEntry] = OrderedDict()
        self._bytes = 0
        self._events: list[RegistryEvent] = []
        self._scope_entries: dict[str, int] = {}
        #: each scope's keys in recency order (evictions of a scope over its share)
        self._scope_lru: dict[str, OrderedDict[int, None]] = {}
        #: a chunk's other copies (``ChunkEntry.base_key``) by its key, in recency order
        self._copies: dict[int, OrderedDict[int, None]] = {}
        self.stats = RegistryStats()
        #: Keys LRU eviction must skip (claimed chunks); owned by the claims ledger.
        self.protected: set[int] = set()
        #: Told ``(entry, state before, tier before, removed)`` after every change of a registered
        #: entry's state, tier, canonical copy or successor digest (``next_digest``), its insertion
        #: and its removal (residency for routing, ``sidecar.routing.residency``); runs on the
        #: registry's thread, must only queue.
        self.observer: Callable[[ChunkEntry, EntryState | None, str | None, bool], None] | None = None
        #: The compiled planner's mirror of the entries (None without ``compiled_lookup``).
        self.table: EntryTable | None = (
            EntryTable(min(config.capacity_entries, 1024), interval_bits(config.seed_interval))
            if config.compiled_lookup else None
        )

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    @property
    def nbytes(self) -> int:
        return self._bytes

    def seed_windows(self) -> int:
        """Seed windows in the mirror's seed map (0 without the mirror), as of its last sync.
        Safe from any thread (a metrics scrape): it reads one counter and applies nothing."""
        return 0 if self.table is None else int(self.table.ctr[5])

    def scope_entries(self, scope: str) -> int:
        """Number of entries stored under ``scope`` (lets Lookup skip searching empty scopes)."""
        return self._scope_entries.get(scope, 0)

    def _count(self, scope: str, d: int) -> None:
        n = self._scope_entries.get(scope, 0) + d
        if n:
            self._scope_entries[scope] = n
        else:
            self._scope_entries.pop(scope, None)

    def peek(self, key: int) -> ChunkEntry | None:
        """Entry for ``key`` without touching recency or hit counts."""
        return self._entries.get(key)

    def get_many(self, keys: list[int]) -> list[ChunkEntry | None]:
        """Entries for ``keys`` (None where absent); no recency change. One C-level map."""
        return list(map(self._entries.get, keys))

    def verify(self, entry: ChunkEntry, tokens: bytes | memoryview) -> bool:
        """True when ``tokens`` equal the entry's stored tokens; counts mismatches."""
        if self.matches(entry, tokens):
            return True
        self.stats.verify_failures += 1
        return False

    def matches(self, entry: ChunkEntry, tokens: bytes | memoryview) -> bool:
        """``entry.matches(tokens)``: a recovered entry verified by its digest adopts the tokens,
        and a registered one then shows them to the compiled planner too. Counts nothing."""
        had = bool(entry.tokens)
        if not entry.matches(tokens):
            return False
        if not had and self.table is not None and self._entries.get(entry.key) is entry:
            self.table.set_tokens(entry)
        return True

    def entries(self) -> list[ChunkEntry]:
        """All entries, least recently used first."""
        return list(self._entries.values())

    def copies(self, key: int) -> list[int]:
        """The registered copies of the chunk ``key`` is a copy of (``key`` its canonical copy's
        key or another copy's): the canonical copy first (when registered), then the others,
        least recently used first; [] when ``key`` is not registered."""
        e = self._entries.get(key)
        if e is None:
            return []
        base = e.base_key or key
        out = [base] if base in self._entries else []
        return out + list(self._copies.get(base, ()))

    def copy_at(self, key: int, source_pos: int) -> int:
        """The key of a registered copy of chunk ``key`` (its canonical key) computed at
        ``source_pos``: one of its other copies when one sits there, else ``key``."""
        for k in self._copies.get(key, ()):
            if self._entries[k].source_pos == source_pos:
                return k
        return key

    def set_state(self, entry: ChunkEntry, state: EntryState, tier: str | None) -> None:
        """Record where an entry's KV lives (``tier``; None with OBSERVED: nowhere). State and
        tier do not change the entry's byte count."""
        was_state, was_tier = entry.state, entry.tier
        entry.state = state
        entry.tier = tier
        if self._entries.get(entry.key) is entry:
            if self.table is not None:
                self.table.put(entry, state is EntryState.RESIDENT)
            if self.observer is not None and (was_state is not state or was_tier != tier):
                self.observer(entry, was_state, was_tier, False)

    def update(
        self,
        entry: ChunkEntry,
        *,
        source_pos: int,
        prefix_digest: int,
        left_context: bytes | None = None,
        digest: bytes | None = None,
        links: tuple[int, int, int] | None = None,
    ) -> None:
        """Move an entry's canonical copy: where it was computed (``source_pos``,
        ``prefix_digest``), the tokens before it (``left_context``; None keeps them) and the
        second digest (None keeps it). The registry's byte count follows the entry's, if the
        entry is registered; growth is bounded by ``left_context_tokens`` and capacity is
        enforced on the next insert. Registered entries change only through this and
        ``set_state``: an assignment elsewhere lets ``nbytes`` drift from the entries' sum.
        ``links``: the new canonical copy's ``(prev_key, next_key, next_digest)``; None keeps
        them when the copy stays where it was and forgets them when it moves."""
        registered = self._entries.get(entry.key) is entry
        before = entry.nbytes
        if links is not None:
            entry.prev_key, entry.next_key, entry.next_digest = links
        elif source_pos != entry.source_pos or prefix_digest != entry.prefix_digest:
            entry.prev_key = entry.next_key = entry.next_digest = 0
        entry.source_pos = source_pos
        entry.prefix_digest = prefix_digest
        if left_context is not None:
            entry.left_context = left_context
        if digest is not None:
            entry.digest = digest
        if registered:
            self._bytes += entry.nbytes - before
            if self.table is not None:
                self.table.put(entry, entry.state is EntryState.RESIDENT)
            if self.observer is not None:
                self.observer(entry, entry.state, entry.tier, False)

    def link(self, chained: list[tuple[ChunkEntry, int]]) -> None:
        """Rebuild neighbour links of registered entries that arrive without them (imported
        from a manifest): ``chained`` holds ``(entry, next_digest)`` pairs; an entry's successor
        is the one whose prefix digest is its ``next_digest`` and whose source position follows
        on, in the same scope. Links an entry already has are kept."""
        by_prefix = {(e.scope, e.prefix_digest): e for e, _ in chained}
        for e, nxt in chained:
            if not nxt or e.next_key or self._entries.get(e.key) is not e:
                continue
            succ = by_prefix.get((e.scope, nxt))
            if succ is not None and succ.source_pos == e.source_pos + e.num_tokens and self._entries.get(succ.key) is succ:
                self._relink(e, e.prev_key, succ.key, nxt)
                if not succ.prev_key:
                    self._relink(succ, e.key, succ.next_key, succ.next_digest)
            else:
                self._relink(e, e.prev_key, e.next_key, nxt)

    def _relink(self, entry: ChunkEntry, prev_key: int, next_key: int, next_digest: int) -> None:
        """Set a registered entry's links; the mirror and the observer see them (residency
        publishes ``next_digest``: peers coalesce this copy with its successor by it, as this
        sidecar does)."""
        digest_changed = entry.next_digest != next_digest
        entry.prev_key, entry.next_key, entry.next_digest = prev_key, next_key, next_digest
        if self.table is not None:
            self.table.put(entry, entry.state is EntryState.RESIDENT)
        if digest_changed and self.observer is not None:
            self.observer(entry, entry.state, entry.tier, False)

    def touch(self, entry: ChunkEntry) -> None:
        """Record a served hit: recency and hit count."""
        entry.hits += 1
        entry.last_seen = time.time()
        self.stats.hits += 1
        self._entries.move_to_end(entry.key)
        self._scope_lru[entry.scope].move_to_end(entry.key)
        if entry.base_key:
            self._copies[entry.base_key].move_to_end(entry.key)

    def touch_many(self, keys: list[int]) -> None:
        """``touch`` each registered entry of ``keys``, in order (a key may repeat: one hit
        each); one timestamp for the batch."""
        now = time.time()
        entries = self._entries
        move = entries.move_to_end
        lrus = self._scope_lru
        copies = self._copies
        for key in keys:
            entry = entries[key]
            entry.hits += 1
            entry.last_seen = now
            move(key)
            lrus[entry.scope].move_to_end(key)
            if entry.base_key:
                copies[entry.base_key].move_to_end(key)
        self.stats.hits += len(keys)

    def insert(self, entry: ChunkEntry) -> bool:
        """Insert ``entry``, or refresh the existing entry with the same key.

        Returns True when a new entry was added. An existing entry keeps its canonical
        ``source_pos`` and context (stored KV is always rotated from its source position) and
        only moves to the most-recent end. An existing entry whose tokens differ (a 64-bit
        collision) is left alone and the insert is refused (counted as a verify failure).
        A copy of another chunk (``base_key``) counts against that chunk's bound
        (``RegistryConfig.max_copies``): past it, the least recently used other copy that is not claimed
        is evicted (reason ``copies``). Evicts least-recently-used entries until both
        capacities hold.
        """
        old = self._entries.get(entry.key)
        if old is not None:
            if not self.matches(old, entry.tokens):
                self.stats.verify_failures += 1
                return False
            old.last_seen = time.time()
            if (not old.next_key and entry.next_key and old.source_pos == entry.source_pos
                    and old.prefix_digest == entry.prefix_digest):
                # the same canonical copy seen with more of its sequence: learn its neighbours
                self._relink(old, entry.prev_key, entry.next_key, entry.next_digest)
            self._entries.move_to_end(entry.key)
            self._scope_lru[old.scope].move_to_end(entry.key)
            if old.base_key:
                self._copies[old.base_key].move_to_end(entry.key)
            elif entry.base_key and entry.base_key != old.key:
                # known here as a record only (records name no chunk of a copy): a copy now
                old.base_key = entry.base_key
                if self.table is not None:
                    self.table.put(old, old.state is EntryState.RESIDENT)
                self._add_copy(old)
            return False
        if entry.nbytes > self.config.capacity_bytes:
            return False
        self._entries[entry.key] = entry
        self._scope_lru.setdefault(entry.scope, OrderedDict())[entry.key] = None
        self._bytes += entry.nbytes
        if self.table is not None:
            self.table.add(entry, entry.state is EntryState.RESIDENT)
        self._count(entry.scope, 1)
        self.stats.inserts += 1
        if self.observer is not None:
            self.observer(entry, None, None, False)
        if entry.base_key:
            self._add_copy(entry)
        self._evict_to_capacity(entry.scope)
        return True

    def _add_copy(self, entry: ChunkEntry) -> None:
        """Count a registered copy against its chunk's bound (``RegistryConfig.max_copies``);
        past it, evict the least recently used other copies that are not claimed (never
        ``entry``)."""
        others = self._copies.setdefault(entry.base_key, OrderedDict())
        others[entry.key] = None
        over = len(others) - self.config.max_copies(entry.num_tokens)
        if over <= 0:
            return
        protected = self.protected
        victims = [k for k in others if k != entry.key and not (protected and k in protected)][:over]
        for key in victims:
            victim = self._entries.pop(key)
            self._unlink(victim)
            self.stats.evictions += 1
            self._events.append(RegistryEvent("evicted", victim.key, victim.scope, "copies"))

    def _unlink(self, entry: ChunkEntry) -> None:
        if self.table is not None:
            self.table.remove(entry.key)
        if entry.base_key:
            others = self._copies[entry.base_key]
            del others[entry.key]
            if not others:
                del self._copies[entry.base_key]
        lru = self._scope_lru[entry.scope]
        del lru[entry.key]
        if not lru:
            del self._scope_lru[entry.scope]
        self._bytes -= entry.nbytes
        self._count(entry.scope, -1)
        if self.observer is not None:
            self.observer(entry, entry.state, entry.tier, True)

    def delete(self, key: int) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._unlink(entry)
        self._events.append(RegistryEvent("evicted", entry.key, entry.scope, "deleted"))
        return True

    def _evict_to_capacity(self, scope: str | None = None) -> None:
        cfg = self.config
        protected = self.protected
        skipped = 0
        share = cfg.scope_share * cfg.capacity_entries
        while len(self._entries) > cfg.capacity_entries or self._bytes > cfg.capacity_bytes:
            reason = "capacity_entries" if len(self._entries) > cfg.capacity_entries else "capacity_bytes"
            own = (self._scope_lru.get(scope) if scope is not None and cfg.scope_share < 1.0
                   and self._scope_entries.get(scope, 0) > share
                   and self._entries[next(iter(self._entries))].scope != scope else None)
            if own:  # over its share, it would evict another tenant's entry: it pays with its own
                key = next((k for k in own if not (protected and k in protected)), None)
                if key is not None:
                    victim = self._entries.pop(key)
                    self._unlink(victim)
                    self.stats.evictions += 1
                    self._events.append(RegistryEvent("evicted", victim.key, victim.scope, "scope_share"))
                    continue
            key, victim = self._entries.popitem(last=False)
            if protected and key in protected:
                self._entries[key] = victim  # back at the most-recent end
                skipped += 1
                if skipped > len(protected):
                    return  # only claimed entries left: over capacity rather than break a claim
                continue
            self._unlink(victim)
            self.stats.evictions += 1
            self._events.append(RegistryEvent("evicted", victim.key, victim.scope, reason))

    def keys_lru(self) -> list[int]:
        """Keys from least to most recently used (for tests and operators)."""
        return list(self._entries.keys())

    def take_events(self) -> list[RegistryEvent]:
        events, self._events = self._events, []
        return events

    def snapshot_stats(self) -> RegistryStats:
        s = self.stats
        return RegistryStats(
            entries=len(self._entries),
            bytes=self._bytes,
            evictions=s.evictions,
            hits=s.hits,
            verify_failures=s.verify_failures,
            inserts=s.inserts,
        )
