"""The sidecar's side: open the buffer a Fetch names, check it is the caller's, and write
payloads into it with ``pwrite`` (never mapped: a truncated buffer cannot SIGBUS the sidecar)."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence

from sidecar.errors import InvalidArgument, PermissionDenied
from sidecar.shm.segment import ALIGN, HEADER_BYTES, MAGIC, NAME_PATTERN, SHM_DIR, TOKEN_BYTES, round_up

_LOCAL_PEERS = ("ipv4:127.", "ipv6:[::1]", "ipv6:[::ffff:127.", "unix:", "unix-abstract:")


def local_peer(peer: str) -> bool:
    """Whether a gRPC peer string (``context.peer()``) is on this host."""
    return peer.startswith(_LOCAL_PEERS)


class ShmWriter:
    """One call's writes into its buffer: payloads placed one after another, aligned."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd = fd
        self.size = size
        self._next = HEADER_BYTES
        self.bytes = 0  # payload bytes written
        self.spilled = 0  # payloads that did not fit (sent inline)
        self.failed = False  # a write failed: the rest of the call goes inline

    def put(self, payload: memoryview | Sequence[memoryview]) -> tuple[int, int] | None:
        """Write one payload (or its pieces, in order: one gathering ``pwritev`` per
        ``_IOV_MAX``); its ``(offset, length)``, or None when it must go inline (it does not fit
        in what is left, or the write failed, e.g. ENOSPC on a full tmpfs)."""
        parts = [_bytes(payload)] if isinstance(payload, memoryview) else [_bytes(p) for p in payload]
        n = sum(len(p) for p in parts)
        off = self._next
        if self.failed or n == 0:
            return None
        if off + n > self.size:
            self.spilled += 1
            return None
        try:
            at = off
            for i in range(0, len(parts), _IOV_MAX):
                at = _pwritev_all(self._fd, parts[i : i + _IOV_MAX], at)
        except OSError:
            self.failed = True
            return None
        self._next = round_up(off + n, ALIGN)
        self.bytes += n
        return off, n

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


#: iovecs per pwritev (Linux IOV_MAX)
_IOV_MAX = 1024


def _bytes(p: memoryview) -> memoryview:
    return p if p.ndim == 1 and p.itemsize == 1 else p.cast("B")


def _pwritev_all(fd: int, parts: list[memoryview], off: int) -> int:
    """Write ``parts`` back to back at ``off`` (a short write is resumed); the end offset."""
    while parts:
        done = os.pwritev(fd, parts, off)
        if done <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        off += done
        i = 0
        while i < len(parts) and done >= len(parts[i]):
            done -= len(parts[i])
            i += 1
        parts = [parts[i][done:], *parts[i + 1 :]] if i < len(parts) else []
    return off


def check_spec(name: str, token: bytes) -> None:
    """Refuse a malformed buffer name or token (INVALID_ARGUMENT naming the field)."""
    if NAME_PATTERN.fullmatch(name) is None:
        raise InvalidArgument(f"shm.name: must be 'kvsc-' and 32 lowercase hex digits, got {name[:80]!r}")
    if len(token) != TOKEN_BYTES:
        raise InvalidArgument(f"shm.token: must be {TOKEN_BYTES} bytes, got {len(token)}")


def open_writer(
    name: str, token: bytes, peer: str, *, enabled: bool = True, directory: str = SHM_DIR
) -> tuple[ShmWriter | None, str]:
    """The writer for a call that names buffer ``name``, or ``(None, reason)`` when its payloads
    go inline: ``disabled``, ``remote_peer`` (not on this host) or ``unavailable`` (no such
    buffer here, e.g. the sidecar's /dev/shm is not the client's). Malformed fields are
    INVALID_ARGUMENT; a file that is not a plain buffer (a symlink, a hard link, not on
    /dev/shm's filesystem) is INVALID_ARGUMENT and a wrong token PERMISSION_DENIED."""
    check_spec(name, token)
    if not enabled:
        return None, "disabled"
    if not local_peer(peer):
        return None, "remote_peer"
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InvalidArgument(f"shm.name: {path} is a symlink, not a shared-memory buffer") from None
        return None, "unavailable"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_dev != os.stat(directory).st_dev:
            raise InvalidArgument(f"shm.name: {path} is not a plain shared-memory buffer "
                                  "(a regular file with one link on the shared-memory filesystem)")
        if os.pread(fd, len(MAGIC) + TOKEN_BYTES, 0) != MAGIC + token:
            raise PermissionDenied(f"shm.token: does not match the one buffer {name} starts with")
        return ShmWriter(fd, st.st_size), ""
    except BaseException:
        os.close(fd)
        raise
