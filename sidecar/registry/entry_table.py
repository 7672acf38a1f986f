"""Numpy mirror of the registry for the compiled Lookup planner (``lookup_kernel``).

The planner reads entries by key, chunk after chunk and neighbour after neighbour; doing that on
the registry's ``OrderedDict`` of ``ChunkEntry`` objects costs Python work per chunk. The mirror
holds what the planner reads in flat arrays a compiled kernel walks without the interpreter::

    hash table (open addressing, linear probing, load <= 1/2; power-of-two capacity)
      ht_key  uint64 [hcap]   chunk key
      ht_slot int64  [hcap]   slot, -1 = empty      (deletion shifts entries back: no tombstones)

    slots (one row per registered entry; freed rows are reused)
      su      uint64 [cap, 5]  key, prefix_digest, next_digest, prev_key, next_key   (U_*)
      si      int64  [cap, 7]  scope id, resident, source_pos, num_tokens,
                               arena offset, token count (-1: tokens not known yet),
                               copy (1: another copy of a chunk, ``ChunkEntry.base_key``;
                               its windows are not seeded: the canonical copy's are)  (I_*)

    arena   uint32 [acap]      every entry's tokens, appended; compacted when garbage (tokens
                               of deleted entries) outweighs live tokens; grows by doubling

    seed map (``seeds``; open addressing like the hash table, load <= 1/2)
      sd_key  uint64 [scap]   seed key (window hash x scope)
      sd_val  int64  [scap]   slot << ROW_BITS | row of the window, -1 = empty

Scopes are small integers (``scope_id``), assigned on first use and never reused.

Maintenance is a log: the registry records each mutation (``add``, ``put``, ``set_tokens``,
``remove``) as one fixed-size uint64 record (plus the tokens of an add) in O(1) Python, and
``sync`` applies the pending records in order, in one compiled call, before the planner reads
the arrays (the log is also applied once it grows past ``SYNC_RECORDS``, so write-only traffic
keeps it bounded). Every mutation of a registered entry's planner-visible fields must be
recorded: the registry does it in ``insert``, ``update``, ``link``, ``set_state``, ``matches``
(tokens adopted by a recovered entry) and its evictions; ``ChunkEntry`` fields assigned anywhere
else are not seen by the compiled planner.

Memory, outside ``registry.capacity_bytes``: ``4 x tokens`` bytes of arena per entry (a second
copy of ``ChunkEntry.tokens``), 104 bytes of slot arrays, 32-64 bytes of hash table and 32-64
bytes per seed (``seeds``: one per ``registry.seed_interval`` tokens); every array grows by
doubling (100K entries of 128 tokens: 80 MiB, and 13-25 MiB of seeds at interval 32).

Thread-safety: owned by the registry (the server's event loop); the kernels release the GIL
but the arrays must not change while a planner call reads them.
"""

from __future__ import annotations

from array import array

import numba
import numpy as np

from sidecar.registry.entry import ChunkEntry
from sidecar.registry.seeds import ROW_BITS, SEED_TOKENS, seed_key, windows

#: ``su`` columns (uint64)
U_KEY, U_PREFIX, U_NEXT_DIGEST, U_PREV, U_NEXT = range(5)
#: ``si`` columns (int64)
I_SCOPE, I_RESIDENT, I_POS, I_NTOK, I_OFF, I_LEN, I_COPY = range(7)

#: log record: op, key, then 10 operand fields
_REC = 12
OP_ADD, OP_PUT, OP_TOKENS, OP_DEL = 1, 2, 3, 4

#: apply the log once it holds this many records even if no Lookup asked for the arrays
SYNC_RECORDS = 4096

_U = np.uint64
_EMPTY = -1

@numba.njit(inline="always")
def _home(key, mask):
    return np.int64((key ^ (key >> _U(31))) & _U(mask))


