"""The shared registry's configuration, Redis key names and record format (no I/O here).

Key layout (docs/architecture.md, "Scale"; docs/operations.md, "Shared registry")::

    <prefix>:{<scope tag>}:<chunk key, 16 hex>    one record per chunk (string, TTL)
    <prefix>:{<scope tag>}:n                      chunks first published under the scope (counter)
    <prefix>:{<scope tag>}:r:<chunk key, 16 hex>  which replicas hold the chunk (hash; routing)
    <prefix>:{replicas}:<replica id>              a replica's heartbeat (string, TTL; routing)
    <prefix>:{replicas}                           replica ids that ever beat (set; routing)

``scope tag`` = xxh64 of the scope name (hex). The chunk key is already salted server-side with
the cache identity and the scope (``CacheIdentity.scope_seed``), so a key names exactly one
(identity, scope, tokens) triple and a client cannot name another tenant's key. The braces are
a Redis Cluster hash tag: every key of one scope lives on one slot, so a Lookup (own scope plus
``shared``) touches at most two slots and sends one MGET per slot, all in one pipeline.

Record (little-endian)::

    u8 version | u8 resident | u8 tier code | pad | u32 source_pos | u64 prefix_digest
    | u32 num_tokens | 16 B xxh3-128 of the chunk's token bytes | u16 len(scope)
    | u16 len(owner) | u16 len(shared_tier) | scope | owner | shared_tier | left context (LE u32)

Tokens are not stored: a peer verifies a hit against the digest (``ChunkEntry.matches``) and
adopts the prompt's tokens on the first verified hit. ``owner`` is the sidecar id that
published the record; ``shared_tier`` names the remote tier that holds a copy of the bytes
(``host:port/namespace``, no credentials) or is empty when only the owner holds them.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import xxhash

from sidecar.registry.entry import ChunkEntry, ChunkHash, EntryState, token_digest
from sidecar.tiers import TIER_NAMES, Tier

_TAG_SEED = 0x6B767363  # "kvsc": fixed, so every sidecar derives the same tags
_HEAD = struct.Struct("<BBBxIQI16sHHH")
_VERSION = 1
# Record tier codes: 0 none, then 1 + the tier's rank (a tier inserted before others changes their
# codes: bump _VERSION then).
_TIERS = ("", *TIER_NAMES)
_TIER_CODE = {t: i for i, t in enumerate(_TIERS)}


@dataclass(frozen=True, kw_only=True)
class SharedRegistryConfig:
    """Settings of the Redis-shared registry (off unless ``redis_url`` is set).

    ``publish_interval_s`` bounds how long a chunk registered here takes to become visible to
    peers (one flush interval plus one Redis write while Redis is up). ``timeout_s`` bounds
    every Redis call (connect and socket); a Lookup never waits on Redis for longer.
    ``entry_ttl_s``: records expire this long after their last publication (0: never).
    ``max_pending``: publishes queued while Redis is slow or down; past it the oldest are
    dropped (counted). ``publish_payloads``: Store also copies each chunk's KV to the remote
    tier (``store.remote_url``) so peers can Fetch it. ``sidecar_id``: this sidecar's name in
    records (empty: ``host:port`` of its gRPC server). ``share_left_context``: records carry
    the chunk's left context (``registry.left_context_tokens`` tokens, ~4x the record size), so
    peers can apply a Lookup's left-context window W to it; without it a peer's chunk passes a
    W > 0 guard only as an exact (same left context) hit.
    """

    redis_url: str = ""
    cluster: bool = False
    key_prefix: str = "kvs"
    sidecar_id: str = ""
    publish_interval_s: float = 0.05
    timeout_s: float = 0.1
    entry_ttl_s: float = 86_400.0
    max_pending: int = 100_000
    max_batch: int = 4096
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 1.0  # a PING per second at most while Redis is down: back within ~1 s
    probe_interval_s: float = 1.0
    publish_payloads: bool = True
    share_left_context: bool = False

    def __post_init__(self) -> None:
        if self.redis_url:
            parse_redis_url(self.redis_url)
        p = self.key_prefix
        if not p or any(c in p for c in "{}: \t\n\x00"):
            raise ValueError(f"shared_registry.key_prefix must be non-empty without braces, ':' or spaces, got {p!r}")
        if len(self.sidecar_id) > 200:
            raise ValueError("shared_registry.sidecar_id must be at most 200 characters")
        for name in ("publish_interval_s", "timeout_s", "backoff_initial_s", "backoff_max_s", "probe_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"shared_registry.{name} must be > 0, got {getattr(self, name)}")
        if self.entry_ttl_s < 0:
            raise ValueError(f"shared_registry.entry_ttl_s must be >= 0 (0: never expire), got {self.entry_ttl_s}")
        for name in ("max_pending", "max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"shared_registry.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def enabled(self) -> bool:
        return bool(self.redis_url)


def parse_redis_url(url: str) -> tuple[str, int]:
    """``(host, port)`` of ``redis[s]://[user[:password]@]host[:port][/db]``; ValueError naming
    ``shared_registry.redis_url`` otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port or 6379
    except ValueError as exc:
        raise ValueError(f"shared_registry.redis_url: {exc} in {url!r}") from None
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"shared_registry.redis_url must be redis://host:port or rediss://, got scheme {parts.scheme!r}")
    if not parts.hostname:
        raise ValueError(f"shared_registry.redis_url must name a host, got {url!r}")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"shared_registry.redis_url: database must be a number, got {db!r}")
    return parts.hostname, port


