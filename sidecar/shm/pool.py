"""The shared pool: the CPU tier's memory as a POSIX shared-memory file engines on this host map.

The sidecar's side (``PoolFile``) names the file, holds a shared ``flock`` on it while alive and
removes it on close; a new sidecar removes the files of dead ones (nobody holds their lock, and
older than a minute: ``reap``), so a crash leaks a pool until the next start on the host. The name is
random per start (``lmcache_l1_pool_kvsc_pool_<32 hex>``, LMCache prefixes its pools' names), so
it is also the pool's incarnation: every answer names its pool and a client trusts offsets only
in the pool it mapped under that name.

The engine's side (``MappedPool``) maps the file read-write (it writes its Stores in place), by a
name the sidecar gave it, and reads and writes only where a lease or a reservation says. A
reader checks an object's header stamp after its copy (``stamp_ok``): the sidecar zeroes the
stamp before it frees an object's memory, so the stamp still there means the copy read that
object's bytes and no other (a lease that expired while the engine read is caught here).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import secrets
import stat
import struct

import numpy as np
import torch

from sidecar.shm.segment import REAP_AFTER_S, SHM_DIR, reap_unlocked

#: the names the sidecar gives its pools (without LMCache's prefix), and the files they become
_OWN_PREFIX = "kvsc_pool_"
FILE_PREFIX = "lmcache_l1_pool_" + _OWN_PREFIX
FILE_PATTERN = re.compile(re.escape(FILE_PREFIX) + r"[0-9a-f]{32}")
#: where in a stored object's header the stamp sits (the header checksum: ``tiers.envelope``)
STAMP_AT = 32


class PoolFile:
    """The sidecar's pool file: its name, size and liveness lock."""

    def __init__(self, name: str, size: int, fd: int) -> None:
        self.name = name
        self.size = size
        self._fd = fd

    @staticmethod
    def prepare() -> str:
        """A fresh pool name for LMCache's allocator (after removing dead sidecars' pools)."""
        reap()
        return _OWN_PREFIX + secrets.token_hex(16)

    @staticmethod
    def room_for(size: int) -> bool:
        """Whether /dev/shm can hold a pool of ``size`` bytes (a tmpfs that runs out of room
        kills the process that touches the page with SIGBUS)."""
        try:
            st = os.statvfs(SHM_DIR)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize >= size

    @classmethod
    def adopt(cls, lmcache_name: str, size: int) -> PoolFile:
        """The file LMCache created for ``lmcache_name``: lock it as alive."""
        name = lmcache_name.lstrip("/")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return cls(name, size, fd)

    def close(self) -> None:
        """Remove the name (engines' mappings stay valid until they unmap) and the lock."""
        if self._fd >= 0:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = -1


def reap(directory: str = SHM_DIR) -> int:
    """Remove the pools of sidecars that are gone (no process holds their lock, and older than
    ``REAP_AFTER_S``: LMCache creates a pool a moment before its sidecar takes the lock, and
    another sidecar starting then must not take it for a dead one's); how many."""
    return reap_unlocked(directory, FILE_PATTERN, REAP_AFTER_S)


class MappedPool:
    """An engine's mapping of its sidecar's pool (``name`` from MapPool)."""

    def __init__(self, name: str, size: int, header_bytes: int, directory: str = SHM_DIR) -> None:
        if FILE_PATTERN.fullmatch(name) is None:
            raise ValueError(f"pool.name: {name[:80]!r} is not a sidecar pool's name")
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < size:
                raise ValueError(f"pool.size: {path} holds {st.st_size} bytes, the sidecar said {size}")
            # Page tables filled now, once (MAP_POPULATE): a first touch of each 4 KiB page in a
            # Fetch or a Store would fault (measured: 512 MiB of fresh pool written at 1.4 GB/s,
            # against 12 GB/s once mapped).
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self.name = name
        self.size = size
        self.header_bytes = header_bytes
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.tensor = torch.from_numpy(self.array)
        self._pinned = False
        self._pin_refused = False

    def view(self, offset: int, length: int) -> torch.Tensor:
        """The pool's bytes ``[offset, offset + length)`` (uint8, in place), bounds-checked: an
        answer can never make the engine touch memory outside the pool."""
        if offset < self.header_bytes or length <= 0 or offset + length > self.size:
            raise ValueError(f"slot.offset / slot.length: [{offset}, {offset + length}) is outside the pool "
                             f"{self.name} ({self.size} bytes)")
        return self.tensor[offset : offset + length]

    def pin(self) -> bool:
        """Register the mapping with CUDA as pinned host memory (``cudaHostRegister``), so a run
        of rows goes host-to-device in one asynchronous copy straight from the pool; False when
        there is no CUDA device or the driver refused (copies then go through a pinned buffer)."""
        if self._pinned or self._pin_refused:
            return self._pinned
        if not torch.cuda.is_available():
            return False
        err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.size, 0)
        self._pinned = int(getattr(err, "value", err)) == 0
        self._pin_refused = not self._pinned  # not asked again for this mapping
        return self._pinned

    def unpin(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._pinned = False

    @property
    def pinned(self) -> bool:
        return self._pinned

    def stamp_ok(self, offset: int, stamp: int) -> bool:
        """Whether the object whose payload starts at ``offset`` still carries ``stamp``."""
        at = offset - self.header_bytes + STAMP_AT
        if at < 0 or at + 8 > self.size:
            return False
        return struct.unpack_from("<Q", self._map, at)[0] == stamp

    def close(self) -> None:
        """Unmap when no view is left (views keep the mapping alive until then)."""
        self.unpin()
        self.array = None  # type: ignore[assignment]
        self.tensor = None  # type: ignore[assignment]
