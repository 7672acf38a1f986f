"""Residency: which replica holds which chunk, and in which tier, kept in the shared registry's Redis.

::

    registry mutation (loop thread)          flusher thread (the shared registry's), each flush:
      insert / set_state / update / evict      HSET  <prefix>:{scope}:r:<key>  <replica> <value>
      ──> Residency.changed: O(1), coalesced      + EXPIRE (shared_registry.entry_ttl_s)
          per chunk, only when the chunk's      HDEL  <prefix>:{scope}:r:<key>  <replica>
          LOCAL tier (gpu/cpu/disk) changes     every heartbeat_ttl_s / 3:
                                                  SET <prefix>:{replicas}:<replica> <beat> PX ttl GET
                                                  SADD <prefix>:{replicas} <replica>

A field's value is ``tier code | incarnation | source_pos | prefix_digest | next_digest`` (25
bytes): the tier of the replica's copy, where that copy was computed and the prefix digest its
successor has there, so a score tells an exact hit from a shifted one for THAT replica's copy
(two replicas may hold one chunk computed at different positions) and coalesces consecutive
copies as the replica's own Lookup does. The field is named by the replica for the chunk's
canonical copy there, and ``<replica>@<prefix digest, 16 hex>`` for each of its other copies of
the chunk (computed after other left contexts, ``ChunkEntry.base_key``): a scorer reads, per
chunk of a prompt, each candidate's canonical copy and its copy after the prompt's own left
context with ONE HMGET. Copies in the shared remote tier are not residency: the chunk records
already say which remote tier holds them, and every replica reading that tier can serve them.

Liveness: the heartbeat key expires ``heartbeat_ttl_s`` after the last beat, so a replica that
stops beating (killed, partitioned) leaves the scores within the TTL. A restarted replica has a
new random ``incarnation``: fields written by its earlier run are ignored by scorers until its
recovered chunks are published again. A replica that stops cleanly deletes its heartbeat.
"""

from __future__ import annotations

import json
import random
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from sidecar.identity import CacheIdentity
from sidecar.registry.entry import ChunkEntry, EntryState
from sidecar.registry.shared_keys import KeySpace, beat_key, members_key, residency_keys
from sidecar.tiers import TIER_NAMES, Tier

VALUE = struct.Struct("<BIIQQ")
#: residency tier codes (1 + rank among the local tiers); the remote tier is never residency
LOCAL_TIERS: tuple[str, ...] = tuple(t for t in TIER_NAMES if t != Tier.REMOTE.value)
_CODE = {t: i + 1 for i, t in enumerate(LOCAL_TIERS)}
_RESIDENT = EntryState.RESIDENT
#: identities a beat names (newest first)
MAX_BEAT_IDENTITIES = 16


@dataclass(frozen=True, slots=True)
class Holding:
    """One replica's copy of a chunk, as its residency field says."""

    tier: str
    source_pos: int
    prefix_digest: int
    next_digest: int


@dataclass(frozen=True, slots=True)
class Beat:
    """A replica's heartbeat: its incarnation, the remote tier it reads, its engines' identities."""

    incarnation: int
    shared_tier: str = ""
    identities: tuple[CacheIdentity, ...] = ()

    def encode(self) -> bytes:
        return json.dumps({
            "incarnation": self.incarnation, "shared_tier": self.shared_tier,
            "identities": [{k: v for k, v in asdict(i).items() if not k.startswith("_")} for i in self.identities],
        }, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes | None) -> Beat | None:
        """None for a missing or unreadable beat (Redis is shared: never an exception)."""
        if not raw:
            return None
        try:
            d = json.loads(raw)
            idents = tuple(CacheIdentity(**i) for i in d.get("identities", ()))
            return cls(int(d["incarnation"]), str(d.get("shared_tier", "")), idents)
        except (ValueError, TypeError, KeyError):
            return None


def decode_holding(raw: bytes | None, incarnation: int) -> Holding | None:
    """The holding a field value names, or None: missing, unreadable, or written by another
    incarnation of the replica than the one beating now."""
    if raw is None or len(raw) != VALUE.size:
        return None
    code, inc, pos, prefix, nxt = VALUE.unpack(raw)
    if inc != incarnation or not 1 <= code <= len(LOCAL_TIERS):
        return None
    return Holding(LOCAL_TIERS[code - 1], pos, prefix, nxt)


def _local_tier(state: EntryState | None, tier: str | None) -> str | None:
    return tier if state is _RESIDENT and tier in _CODE else None


def copy_field(replica: bytes, prefix_digest: int) -> bytes:
    """The residency field of ``replica``'s copy of a chunk computed after the left context
    ``prefix_digest`` (not its canonical copy: that one's field is the replica id)."""
    return b"%s@%016x" % (replica, prefix_digest)


