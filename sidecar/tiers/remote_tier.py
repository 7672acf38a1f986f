"""Remote tier on Redis/Valkey through redis-py (already a dependency: the shared registry).

LMCache's ``resp`` L2 adapter was used here before; its native client loses protocol sync on
any failed GET (a missing key closes the connection, a wrong-size buffer shifts the reply
stream), which took ~150 lines of EXISTS-before-GET and reconnect workarounds. LMCache's
``valkey`` adapter needs valkey-glide (a Rust client, not installed). redis-py answers a
missing key with ``None`` and any size with its bytes, retries transient connection errors
itself (``Retry`` with exponential backoff), and measured as fast on the tiers bench
(``bench/results/tiers.json``), so it replaced both.

Keys keep LMCache's naming (``<namespace>@00000000@<group>@<hex key>``; group 0 is the stored
object, group 1 a copy of its 4 KiB header, so a sidecar that never saw a chunk can read its
metadata first): what a previous version left in Redis stays readable.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import redis
import torch
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from sidecar.tiers.config import RemoteEndpoint
from sidecar.tiers.envelope import HEADER_NBYTES, CorruptChunkError, parse_header
from sidecar.tiers.l2_tiers import LoadFailure
from sidecar.tiers.types import ChunkKey, ChunkMeta, Tier

logger = logging.getLogger(__name__)

_BODY = 0
_HEADER = 1
_TRANSIENT = (redis.ConnectionError, redis.TimeoutError)


class RemoteTier:
    """Shared by every sidecar pointed at the same server: a chunk is stored as the object plus
    a header copy, so any sidecar can fetch it by key alone. Redis may evict on its own
    (maxmemory); such a chunk is simply a miss. Every call is bounded by ``timeout_s`` per
    attempt (two retries with backoff on a connection error); past that a read raises
    ``TimeoutError`` (a miss this time, nothing removed) and a write returns False."""

    tier = Tier.REMOTE

    def __init__(self, *, url: str, capacity_bytes: int, namespace: str, workers: int, timeout_s: float) -> None:
        ep = RemoteEndpoint.parse(url)
        self.capacity_bytes = capacity_bytes
        self._namespace = namespace
        self._redis = redis.Redis(
            host=ep.host,
            port=ep.port,
            username=ep.username or None,
            password=ep.password or None,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(ExponentialBackoff(cap=min(1.0, timeout_s), base=0.01), retries=2),
            retry_on_error=list(_TRANSIENT),
            max_connections=max(4, 4 * workers),
            health_check_interval=0,
            socket_read_size=1 << 20,  # values are MiB-sized: fewer, larger reads in the Python parser
        )
        self.reconnects = 0  # failed calls (each one's connection is replaced by the pool)

    def _name(self, key: ChunkKey, group: int = _BODY) -> bytes:
        return f"{self._namespace}@00000000@{group}@{key.hex()}".encode()

    def footprint(self, nbytes: int) -> int:
        return nbytes

    def _failed(self, what: str, exc: Exception) -> None:
        self.reconnects += 1
        logger.warning("remote tier: %s failed: %s", what, exc)

    def store(self, key: ChunkKey, obj: torch.Tensor) -> bool:
        """Body and header copy in one pipeline (body first: a reader that finds the header
        finds the body)."""
        data = memoryview(obj.numpy())
        try:
            with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(self._name(key), data)
                pipe.set(self._name(key, _HEADER), data[:HEADER_NBYTES])
                return all(pipe.execute())
        except (redis.RedisError, OSError) as exc:
            self._failed(f"write of {key.hex()}", exc)
            return False

    def _mget(self, names: list[bytes]) -> list[bytes | None]:
        try:
            return self._redis.mget(names)
        except (redis.RedisError, OSError) as exc:
            self._failed(f"read of {len(names)} objects", exc)
            raise TimeoutError(f"remote read of {len(names)} objects failed: {exc}") from exc

    def load_many(self, keys: Sequence[ChunkKey], sizes: Sequence[int]) -> list[torch.Tensor | LoadFailure]:
        """Objects of ``keys`` (one MGET) or why not (``MISSING``: not on the server,
        ``UNREADABLE``: there but not of the expected size); ``TimeoutError`` when the server
        did not answer."""
        if not keys:
            return []
        out: list[torch.Tensor | LoadFailure] = []
        for raw, size in zip(self._mget([self._name(k) for k in keys]), sizes, strict=True):
            if raw is None:
                out.append(LoadFailure.MISSING)
            elif len(raw) != size:
                out.append(LoadFailure.UNREADABLE)
            else:
                out.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8))  # the caller's to keep
        return out

    def load_headers(self, keys: Sequence[ChunkKey]) -> list[ChunkMeta | None]:
        """Metadata of chunks this store has no record of (written by another sidecar)."""
        if not keys:
            return []
        try:
            raws = self._mget([self._name(k, _HEADER) for k in keys])
        except TimeoutError:
            return [None] * len(keys)
        out: list[ChunkMeta | None] = []
        for key, raw in zip(keys, raws, strict=True):
            meta = None
            if raw is not None:
                try:
                    meta = parse_header(raw)
                except CorruptChunkError as exc:
                    logger.warning("corrupt remote header for %s: %s", key.hex(), exc)
                if meta is not None and meta.key != key:
                    meta = None
            out.append(meta)
        return out

    def suspect(self) -> None:
        """A read returned bytes that failed verification (nothing to resync with redis-py)."""

    def remove(self, keys: Sequence[ChunkKey]) -> bool:
        """Delete objects and header copies; True when the server confirmed the DEL."""
        if not keys:
            return True
        try:
            self._redis.delete(*(self._name(k, g) for k in keys for g in (_BODY, _HEADER)))
            return True
        except (redis.RedisError, OSError) as exc:
            self._failed(f"delete of {len(keys)} objects", exc)
            return False

    def close(self, timeout: float) -> bool:
        self._redis.close()
        self._redis.connection_pool.disconnect()
        return True
