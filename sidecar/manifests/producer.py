"""The manifest producer: one JSONL line per newly seen unique chunk, appended as the sidecar runs.

::

    event loop (Store / register)             background thread "manifest-writer"
      ChunkIndex announces new entries ──>      every flush_interval_s (or when woken):
      observe(): append (identity, entry)         swap the pending list (one lock, no I/O held)
      to a list; O(1) per chunk, no I/O           encode each line, os.write(fd, line) once per line
                                                  on an O_APPEND fd; rotate first when the file
                                                  would pass max_bytes
                                                every counts_interval_s: a later line for each
                                                written chunk whose count grew

Crash safety: every line reaches the kernel in ONE ``write`` call on an ``O_APPEND`` descriptor,
so a process killed at any instant (SIGKILL included) leaves whole lines plus at most one torn
last line, which readers skip as malformed. Lines are not fsync'ed: a crash of the process loses
nothing written; a crash of the machine may lose the page cache (``fsync`` option).

Rotation: ``manifest.jsonl`` -> ``manifest.jsonl.1`` -> ... -> ``manifest.jsonl.<keep>`` (the
oldest is dropped). Importers read the rotated files oldest first, then the live one.

Counts: ``count`` is ``entry.hits + 1`` (registered once, then served ``hits`` times). The
writer reads ``hits`` of the entries it wrote without the event loop's lock (a plain int read
under the GIL: at worst a line carries a count one behind). Readers take the largest count per
key, so later lines only ever raise it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from sidecar.identity import CacheIdentity
from sidecar.manifests.config import ManifestsConfig
from sidecar.manifests.format import ManifestEntry, encode_line
from sidecar.registry.entry import ChunkEntry

logger = logging.getLogger(__name__)


def rotated_paths(path: str | Path, keep: int) -> list[Path]:
    """The files of one manifest, oldest first (those that exist)."""
    p = Path(path)
    files = [Path(f"{p}.{i}") for i in range(keep, 0, -1)] + [p]
    return [f for f in files if f.exists()]


class ManifestWriter:
    """Appends whole lines to ``path`` with one ``os.write`` each; rotates by size. Not
    thread-safe: one writer thread owns it."""

    def __init__(self, path: str | Path, *, max_bytes: int, keep: int, fsync: bool = False) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep = keep
        self.fsync = fsync
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = -1
        self._size = 0
        self.lines_written = 0
        self.rotations = 0
        self._open()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size

    def write_line(self, line: bytes) -> None:
        """Append one line (newline included) in a single write call."""
        if self._size and self._size + len(line) > self.max_bytes:
            self.rotate()
        view = memoryview(line)
        n = os.write(self._fd, view)
        while n < len(view):  # a short write to a regular file: only on a full disk or a signal
            view = view[n:]
            n = os.write(self._fd, view)
        self._size += len(line)
        self.lines_written += 1

    def flush(self) -> None:
        if self.fsync and self._fd >= 0:
            os.fsync(self._fd)

    def rotate(self) -> None:
        os.close(self._fd)
        if self.keep > 0:
            for i in range(self.keep - 1, 0, -1):
                src = Path(f"{self.path}.{i}")
                if src.exists():
                    os.replace(src, f"{self.path}.{i + 1}")
            os.replace(self.path, f"{self.path}.1")
        else:
            os.unlink(self.path)
        self.rotations += 1
        self._open()

    def close(self) -> None:
        if self._fd >= 0:
            self.flush()
            os.close(self._fd)
            self._fd = -1


class ManifestProducer:
    """Buffers newly registered chunks and writes them from a background thread.

    ``observe`` is called on the event loop right after chunks are registered for the first
    time; it only appends to a list. ``close`` writes everything still pending (and the final
    counts), then stops the thread. ``flush`` (tests, export) waits until what was observed
    before the call is written.
    """

    def __init__(self, config: ManifestsConfig) -> None:
        assert config.path, "ManifestProducer needs manifests.path"
        self.config = config
        self.writer = ManifestWriter(config.path, max_bytes=config.max_bytes, keep=config.keep, fsync=config.fsync)
        self._pending: list[tuple[int, ChunkEntry]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._written: dict[tuple[int, int], tuple[ChunkEntry, int]] = {}  # (salt, key) -> (entry, count written)
        self._stop = False
        self._flushed = threading.Condition()
        self._generation = 0  # batches handed to the writer
        self._done = 0  # batches written
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="manifest-writer", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- event loop side

    def observe(self, identity: CacheIdentity, entries: Sequence[ChunkEntry]) -> None:
        """Record chunks registered for the first time (O(1) per chunk; no I/O)."""
        if not entries:
            return
        salt = identity.salt
        with self._lock:
            self._pending.extend((salt, e) for e in entries)

    def flush(self, timeout: float = 10.0) -> None:
        """Block until everything observed before this call is on disk (written, not fsync'ed)."""
        with self._flushed:
            target = self._generation + 1
            self._wake.set()
            self._flushed.wait_for(lambda: self._done >= target or self._stop, timeout)

    def close(self) -> None:
        """Write what is pending and the final counts; stop the thread. Idempotent."""
        if self._stop:
            return
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.writer.close()

    # -------------------------------------------------------------- writer thread

    def _run(self) -> None:
        cfg = self.config
        next_counts = time.monotonic() + cfg.counts_interval_s if cfg.counts_interval_s > 0 else float("inf")
        while True:
            self._wake.wait(cfg.flush_interval_s)
            self._wake.clear()
            stopping = self._stop
            with self._flushed:
                self._generation += 1
                generation = self._generation
            try:
                self._write_pending()
                if stopping or time.monotonic() >= next_counts:
                    self._write_counts()
                    next_counts = time.monotonic() + cfg.counts_interval_s if cfg.counts_interval_s > 0 else float("inf")
                self.writer.flush()
            except OSError:
                self.errors += 1
                logger.exception("manifest producer: writing %s failed; will retry", self.writer.path)
            with self._flushed:
                self._done = generation
                self._flushed.notify_all()
            if stopping:
                return

    def _write_pending(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        written = self._written
        for salt, e in batch:
            k = (salt, e.key)
            if k in written or not e.tokens:
                continue  # already written (re-registered after an eviction), or tokens unknown
            count = e.hits + 1
            self.writer.write_line(encode_line(_line(salt, e, count)))
            written[k] = (e, count)

    def _write_counts(self) -> None:
        written = self._written
        for k, (e, count) in list(written.items()):
            now = e.hits + 1
            if now > count:
                self.writer.write_line(encode_line(_line(k[0], e, now)))
                written[k] = (e, now)


def _line(salt: int, e: ChunkEntry, count: int) -> ManifestEntry:
    return ManifestEntry(
        content_hash=e.key,
        identity=salt,
        scope=e.scope,
        tokens=e.tokens,
        count=count,
        source_pos=e.source_pos,
        prefix_digest=e.prefix_digest,
        first_seen=e.first_seen,
        last_seen=e.last_seen or e.first_seen,
    )