@numba.njit(inline="always")
def _probe(ht_key, ht_slot, key):
    """Table index holding ``key``, or -1 (linear probing from its home)."""
    mask = ht_key.shape[0] - 1
    i = _home(key, mask)
    while True:
        if ht_slot[i] < 0:
            return np.int64(-1)
        if ht_key[i] == key:
            return i
        i = (i + 1) & mask


@numba.njit(cache=True, nogil=True)
def find_slot(ht_key, ht_slot, key):
    """Slot of ``key`` (uint64), or -1."""
    i = _probe(ht_key, ht_slot, key)
    return np.int64(-1) if i < 0 else ht_slot[i]


@numba.njit(cache=True, nogil=True)
def _ht_insert(ht_key, ht_slot, key, slot):
    """Insert an absent ``key``; the caller keeps the load below one half."""
    mask = ht_key.shape[0] - 1
    i = _home(key, mask)
    while ht_slot[i] >= 0:
        i = (i + 1) & mask
    ht_key[i] = key
    ht_slot[i] = slot


@numba.njit(cache=True, nogil=True)
def _ht_delete(ht_key, ht_slot, key):
    """Remove ``key``; returns its slot or -1. Backward-shift deletion keeps every probe chain
    unbroken without tombstones: each later entry of the cluster that may move into the hole
    (its home is not cyclically inside (hole, j]) does, and the hole moves on."""
    i = _probe(ht_key, ht_slot, key)
    if i < 0:
        return np.int64(-1)
    mask = ht_key.shape[0] - 1
    slot = ht_slot[i]
    j = i
    while True:
        j = (j + 1) & mask
        if ht_slot[j] < 0:
            break
        h = _home(ht_key[j], mask)
        if i <= j:
            stays = i < h <= j
        else:
            stays = h > i or h <= j
        if not stays:
            ht_key[i] = ht_key[j]
            ht_slot[i] = ht_slot[j]
            i = j
    ht_slot[i] = -1
    return slot


@numba.njit(cache=True, nogil=True)
def _rehash(ht_key, ht_slot, hcap):
    """A hash table of ``hcap`` buckets holding the same keys."""
    nk = np.zeros(hcap, dtype=np.uint64)
    ns = np.full(hcap, -1, dtype=np.int64)
    for i in range(ht_key.shape[0]):
        if ht_slot[i] >= 0:
            _ht_insert(nk, ns, ht_key[i], ht_slot[i])
    return nk, ns


@numba.njit(cache=True, nogil=True)
def _compact(si, high, arena, acap):
    """Live tokens copied to a fresh arena of ``acap`` words in slot order; offsets rewritten.
    Returns (arena, used)."""
    out = np.empty(acap, dtype=np.uint32)
    used = 0
    for s in range(high):
        ln = si[s, I_LEN]
        if si[s, I_SCOPE] < 0 or ln <= 0:
            continue
        off = si[s, I_OFF]
        out[used : used + ln] = arena[off : off + ln]
        si[s, I_OFF] = used
        used += ln
    return out, used


@numba.njit(cache=True, nogil=True)
def _slot_seeds(arena, s, si, bits):
    """The seed map entries of slot ``s``'s tokens: keys, and values ``s << ROW_BITS | row``."""
    off = si[s, I_OFF]
    ln = si[s, I_LEN]
    if bits < 0 or ln < SEED_TOKENS:
        return np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.int64)
    pos, mix = windows(arena, off, off + ln, bits)
    m = 0
    while m < pos.shape[0] and not ((pos[m] - off) >> ROW_BITS):  # rows past the packed width: none
        m += 1
    keys = np.empty(m, dtype=np.uint64)
    vals = np.empty(m, dtype=np.int64)
    scope = si[s, I_SCOPE]
    for i in range(m):
        keys[i] = seed_key(mix[i], scope)
        vals[i] = (s << ROW_BITS) | (pos[i] - off)
    return keys, vals