class Residency:
    """This replica's residency writer: the registry's observer (``changed``) and what the shared
    registry's flusher sends (``write``). ``identities`` its engines stored under are named in
    its beat (for llm-d's GetPodScores, which names a model, not an identity)."""

    def __init__(self, keys: KeySpace, replica: str, *, ttl_s: float, entry_ttl_s: float, shared_tier: str = "",
                 incarnation: int | None = None) -> None:
        self.keys = keys
        self.replica = replica
        self.field = replica.encode()
        self.ttl_s = ttl_s
        self.entry_ttl = int(entry_ttl_s) or None
        self.shared_tier = shared_tier
        self.incarnation = random.getrandbits(32) if incarnation is None else incarnation
        #: (scope, the chunk's key, field) -> value (None: delete the field)
        self._pending: dict[tuple[str, int, bytes], bytes | None] = {}
        self._lock = threading.Lock()
        self._identities: dict[CacheIdentity, None] = {}
        self._beat_at = 0.0
        self._beat_ok_at = 0.0
        self.written = 0  # fields set or deleted (counter)
        #: called (flusher thread) when Redis lost this replica's heartbeat within its TTL: Redis
        #: restarted without its data, unnoticed (redis-py reconnects a dead connection quietly)
        self.on_lost: Callable[[], None] | None = None

    # ------------------------------------------------------------------ loop thread

    def changed(self, entry: ChunkEntry, was_state: EntryState | None, was_tier: str | None, removed: bool) -> None:
        """The registry's observer: ``entry`` was inserted, changed state or tier, was updated, or
        was ``removed``. Queues a write when what this replica holds locally changed (O(1))."""
        was = _local_tier(was_state, was_tier)
        now = None if removed else _local_tier(entry.state, entry.tier)
        if was is None and now is None:
            return
        value = None if now is None else VALUE.pack(_CODE[now], self.incarnation, entry.source_pos,
                                                       entry.prefix_digest, entry.next_digest)
        if entry.base_key:
            op = (entry.scope, entry.base_key, copy_field(self.field, entry.prefix_digest))
        else:
            op = (entry.scope, entry.key, self.field)
        with self._lock:
            self._pending[op] = value

    def saw_identity(self, identity: CacheIdentity) -> None:
        """An engine stored KV under ``identity`` (named in the next beats; newest first)."""
        ids = self._identities
        with self._lock:
            ids.pop(identity, None)
            ids[identity] = None
            while len(ids) > MAX_BEAT_IDENTITIES:
                del ids[next(iter(ids))]

    def identities(self) -> tuple[CacheIdentity, ...]:
        """The identities named in the beat, newest first."""
        with self._lock:
            return tuple(reversed(list(self._identities)))

    # ------------------------------------------------------------------ flusher thread

    def take(self, limit: int) -> list[tuple[tuple[str, int, bytes], bytes | None]]:
        with self._lock:
            if len(self._pending) <= limit:
                ops, self._pending = list(self._pending.items()), {}
                return ops
            ops = []
            for k in list(self._pending)[:limit]:
                ops.append((k, self._pending.pop(k)))
            return ops

    def restore(self, ops: Iterable[tuple[tuple[str, int, bytes], bytes | None]]) -> None:
        """Put back writes that failed, unless a newer change of the same chunk is queued."""
        with self._lock:
            for k, v in ops:
                self._pending.setdefault(k, v)

    def write(self, pipe: Any, ops: list[tuple[tuple[str, int, bytes], bytes | None]]) -> None:
        """Queue ``ops`` (from ``take``) on a Redis pipeline."""
        ttl = self.entry_ttl
        for (scope, key, f), value in ops:
            rkey = residency_keys(self.keys, scope, (key,))[0]
            if value is None:
                pipe.hdel(rkey, f)
            else:
                pipe.hset(rkey, f, value)
                if ttl:
                    pipe.expire(rkey, ttl)
        self.written += len(ops)

    def beat_due(self, now: float) -> bool:
        return now - self._beat_at >= self.ttl_s / 3

    def beat(self, pipe: Any, now: float) -> None:
        """Queue this replica's heartbeat on a pipeline."""
        beat = Beat(self.incarnation, self.shared_tier, self.identities())
        pipe.set(beat_key(self.keys, self.replica), beat.encode(), px=int(self.ttl_s * 1000), get=True)
        pipe.sadd(members_key(self.keys), self.field)
        self._beat_at = now

    def beat_answered(self, previous: bytes | None, now: float) -> None:
        """The beat was written; ``previous`` is what the key held. Nothing, although the last
        beat was written within the TTL: Redis lost its data (``on_lost``)."""
        lost = previous is None and self._beat_ok_at and now - self._beat_ok_at < 0.9 * self.ttl_s
        self._beat_ok_at = now
        if lost and self.on_lost is not None:
            self.on_lost()

    def beat_failed(self) -> None:
        """The pipeline carrying the last beat failed: beat again at the next flush."""
        self._beat_at = 0.0

    def leave(self, client: Any) -> None:
        """Delete the heartbeat (a clean stop): scorers drop this replica at once."""
        client.delete(beat_key(self.keys, self.replica))
        self._beat_at = 0.0
