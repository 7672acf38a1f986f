"""What the registry stores per chunk: ``ChunkEntry``, its key type and state, the token digest,
and the key of a chunk's copy computed after another left context (``variant_key``).

Kept apart from ``registry`` (the LRU map of entries) so that ``entry_table`` (the flat mirror
the compiled planner reads) and the Lookup planners share these types without importing the
registry itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import NewType

import xxhash

ChunkHash = NewType("ChunkHash", int)

#: Rough per-entry Python overhead (object, dict slot, bytes headers), counted in capacity.
ENTRY_OVERHEAD_BYTES = 256


class EntryState(str, Enum):
    OBSERVED = "observed"  # metadata only: counted by observer-mode lookups, never served
    RESIDENT = "resident"  # KV payload held by a tier: served to engines


def token_digest(data: bytes | memoryview) -> bytes:
    """Second, independent digest of a chunk's token bytes (xxh3-128), kept with stored KV so
    entries recovered after a restart are verified before they are served."""
    return xxhash.xxh3_128_digest(data)


@dataclass(slots=True, eq=False)
class ChunkEntry:
    """One registered chunk. ``tokens`` may be empty for an entry recovered from a tier after a
    restart: it is then verified by ``digest`` and adopts the tokens on its first verified hit."""

    key: ChunkHash
    scope: str
    tokens: bytes  # packed little-endian uint32
    source_pos: int
    prefix_digest: int
    left_context: bytes  # packed LE uint32, at most left_context_tokens tokens before the chunk
    state: EntryState = EntryState.OBSERVED
    tier: str | None = None
    hits: int = 0
    first_seen: float = field(default_factory=time.time)
    last_seen: float = 0.0
    num_tokens: int = 0
    digest: bytes = b""
    #: Links to the neighbouring chunks of the sequence this entry's canonical copy was computed
    #: in (same scope; 0 = unknown): the chunk right before it, the chunk right after it, and
    #: the prefix digest the chunk after it has there (``prefix_digest`` chained over this
    #: chunk). Lookup follows them to coalesce hits and to extend a hit token by token into its
    #: stored neighbours (``chunk_index.ChunkIndex.lookup``); every use re-checks the neighbour.
    prev_key: int = 0
    next_key: int = 0
    next_digest: int = 0
    #: 0 for a chunk's canonical copy (its first stored one, keyed by the chunk key: the source
    #: of every rotated hit); for another copy of the same tokens computed after another left
    #: context, the chunk key it is a copy of (its own key is ``variant_key(base_key,
    #: prefix_digest)``). Registries bound the copies of one chunk (``copies_per_chunk``).
    base_key: int = 0

    def __post_init__(self) -> None:
        if not self.num_tokens:
            self.num_tokens = len(self.tokens) // 4

    @property
    def nbytes(self) -> int:
        return 4 * self.num_tokens + len(self.left_context) + ENTRY_OVERHEAD_BYTES

    def matches(self, data: bytes) -> bool:
        """Token verification: stored tokens, or the second digest for recovered entries (which
        adopt the tokens). For a registered entry call ``InMemoryRegistry.matches``: it keeps
        the compiled planner's mirror in step."""
        if self.tokens:
            return self.tokens == data
        if self.digest and len(data) == 4 * self.num_tokens and self.digest == token_digest(data):
            self.tokens = bytes(data)
            return True
        return False


#: the prefix-digest chain (the Lookup kernels inline the same mixing)
MASK64 = (1 << 64) - 1
P1 = 0x9E3779B185EBCA87
P2 = 0xC2B2AE3D27D4EB4F


def chain_reference(prev: int, chunk_hash: int) -> int:
    """Prefix-digest step: digest of (everything before) + this chunk."""
    x = ((prev ^ chunk_hash) * P1) & MASK64
    x ^= x >> 29
    x = (x * P2) & MASK64
    return x ^ (x >> 32)


#: mixed into a left-context digest before it keys a copy (``variant_key``): a copy's key is
#: never the chain step that makes prefix digests or chunk keys
VARIANT_SEED = 0x636F70792D6B6579  # "copy-key"


def variant_key(chunk_key: int, prefix_digest: int) -> int:
    """The key of the copy of chunk ``chunk_key`` computed after the left context whose chained
    digest is ``prefix_digest`` (a chunk's copies other than its canonical one). Scope-salted
    like the chunk key it mixes (a tenant cannot name another tenant's copy), position-free
    (the digest already names the whole left context). ``chunker.variant_keys`` computes the
    same for a whole prompt; hits are token-verified as for any key."""
    return chain_reference(prefix_digest ^ VARIANT_SEED, chunk_key)