@numba.njit(cache=True, nogil=True)
def _seed_add(sd_key, sd_val, arena, s, si, bits, ctr):
    """Map every seed window of slot ``s``'s tokens to it (the last chunk registered with a
    window owns it); grows the map past load 1/2. Returns the (possibly new) map."""
    keys, vals = _slot_seeds(arena, s, si, bits)
    for i in range(keys.shape[0]):
        j = _probe(sd_key, sd_val, keys[i])
        if j >= 0:
            sd_val[j] = vals[i]
            continue
        if 2 * (ctr[5] + 1) > sd_key.shape[0]:
            sd_key, sd_val = _rehash(sd_key, sd_val, 2 * sd_key.shape[0])
        _ht_insert(sd_key, sd_val, keys[i], vals[i])
        ctr[5] += 1
    return sd_key, sd_val


@numba.njit(cache=True, nogil=True)
def _seed_remove(sd_key, sd_val, arena, s, si, bits, ctr):
    """Forget the seed windows slot ``s`` (about to be freed) owns."""
    keys, vals = _slot_seeds(arena, s, si, bits)
    for i in range(keys.shape[0]):
        j = _probe(sd_key, sd_val, keys[i])
        if j >= 0 and sd_val[j] == vals[i]:
            _ht_delete(sd_key, sd_val, keys[i])
            ctr[5] -= 1


