"""The remote tier on Redis/Valkey through LMCache's ``resp`` L2 adapter, an ``ObjectBackend``.

Kept over the alternatives after measuring (``./dev bench tiers --only remote``,
``bench/results/tiers.json`` "remote"): redis-py (already a dependency, with its own
Retry/backoff) needs none of the workarounds below, but its pure-Python reply parser (hiredis is
not installed) read 64 x 1 MiB 2-5x slower than this client in the same runs (~30-100 vs
~110-550 MiB/s on the loaded 2-core machine), and reads are the hot path (Fetch of chunks other
sidecars published); LMCache's ``valkey`` adapter needs valkey-glide, which is not installed.
The cost of keeping it is the resynchronization code below (pitfall 7 in ``sidecar.tiers``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import redis
import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import RESPL2AdapterConfig

from sidecar.tiers.backends.base import LoadFailure, ObjectBackend
from sidecar.tiers.backends.l2_driver import L2Driver
from sidecar.tiers.config import RemoteEndpoint, StoreConfig
from sidecar.tiers.envelope import HEADER_NBYTES, CorruptChunkError, parse_header
from sidecar.tiers.types import ChunkKey, ChunkMeta, Tier

logger = logging.getLogger(__name__)

_BODY = 0
_HEADER = 1
_PROBE = 2  # object group of the liveness probe key (never a chunk's)
_PROBE_KEY = b"kv-sidecar-probe"
_RETRY_INITIAL_S = 0.05  # PING back-off while Redis is down
_RETRY_MAX_S = 1.0


class RemoteTier(ObjectBackend):
    """Remote tier on LMCache's ``resp`` adapter (native C++ RESP client) over Redis/Valkey.

    Shared by every sidecar pointed at the same server: a chunk is stored as the object plus a
    header copy, so any sidecar can fetch it by key alone. Redis may evict on its own
    (maxmemory); such a chunk is simply a miss.

    LMCache 0.5.6's RESP client loses protocol sync on any failed GET: a GET of a missing key
    closes the connection for good ("socket recv failed", then "writev failed" forever) and a
    GET into a buffer of the wrong size leaves the reply stream shifted, so later GET/DEL/EXISTS
    read each other's replies. Hence: every GET is preceded by a batched EXISTS and uses the
    exact size (from the index or the fixed-size header copy), and any failed or unanswered
    call replaces the adapter with a fresh connection before the next use.

    A connection opened while Redis is down never recovers, yet answers every EXISTS with
    "absent" instead of failing, so a peer would miss forever once Redis is back (found by
    tests/faults/test_redis_kill.py). So each new connection is proven first: a probe key is
    written, found and deleted (SET, EXISTS, DEL) before it serves; until then calls fail as
    timeouts, which opens the tier's breaker, and the next call reconnects.

    The native client must never connect while Redis is down: LMCache 0.5.6's
    ``WorkerConn::connect`` closes its socket when the connect is refused and its destructor
    then closes the same fd number again, by then possibly another connection's (redis-py's
    shared registry, gRPC, a sibling worker). Two owners of one fd number cross-talk: the Redis-
    kill fault test saw the shared registry's pipeline read a chunk header that a native GET had
    asked for. So a connection opens only after a PING from Python succeeds, a replaced one is
    closed completely first, and both happen on a background thread that retries (with
    back-off) until Redis answers; calls made meanwhile fail as timeouts (the breaker's
    business) instead of waiting.
    """

    tier = Tier.REMOTE

    def __init__(
        self, *, url: str, capacity_bytes: int, namespace: str, workers: int, timeout_s: float,
        close_timeout_s: float = 5.0,
    ) -> None:
        self._endpoint = RemoteEndpoint.parse(url)
        self._workers = workers
        self.capacity_bytes = capacity_bytes
        self._namespace = namespace
        self._timeout = timeout_s
        self._close_timeout = close_timeout_s
        self._io_lock = threading.Condition()
        self._io: L2Driver | None = None  # None until connected, and while being replaced
        self._closed = False
        self._replacer: threading.Thread | None = None
        self._proven: L2Driver | None = None  # the connection whose probe succeeded
        self._prove_lock = threading.Lock()
        self._probe = torch.zeros(8, dtype=torch.uint8)
        self.reconnects = 0
        if self._reachable():
            self._io = self._connect()
        else:
            logger.warning("remote tier: Redis at %s:%d not reachable; connecting in the background",
                           self._endpoint.host, self._endpoint.port)
            self._start_replacer(None)

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
            close_timeout_s=config.close_timeout_s,
        )

    def _live_io(self) -> L2Driver:
        """The current connection once it has proven it reaches Redis; ``TimeoutError`` (after
        replacing it) when it cannot."""
        io = self._io
        if io is not None and io is self._proven:
            return io
        with self._prove_lock:  # one prover at a time: concurrent probes of one key would race
            io = self._io
            if io is None:
                raise TimeoutError("remote tier: reconnecting")
            if io is self._proven:
                return io
            probe = self._okey(_PROBE_KEY, _PROBE)
            if io.store([probe], [self._probe], self._timeout) and io.exists([probe], self._timeout) == [True]:
                io.delete([probe], self._timeout)
                self._proven = io
                return io
        self._reconnect(io)
        raise TimeoutError("remote tier: Redis not reachable")

    def _connect(self) -> L2Driver:
        ep = self._endpoint
        adapter = create_l2_adapter(
            RESPL2AdapterConfig(
                host=ep.host, port=ep.port, num_workers=self._workers, username=ep.username, password=ep.password
            ),
            None,
        )
        return L2Driver(adapter, "remote")

    def _reachable(self) -> bool:
        """Whether Redis answers a PING (from Python; see the class docstring for why)."""
        ep = self._endpoint
        try:
            with redis.Redis(
                host=ep.host, port=ep.port, username=ep.username or None, password=ep.password or None,
                socket_timeout=self._timeout, socket_connect_timeout=self._timeout,
            ) as client:
                return bool(client.ping())
        except (redis.RedisError, OSError):
            return False

    def _reconnect(self, bad: L2Driver | None) -> None:
        """Start replacing ``bad`` (close it, then connect) unless another caller already did."""
        with self._io_lock:
            if bad is None or self._io is not bad or self._closed:
                return
            self._io = None
            self.reconnects += 1
            self._start_replacer(bad)
        logger.warning("remote tier: RESP connection out of sync or down; reconnecting")

    def _start_replacer(self, bad: L2Driver | None) -> None:
        self._replacer = threading.Thread(
            target=self._replace, args=(bad,), name="kv-sidecar-resp-reconnect", daemon=True
        )
        self._replacer.start()

    def _replace(self, bad: L2Driver | None) -> None:
        if bad is not None and not bad.close(self._close_timeout):
            logger.warning("remote tier: old connection still closing; opening the next one anyway")
        wait = _RETRY_INITIAL_S
        while True:
            io = None
            try:
                if self._reachable():
                    io = self._connect()
            except Exception:  # noqa: BLE001 - keep trying until the tier closes; calls fail meanwhile
                logger.exception("remote tier: connecting to %s failed; retrying", self._endpoint.host)
            with self._io_lock:
                if self._closed:
                    break
                if io is not None:
                    self._io = io
                    self._io_lock.notify_all()
                    return
                self._io_lock.wait_for(lambda: self._closed, wait)
            wait = min(2 * wait, _RETRY_MAX_S)
        if io is not None:
            io.close(self._close_timeout)

    def _next_io(self) -> L2Driver:
        """The connection that replaces the one just given up: waits one I/O timeout plus the
        old one's close (LMCache's demux thread notices a close within 0.5 s)."""
        with self._io_lock:
            if not self._io_lock.wait_for(lambda: self._io is not None or self._closed, self._timeout + 1.0):
                raise TimeoutError("remote tier: reconnect did not finish")
            if self._io is None:
                raise TimeoutError("remote tier: closed")
            return self._io

    def _okey(self, key: ChunkKey, group: int = _BODY) -> ObjectKey:
        return ObjectKey(chunk_hash=key, model_name=self._namespace, kv_rank=0, object_group_id=group)

    def footprint(self, nbytes: int) -> int:
        return nbytes

    def store(self, key: ChunkKey, obj: torch.Tensor) -> bool:
        try:
            io = self._live_io()
        except TimeoutError:
            return False
        # Body first, then the header copy: a reader that finds the header finds the body.
        ok = io.store([self._okey(key)], [obj], self._timeout) and io.store(
            [self._okey(key, _HEADER)], [obj[:HEADER_NBYTES].clone()], self._timeout
        )
        if not ok:
            self._reconnect(io)
        return ok

    def _get(self, okeys: list[ObjectKey], sizes: Sequence[int]) -> list[torch.Tensor | LoadFailure]:
        """EXISTS, then GET of the present keys only, into buffers of exactly ``sizes``.

        One bad object in a batch desyncs the connection for the GETs queued behind it, so keys
        that fail in a batch are retried one by one, each on a fresh connection (EXISTS first
        again): only a key that fails alone is ``UNREADABLE``.
        """
        if not okeys:
            return []
        io = self._live_io()
        present = io.exists(okeys, self._timeout)
        if present is None:
            self._reconnect(io)
            raise TimeoutError("remote EXISTS timed out")
        out: list[torch.Tensor | LoadFailure] = [LoadFailure.MISSING] * len(okeys)
        wanted = [i for i, p in enumerate(present) if p]
        bufs = {i: torch.empty(sizes[i], dtype=torch.uint8) for i in wanted}
        ok = io.load([okeys[i] for i in wanted], [bufs[i] for i in wanted], self._timeout)
        if ok is None:
            ok = [False] * len(wanted)  # the GET hung: a key vanished after EXISTS
        retry = []
        for i, good in zip(wanted, ok, strict=True):
            if good:
                out[i] = bufs[i]
            else:
                retry.append(i)
        for i in retry:
            self._reconnect(io)
            io = self._next_io()
            again = io.exists([okeys[i]], self._timeout)
            if not again:  # gone (or no answer): a miss, not a corrupt object
                continue
            result = io.load([okeys[i]], [bufs[i]], self._timeout)
            out[i] = bufs[i] if result == [True] else LoadFailure.UNREADABLE
        if retry and out[retry[-1]] is LoadFailure.UNREADABLE:
            self._reconnect(io)
        return out

    def load_many(self, keys: Sequence[ChunkKey], sizes: Sequence[int]) -> list[torch.Tensor | LoadFailure]:
        """Objects of ``keys`` or why not (``MISSING``: not on the server, ``UNREADABLE``: there
        but not of the expected size); ``TimeoutError`` when the server did not answer (the
        connection is replaced)."""
        return self._get([self._okey(k) for k in keys], sizes)

    def load_headers(self, keys: Sequence[ChunkKey]) -> list[ChunkMeta | None]:
        """Metadata of chunks this store has no record of (written by another sidecar);
        ``TimeoutError`` when the server did not answer."""
        bufs = self._get([self._okey(k, _HEADER) for k in keys], [HEADER_NBYTES] * len(keys))
        out: list[ChunkMeta | None] = []
        for key, buf in zip(keys, bufs, strict=True):
            meta = None
            if isinstance(buf, torch.Tensor):
                try:
                    meta = parse_header(buf)
                except CorruptChunkError as exc:
                    logger.warning("corrupt remote header for %s: %s", key.hex(), exc)
                if meta is not None and meta.key != key:
                    meta = None
            out.append(meta)
        return out

    def suspect(self) -> None:
        """A read returned bytes that failed verification: resync the connection."""
        self._reconnect(self._io)

    def remove(self, keys: Sequence[ChunkKey]) -> bool:
        """Delete objects and header copies; True when the server no longer has them
        (checked with EXISTS: LMCache's client also misreports DEL on a desynced connection)."""
        okeys = [self._okey(k, g) for k in keys for g in (_BODY, _HEADER)]
        try:
            io = self._live_io()
        except TimeoutError:
            return False
        left = io.exists(okeys, self._timeout) if io.delete(okeys, self._timeout) else None
        if left is None or any(left):  # desynced (retry once on a fresh connection) or down
            self._reconnect(io)
            try:
                io = self._live_io()
            except TimeoutError:
                return False
            left = io.exists(okeys, self._timeout) if io.delete(okeys, self._timeout) else None
        return left is not None and not any(left)

    def close(self, timeout: float) -> bool:
        with self._io_lock:
            self._closed = True
            io, self._io = self._io, None
            replacer = self._replacer
            self._io_lock.notify_all()
        if replacer is not None:  # it closes the connection it was opening itself
            replacer.join(timeout)
        ok = replacer is None or not replacer.is_alive()
        return (io.close(timeout) if io is not None else True) and ok
