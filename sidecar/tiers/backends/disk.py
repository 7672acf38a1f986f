"""The disk tier on LMCache's ``fs_native`` L2 adapter (C++ file workers), an ``ObjectBackend``.

Objects are stored under ``ObjectKey(chunk_hash=key, model_name=namespace, kv_rank=0)``
(``object_group_id`` 0: the stored object, header + payload), through ``L2Driver``
(``sidecar.tiers.backends.l2_driver``: blocking batch calls with timeouts).
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.fs_native_l2_adapter import FSNativeL2AdapterConfig

from sidecar.tiers.backends.base import LoadFailure, ObjectBackend
from sidecar.tiers.backends.l2_driver import L2Driver
from sidecar.tiers.config import StoreConfig
from sidecar.tiers.disk_index import DiskIndex, IndexedObject
from sidecar.tiers.envelope import HEADER_NBYTES, CorruptChunkError, parse_header
from sidecar.tiers.types import ChunkKey, ChunkMeta, Tier

logger = logging.getLogger(__name__)

_BODY = 0


@dataclass(frozen=True, slots=True)
class DiskFile:
    """A stored object found on disk at startup (header verified, payload not yet)."""

    meta: ChunkMeta
    nbytes: int
    mtime_ns: int
    path: str


_FOREIGN: DiskFile = object()  # type: ignore[assignment]  # DiskTier._read_header: not this key's file


class DiskTier(ObjectBackend):
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

    @classmethod
    def from_config(cls, config: StoreConfig) -> DiskTier | None:
        if config.disk_bytes <= 0:
            return None
        assert config.disk_path is not None
        return cls(
            path=config.disk_path,
            capacity_bytes=config.disk_bytes,
            namespace=config.namespace,
            workers=config.disk_workers,
            timeout_s=config.io_timeout_s,
        )

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

    def remove(self, keys: Sequence[ChunkKey]) -> bool:
        self._index.delete(keys)
        self._io.delete([self._okey(k) for k in keys])
        for key in keys:  # the connector's delete is best-effort; make sure the bytes are gone
            self.path_of(key).unlink(missing_ok=True)
        return True

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
