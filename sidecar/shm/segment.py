"""The client's side: shared-memory buffers (``Segment``), lent one per call in flight
(``Lease``) by a ``SegmentPool`` that takes a buffer back once no payload view into it is left.

A buffer's creator holds a shared ``flock`` on it for the buffer's life, so a process killed
before it could remove its buffers (SIGKILL, the OOM killer) leaves files nobody locks; the next
``SegmentPool`` on the host removes those older than a minute (``reap``)."""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import secrets
import threading
import time
import weakref

import numpy as np

MAGIC = b"KVSCSHM1"
TOKEN_BYTES = 16
#: payloads start after the header, each at a multiple of ``ALIGN`` (cache lines, and the
#: alignment torch and numpy views of bf16 / fp32 payloads need)
HEADER_BYTES = 64
ALIGN = 64
SHM_DIR = "/dev/shm"

logger = logging.getLogger(__name__)
NAME_PATTERN = re.compile(r"kvsc-[0-9a-f]{32}")


def local_target(target: str) -> bool:
    """Whether a gRPC target names this host (loopback or a unix socket): only then can the
    sidecar open a buffer this process creates."""
    t = target.strip()
    if t.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if t.startswith(scheme):
            t = t[len(scheme):]
            break
    if t.startswith("["):
        host = t[1 : t.find("]")] if "]" in t else t[1:]
    else:
        host = t.rsplit(":", 1)[0] if t.count(":") == 1 else t
    return host in ("localhost", "::1") or host.startswith("127.")


