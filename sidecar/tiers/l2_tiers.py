"""The disk tier on LMCache's ``fs_native`` L2 adapter (the remote tier: ``remote_tier``).

LMCache's L2 adapters are non-blocking (submit a task, poll an eventfd, pop the result).
``L2Driver`` turns one adapter into blocking batch calls with timeouts: a dispatcher thread
polls the adapter's eventfds and wakes waiters; buffers of a task that timed out stay referenced
until the adapter reports it, so a late completion never writes into freed memory.

Objects are stored under ``ObjectKey(chunk_hash=key, model_name=namespace, kv_rank=0)``
(``object_group_id`` 0: the stored object, header + payload).
"""

from __future__ import annotations

import enum
import fcntl
import logging
import os
import select
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.fs_native_l2_adapter import FSNativeL2AdapterConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform.event_notifier import consume_fd

from sidecar.tiers.disk_index import DiskIndex, IndexedObject
from sidecar.tiers.envelope import HEADER_NBYTES, CorruptChunkError, parse_header
from sidecar.tiers.types import ChunkKey, ChunkMeta, Tier

logger = logging.getLogger(__name__)

_BODY = 0


def wrap_host_buffer(buf: torch.Tensor) -> TensorMemoryObj:
    """An LMCache ``MemoryObj`` over a contiguous 1-D uint8 CPU tensor (no copy, no allocator)."""
    assert buf.device.type == "cpu" and buf.dtype == torch.uint8 and buf.is_contiguous(), (
        "L2 adapters read and write host memory only; stage device data through the CPU first"
    )
    meta = MemoryObjMetadata(
        shape=buf.shape,
        dtype=torch.uint8,
        address=0,
        phy_size=buf.numel(),
        ref_count=1,
        fmt=MemoryFormat.BINARY_BUFFER,
    )
    return TensorMemoryObj(buf, meta, None)


