"""The engine's own exact-prefix cache, the way a serving engine keeps one across requests.

vLLM's automatic prefix caching reuses the KV of the longest run of leading full blocks (16
tokens) that an earlier request computed; SGLang's radix cache does the same at token
granularity. This cache keeps finished requests' ``SequenceCache`` objects whole (no copy: a
request never writes its cache again once it is finished) with the token ids of their positions;
a new request reuses the longest common prefix with any of them, rounded down to whole blocks
and capped so at least the last prompt token is computed (its logits give the first output
token), exactly like vLLM::

    entry A  | t0 t1 ... t511 | t512 ...          (tokens of an earlier request, KV held)
    request  | t0 t1 ... t511 | u512 ...
    hit      |<-- 512 -------->|   copied into the new request's cache, then prefill from 512

Entries whose tokens are a prefix of a newer entry are dropped (the newer one serves them);
least-recently-used entries go first when ``capacity_bytes`` is exceeded.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from clients.transformers.cache import SequenceCache


@dataclass(slots=True)
class PrefixEntry:
    tokens: np.ndarray  # uint32 [length], the ids at cache positions 0 .. length-1
    cache: SequenceCache
    nbytes: int


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    if m == 0:
        return 0
    neq = np.flatnonzero(a[:m] != b[:m])
    return int(neq[0]) if len(neq) else m


def _cache_bytes(cache: SequenceCache) -> int:
    n = 0
    for layer in cache.layers:
        if layer._kbuf is not None:
            n += layer._kbuf.numel() * layer._kbuf.element_size() + layer._vbuf.numel() * layer._vbuf.element_size()
    return n


class PrefixCache:
    """Longest-common-prefix KV reuse across requests (block granularity, LRU by bytes).

    Not thread-safe: one engine, one request at a time.
    """

    def __init__(self, *, capacity_bytes: int = 2 << 30, block_size: int = 16) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.capacity_bytes = int(capacity_bytes)
        self.block_size = int(block_size)
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._next_id = 0
        self._bytes = 0
        self.hits = 0
        self.lookups = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def match(self, tokens: np.ndarray) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest prefix with ``tokens`` and the reusable length: whole
        blocks, at most ``len(tokens) - 1`` (the last prompt token is always computed)."""
        self.lookups += 1
        best, best_len = None, 0
        for key, e in self._entries.items():
            n = _lcp(e.tokens, tokens)
            if n > best_len:
                best, best_len, best_key = e, n, key
        cap = len(tokens) - 1
        hit = (min(best_len, cap) // self.block_size) * self.block_size
        if hit <= 0:
            return None, 0
        self._entries.move_to_end(best_key)
        self.hits += 1
        return best, hit

    def insert(self, tokens: np.ndarray, cache: SequenceCache) -> None:
        """Keep ``cache`` (positions ``0 .. len(tokens)-1`` hold ``tokens``) for later requests.
        The caller must not modify ``cache`` afterwards."""
        tokens = np.ascontiguousarray(tokens, dtype=np.uint32)
        if len(tokens) == 0:
            return
        if cache.length < len(tokens):
            raise ValueError(f"cache holds {cache.length} positions, tokens has {len(tokens)}")
        # Drop entries this one subsumes (their tokens are a prefix of ours).
        for key in [k for k, e in self._entries.items() if len(e.tokens) <= len(tokens) and _lcp(e.tokens, tokens) == len(e.tokens)]:
            self._bytes -= self._entries.pop(key).nbytes
        nbytes = _cache_bytes(cache)
        if nbytes > self.capacity_bytes:
            return
        self._entries[self._next_id] = PrefixEntry(tokens=tokens.copy(), cache=cache, nbytes=nbytes)
        self._next_id += 1
        self._bytes += nbytes
        while self._bytes > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0
