"""The chunk index: chunker + registry behind Lookup and Store (no gRPC here).

Lookup (docs/architecture.md, "The reuse path")::

    tokens ──CDC──> chunks c0..cm  (bounds, per-scope keys, prefix digests: one compiled pass)
    skip chunks wholly inside the engine's own prefix
    for each remaining chunk (per chunk, never per token):
        copy  = the chunk's copy computed after this very left context, own scope or shared
                (``variant_key(chunk key, prefix digest)``): verified and at this position it
                is an EXACT hit, preferred (docs/architecture.md, "Copies of one chunk")
        entry = else own-scope key or shared-scope key  (one C-level map per scope)
        verify stored tokens == prompt tokens            (a 64-bit hash is never trusted alone)
        exact   = same source position and same whole left context (prefix digest)
        admit by policy: exact | position_independent (+ window W)
        group with the previous hit when it continues the same stored sequence (same delta)
    shape (``shaping.shape_runs``): coalesce groups into hit segments, extend each segment
        token by token into its stored neighbours, repair k tokens at every stored chunk's
        start (or once per segment start: ``repair_scope``), carve-out, fold segments shorter than registry.min_hit_tokens into the prefill
    seeds (``seeds``, ``shaping.seed_pieces``): where no run reached, 16-token seed windows
        found in the mirror's seed map enter stored chunks mid-way; shaped the same way
        (folded below registry.seed_min_tokens)
    emit ENGINE_PREFIX | CHUNK_HIT (one row per chunk piece) | PREFILL segments tiling [0, n)

Two planners produce the same plan: ``lookup_reference`` (the steps above in Python, per
chunk; the specification) and, when the registry keeps its mirror (``compiled_lookup``, the
default), ``lookup_kernel.plan``: chunking, fingerprints and every step above in ONE compiled call
over the mirror's arrays (chunks the shared registry's near-cache ``fill`` computed are taken
as they are), then one batch ``touch``. ``lookup`` uses the reference for what the
kernel does not do (the left-context-window guard) or cannot decide (an admitted entry recovered
after a restart whose tokens are not known yet: the reference verifies it by its digest and it
adopts the tokens, so the next Lookup is compiled again).

A chunk registered by Store is visible to the very next Lookup: registration is synchronous
on the event loop that also serves lookups.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from sidecar.identity import SHARED_SCOPE, CacheIdentity
from sidecar.registry import lookup_kernel
from sidecar.registry.chunker import ChunkerConfig, Chunks, chunk_tokens, variant_keys
from sidecar.registry.entry import ChunkEntry, ChunkHash, EntryState
from sidecar.registry.entry_table import U_KEY, EntryTable
from sidecar.registry.lookup_plan import (
    AdmissionPolicy,
    Fidelity,
    LookupPlan,
    LookupSummary,
    RepairScope,
    SegmentKind,
)
from sidecar.registry.registry import InMemoryRegistry
from sidecar.registry.seeds import SEED_TOKENS, chunk_key, seed_key, unpack
from sidecar.registry.shaping import seed_pieces, shape_runs

_HIT = int(SegmentKind.CHUNK_HIT)
_PREFILL = int(SegmentKind.PREFILL)
_PREFIX = int(SegmentKind.ENGINE_PREFIX)
_EXACT = int(Fidelity.EXACT)
_APPROX = int(Fidelity.APPROXIMATE)
#: identities x scopes whose seed arrays a ChunkIndex keeps
_SEED_CACHE = 1024


class SharedIndex(Protocol):
    """The registry shared across sidecars (``sidecar.registry.shared.SharedRegistry``), of
    which this index's registry is the near cache."""

    async def fill(self, index: ChunkIndex, q: LookupQuery) -> Chunks:
        """Chunk ``q`` once for its scopes and bring the chunks missing here in (one round trip
        at most; never raises for its transport): the chunks for ``index.lookup(q, chunks)``."""

    def publish(self, entries: Iterable[ChunkEntry | None], shared_copies: Collection[int] = ()) -> None:
        """Make ``entries`` (just registered; None where already evicted) known to peers;
        ``shared_copies``: keys whose bytes the shared remote tier holds. Must not block."""

    def unpublish(self, entries: Iterable[tuple[int, str]]) -> None:
        """Withdraw ``(chunk key, scope)`` entries deleted here. Must not block."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LookupQuery:
    """A validated Lookup. ``data`` is the packed LE uint32 view of ``tokens``."""

    tokens: np.ndarray
    data: bytes
    identity: CacheIdentity
    scope: str
    engine_prefix_len: int = 0
    policy: AdmissionPolicy = AdmissionPolicy.POSITION_INDEPENDENT
    left_context_window: int = 0
    recompute_tokens: int = 0
    repair_scope: RepairScope = RepairScope.CHUNK
    dry_run: bool = False


@dataclass(frozen=True, slots=True)
class RegisterResult:
    chunks_total: int
    chunks_registered: int
    chunks_refreshed: int
    keys: tuple[ChunkHash, ...]
    bounds: tuple[int, ...]


class ChunkIndex:
    """Owns the chunker configuration and the registry; plans lookups, registers chunks."""

    def __init__(self, chunker: ChunkerConfig, registry: InMemoryRegistry,
                 shared: SharedIndex | None = None) -> None:
        self.chunker = chunker
        self.registry = registry
        #: The registry shared across sidecars (None: this one alone): a Lookup fills the near
        #: cache from it first (``plan``), every entry registered here is published to it.
        self.shared = shared
        #: Told ``(identity, entries)`` after chunks are registered here for the first time (the
        #: manifest producer). Called on the registering thread: it must only buffer.
        self.on_new_chunks: Callable[[CacheIdentity, list[ChunkEntry]], None] | None = None
        #: Lookups planned by the compiled kernel / by the reference planner (counts).
        self.compiled_lookups = 0
        self.reference_lookups = 0
        #: uint64 seed arrays by (identity salt, scope, with shared); cleared past _SEED_CACHE
        self._seeds: dict[tuple[int, str, bool], np.ndarray] = {}

    def announce(self, identity: CacheIdentity, entries: list[ChunkEntry]) -> None:
        """Report newly registered ``entries`` to ``on_new_chunks`` (if set): canonical copies
        only (a manifest line's key is its tokens' chunk key; another copy's is not)."""
        if self.on_new_chunks is not None:
            entries = [e for e in entries if not e.base_key]
            if entries:
                self.on_new_chunks(identity, entries)

    def chunk(self, tokens: np.ndarray, identity: CacheIdentity, scopes: tuple[str, ...]) -> Chunks:
        seeds = [identity.scope_seed(s) for s in scopes]
        return chunk_tokens(tokens, self.chunker, seeds, identity.salt)

    # ----------------------------------------------------------------------------- lookup

    async def plan(self, q: LookupQuery) -> LookupPlan:
        """Plan ``q`` after filling the near cache from the shared registry (``SharedIndex.fill``:
        the chunks missing here brought in, one round trip at most), or from this registry alone."""
        chunks = await self.shared.fill(self, q) if self.shared is not None else None
        return self.lookup(q, chunks)

    def lookup(self, q: LookupQuery, chunks: Chunks | None = None) -> LookupPlan:
        """Plan ``q``. ``chunks``: ``self.chunk(q.tokens, q.identity, scopes)`` already computed
        for scopes ``(q.scope,)`` or ``(q.scope, "shared")`` (the shared registry's near-cache
        fill does this once for both). Compiled when the registry has its mirror and the kernel
        can decide (module docstring), else ``lookup_reference``: the same plan either way."""
        table = self.registry.table
        if table is not None and not q.left_context_window and q.engine_prefix_len < len(q.tokens):
            plan = self._lookup_compiled(q, chunks, table)
            if plan is not None:
                self.compiled_lookups += 1
                return plan
        self.reference_lookups += 1
        return self.lookup_reference(q, chunks)

    def _key_seeds(self, identity: CacheIdentity, scope: str, search_shared: bool) -> np.ndarray:
        """uint64 ``[n_scopes]``: the key seeds of ``scope`` (and the shared scope) under ``identity``."""
        salt = identity.salt
        seeds = self._seeds.get((salt, scope, search_shared))
        if seeds is None:
            if len(self._seeds) >= _SEED_CACHE:
                self._seeds.clear()
            scopes = (scope, SHARED_SCOPE) if search_shared else (scope,)
            seeds = np.array([identity.scope_seed(s) for s in scopes], dtype=np.uint64)
            self._seeds[(salt, scope, search_shared)] = seeds
        return seeds

    def _lookup_compiled(self, q: LookupQuery, chunks: Chunks | None, table: EntryTable) -> LookupPlan | None:
        """``lookup_kernel.plan`` of ``q``, touches and counts applied; None: the kernel could not
        decide (nothing was changed)."""
        reg = self.registry
        scope = q.scope
        epl = q.engine_prefix_len
        exact_only = q.policy is AdmissionPolicy.EXACT
        cfg = reg.config
        extend = cfg.extend_hits
        if chunks is None:
            search_shared = scope != SHARED_SCOPE and reg.scope_entries(SHARED_SCOPE) > 0
        else:
            search_shared = len(chunks.fingerprints) > 1
        seeds = self._key_seeds(q.identity, scope, search_shared)
        out = lookup_kernel.plan(
            table, q.tokens, scope, SHARED_SCOPE if search_shared else None,
            engine_prefix_len=epl, exact_only=exact_only, recompute_tokens=q.recompute_tokens,
            repair_chunks=q.repair_scope is RepairScope.CHUNK, min_hit_tokens=cfg.min_hit_tokens,
            seed_min_tokens=cfg.seed_min_tokens, extend_left=extend and not exact_only, extend_right=extend,
            serve_observed=q.dry_run,
            chunks=chunks, chunker=self.chunker, seeds=seeds, chain_seed=q.identity.salt,
        )
        status, nrows, nseg, ntouch, _nb, total, hits, exact, shifted, vfail, seeded = out[: lookup_kernel.HEADER].tolist()
        if status != lookup_kernel.PLANNED:
            return None
        r = lookup_kernel.HEADER + 7 * nrows
        t = r + nseg
        b = t + ntouch
        if ntouch:
            reg.touch_many(out[t:b].tolist())
        if vfail:
            reg.stats.verify_failures += vfail
        n = len(q.tokens)
        summary = LookupSummary(total_tokens=n, prefix_tokens=epl, exact_tokens=exact, shifted_tokens=shifted,
                                prefill_tokens=n - epl - exact - shifted, chunks_total=total, chunks_hit=hits)
        return LookupPlan(table=out[lookup_kernel.HEADER : r].reshape(nrows, 7), summary=summary, dry_run=q.dry_run,
                          chunk_bounds=out[b:].astype(np.uint32), hit_segment_tokens=out[r:t].tolist(),
                          seed_tokens=seeded)

    def lookup_reference(self, q: LookupQuery, chunks: Chunks | None = None,
                         view: Callable[[int], ChunkEntry | None] | None = None, *, seeds: bool = True,
                         extend: bool = True) -> LookupPlan:
        """``lookup`` by the reference planner (Python, per chunk): the specification of the
        compiled one, and what plans when the kernel cannot.

        ``view``: plan over the entries ``view(key)`` returns instead of the registry's RESIDENT
        ones (None: not servable there): what one routing candidate holds
        (``sidecar.routing.score``). Nothing is touched then. ``seeds=False``: no seed hits;
        ``extend=False``: hits are not extended into their stored neighbours."""
        n = len(q.tokens)
        epl = q.engine_prefix_len
        reg = self.registry
        if chunks is None:
            search_shared = q.scope != SHARED_SCOPE and reg.scope_entries(SHARED_SCOPE) > 0
            scopes = (q.scope, SHARED_SCOPE) if search_shared else (q.scope,)
            chunks = self.chunk(q.tokens, q.identity, scopes)
        else:
            scopes = (q.scope, SHARED_SCOPE)[: len(chunks.fingerprints)]
        bounds = chunks.bounds
        summary = LookupSummary(total_tokens=n)
        rows: list[int] = []  # flat 7-field records (lookup_plan.SEG_*)
        if epl > 0:
            rows += (_PREFIX, 0, epl, 0, 0, 0, 0)
            summary.prefix_tokens = epl
        if epl >= n:
            return LookupPlan.from_flat(rows, summary=summary, dry_run=q.dry_run)

        # First chunk that ends past the engine's prefix (it may straddle the prefix end).
        c0 = int(np.searchsorted(bounds, epl, side="right")) - 1
        bl = bounds[c0:].tolist()
        scope = q.scope
        get_many = reg.get_many if view is None else (lambda keys: list(map(view, keys)))
        cands = get_many(chunks.fingerprints[0, c0:].tolist())
        # the copy of each chunk computed after this very left context, where one is held
        vkeys = variant_keys(chunks)
        copies = get_many(vkeys[0, c0:].tolist())
        if len(scopes) > 1:
            shared = get_many(chunks.fingerprints[1, c0:].tolist())
            cands = [o if o is not None else s for o, s in zip(cands, shared)]
            shared = get_many(vkeys[1, c0:].tolist())
            copies = [o if o is not None else s for o, s in zip(copies, shared)]
        summary.chunks_total = len(cands)
        # Only candidate hits are visited; the gaps between them become PREFILL rows.
        idx = [j for j, (e, v) in enumerate(zip(cands, copies)) if e is not None or v is not None]
        prefix = chunks.prefix_digests[c0:].tolist() if idx else ()

        data = q.data
        exact_only = q.policy is AdmissionPolicy.EXACT
        window = q.left_context_window
        k = q.recompute_tokens
        serve_observed = q.dry_run or view is not None
        resident = EntryState.RESIDENT
        cfg = reg.config
        extend = cfg.extend_hits and extend
        # Phase 1: admitted chunk hits, one piece per prompt chunk (see ``shaping``), grouped
        # as they go: a chunk that continues the previous hit's stored sequence joins its group.
        groups: list[list[list]] = []
        group: list[list] = []
        last: ChunkEntry | None = None
        last_end = -1
        last_exact = False
        for j in idx:
            a = bl[j]
            b = bl[j + 1]
            piece = data[4 * a : 4 * b]
            entry = copies[j]
            if entry is not None and (
                (entry.scope != scope and entry.scope != SHARED_SCOPE) or (not serve_observed and entry.state is not resident)
                or not (entry.tokens == piece or reg.verify(entry, piece))
                or entry.source_pos != a or entry.prefix_digest != prefix[j]
            ):
                entry = None
            if entry is not None:
                exact = True  # the copy computed after this left context: preferred
            else:
                entry = cands[j]
                if entry is None or (entry.scope != scope and entry.scope != SHARED_SCOPE) or (
                    not serve_observed and entry.state is not resident
                ):
                    continue
                if entry.tokens != piece and not reg.verify(entry, piece):
                    continue
                exact = entry.source_pos == a and entry.prefix_digest == prefix[j]
                if not exact:
                    if exact_only:
                        continue
                    if window and data[4 * max(0, a - window) : 4 * a] != entry.left_context[-4 * window :]:
                        continue
            if (a == last_end and entry.source_pos == last.source_pos + last.num_tokens and entry.scope == last.scope
                    and ((exact and last_exact) or (last.next_digest and entry.prefix_digest == last.next_digest))):
                group.append([a, b, entry, 0, exact, True])
            else:
                seg = a if a > epl else epl
                group = [[seg, b, entry, seg - a, exact, True]]
                groups.append(group)
            last, last_end, last_exact = entry, b, exact
        shaping = dict(
            extend_left_=extend and not exact_only and not window,
            extend_right_=extend,
            serve_observed=serve_observed,
            recompute_tokens=k,
            repair_chunks=q.repair_scope is RepairScope.CHUNK,
            min_hit_tokens=cfg.min_hit_tokens,
        )
        extents: list[tuple[int, int]] = []
        seed_tokens = 0
        peek = reg.peek if view is None else view
        runs = shape_runs(groups, q.tokens, epl, n, peek, extents=extents, **shaping)
        table = reg.table
        if seeds and table is not None and table.seed_bits >= 0 and not exact_only and not window:
            # Seed hits in what the chunk hits' runs did not reach (``seeds``), shaped the same way.
            gaps, lo = [], epl
            for a, b in extents:
                gaps.append((lo, a))
                lo = b
            gaps.append((lo, n))
            find = self._seed_finder(q, scopes, table, view)
            seed_min = min(max(cfg.min_hit_tokens, cfg.seed_min_tokens), n - epl)
            sgroups, edges, limits = seed_pieces(gaps, q.tokens, find, table.seed_bits, seed_min)
            if sgroups:
                shaping["min_hit_tokens"] = seed_min
                seeded = shape_runs(sgroups, q.tokens, epl, n, peek, edges=edges, limits=limits, **shaping)
                seed_tokens = sum(e - s for run in seeded for s, e, *_ in run)
                runs = sorted(runs + seeded, key=lambda run: run[0][0])
        pos = epl
        exact_tokens = shifted_tokens = hits = 0
        seg_tokens: list[int] = []
        touched: list[ChunkEntry] = []
        for run in runs:
            seg_tokens.append(run[-1][1] - run[0][0])
            for s, e, entry, off, exact, is_chunk in run:
                if s > pos:
                    rows += (_PREFILL, pos, s, 0, 0, 0, 0)
                if exact:
                    rows += (_HIT, s, e, entry.key, off, entry.source_pos + off, _EXACT)
                    exact_tokens += e - s
                else:
                    rows += (_HIT, s, e, entry.key, off, entry.source_pos + off, _APPROX)
                    shifted_tokens += e - s
                pos = e
                hits += is_chunk
                if not serve_observed:
                    touched.append(entry)
        if pos < n:
            rows += (_PREFILL, pos, n, 0, 0, 0, 0)
        for entry in touched:
            reg.touch(entry)
        summary.chunks_hit = hits
        summary.exact_tokens = exact_tokens
        summary.shifted_tokens = shifted_tokens
        summary.prefill_tokens = n - epl - exact_tokens - shifted_tokens
        return LookupPlan.from_flat(
            rows, summary=summary, dry_run=q.dry_run, chunk_bounds=bounds[c0:].astype(np.uint32),
            hit_segment_tokens=seg_tokens, seed_tokens=seed_tokens,
        )

    def _seed_finder(self, q: LookupQuery, scopes: tuple[str, ...], table: EntryTable,
                     view: Callable[[int], ChunkEntry | None] | None = None,
                     ) -> Callable[[int, int], tuple[ChunkEntry, int] | None]:
        """``seed_pieces``' ``find`` for ``q``: the entry holding a seed window at prompt
        position ``p`` (mixed hash ``mix``) and the window's row, in the first of ``scopes``
        whose seed map names one that may serve it (``seeds``: scope, state, tokens, a whole
        window in the chunk at a non-negative chunk start, the identity's key)."""
        reg = self.registry
        peek = reg.peek if view is None else view
        any_state = q.dry_run or view is not None
        tokens = q.tokens
        salt = q.identity.salt
        probes = [(table.scope_ids[s], s, q.identity.scope_seed(s)) for s in scopes if s in table.scope_ids]
        w = SEED_TOKENS

        def find(p: int, mix: int) -> tuple[ChunkEntry, int] | None:
            for sid, scope, key_seed in probes:
                value = table.seed(int(seed_key(np.uint64(mix), sid)))
                if value < 0:
                    continue
                slot, row = unpack(value)
                entry = peek(int(table.su[slot, U_KEY]))
                if entry is None or entry.scope != scope or not entry.tokens:
                    continue
                if not any_state and entry.state is not EntryState.RESIDENT:
                    continue
                if row + w > entry.num_tokens or p < row:
                    continue
                stored = np.frombuffer(entry.tokens, dtype="<u4")
                if not np.array_equal(tokens[p : p + w], stored[row : row + w]):
                    continue
                if int(chunk_key(stored, 0, len(stored), np.uint64(key_seed), np.uint64(salt))) != entry.key:
                    continue
                return entry, row
            return None

        return find

    # ----------------------------------------------------------------------------- register

    def entries(
        self,
        tokens: np.ndarray,
        data: bytes,
        identity: CacheIdentity,
        scope: str,
        *,
        register_from: int = 0,
        state: EntryState = EntryState.OBSERVED,
        copies: bool = False,
    ) -> tuple[list[ChunkEntry], int]:
        """Registry entries for every chunk of ``tokens`` starting at or after ``register_from``
        (in order), and the end of the last one. Nothing is registered.

        Keyed by chunk key (a chunk's content, as claims name it), or with ``copies`` (what a
        Store registers) by the copy each occurrence will be (``copy_keys``): the chunk key
        where it is (or becomes) the chunk's canonical copy, else the key of its copy computed
        after this left context (``base_key`` set). Links name the neighbours' keys as the
        entries are keyed."""
        chunks = self.chunk(tokens, identity, (scope,))
        bounds = chunks.bounds.tolist()
        base = chunks.fingerprints[0].tolist()
        prefix = chunks.prefix_digests.tolist()
        keys = self.copy_keys(chunks) if copies else base
        ctx = self.registry.config.left_context_tokens
        last = len(keys) - 1
        out: list[ChunkEntry] = []
        for c, key in enumerate(keys):
            a, b = bounds[c], bounds[c + 1]
            if a < register_from:
                continue
            # The last chunk's successor is unknown (the sequence may go on differently); the
            # prefix digest a successor would have is not.
            out.append(
                ChunkEntry(
                    key=ChunkHash(key),
                    scope=scope,
                    tokens=data[4 * a : 4 * b],
                    source_pos=a,
                    prefix_digest=prefix[c],
                    left_context=data[4 * max(0, a - ctx) : 4 * a] if ctx else b"",
                    state=state,
                    prev_key=keys[c - 1] if c else 0,
                    next_key=keys[c + 1] if c < last else 0,
                    next_digest=prefix[c + 1] if c < last else chunks.end_digest,
                    base_key=base[c] if key != base[c] else 0,
                )
            )
        return out, bounds[-1]

    def copy_keys(self, chunks: Chunks) -> list[int]:
        """The key each chunk of a sequence (chunked for one scope) is registered under.

        A chunk's first stored copy is canonical and keyed by the chunk key. An occurrence
        whose left context differs (another prefix digest) from the canonical copy's is another
        copy, keyed ``variant_key(chunk key, prefix digest)``, when the canonical copy holds
        KV (RESIDENT) or is an earlier occurrence of this same sequence; otherwise (the chunk
        unknown, or known here as metadata only) this occurrence becomes canonical. With
        ``registry.copies_per_chunk`` 1 every chunk is keyed by its chunk key."""
        base = chunks.fingerprints[0].tolist()
        if self.registry.config.copies_per_chunk <= 1:
            return base
        prefix = chunks.prefix_digests.tolist()
        variants = variant_keys(chunks)[0].tolist()
        peek = self.registry.peek
        resident = EntryState.RESIDENT
        canonical: dict[int, int] = {}  # chunk key -> the prefix digest of its canonical copy
        out = []
        for k, p, v in zip(base, prefix, variants):
            at = canonical.get(k)
            if at is None:
                e = peek(k)
                at = canonical[k] = e.prefix_digest if e is not None and e.state is resident else p
            out.append(k if at == p else v)
        return out

    def register(
        self,
        tokens: np.ndarray,
        data: bytes,
        identity: CacheIdentity,
        scope: str,
        *,
        register_from: int = 0,
        state: EntryState = EntryState.OBSERVED,
    ) -> RegisterResult:
        """Register every chunk of ``tokens`` that starts at or after ``register_from``.

        ``tokens`` is the whole sequence from position 0, so chunk boundaries and left-context
        digests are the same ones a later Lookup computes. Idempotent: re-registering a chunk
        refreshes its recency and keeps its canonical source position.
        """
        entries, end = self.entries(tokens, data, identity, scope, register_from=register_from, state=state,
                                    copies=True)
        new = [entry for entry in entries if self.registry.insert(entry)]
        added = len(new)
        self.announce(identity, new)
        if self.shared is not None:
            # RESIDENT entries are published by the data plane, which knows where their bytes are.
            known = map(self.registry.peek, [e.key for e in entries])
            self.shared.publish([e for e in known if e is not None and e.state is not EntryState.RESIDENT])
        starts = [e.source_pos for e in entries]
        bounds = (*starts, end) if starts else ()
        return RegisterResult(len(entries), added, len(entries) - added, tuple(e.key for e in entries), bounds)