class L2Driver:
    """Blocking, thread-safe batch calls over one LMCache L2 adapter."""

    def __init__(self, adapter: L2AdapterInterface, name: str) -> None:
        self._adapter = adapter
        self._cv = threading.Condition()
        self._stores: dict[int, bool] = {}
        self._loads: dict[int, list[bool]] = {}
        self._lookups: dict[int, list[bool]] = {}
        self._pending_stores: set[int] = set()
        self._pending_loads: dict[int, int] = {}
        self._pending_lookups: dict[int, list[ObjectKey]] = {}
        self._keepalive: dict[tuple[str, int], object] = {}
        self._abandoned: set[tuple[str, int]] = set()
        self._closed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-sidecar-{name}-io", daemon=True)
        self._thread.start()

    # -- dispatcher ---------------------------------------------------------------------------

    def _run(self) -> None:
        poller = select.poll()
        fds = (
            self._adapter.get_store_event_fd(),
            self._adapter.get_load_event_fd(),
            self._adapter.get_lookup_and_lock_event_fd(),
        )
        for fd in fds:
            poller.register(fd, select.POLLIN)
        while not self._stop.is_set():
            # The timeout bounds the damage of a missed wake-up; results are re-polled anyway.
            try:
                for fd, _ in poller.poll(50):
                    consume_fd(fd)
            except OSError as exc:
                # The adapter's eventfds were closed under a late poll (by close(), or by the
                # adapter itself when its connection died): this dispatcher is done; waiters of
                # its tasks time out and the tier replaces the connection.
                if not self._stop.is_set():
                    logger.warning("L2 dispatcher stopped: adapter event fd closed (%s)", exc)
                return
            try:
                self._collect()
            except Exception:  # the adapter is closing or broken: waiters time out
                logger.exception("L2 dispatcher failed to collect completions")

    def _collect(self) -> None:
        stores = self._adapter.pop_completed_store_tasks()
        with self._cv:
            loads = dict(self._pending_loads)
            lookups = dict(self._pending_lookups)
        done_loads = {}
        for tid, n in loads.items():
            bm = self._adapter.query_load_result(tid)
            if bm is not None:
                done_loads[tid] = [bm.test(i) for i in range(n)]
        done_lookups = {}
        for tid, keys in lookups.items():
            bm = self._adapter.query_lookup_and_lock_result(tid)
            if bm is not None:
                found = [bm.test(i) for i in range(len(keys))]
                # The native adapter "locks" found keys with a client-side refcount; release them
                # at once, the store has its own readers.
                self._adapter.submit_unlock([k for k, f in zip(keys, found) if f])
                done_lookups[tid] = found
        if not (stores or done_loads or done_lookups):
            return
        with self._cv:
            self._pending_stores.difference_update(stores)
            for tid in done_loads:
                del self._pending_loads[tid]
            for tid in done_lookups:
                del self._pending_lookups[tid]
            store_ok = {tid: bool(r.is_successful()) for tid, r in stores.items()}
            for kind, results, target in (
                ("store", store_ok, self._stores),
                ("load", done_loads, self._loads),
                ("lookup", done_lookups, self._lookups),
            ):
                for tid, result in results.items():
                    self._keepalive.pop((kind, tid), None)
                    if (kind, tid) in self._abandoned:
                        self._abandoned.discard((kind, tid))
                    else:
                        target[tid] = result
            self._cv.notify_all()

    def _fail_pending(self) -> None:
        """Resolve every in-flight task as failed (the adapter is being abandoned)."""
        with self._cv:
            for tid in self._pending_stores:
                self._stores[tid] = False
            for tid in self._pending_loads:
                self._loads[tid] = None
            for tid in self._pending_lookups:
                self._lookups[tid] = None
            self._pending_stores.clear()
            self._pending_loads.clear()
            self._pending_lookups.clear()
            self._closed = True
            self._cv.notify_all()

    def _wait(self, kind: str, tid: int, results: dict, timeout: float):
        with self._cv:
            if self._closed and tid not in results:
                return None
            if not self._cv.wait_for(lambda: tid in results, timeout=timeout):
                self._abandoned.add((kind, tid))
                return None
            return results.pop(tid)

    # -- blocking calls -------------------------------------------------------------------------

    def store(self, keys: Sequence[ObjectKey], bufs: Sequence[torch.Tensor], timeout: float) -> bool:
        """Write every buffer (one task; success is all-or-nothing as LMCache reports it)."""
        objs = [wrap_host_buffer(b) for b in bufs]
        with self._cv:
            if self._closed:
                return False
            tid = self._adapter.submit_store_task(list(keys), objs)
            self._pending_stores.add(tid)
            self._keepalive[("store", tid)] = objs
        ok = self._wait("store", tid, self._stores, timeout)
        return bool(ok)

    def load(self, keys: Sequence[ObjectKey], bufs: Sequence[torch.Tensor], timeout: float) -> list[bool] | None:
        """Read each key into its buffer (sizes must match exactly); per-key success, or
        ``None`` when the backend did not answer within ``timeout``."""
        if not keys:
            return []
        objs = [wrap_host_buffer(b) for b in bufs]
        with self._cv:
            if self._closed:
                return None
            tid = self._adapter.submit_load_task(list(keys), objs)
            self._pending_loads[tid] = len(keys)
            self._keepalive[("load", tid)] = objs
        return self._wait("load", tid, self._loads, timeout)

    def exists(self, keys: Sequence[ObjectKey], timeout: float) -> list[bool] | None:
        """Per-key existence; ``None`` when the backend did not answer in time."""
        if not keys:
            return []
        with self._cv:
            if self._closed:
                return None
            tid = self._adapter.submit_lookup_and_lock_task(list(keys), {})
            self._pending_lookups[tid] = list(keys)
        return self._wait("lookup", tid, self._lookups, timeout)

    def delete(self, keys: Sequence[ObjectKey], timeout: float | None = None) -> bool:
        """Delete ``keys`` (best effort). LMCache's adapter blocks up to 30 s on a dead
        connection, so with ``timeout`` the call runs on a helper thread and is abandoned past
        it; returns False then (the caller treats the connection as failed)."""
        if not keys:
            return True
        if timeout is None:
            self._adapter.delete(list(keys))
            return True
        t = threading.Thread(target=self._adapter.delete, args=(list(keys),), name="kv-sidecar-l2-delete", daemon=True)
        t.start()
        t.join(timeout)
        return not t.is_alive()

    def close(self, timeout: float) -> bool:
        """Stop the dispatcher and close the adapter; never blocks past ``timeout``. Waiters of
        tasks still in flight return as failed at once."""
        self._stop.set()
        self._thread.join(timeout)
        self._fail_pending()
        closer = threading.Thread(target=self._adapter.close, name="kv-sidecar-l2-close", daemon=True)
        closer.start()
        closer.join(timeout)
        if closer.is_alive():
            logger.warning(
                "L2 adapter %s did not close within %.1f s; abandoned", type(self._adapter).__name__, timeout
            )
            return False
        return True