class Segment:
    """A buffer in ``directory``: ``size`` bytes, mapped here, starting with ``MAGIC`` and the
    token the sidecar checks before it writes."""

    def __init__(self, size: int, directory: str = SHM_DIR) -> None:
        if size <= HEADER_BYTES:
            raise ValueError(f"size: a buffer needs more than {HEADER_BYTES} bytes, got {size}")
        self.name = "kvsc-" + secrets.token_hex(16)
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.size = size
        self.path = os.path.join(directory, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # alive while this fd is open (``reap``)
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        self._fd = fd
        weakref.finalize(self, os.close, fd)
        self._map[: len(MAGIC) + TOKEN_BYTES] = MAGIC + self.token

    def array(self) -> np.ndarray:
        """A fresh uint8 view of the whole buffer (the object a lease's payloads hang from)."""
        return np.frombuffer(self._map, dtype=np.uint8)

    def unlink(self) -> None:
        """Remove the name (views already handed out stay valid until they are dropped)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class Lease:
    """One call's use of a segment. Payloads are views of ``_array``; the segment returns to
    its pool when the lease, the array and every view into it are gone."""

    __slots__ = ("segment", "_array", "used", "inline")

    def __init__(self, segment: Segment, array: np.ndarray) -> None:
        self.segment = segment
        self._array = array
        self.used = HEADER_BYTES  # the end of the last payload the sidecar wrote
        self.inline = 0  # payload bytes that came inline although this buffer was offered

    def payload(self, offset: int, length: int) -> memoryview:
        """The writable view of a payload the sidecar wrote at ``offset``."""
        if offset < HEADER_BYTES or length <= 0 or offset + length > self.segment.size:
            raise ValueError(f"shm_offset / shm_length: [{offset}, {offset + length}) is outside the "
                             f"payload area [{HEADER_BYTES}, {self.segment.size}) of {self.segment.name}")
        self.used = max(self.used, offset + length)
        return memoryview(self._array[offset : offset + length])


class SegmentPool:
    """Buffers lent to calls: at most ``max_segments`` at once (a call that finds none free goes
    inline, it never waits). A buffer holds at least what the call says it needs (span items
    and session ranges know their size); a call whose payloads did not all fit makes every new
    buffer big enough for it, up to ``max_bytes``; smaller idle buffers are then dropped. A
    buffer costs memory only for the pages written into it. ``close()``
    (and interpreter exit) removes every buffer's name."""

    def __init__(
        self, *, size: int = 64 << 20, max_bytes: int = 1 << 30, max_segments: int = 4, directory: str = SHM_DIR
    ) -> None:
        if not HEADER_BYTES < size <= max_bytes:
            raise ValueError(f"size: must be in ({HEADER_BYTES}, max_bytes={max_bytes}], got {size}")
        if max_segments < 1:
            raise ValueError(f"max_segments: must be >= 1, got {max_segments}")
        self.directory = directory
        self.max_bytes = max_bytes
        self.max_segments = max_segments
        self._want = size
        self._idle: list[Segment] = []
        self._lent = 0
        self._closed = False
        self._warned = False
        # Reentrant: a lease's finalizer can run inside this pool's own critical section when
        # the garbage collector frees payloads caught in a reference cycle there.
        self._lock = threading.RLock()
        self._names: set[str] = set()  # every buffer not yet unlinked (for the exit finalizer)
        self._finalizer = weakref.finalize(self, _unlink_all, self._names)
        reap(directory)

    def lease(self, need: int = 0) -> Lease | None:
        """A buffer for one call that expects at least ``need`` payload bytes (0: unknown), or
        None (pool closed, all lent, or /dev/shm unusable)."""
        size = min(self.max_bytes, max(self._want, round_up(HEADER_BYTES + need))) if need else self._want
        drop = None
        with self._lock:
            if self._closed:
                return None
            if self._lent >= self.max_segments:
                if not self._warned:
                    self._warned = True
                    logger.warning("all %d shared-memory buffers are held by payloads still referenced; Fetches come "
                                   "inline until those payloads are dropped (copy what you keep)", self.max_segments)
                return None
            seg = self._idle.pop() if self._idle else None
            if seg is not None and seg.size < size:
                drop, seg = seg, None
                self._names.discard(drop.path)
            self._lent += 1
        if drop is not None:
            drop.unlink()
        if seg is None:
            try:
                seg = Segment(size, self.directory)
            except OSError:
                with self._lock:
                    self._lent -= 1
                return None
            with self._lock:
                self._names.add(seg.path)
        lease = Lease(seg, seg.array())
        # Keyed on the array every payload view hangs from (a slice's ``base`` is this array,
        # whose own base is the mmap's buffer), not on the lease a caller may drop first.
        weakref.finalize(lease._array, self._give_back, seg)
        return lease

    def done(self, lease: Lease) -> None:
        """Learn from a finished call: if payloads spilled inline, size new buffers for all."""
        if lease.inline:
            with self._lock:
                self._want = min(self.max_bytes, max(self._want, round_up(lease.used + lease.inline)))

    def _give_back(self, seg: Segment) -> None:
        with self._lock:
            self._lent -= 1
            keep = not self._closed and seg.size >= self._want
            if keep:
                self._idle.append(seg)
            else:
                self._names.discard(seg.path)
        if not keep:
            seg.unlink()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for seg in idle:
            seg.unlink()
        self._finalizer()  # lent buffers lose their names now; their views stay valid

    @property
    def lent(self) -> int:
        return self._lent

    @property
    def idle(self) -> int:
        return len(self._idle)


def round_up(n: int, to: int = 1 << 20) -> int:
    return -(-n // to) * to


def _unlink_all(paths: set[str]) -> None:
    for p in list(paths):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
    paths.clear()


#: a file younger than this is never reaped: its creator locks it a moment after creating it
REAP_AFTER_S = 60.0


def reap(directory: str = SHM_DIR, older_than_s: float = REAP_AFTER_S) -> int:
    """Remove the buffers of processes that are gone (``reap_unlocked``); how many."""
    return reap_unlocked(directory, NAME_PATTERN, older_than_s)


def reap_unlocked(directory: str, pattern: re.Pattern, older_than_s: float = REAP_AFTER_S) -> int:
    """Remove the files of ``directory`` named by ``pattern`` that no process holds a lock on
    and that are older than ``older_than_s`` (their creators are gone); how many. The pool's
    files and the client buffers both live by this rule."""
    n = 0
    now = time.time()
    try:
        names = [f for f in os.listdir(directory) if pattern.fullmatch(f)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            young = now - os.fstat(fd).st_mtime < older_than_s
            if not young:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            young = True  # locked: alive
        if young:
            os.close(fd)
            continue
        try:
            os.unlink(path)
            n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n