def scope_tag(scope: str) -> str:
    """The Cluster hash tag of a scope (16 hex digits)."""
    return f"{xxhash.xxh64_intdigest(scope.encode(), seed=_TAG_SEED):016x}"


class KeySpace:
    """Redis key names under one prefix (bytes, built once per scope)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._bases: dict[str, str] = {}

    def base(self, scope: str) -> str:
        b = self._bases.get(scope)
        if b is None:
            if len(self._bases) > 100_000:  # bounded: scopes are tenants
                self._bases.clear()
            b = self._bases[scope] = f"{self.prefix}:{{{scope_tag(scope)}}}:"
        return b

    def chunk_keys(self, scope: str, keys: Sequence[int]) -> list[bytes]:
        base = self.base(scope)
        return [f"{base}{k:016x}".encode() for k in keys]

    def count_key(self, scope: str) -> bytes:
        return f"{self.base(scope)}n".encode()


@dataclass(frozen=True, slots=True)
class SharedRecord:
    """What the shared registry knows of one chunk."""

    scope: str
    source_pos: int
    prefix_digest: int
    num_tokens: int
    digest: bytes
    left_context: bytes
    resident: bool
    tier: str
    owner: str
    shared_tier: str

    @classmethod
    def of(cls, entry: ChunkEntry, owner: str, shared_tier: str, left_context: bool = True) -> SharedRecord:
        """Snapshot of ``entry`` (taken on the loop thread that owns it); ``shared_tier`` is
        non-empty when the remote tier holds a copy of its bytes; ``left_context``: keep it."""
        resident = entry.state is EntryState.RESIDENT
        return cls(
            scope=entry.scope, source_pos=entry.source_pos, prefix_digest=entry.prefix_digest,
            num_tokens=entry.num_tokens, digest=entry.digest or token_digest(entry.tokens),
            left_context=entry.left_context if left_context else b"", resident=resident, tier=(entry.tier or "") if resident else "",
            owner=owner, shared_tier=shared_tier if resident else "",
        )

    def encode(self) -> bytes:
        s, o, t = self.scope.encode(), self.owner.encode(), self.shared_tier.encode()
        head = _HEAD.pack(
            _VERSION, self.resident, _TIER_CODE.get(self.tier, 0), self.source_pos, self.prefix_digest,
            self.num_tokens, self.digest, len(s), len(o), len(t),
        )
        return b"".join((head, s, o, t, self.left_context))

    @classmethod
    def decode(cls, raw: bytes) -> SharedRecord | None:
        """None for a record this version cannot read (never an exception: Redis is shared)."""
        if len(raw) < _HEAD.size:
            return None
        version, resident, tier, src, prefix, ntok, digest, ls, lo, lt = _HEAD.unpack_from(raw)
        if version != _VERSION or tier >= len(_TIERS) or ntok == 0:
            return None
        a = _HEAD.size
        b, c, d = a + ls, a + ls + lo, a + ls + lo + lt
        if d > len(raw) or (len(raw) - d) % 4:
            return None
        try:
            scope, owner, shared_tier = raw[a:b].decode(), raw[b:c].decode(), raw[c:d].decode()
        except UnicodeDecodeError:
            return None
        return cls(scope, src, prefix, ntok, digest, raw[d:], bool(resident), _TIERS[tier], owner, shared_tier)

    @staticmethod
    def decode_entry(raw: bytes, key: int, scope: str, scope_b: bytes, shared_tier_b: bytes) -> ChunkEntry | None:
        """The hot-path form of ``decode(raw).entry(key, servable)``: one unpack, no string
        decoding. None unless the record is readable AND of ``scope`` (``scope_b`` its bytes);
        RESIDENT when its bytes sit in the shared tier ``shared_tier_b`` (non-empty)."""
        if len(raw) < _HEAD.size:
            return None
        version, resident, _tier, src, prefix, ntok, digest, ls, lo, lt = _HEAD.unpack_from(raw)
        a = _HEAD.size
        b = a + ls
        c = b + lo
        d = c + lt
        if version != _VERSION or ntok == 0 or d > len(raw) or (len(raw) - d) % 4 or raw[a:b] != scope_b:
            return None
        servable = resident and lt and shared_tier_b and raw[c:d] == shared_tier_b
        return ChunkEntry(
            key=ChunkHash(key), scope=scope, tokens=b"", source_pos=src, prefix_digest=prefix, left_context=raw[d:],
            state=EntryState.RESIDENT if servable else EntryState.OBSERVED,
            tier=Tier.REMOTE.value if servable else None, num_tokens=ntok, digest=digest,
        )

    def entry(self, key: int, servable: bool) -> ChunkEntry:
        """A local registry entry for this record: RESIDENT (tier ``remote``) when this sidecar
        can read the bytes (``servable``), else OBSERVED (metadata only, never served)."""
        return ChunkEntry(
            key=ChunkHash(key), scope=self.scope, tokens=b"", source_pos=self.source_pos,
            prefix_digest=self.prefix_digest, left_context=self.left_context,
            state=EntryState.RESIDENT if servable else EntryState.OBSERVED,
            tier=Tier.REMOTE.value if servable else None, num_tokens=self.num_tokens, digest=self.digest,
        )


def residency_keys(space: KeySpace, scope: str, keys: Sequence[int]) -> list[bytes]:
    """The residency hashes of ``keys`` (``<prefix>:{<scope tag>}:r:<chunk key>``): one field
    per replica holding the chunk (``sidecar.routing.residency``). Same slot as the records."""
    base = space.base(scope)
    return [f"{base}r:{k:016x}".encode() for k in keys]


def beat_key(space: KeySpace, replica: str) -> bytes:
    """A replica's heartbeat (``<prefix>:{replicas}:<replica id>``, with a TTL)."""
    return f"{space.prefix}:{{replicas}}:{replica}".encode()


def members_key(space: KeySpace) -> bytes:
    """The set of replica ids that ever beat (``<prefix>:{replicas}``; live = a beat exists)."""
    return f"{space.prefix}:{{replicas}}".encode()