@numba.njit(cache=True, nogil=True)
def _apply(log, toks, ht_key, ht_slot, su, si, arena, free, ctr, sd_key, sd_val, bits):
    """Apply ``log`` records in order. ``toks``: the tokens of OP_ADD / OP_TOKENS records, in
    record order. ``ctr``: [live entries, high-water slot, free count, arena used, garbage].
    The caller has made room: slots for every add, load <= 1/2, arena space for ``toks``."""
    t = 0
    for r in range(log.shape[0] // _REC):
        b = r * _REC
        op = log[b]
        key = log[b + 1]
        if op == 1:  # add: scope, resident, pos, ntok, prefix, next_digest, prev, next, len + 1, copy
            if ctr[2] > 0:
                ctr[2] -= 1
                s = free[ctr[2]]
            else:
                s = ctr[1]
                ctr[1] += 1
            _ht_insert(ht_key, ht_slot, key, s)
            ctr[0] += 1
            si[s, I_SCOPE] = np.int64(log[b + 2])
            si[s, I_RESIDENT] = np.int64(log[b + 3])
            si[s, I_POS] = np.int64(log[b + 4])
            si[s, I_NTOK] = np.int64(log[b + 5])
            su[s, U_KEY] = key
            su[s, U_PREFIX] = log[b + 6]
            su[s, U_NEXT_DIGEST] = log[b + 7]
            su[s, U_PREV] = log[b + 8]
            su[s, U_NEXT] = log[b + 9]
            ln = np.int64(log[b + 10]) - 1
            si[s, I_LEN] = ln
            si[s, I_OFF] = ctr[3]
            si[s, I_COPY] = np.int64(log[b + 11])
            if ln > 0:
                arena[ctr[3] : ctr[3] + ln] = toks[t : t + ln]
                ctr[3] += ln
                t += ln
                if si[s, I_COPY] == 0:
                    sd_key, sd_val = _seed_add(sd_key, sd_val, arena, s, si, bits, ctr)
        elif op == 2:  # put: resident, pos, prefix, next_digest, prev, next, copy
            s = find_slot(ht_key, ht_slot, key)
            if s < 0:
                continue
            si[s, I_COPY] = np.int64(log[b + 11])
            si[s, I_RESIDENT] = np.int64(log[b + 3])
            si[s, I_POS] = np.int64(log[b + 4])
            su[s, U_PREFIX] = log[b + 6]
            su[s, U_NEXT_DIGEST] = log[b + 7]
            su[s, U_PREV] = log[b + 8]
            su[s, U_NEXT] = log[b + 9]
        elif op == 3:  # tokens: len + 1
            ln = np.int64(log[b + 10]) - 1
            s = find_slot(ht_key, ht_slot, key)
            if s >= 0 and si[s, I_LEN] <= 0 and ln > 0:
                si[s, I_OFF] = ctr[3]
                si[s, I_LEN] = ln
                arena[ctr[3] : ctr[3] + ln] = toks[t : t + ln]
                ctr[3] += ln
                if si[s, I_COPY] == 0:
                    sd_key, sd_val = _seed_add(sd_key, sd_val, arena, s, si, bits, ctr)
            t += ln if ln > 0 else 0
        elif op == 4:  # delete
            s = _ht_delete(ht_key, ht_slot, key)
            if s < 0:
                continue
            ctr[0] -= 1
            if si[s, I_LEN] > 0:
                # (a copy may own windows: seeded before it was known as one)
                _seed_remove(sd_key, sd_val, arena, s, si, bits, ctr)
                ctr[4] += si[s, I_LEN]
            si[s, I_SCOPE] = -1
            si[s, I_LEN] = -1
            free[ctr[2]] = s
            ctr[2] += 1
    return sd_key, sd_val


class EntryTable:
    """The planner's view of one ``InMemoryRegistry`` (see the module docstring).

    ``capacity``: initial slots (and half the initial hash buckets); everything grows by
    doubling, so a small value only costs regrowth (the tests use it to force probe chains).
    ``seed_bits``: ``seeds.interval_bits`` of ``registry.seed_interval`` (-1: no seed map)."""

    def __init__(self, capacity: int = 1024, seed_bits: int = -1) -> None:
        cap = max(8, 1 << (int(capacity) - 1).bit_length())
        self.seed_bits = seed_bits
        self.scope_ids: dict[str, int] = {}
        self.ht_key = np.zeros(2 * cap, dtype=np.uint64)
        self.ht_slot = np.full(2 * cap, _EMPTY, dtype=np.int64)
        self.su = np.zeros((cap, 5), dtype=np.uint64)
        self.si = np.full((cap, 7), -1, dtype=np.int64)
        self.free = np.zeros(cap, dtype=np.int64)
        self.arena = np.zeros(16 * cap, dtype=np.uint32)
        self.sd_key = np.zeros(2 * cap, dtype=np.uint64)
        self.sd_val = np.full(2 * cap, _EMPTY, dtype=np.int64)
        #: [live entries, high-water slot, free slots, arena words used, arena garbage words, seeds]
        self.ctr = np.zeros(6, dtype=np.int64)
        self._log = array("Q")
        self._toks = bytearray()
        self._adds = 0

    # ------------------------------------------------------------------ recording (O(1))

    def scope_id(self, scope: str) -> int:
        """The id of ``scope``, assigned on first use."""
        sid = self.scope_ids.get(scope)
        if sid is None:
            sid = self.scope_ids[scope] = len(self.scope_ids)
        return sid

    def add(self, entry: ChunkEntry, resident: bool) -> None:
        """Record a new registered entry (its key must not be registered); ``resident``: its
        state is RESIDENT."""
        tokens = entry.tokens
        self._log.extend((OP_ADD, entry.key, self.scope_id(entry.scope), resident, entry.source_pos,
                          entry.num_tokens, entry.prefix_digest, entry.next_digest, entry.prev_key, entry.next_key,
                          len(tokens) // 4 + 1 if tokens else 0, 1 if entry.base_key else 0))
        self._toks += tokens
        self._adds += 1
        if len(self._log) >= SYNC_RECORDS * _REC:
            self.sync()

    def put(self, entry: ChunkEntry, resident: bool) -> None:
        """Record a registered entry's new state, position, prefix digest, links or copy flag."""
        self._log.extend((OP_PUT, entry.key, 0, resident, entry.source_pos, 0, entry.prefix_digest,
                          entry.next_digest, entry.prev_key, entry.next_key, 0, 1 if entry.base_key else 0))
        if len(self._log) >= SYNC_RECORDS * _REC:
            self.sync()

    def set_tokens(self, entry: ChunkEntry) -> None:
        """Record the tokens a registered entry learned (a recovered entry, verified)."""
        tokens = entry.tokens
        if not tokens:
            return
        self._log.extend((OP_TOKENS, entry.key, 0, 0, 0, 0, 0, 0, 0, 0, len(tokens) // 4 + 1, 0))
        self._toks += tokens
        if len(self._log) >= SYNC_RECORDS * _REC:
            self.sync()

    def remove(self, key: int) -> None:
        """Record that ``key`` left the registry."""
        self._log.extend((OP_DEL, key, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
        if len(self._log) >= SYNC_RECORDS * _REC:
            self.sync()

    # ------------------------------------------------------------------ applying (compiled)

    def sync(self) -> None:
        """Apply the pending records (one compiled call); the arrays then mirror the registry."""
        if not self._log:
            return
        log = np.frombuffer(self._log, dtype=np.uint64)
        toks = np.frombuffer(self._toks, dtype="<u4") if self._toks else np.zeros(0, dtype=np.uint32)
        self._reserve(self._adds, len(toks))
        self.sd_key, self.sd_val = _apply(log, toks, self.ht_key, self.ht_slot, self.su, self.si, self.arena, self.free,
                                          self.ctr, self.sd_key, self.sd_val, self.seed_bits)
        self._log = array("Q")
        self._toks = bytearray()
        self._adds = 0

    def _reserve(self, adds: int, words: int) -> None:
        """Room for ``adds`` new slots and ``words`` arena words (grow by doubling; compact the
        arena first when garbage outweighs live tokens)."""
        live, high, nfree, used, garbage, _ = self.ctr.tolist()
        cap = len(self.si)
        if high + adds > cap:
            new = max(2 * cap, 1 << (high + adds - 1).bit_length())
            su = np.zeros((new, 5), dtype=np.uint64)
            su[:cap] = self.su
            si = np.full((new, 7), -1, dtype=np.int64)
            si[:cap] = self.si
            free = np.zeros(new, dtype=np.int64)
            free[:cap] = self.free
            self.su, self.si, self.free = su, si, free
        hcap = len(self.ht_key)
        if 2 * (live + adds) > hcap:
            new = max(2 * hcap, 1 << (2 * (live + adds) - 1).bit_length())
            self.ht_key, self.ht_slot = _rehash(self.ht_key, self.ht_slot, new)
        acap = len(self.arena)
        if used + words > acap:
            if garbage > used - garbage:
                need = used - garbage + words
                self.arena, used = _compact(self.si, high, self.arena, max(acap, 1 << max(need - 1, 0).bit_length()))
                self.ctr[3], self.ctr[4] = used, 0
            acap = len(self.arena)
            if used + words > acap:
                grown = np.empty(max(2 * acap, 1 << (used + words - 1).bit_length()), dtype=np.uint32)
                grown[:used] = self.arena[:used]
                self.arena = grown

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        self.sync()
        return int(self.ctr[0])

    def slot(self, key: int) -> int:
        """Slot of ``key`` or -1 (tests and tools)."""
        self.sync()
        return int(find_slot(self.ht_key, self.ht_slot, np.uint64(key)))

    def seed(self, key: int) -> int:
        """The seed map's value for ``key`` (``seeds.unpack``), or -1 (the reference planner)."""
        self.sync()
        return int(find_slot(self.sd_key, self.sd_val, np.uint64(key)))

    def tokens(self, slot: int) -> np.ndarray | None:
        """The arena tokens of ``slot`` (a view), or None when they are not known."""
        off, ln = self.si[slot, I_OFF], self.si[slot, I_LEN]
        return self.arena[off : off + ln] if ln > 0 else None

