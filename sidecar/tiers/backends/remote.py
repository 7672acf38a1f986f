"""The remote tier on Redis/Valkey through redis-py with the hiredis reply parser, an
``ObjectBackend``.

One object per chunk under ``kvsidecar:<namespace>:<key hex>``: the envelope header followed
by the payload, so any sidecar pointed at the same server reads a chunk by key alone (its size
and checksum come with it). Every batched call is one command, so one round trip: ``MGET`` for
reads (of any mix of sizes), ``SET`` per write, ``DEL`` for removals. A failed call never
poisons the next one: redis-py drops a connection whose call failed and the pool opens a fresh
one at the next use, so nothing here resynchronizes or reconnects by hand.

Chosen over LMCache's ``resp`` adapter after measuring (``./dev bench peer_fetch``,
``./dev bench tiers --only remote``): its batched GET of objects of different sizes failed every
object whose size differed from the batch's first and then lost protocol sync (a reconnect and a
retry per chunk: a peer's Fetch of an 8K-token prompt took 24 s, now 0.4 s). Its native client
reads batches of one size about twice as fast (docs/benchmarks.md); content-defined chunks
never come in one size.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from sidecar.tiers.backends.base import LoadFailure, ObjectBackend
from sidecar.tiers.config import RemoteEndpoint, StoreConfig
from sidecar.tiers.types import ChunkKey, Tier

logger = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 0.25  # a PING's bound while the tier is being avoided


class RemoteTier(ObjectBackend):
    """Remote tier over Redis/Valkey, shared by every sidecar pointed at the same server.

    Redis may evict on its own (maxmemory); such a chunk is simply a miss. Calls block at most
    ``timeout_s``; one that fails (refused, reset, timed out) raises ``TimeoutError`` from reads
    and returns False from writes and removals, which opens the store's breaker for the tier;
    ``probe`` (a PING) tells the breaker when Redis answers again.
    """

    tier = Tier.REMOTE

    def __init__(
        self, *, url: str, capacity_bytes: int, namespace: str, workers: int, timeout_s: float,
    ) -> None:
        ep = RemoteEndpoint.parse(url)
        self.capacity_bytes = capacity_bytes
        self._prefix = f"kvsidecar:{namespace}:".encode()
        self._timeout = timeout_s
        kw = dict(
            host=ep.host, port=ep.port, db=ep.db, username=ep.username or None, password=ep.password or None,
            retry=Retry(NoBackoff(), 0),  # the store's breaker decides when to try again
        )
        # Calls come from the store's worker threads: one connection each, a caller waits for a
        # free one at most one I/O timeout.
        self._pool = redis.BlockingConnectionPool(
            max_connections=max(2, 2 * workers), timeout=timeout_s, socket_read_size=1 << 20,
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **kw,
        )
        self._client = redis.Redis(connection_pool=self._pool)
        self._probe_pool = redis.ConnectionPool(
            max_connections=1, socket_timeout=_PROBE_TIMEOUT_S, socket_connect_timeout=_PROBE_TIMEOUT_S, **kw,
        )
        #: calls that failed on the wire (each cost its connection; the next call opens a new one)
        self.reconnects = 0
        if not self.probe():
            logger.warning("remote tier: Redis at %s:%d not reachable yet; its reads miss until it answers",
                           ep.host, ep.port)

    @classmethod
    def from_config(cls, config: StoreConfig) -> RemoteTier | None:
        if config.remote_bytes <= 0:
            return None
        assert config.remote_url is not None
        return cls(
            url=config.remote_url,
            capacity_bytes=config.remote_bytes,
            namespace=config.namespace,
            workers=config.remote_workers,
            timeout_s=config.io_timeout_s,
        )

    def _name(self, key: ChunkKey) -> bytes:
        return self._prefix + key.hex().encode()

    def _failed(self, what: str, exc: Exception) -> None:
        self.reconnects += 1
        logger.debug("remote tier: %s failed: %s", what, exc)

    def footprint(self, nbytes: int) -> int:
        return nbytes

    def probe(self) -> bool:
        """Whether Redis answers a PING now (bounded by a short timeout of its own)."""
        try:
            with redis.Redis(connection_pool=self._probe_pool) as client:
                return bool(client.ping())
        except (redis.RedisError, OSError):
            self._probe_pool.disconnect()
            return False

    def store(self, key: ChunkKey, obj: torch.Tensor) -> bool:
        try:
            return bool(self._client.set(self._name(key), memoryview(obj.numpy())))
        except (redis.RedisError, OSError) as exc:
            self._failed("SET", exc)
            return False

    def load_objects(self, keys: Sequence[ChunkKey]) -> list[torch.Tensor | None]:
        """Objects of ``keys`` at whatever size the server holds (``None``: not there), in one
        round trip; ``TimeoutError`` when the server did not answer. For chunks this store
        has no record of (another sidecar's): the object's own header says what it is."""
        if not keys:
            return []
        try:
            values = self._client.mget([self._name(k) for k in keys])
        except (redis.RedisError, OSError) as exc:
            self._failed("MGET", exc)
            raise TimeoutError(f"remote MGET of {len(keys)} objects failed: {exc}") from exc
        # One copy into memory the caller owns (the reply's bytes are immutable).
        return [None if v is None else torch.frombuffer(bytearray(v), dtype=torch.uint8) for v in values]

    def load_many(self, keys: Sequence[ChunkKey], sizes: Sequence[int]) -> list[torch.Tensor | LoadFailure]:
        """Objects of ``keys`` or why not (``MISSING``: not on the server, ``UNREADABLE``: there
        but not of the expected size), in one round trip; ``TimeoutError`` when the server did
        not answer."""
        out: list[torch.Tensor | LoadFailure] = []
        for obj, size in zip(self.load_objects(keys), sizes, strict=True):
            if obj is None:
                out.append(LoadFailure.MISSING)
            elif obj.numel() != size:
                out.append(LoadFailure.UNREADABLE)
            else:
                out.append(obj)
        return out

    def remove(self, keys: Sequence[ChunkKey]) -> bool:
        """Delete objects; True once the server answered (absent keys are fine)."""
        if not keys:
            return True
        try:
            self._client.delete(*(self._name(k) for k in keys))
            return True
        except (redis.RedisError, OSError) as exc:
            self._failed("DEL", exc)
            return False

    def close(self, timeout: float) -> bool:
        self._pool.disconnect()
        self._probe_pool.disconnect()
        return True
