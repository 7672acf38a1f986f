"""The compiled Lookup planner against the reference planner (differential), and the mirror.

Two chunk indexes are fed the same operations (registrations in several scopes and states,
state changes, deletions, evictions, canonical-copy moves, relinks, entries recovered without
tokens, 64-bit collisions, a key of one tenant holding another tenant's entry, chunks repeated
at several positions and so held as several copies, bounded by ``copies_per_chunk``): one plans with
the reference planner only (``lookup_reference``; its mirror serves only the seed map), the
other compiles. Every
Lookup (random policy, k, repair scope, engine prefix, dry run, scope, chunks given or not) must
give the same plan table, summary, chunk bounds and hit segment lengths, and leave both
registries in the same state (recency orders, hit counts, stats, adopted tokens). The mirror is
checked field by field against the registry it mirrors.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sidecar.identity import SHARED_SCOPE, CacheIdentity
from sidecar.registry.chunk_index import ChunkIndex, LookupQuery
from sidecar.registry.chunker import ChunkerConfig
from sidecar.registry.entry import ChunkEntry, EntryState, token_digest
from sidecar.registry.entry_table import (
    I_COPY,
    I_LEN,
    I_NTOK,
    I_POS,
    I_RESIDENT,
    I_SCOPE,
    U_KEY,
    U_NEXT,
    U_NEXT_DIGEST,
    U_PREFIX,
    U_PREV,
    EntryTable,
)
from sidecar.registry.lookup_plan import AdmissionPolicy, RepairScope
from sidecar.registry.registry import InMemoryRegistry, RegistryConfig
from sidecar.registry.seeds import SEED_TOKENS, seed_key, unpack, windows
from tests.conftest import ANCHOR_BASE, ANCHORS

#: small chunks: many chunks, links and extensions per prompt
CHUNKER = ChunkerConfig(mask_bits=3, min_size=4, max_size=48, anchor_tokens=ANCHORS)
IDENT = CacheIdentity(model_id="differential")
SCOPES = ("a", "b", SHARED_SCOPE)


def check_mirror(reg: InMemoryRegistry) -> None:
    """Every registered entry is in the mirror with the fields the planner reads, nothing else is."""
    table = reg.table
    assert len(table) == len(reg)
    for e in reg.entries():
        s = table.slot(e.key)
        assert s >= 0, f"entry {e.key:#x} missing from the mirror"
        su, si = table.su[s].tolist(), table.si[s].tolist()
        assert su[U_KEY] == e.key and si[I_SCOPE] == table.scope_ids[e.scope]
        assert si[I_RESIDENT] == (e.state is EntryState.RESIDENT)
        assert (si[I_POS], si[I_NTOK]) == (e.source_pos, e.num_tokens)
        assert (su[U_PREFIX], su[U_NEXT_DIGEST], su[U_PREV], su[U_NEXT]) == (
            e.prefix_digest, e.next_digest, e.prev_key, e.next_key)
        assert si[I_COPY] == (e.base_key != 0)
        if e.tokens:
            assert table.tokens(s).tobytes() == e.tokens
        else:
            assert si[I_LEN] == -1 and table.tokens(s) is None
    check_seed_map(table)


def check_seed_map(table: EntryTable) -> None:
    """Every seed names a live slot whose tokens hold that window at that row, in that scope."""
    used = np.flatnonzero(table.sd_val >= 0)
    assert len(used) == table.ctr[5] and 2 * len(used) <= len(table.sd_val)
    if table.seed_bits < 0:
        assert not len(used)
    for i in used.tolist():
        slot, row = unpack(int(table.sd_val[i]))
        tokens = table.tokens(slot)
        assert table.si[slot, I_SCOPE] >= 0 and tokens is not None and row + SEED_TOKENS <= len(tokens)
        pos, mix = windows(tokens, row, row + SEED_TOKENS, table.seed_bits)
        assert pos.tolist() == [row]
        assert int(seed_key(mix[0], table.si[slot, I_SCOPE])) == int(table.sd_key[i])


def registry_state(reg: InMemoryRegistry) -> tuple:
    return (
        reg.keys_lru(),
        {s: list(lru) for s, lru in reg._scope_lru.items()},
        [(e.key, e.hits, e.tokens, e.state, e.source_pos, e.prefix_digest, e.prev_key, e.next_key, e.next_digest,
          e.base_key) for e in reg.entries()],
        {k: list(v) for k, v in reg._copies.items()},
        reg.snapshot_stats(),
    )


class Twin:
    """A reference index and a compiled one, always in the same state."""

    def __init__(self, rng: np.random.Generator, **config) -> None:
        self.rng = rng
        self.ref = ChunkIndex(CHUNKER, InMemoryRegistry(RegistryConfig(**config)))
        self.cmp = ChunkIndex(CHUNKER, InMemoryRegistry(RegistryConfig(**config)))
        bits = self.cmp.registry.table.seed_bits
        self.cmp.registry.table = EntryTable(8, bits)  # tiny: long probe chains, regrowth, rehashing
        self.seqs: list[np.ndarray] = []
        #: chunk tokens planned EXACT from a chunk's other copy (not its canonical one)
        self.copy_hits = 0

    def both(self, fn):
        return fn(self.ref), fn(self.cmp)

    # ------------------------------------------------------------------ operations

    def register(self, tokens: np.ndarray, scope: str, state: EntryState, register_from: int = 0) -> None:
        self.seqs.append(tokens)
        self.both(lambda ix: ix.register(tokens, tokens.tobytes(), IDENT, scope, state=state,
                                         register_from=register_from))

    def pick(self) -> int | None:
        keys = self.ref.registry.keys_lru()
        return keys[int(self.rng.integers(len(keys)))] if keys else None

    def mutate(self) -> str:
        """One random registry change applied to both; returns its name."""
        rng = self.rng
        key = self.pick()
        if key is None:
            return "none"
        op = int(rng.integers(8))
        if op == 0:
            state = EntryState.RESIDENT if rng.random() < 0.6 else EntryState.OBSERVED
            self.both(lambda ix: ix.registry.set_state(ix.registry.peek(key), state, "cpu" if state is
                                                       EntryState.RESIDENT else None))
            return "set_state"
        if op == 1:
            self.both(lambda ix: ix.registry.delete(key))
            return "delete"
        if op == 2:  # the canonical copy moves (links forgotten, or new ones)
            other = self.pick()
            links = None if rng.random() < 0.5 else (other, self.pick(), int(rng.integers(1, 2**63)))
            pos = int(rng.integers(0, 400))
            digest = int(rng.integers(0, 2**63))
            self.both(lambda ix: ix.registry.update(ix.registry.peek(key), source_pos=pos, prefix_digest=digest,
                                                    links=links))
            return "update"
        if op == 3:  # recovered after a restart: tokens unknown, verified by the digest
            def recover(ix):
                e = ix.registry.peek(key)
                ix.registry.delete(key)
                digest = token_digest(e.tokens) if e.tokens else e.digest
                ix.registry.insert(dataclasses.replace(e, tokens=b"", digest=digest))
            self.both(recover)
            return "recover"
        if op == 4:  # a 64-bit collision: other tokens under the key
            def collide(ix):
                e = ix.registry.peek(key)
                ix.registry.delete(key)
                tokens = bytearray(e.tokens)
                if tokens:
                    tokens[-4] ^= 1
                ix.registry.insert(dataclasses.replace(e, tokens=bytes(tokens)))
            self.both(collide)
            return "collide"
        if op == 5:  # another tenant's entry under this key
            def cross(ix):
                e = ix.registry.peek(key)
                ix.registry.delete(key)
                ix.registry.insert(dataclasses.replace(e, scope="other"))
            self.both(cross)
            return "cross_scope"
        if op == 6:  # links forgotten, then rebuilt from digests (manifest import)
            recent = self.ref.registry.keys_lru()[-6:]
            keys = [recent[i] for i in rng.permutation(len(recent))]  # any order: successors first too

            def relink(ix):
                reg = ix.registry
                chained = []
                for k in keys:
                    e = reg.peek(k)
                    nxt = e.next_digest
                    reg.update(e, source_pos=e.source_pos + 1, prefix_digest=e.prefix_digest)
                    reg.update(e, source_pos=e.source_pos - 1, prefix_digest=e.prefix_digest)
                    chained.append((e, nxt))
                reg.link(chained)
            self.both(relink)
            return "relink"
        # refresh: the same chunks registered again (learns links, moves recency)
        seq = self.seqs[int(rng.integers(len(self.seqs)))]
        self.both(lambda ix: ix.register(seq, seq.tobytes(), IDENT, "a", state=EntryState.RESIDENT))
        return "refresh"

    # ------------------------------------------------------------------ lookups

    def lookup(self, tokens: np.ndarray, *, give_chunks: bool = False, **kw) -> None:
        """The same Lookup on both; plans and registries must agree."""
        q = LookupQuery(tokens=tokens, data=tokens.tobytes(), identity=IDENT, **kw)

        def run(ix):
            plan = ix.lookup if ix is self.cmp else ix.lookup_reference
            if give_chunks:  # the shared registry's near-cache fill chunks both scopes itself
                scopes = (q.scope, SHARED_SCOPE) if q.scope != SHARED_SCOPE else (q.scope,)
                return plan(q, ix.chunk(tokens, IDENT, scopes))
            return plan(q)

        want, got = self.both(run)
        assert got.table.dtype == np.uint64 and np.array_equal(got.table, want.table), (q, want.segments, got.segments)
        assert got.summary == want.summary, q
        assert got.hit_segment_tokens == want.hit_segment_tokens, q
        assert got.seed_tokens == want.seed_tokens <= got.summary.shifted_tokens, q
        assert got.dry_run == want.dry_run
        assert np.array_equal(got.chunk_bounds, want.chunk_bounds) and got.chunk_bounds.dtype == want.chunk_bounds.dtype
        got.check_tiling(len(tokens))
        assert registry_state(self.cmp.registry) == registry_state(self.ref.registry)
        peek = self.ref.registry.peek
        self.copy_hits += sum(len(h) for h in want.hits() if (e := peek(h.chunk_hash)) is not None and e.base_key)


def text(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, size=n).astype(np.uint32)


def document(rng: np.random.Generator, vocab: int) -> np.ndarray:
    """1-4 messages, each opened by an anchor."""
    parts = [np.concatenate([[ANCHORS[int(rng.integers(len(ANCHORS)))]], text(rng, int(rng.integers(3, 160)), vocab)])
             for _ in range(int(rng.integers(1, 5)))]
    return np.concatenate(parts).astype(np.uint32)


def prompt(rng: np.random.Generator, seqs: list[np.ndarray], vocab: int) -> np.ndarray:
    """Pieces of registered sequences (whole, sliced, reordered, edited) and new text."""
    parts = []
    if rng.random() < 0.5:
        parts.append(document(rng, vocab)[: int(rng.integers(1, 80))])  # a new header: everything shifts
    for _ in range(int(rng.integers(1, 5))):
        r = rng.random()
        seq = seqs[int(rng.integers(len(seqs)))] if seqs else document(rng, vocab)
        if r < 0.35:
            parts.append(seq)
        elif r < 0.7:
            a = int(rng.integers(len(seq)))
            parts.append(seq[a : a + int(rng.integers(1, len(seq) + 1))])
        elif r < 0.85:
            edited = seq.copy()
            for _ in range(int(rng.integers(1, 4))):
                edited[int(rng.integers(len(edited)))] = int(rng.integers(vocab))
            parts.append(edited)
        else:
            parts.append(document(rng, vocab))
    if rng.random() < 0.2 and seqs:  # an exact prefix of a registered sequence
        seq = seqs[int(rng.integers(len(seqs)))]
        parts = [seq[: int(rng.integers(1, len(seq) + 1))]] + parts[:1]
    return np.concatenate(parts).astype(np.uint32)


def random_query(rng: np.random.Generator, n: int) -> dict:
    exact = rng.random() < 0.2
    r = rng.random()
    epl = 0 if r < 0.5 else (int(rng.integers(n + 1)) if r < 0.95 else n)
    return dict(
        scope=SCOPES[int(rng.choice(3, p=[0.7, 0.15, 0.15]))],
        engine_prefix_len=epl,
        policy=AdmissionPolicy.EXACT if exact else AdmissionPolicy.POSITION_INDEPENDENT,
        recompute_tokens=0 if exact else int(rng.choice([0, 4, 32])),
        repair_scope=RepairScope.CHUNK if rng.random() < 0.6 else RepairScope.SEGMENT,
        dry_run=bool(rng.random() < 0.4),
    )


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("config", [
    dict(),
    dict(min_hit_tokens=0),
    dict(min_hit_tokens=40, extend_hits=False),
    dict(capacity_entries=60, scope_share=0.6),  # evictions all along
    dict(seed_interval=2),  # seeds everywhere
    dict(seed_interval=0),
    dict(copies_per_chunk=2, copy_tokens_per_chunk=0),  # copies replaced all along
    dict(copies_per_chunk=1),  # the first copy only
])
def test_compiled_plans_equal_the_reference(seed, config):
    rng = np.random.default_rng(seed)
    vocab = int(rng.choice([6, 40, ANCHOR_BASE]))  # small vocabularies: partial matches everywhere
    twin = Twin(rng, **config)
    for _ in range(4):
        scope = SCOPES[int(rng.choice(3, p=[0.6, 0.2, 0.2]))]
        state = EntryState.RESIDENT if rng.random() < 0.7 else EntryState.OBSERVED
        twin.register(document(rng, vocab), scope, state)
    for step in range(60):
        r = rng.random()
        if r < 0.25:
            doc = prompt(rng, twin.seqs, vocab)
            scope = SCOPES[int(rng.choice(3, p=[0.6, 0.2, 0.2]))]
            state = EntryState.RESIDENT if rng.random() < 0.7 else EntryState.OBSERVED
            twin.register(doc, scope, state, register_from=int(rng.integers(len(doc))) if rng.random() < 0.2 else 0)
        elif r < 0.45:
            twin.mutate()
        tokens = prompt(rng, twin.seqs, vocab)
        twin.lookup(tokens, give_chunks=bool(rng.random() < 0.3), **random_query(rng, len(tokens)))
        if step % 10 == 0:
            check_mirror(twin.cmp.registry)
    check_mirror(twin.cmp.registry)
    # the kernel planned (almost) everything: the reference only after recoveries
    cmp = twin.cmp
    assert cmp.compiled_lookups > 0 and cmp.reference_lookups <= 0.2 * (cmp.compiled_lookups + cmp.reference_lookups)
    if config.get("copies_per_chunk", 4) == 1:
        assert twin.copy_hits == 0 and not any(e.base_key for e in cmp.registry.entries())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("copies", [4, 2])
def test_compiled_plans_equal_the_reference_on_repeated_content(seed, copies):
    """Histories that repeat themselves (a file read again, a listing printed again): the same
    messages at several positions, so chunks are held as several copies, some replaced past the
    bound; every Lookup plans the same on both planners, and copies do serve exact hits."""
    rng = np.random.default_rng(100 + seed)
    vocab = int(rng.choice([40, ANCHOR_BASE]))
    twin = Twin(rng, copies_per_chunk=copies, copy_tokens_per_chunk=0 if copies == 2 else 512)
    msgs = [document(rng, vocab) for _ in range(4)]

    def history() -> np.ndarray:
        parts = [document(rng, vocab)[: int(rng.integers(1, 60))]]  # a header of its own
        for _ in range(int(rng.integers(3, 8))):
            parts.append(msgs[int(rng.integers(len(msgs)))] if rng.random() < 0.7 else document(rng, vocab))
        return np.concatenate(parts).astype(np.uint32)

    for step in range(40):
        h = history()
        scope = "a" if rng.random() < 0.8 else SHARED_SCOPE
        twin.register(h, scope, EntryState.RESIDENT if rng.random() < 0.85 else EntryState.OBSERVED)
        if rng.random() < 0.2:
            twin.mutate()
        # the history itself (its own copies: exact), another one, a stored one again
        for q in (h, history(), twin.seqs[int(rng.integers(len(twin.seqs)))]):
            twin.lookup(q, give_chunks=bool(rng.random() < 0.3), **random_query(rng, len(q)))
        if step % 10 == 0:
            check_mirror(twin.cmp.registry)
    check_mirror(twin.cmp.registry)
    assert twin.copy_hits > 0
    reg = twin.cmp.registry
    for base, others in reg._copies.items():
        n = reg.peek(next(iter(others))).num_tokens
        assert len(others) <= reg.config.max_copies(n) or all(k in reg.protected for k in others)


def test_recovered_entry_falls_back_once_then_compiles(rng):
    """An admitted candidate without tokens: the reference plans (verifying by the digest, the
    entry adopts the tokens, the mirror learns them) and the next Lookup is compiled."""
    twin = Twin(rng)
    doc = document(rng, ANCHOR_BASE)
    twin.register(doc, "a", EntryState.RESIDENT)
    key = twin.ref.registry.keys_lru()[0]

    def recover(ix):
        e = ix.registry.peek(key)
        ix.registry.delete(key)
        ix.registry.insert(dataclasses.replace(e, tokens=b"", digest=token_digest(e.tokens)))
    twin.both(recover)
    assert twin.cmp.registry.table.tokens(twin.cmp.registry.table.slot(key)) is None
    twin.lookup(doc, scope="a")
    assert (twin.cmp.compiled_lookups, twin.cmp.reference_lookups) == (0, 1)
    assert twin.cmp.registry.peek(key).tokens
    check_mirror(twin.cmp.registry)
    twin.lookup(doc, scope="a")
    assert (twin.cmp.compiled_lookups, twin.cmp.reference_lookups) == (1, 1)


def test_window_guard_uses_the_reference(rng):
    twin = Twin(rng, left_context_tokens=16)
    doc = document(rng, ANCHOR_BASE)
    twin.register(doc, "a", EntryState.RESIDENT)
    twin.lookup(np.concatenate([doc[:3], doc]).astype(np.uint32), scope="a", left_context_window=8)
    assert (twin.cmp.compiled_lookups, twin.cmp.reference_lookups) == (0, 1)


def test_mirror_follows_inserts_deletes_and_compaction():
    """Hash table probe chains, deletion by backward shift, slot reuse, arena compaction."""
    reg = InMemoryRegistry(RegistryConfig(capacity_entries=50))
    reg.table = EntryTable(8)
    rng = np.random.default_rng(3)
    # keys equal in their low bits: one probe chain
    keys = [int(k) << 40 | 5 for k in rng.permutation(1000)[:300]]
    live: set[int] = set()
    for i, key in enumerate(keys):
        tokens = rng.integers(0, 1000, int(rng.integers(1, 200))).astype("<u4").tobytes()
        reg.insert(ChunkEntry(key=key, scope="a" if i % 3 else "b", tokens=tokens, source_pos=i, prefix_digest=i,
                              left_context=b"", state=EntryState.RESIDENT if i % 2 else EntryState.OBSERVED))
        live = set(reg.keys_lru())
        if rng.random() < 0.3 and live:
            reg.delete(sorted(live)[int(rng.integers(len(live)))])
        if i % 25 == 0:
            check_mirror(reg)
    check_mirror(reg)
    for key in keys:
        assert (reg.table.slot(key) >= 0) == (key in reg)
    table = reg.table
    assert table.ctr[1] <= 2 * 50  # slots are reused
    assert table.ctr[3] - table.ctr[4] == sum(e.num_tokens for e in reg.entries())  # live arena words