class LoadFailure(enum.Enum):
    """Why an object tier returned no object for a key."""

    MISSING = "missing"  # not there: deleted, evicted, never written
    UNREADABLE = "unreadable"  # there, but not readable as the expected object


@dataclass(frozen=True, slots=True)
class DiskFile:
    """A stored object found on disk at startup (header verified, payload not yet)."""

    meta: ChunkMeta
    nbytes: int
    mtime_ns: int
    path: str


_FOREIGN: DiskFile = object()  # type: ignore[assignment]  # DiskTier._read_header: not this key's file


class DiskTier:
    """Local disk tier on LMCache's ``fs_native`` adapter (C++ workers, write to ``.tmp`` then
    rename, one ``<namespace>@0x<rank>@<group>@<hex key>.data`` file per object).

    ``fs_native`` keeps no index and cannot list its keys, so this tier keeps its own
    (``sidecar.tiers.disk_index``: ``<path>/<namespace>.kvindex``) and a restart is served by
    ``scan()`` from it: one listing of the directory's names, no file opened except those the
    index does not name, whose header is read as before. Without an index ``scan()`` reads
    every file's header (the metadata is stored in the object). Either way stale ``.tmp`` files
    and corrupt objects are removed; an object whose bytes were damaged behind a valid record
    is found on its first read (a miss, then removed). One store owns a directory: an ``flock``
    on ``<path>/.kv-sidecar.lock`` refuses a second one.
    """

    tier = Tier.DISK

    def __init__(self, *, path: str, capacity_bytes: int, namespace: str, workers: int, timeout_s: float) -> None:
        self.capacity_bytes = capacity_bytes
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._namespace = namespace
        self._timeout = timeout_s
        self._mtime_lock = threading.Lock()
        self._last_mtime_ns = 0
        self._lock_fd = os.open(self.path / ".kv-sidecar.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise ValueError(f"store.disk_path {path!r} is in use by another store") from None
        self._index = DiskIndex(self.path / f"{namespace}.kvindex")
        adapter = create_l2_adapter(FSNativeL2AdapterConfig(base_path=str(self.path), num_workers=workers), None)
        self._io = L2Driver(adapter, "disk")

    def _okey(self, key: ChunkKey) -> ObjectKey:
        return ObjectKey(chunk_hash=key, model_name=self._namespace, kv_rank=0)

    def footprint(self, nbytes: int) -> int:
        return nbytes

    def name_of(self, key: ChunkKey) -> str:
        """The file name LMCache's fs connector writes for ``key`` (its naming, mirrored here)."""
        return f"{self._namespace}@0x{0:08x}@{_BODY:x}@{key.hex()}.data"

    def path_of(self, key: ChunkKey) -> Path:
        return self.path / self.name_of(key)

    def store(self, key: ChunkKey, obj: torch.Tensor) -> bool:
        # fs_native reports success but keeps an existing file when a key is stored again, so a
        # leftover (e.g. from a delete that timed out) would shadow the new bytes.
        self.path_of(key).unlink(missing_ok=True)
        if not self._io.store([self._okey(key)], [obj], self._timeout):
            return False
        # File times are kernel-tick coarse; stamp a strictly increasing mtime so a restart
        # rebuilds the exact LRU order (writes are demotions, i.e. recency order).
        with self._mtime_lock:
            self._last_mtime_ns = stamp = max(time.time_ns(), self._last_mtime_ns + 1)
        try:
            os.utime(self.path_of(key), ns=(stamp, stamp))
        except OSError:
            pass  # recency is a hint; the object is stored
        self._index.add(parse_header(obj), obj.numel())
        return True

    def load_many(self, keys: Sequence[ChunkKey], sizes: Sequence[int]) -> list[torch.Tensor | LoadFailure]:
        """Objects of ``keys`` or why not (``MISSING``: no file, ``UNREADABLE``: a file that
        could not be read in full, e.g. truncated); ``TimeoutError`` when the disk did not
        answer in time (nothing is known to be lost)."""
        bufs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        ok = self._io.load([self._okey(k) for k in keys], bufs, self._timeout)
        if ok is None:
            raise TimeoutError(f"disk read of {len(keys)} objects timed out")
        return [
            b if good else (LoadFailure.UNREADABLE if self.path_of(k).exists() else LoadFailure.MISSING)
            for k, b, good in zip(keys, bufs, ok, strict=True)
        ]

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        self._index.delete(keys)
        self._io.delete([self._okey(k) for k in keys])
        for key in keys:  # the connector's delete is best-effort; make sure the bytes are gone
            self.path_of(key).unlink(missing_ok=True)

    def scan(self) -> tuple[list[IndexedObject], int]:
        """Objects on disk (oldest first) and the number of corrupt files removed. Reads the
        index and lists the directory's names (no file opened, no stat: a file damaged behind a
        valid record is found on its first read); files the index does not name (or every file,
        without an index) have their header read and their size checked."""
        loaded = self._index.load()
        prefix = f"{self._namespace}@"
        names = {n for n in os.listdir(self.path) if n.startswith(prefix)}
        for name in [n for n in names if n.endswith(".tmp")]:
            names.discard(name)
            (self.path / name).unlink(missing_ok=True)  # a write interrupted before its rename
        found: list[IndexedObject] = []
        corrupt = 0
        if loaded is not None:
            body = f"{self._namespace}@0x{0:08x}@{_BODY:x}@"
            indexed = [body + obj.meta.key.hex() + ".data" for obj in loaded[0]]
            # a record without its file: removed after the record (a crash before the delete record)
            found = [obj for obj, name in zip(loaded[0], indexed) if name in names]
            names.difference_update(indexed)
        unindexed: list[DiskFile] = []
        for name in names:
            if not name.endswith(".data"):
                continue
            f = self._read_header(name)
            if f is None:
                corrupt += 1
            elif f is not _FOREIGN:
                unindexed.append(f)
        unindexed.sort(key=lambda f: f.mtime_ns)
        if loaded is None:
            found = [IndexedObject(f.meta, f.nbytes) for f in unindexed]
            self._index.set(found)
        else:
            self._index.retain(o.meta.key for o in found)
            for f in unindexed:
                self._index.add(f.meta, f.nbytes)
                found.append(IndexedObject(f.meta, f.nbytes))
        self._last_mtime_ns = max([time.time_ns(), *(f.mtime_ns for f in unindexed)])
        return found, corrupt

    def _read_header(self, name: str) -> DiskFile | None:
        """The header of object file ``name``, checked against its size and name; ``None``:
        corrupt (removed); ``_FOREIGN``: a valid object under another key's name, not a regular
        file, or gone since the listing (left alone)."""
        path = str(self.path / name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return _FOREIGN
        if not stat.S_ISREG(st.st_mode):
            return _FOREIGN
        try:
            with open(path, "rb") as f:
                meta = parse_header(f.read(HEADER_NBYTES))
            if st.st_size != HEADER_NBYTES + meta.payload_nbytes:
                raise CorruptChunkError(f"size {st.st_size} != {HEADER_NBYTES + meta.payload_nbytes}")
        except (CorruptChunkError, OSError) as exc:
            logger.warning("removing corrupt disk object %s: %s", name, exc)
            Path(path).unlink(missing_ok=True)
            return None
        if self.name_of(meta.key) != name:
            logger.warning("ignoring disk object %s: its header names key %s", name, meta.key.hex())
            return _FOREIGN
        return DiskFile(meta=meta, nbytes=st.st_size, mtime_ns=st.st_mtime_ns, path=path)

    def close(self, timeout: float) -> bool:
        ok = self._io.close(timeout)
        self._index.close()
        os.close(self._lock_fd)
        return ok
