"""The Redis-shared registry: the local ``InMemoryRegistry`` becomes a near cache in front of it.

::

    Lookup (event loop)                                  Store / register (event loop)
      chunk own scope (+ shared)                           entries registered locally (visible now)
      keys missing from the local registry                 records queued (bounded, O(1) per chunk)
      ── one MGET per slot, ONE pipelined round trip ──>   flusher thread, every publish_interval_s:
         (worker thread, timeout_s; skipped while down)      one pipeline of SET per record
      records verified to be of the asked scope           peers see a chunk <= publish_interval_s
      inserted locally: RESIDENT when the bytes sit        + one Redis write after it was registered
      in the shared remote tier this sidecar reads,
      OBSERVED (never served) when only the owner has them

Failure (Redis gone, slow or restarting): Lookups skip Redis while it is down and never wait
longer than ``timeout_s`` for it; the local registry is never touched by a Redis failure. The
flusher thread reconnects with jittered exponential backoff, keeps unsent publishes (oldest
dropped past ``max_pending``, counted) and sends them once Redis answers again. Health changes
are reported to a listener (the server's gRPC health name for the registry).

Tenancy: Redis keys are derived from the server-side, scope-salted chunk keys of the Lookup's
own scope and ``shared`` only (``shared_keys``), and a record whose scope is not the one it was
asked for is dropped, so a tenant never sees another tenant's private chunks through Redis.

Threads: ``fill``/``publish`` run on the event loop that owns the local registry; reads run in a
small worker pool; writes in one flusher thread. Stats are plain counters read at scrape time.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from sidecar.identity import SHARED_SCOPE
from sidecar.registry.chunker import variant_keys
from sidecar.registry.entry import ChunkEntry, EntryState, token_digest
from sidecar.registry.shared_keys import KeySpace, SharedRecord, SharedRegistryConfig
from sidecar.tiers import Tier

if TYPE_CHECKING:
    from sidecar.registry.chunk_index import ChunkIndex, LookupQuery
    from sidecar.registry.chunker import Chunks

logger = logging.getLogger(__name__)

#: Error counter labels (``kv_sidecar_shared_registry_errors_total{op}``).
OPS = ("read", "publish", "connect")


class ResidencyWriter(Protocol):
    """What the flusher sends for routing (``sidecar.routing.residency.Residency``)."""

    def take(self, limit: int) -> list: ...
    def restore(self, ops: list) -> None: ...
    def write(self, pipe: Any, ops: list) -> None: ...
    def beat_due(self, now: float) -> bool: ...
    def beat(self, pipe: Any, now: float) -> None: ...
    def beat_failed(self) -> None: ...
    def beat_answered(self, previous: Any, now: float) -> None: ...
    def leave(self, client: Any) -> None: ...


@dataclass(slots=True)
class SharedRegistryStats:
    up: bool = False
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    reads: int = 0  # Lookups that went to Redis (one round trip each)
    reads_skipped: int = 0  # Lookups with local misses that did not ask Redis (down)
    read_keys: int = 0
    read_found: int = 0  # records absorbed into the local registry
    published: int = 0  # records written
    dropped: int = 0  # queued records dropped (oldest first) past max_pending
    reconnects: int = 0


class SharedRegistry:
    """Redis-backed chunk index shared by sidecars (see the module docstring).

    ``shared_tier``: this sidecar's remote tier (``host:port/namespace``, empty without one);
    a peer's chunk is served here only when its bytes sit in that same tier.
    """

    def __init__(self, config: SharedRegistryConfig, *, sidecar_id: str, shared_tier: str = "") -> None:
        if not config.enabled:
            raise ValueError("shared_registry.redis_url is required to run the shared registry")
        self.config = config
        self.sidecar_id = sidecar_id
        self.shared_tier = shared_tier
        self.keys = KeySpace(config.key_prefix)
        self.stats = SharedRegistryStats()
        #: Whether any sidecar published into the ``shared`` scope (refreshed by the flusher).
        self.shared_nonempty = True
        self._pending: deque[tuple[bytes, bytes | None, bool, str]] = deque()  # key, record, resident, scope
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._reader: Any = None
        self._writer: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        self._listener: Callable[[bool], None] | None = None
        self._retry_at = 0.0
        self._backoff = config.backoff_initial_s
        self._probed_at = 0.0
        self._was_up = False
        #: this replica's residency writer (routing; None without ``routing.replica_id``): its
        #: writes and heartbeat ride on the flusher's pipelines
        self.residency: ResidencyWriter | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, listener: Callable[[bool], None] | None = None) -> bool:
        """Connect (one bounded attempt; a failure leaves the registry degraded, not broken)
        and start the flusher. ``listener(up)`` is called from any thread on every health
        change. Returns whether Redis answered."""
        self._listener = listener
        self._reader = self._client()
        self._writer = self._client()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="shared-registry-read")
        self._try_connect()
        if self.stats.up:
            # Whether any sidecar has shared chunks, known before the first Lookup (else the
            # first Lookups search the shared scope too, until the flusher's first probe).
            try:
                self.shared_nonempty = bool(int(self._writer.get(self.keys.count_key(SHARED_SCOPE)) or 0))
                self._probed_at = time.monotonic()
            except Exception:  # noqa: BLE001 - the flusher probes again
                pass
        self._thread = threading.Thread(target=self._run, name="shared-registry-flush", daemon=True)
        self._thread.start()
        return self.stats.up

    def _client(self) -> Any:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        cfg = self.config
        # No client-side retries: one bounded attempt per call; the flusher owns reconnection.
        kw = dict(socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.timeout_s, retry=Retry(NoBackoff(), 0))
        if cfg.cluster:
            from redis.cluster import RedisCluster

            return RedisCluster.from_url(cfg.redis_url, **kw)
        return redis.Redis.from_url(cfg.redis_url, **kw)

    def close(self, timeout: float = 1.0) -> None:
        """Stop the flusher after one last flush attempt (bounded by ``timeout``). Idempotent."""
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.residency is not None and self.stats.up:
            try:
                self.residency.leave(self._writer)
            except Exception:  # noqa: BLE001 - the heartbeat then expires on its own
                pass
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for c in (self._reader, self._writer):
            if c is not None:
                try:
                    c.close()
                except Exception:  # noqa: BLE001 - closing a dead connection
                    pass

    @property
    def up(self) -> bool:
        return self.stats.up

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _set_up(self, up: bool, op: str = "", exc: BaseException | None = None) -> None:
        st = self.stats
        if op:
            st.errors[op] += 1
        if up == st.up:
            return
        st.up = up
        if up:
            self._backoff = self.config.backoff_initial_s
            st.reconnects += self._was_up
            self._was_up = True
            logger.info("shared registry: Redis answers again; %d publishes pending", len(self._pending))
        else:
            self._retry_at = time.monotonic() + self._backoff
            logger.warning("shared registry: Redis unavailable (%s: %s); serving from the local registry", op, exc)
        if self._listener is not None:
            try:
                self._listener(up)
            except Exception:  # noqa: BLE001 - a listener must not break the registry
                logger.exception("shared registry health listener failed")

    def _try_connect(self) -> None:
        try:
            self._writer.ping()
        except Exception as exc:  # noqa: BLE001 - any transport error means down
            self._backoff = min(self._backoff * 2, self.config.backoff_max_s)
            self._retry_at = time.monotonic() + self._backoff * (0.5 + random.random() / 2)
            self._set_up(False, "connect", exc)
            return
        self._set_up(True)

    # ------------------------------------------------------------------ Lookup (near cache)

    async def fill(self, index: ChunkIndex, q: LookupQuery) -> Chunks:
        """Chunk ``q`` (own scope, plus ``shared`` when any sidecar has shared chunks) and bring
        the chunks missing from the local registry in from Redis: at most ONE pipelined round
        trip, run in a worker thread, bounded by ``timeout_s``; skipped while Redis is down.
        The same round trip also asks for each chunk's copy computed after the prompt's own
        left context (``variant_key``) where no exact copy is held here; those alone never make
        a round trip. Returns the chunks for ``index.lookup(q, chunks)``. Never raises for
        Redis."""
        reg = index.registry
        own = q.scope
        search_shared = own != SHARED_SCOPE and (self.shared_nonempty or reg.scope_entries(SHARED_SCOPE) > 0)
        scopes = (own, SHARED_SCOPE) if search_shared else (own,)
        chunks = index.chunk(q.tokens, q.identity, scopes)
        c0 = int(np.searchsorted(chunks.bounds, q.engine_prefix_len, side="right")) - 1
        missing: list[int] = []
        keys: list[bytes] = []
        scope_of: list[str] = []
        copies: list[tuple[int, str]] = []
        # A Lookup that serves RESIDENT chunks only also asks again for local entries it cannot
        # serve: a peer may have stored their KV since (metadata published before the bytes).
        refresh = not q.dry_run
        resident = EntryState.RESIDENT
        starts = chunks.bounds[c0:-1].tolist()
        prefix = chunks.prefix_digests[c0:].tolist()
        vks = variant_keys(chunks)
        for row, scope in enumerate(scopes):
            fps = chunks.fingerprints[row, c0:].tolist()
            have = reg.get_many(fps)
            if refresh:
                miss = [k for k, e in zip(fps, have) if e is None or e.state is not resident]
            else:
                miss = [k for k, e in zip(fps, have) if e is None]
            if miss:
                missing += miss
                keys += self.keys.chunk_keys(scope, miss)
                scope_of += [scope] * len(miss)
            vs = vks[row, c0:].tolist()
            for v, ve, e, a, p in zip(vs, reg.get_many(vs), have, starts, prefix):
                if ve is not None and (ve.state is resident or not refresh):
                    continue  # the exact copy is here
                if e is not None and e.source_pos == a and e.prefix_digest == p and (e.state is resident or not refresh):
                    continue  # the canonical copy is the exact one
                copies.append((v, scope))
        if not keys:
            return chunks
        for v, scope in copies:
            missing.append(v)
            keys += self.keys.chunk_keys(scope, (v,))
            scope_of.append(scope)
        raw = await self.run_read(lambda r: self._mget(r, keys))
        if raw is not None:
            self.absorb(reg, missing, scope_of, raw)
        return chunks

    async def run_read(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(reader client)`` in the read pool, bounded by ``timeout_s`` per Redis call; None
        while Redis is down, when it fails (Redis then counts as down), or while closing."""
        if not self.stats.up or self._pool is None:
            self.stats.reads_skipped += 1
            return None

        def call() -> Any:
            self.stats.reads += 1
            try:
                return fn(self._reader)
            except Exception as exc:  # noqa: BLE001 - Redis trouble never fails a call
                self._set_up(False, "read", exc)
                return None

        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, call)
        except RuntimeError:  # pool shut down (closing)
            return None

    def _mget(self, reader: Any, keys: list[bytes]) -> list[bytes | None]:
        """One round trip: MGET on one server; one MGET per slot in one pipeline on Cluster."""
        self.stats.read_keys += len(keys)
        if not self.config.cluster:
            return reader.mget(keys)
        # redis-py refuses MGET in a user cluster pipeline; mget_nonatomic partitions the keys by
        # slot and sends one MGET per slot through its own pipeline (the hash tag puts a scope on
        # one slot: at most two MGETs, own scope and shared)
        return reader.mget_nonatomic(keys)

    def absorb(self, reg: Any, keys: list[int], scopes: list[str], raw: list[bytes | None]) -> set[int]:
        """Insert the records found into the local registry (loop thread). Returns the keys
        whose bytes sit in this sidecar's shared remote tier (servable here from it)."""
        n = 0
        servable: set[int] = set()
        tier_b = self.shared_tier.encode()
        decode = SharedRecord.decode_entry
        scope_b = {s: s.encode() for s in set(scopes)}
        resident = EntryState.RESIDENT
        for key, scope, value in zip(keys, scopes, raw):
            if value is None:
                continue
            # never lets a record cross scopes: None unless it carries the scope it was asked for
            e = decode(value, key, scope, scope_b[scope], tier_b)
            if e is None:
                continue
            if e.state is resident:
                servable.add(key)
            old = reg.peek(key)
            if old is None:
                n += reg.insert(e)
            elif e.state is resident and old.state is not resident and (
                old.num_tokens == e.num_tokens and (not old.tokens or token_digest(old.tokens) == e.digest)
            ):
                # Known here as metadata only; a peer's copy is servable now: it is canonical.
                reg.update(old, source_pos=e.source_pos, prefix_digest=e.prefix_digest,
                           left_context=e.left_context, digest=e.digest)
                reg.set_state(old, resident, Tier.REMOTE.value)
                n += 1
        self.stats.read_found += n
        return servable

    # ------------------------------------------------------------------ publish

    def publish(self, entries: Iterable[ChunkEntry | None], shared_copies: Collection[int] = (), *,
                only_missing: bool = False) -> None:
        """Queue records of ``entries`` (loop thread; O(1) per entry, no I/O). ``shared_copies``:
        keys whose bytes the remote tier now holds. A RESIDENT record replaces what Redis
        holds; an OBSERVED one is only written where Redis has nothing yet, and so is every
        record with ``only_missing`` (publishing again after Redis came back without its data)."""
        shared_tier = self.shared_tier
        owner = self.sidecar_id
        ctx = self.config.share_left_context
        batch = []
        for e in entries:
            if e is None:
                continue
            rec = SharedRecord.of(e, owner, shared_tier if e.key in shared_copies else "", ctx)
            replace = rec.resident and not only_missing
            batch.append((self.keys.chunk_keys(e.scope, (e.key,))[0], rec.encode(), replace, e.scope))
        self._enqueue(batch)

    def unpublish(self, entries: Iterable[tuple[int, str]]) -> None:
        """Queue deletions of ``(chunk key, scope)`` records (operator Delete)."""
        self._enqueue([(self.keys.chunk_keys(scope, (k,))[0], None, False, scope) for k, scope in entries])

    def _enqueue(self, batch: list[tuple[bytes, bytes | None, bool, str]]) -> None:
        if not batch:
            return
        limit = self.config.max_pending
        with self._lock:
            q = self._pending
            q.extend(batch)
            over = len(q) - limit
            for _ in range(max(0, over)):
                q.popleft()
            if over > 0:
                self.stats.dropped += over

    # ------------------------------------------------------------------ flusher thread

    def _run(self) -> None:
        cfg = self.config
        while True:
            closing = self._closing
            if self.stats.up:
                self._flush()
            elif time.monotonic() >= self._retry_at or closing:
                self._try_connect()
                if self.stats.up:
                    self._flush()
            if closing:
                return
            wait = cfg.publish_interval_s if self.stats.up else max(0.0, min(cfg.publish_interval_s * 4,
                                                                               self._retry_at - time.monotonic()))
            self._wake.wait(wait)

    def _flush(self) -> None:
        """Send what is queued, batch by batch, while Redis answers (records first, then this
        replica's residency writes and heartbeat: a scorer finds a chunk's record whenever it
        finds the chunk's residency); probe the shared scope."""
        cfg = self.config
        ttl = int(cfg.entry_ttl_s) or None
        now = time.monotonic()
        probe = now - self._probed_at >= cfg.probe_interval_s
        res = self.residency
        beat = res is not None and res.beat_due(now)
        while True:
            with self._lock:
                n = min(len(self._pending), cfg.max_batch)
                batch = [self._pending.popleft() for _ in range(n)]
            ops = res.take(cfg.max_batch) if res is not None else []
            if not batch and not probe and not ops and not beat:
                return
            try:
                pipe = self._writer.pipeline(transaction=False)
                for key, value, resident, _scope in batch:
                    if value is None:
                        pipe.delete(key)
                    elif resident:
                        pipe.set(key, value, ex=ttl, get=True)
                    else:
                        pipe.set(key, value, ex=ttl, nx=True)
                if ops:
                    res.write(pipe, ops)
                if beat:
                    beat_at = len(pipe)
                    res.beat(pipe, now)
                if probe:
                    pipe.get(self.keys.count_key(SHARED_SCOPE))
                results = pipe.execute()
                new: dict[str, int] = {}
                for (_key, value, resident, scope), r in zip(batch, results):
                    if value is not None and ((resident and r is None) or (not resident and r)):
                        new[scope] = new.get(scope, 0) + 1
                if new:
                    pipe = self._writer.pipeline(transaction=False)
                    for scope, k in new.items():
                        pipe.incrby(self.keys.count_key(scope), k)
                    pipe.execute()
                    if SHARED_SCOPE in new:
                        self.shared_nonempty = True
            except Exception as exc:  # noqa: BLE001 - put the batch back, go down, retry later
                with self._lock:
                    self._pending.extendleft(reversed(batch))
                    over = len(self._pending) - cfg.max_pending
                    for _ in range(max(0, over)):
                        self._pending.popleft()
                    if over > 0:
                        self.stats.dropped += over
                if ops:
                    res.restore(ops)
                if beat:
                    res.beat_failed()
                self._set_up(False, "publish", exc)
                return
            self.stats.published += sum(1 for b in batch if b[1] is not None)
            if beat:
                res.beat_answered(results[beat_at], now)
            beat = False
            if probe:
                self.shared_nonempty = SHARED_SCOPE in new or bool(int(results[-1] or 0))
                self._probed_at = now
                probe = False
            if not batch and not ops:
                return
