"""The primitives a tier backend provides (one subclass per backend: gpu, cpu, disk, remote).

A backend holds *stored objects*: one 1-D ``torch.uint8`` tensor per chunk, the envelope header
followed by the payload (``sidecar.tiers.envelope``). It owns memory or storage and nothing
else: placement (which tier, which victim), capacity accounting (the store counts
``footprint`` bytes against ``capacity_bytes`` before any write), recency, read pins across
tiers, checksums, quotas, retries and circuit breakers all belong to ``TieredStore`` and
``TierIO``. A backend never evicts on its own and never refuses a write for capacity except
through its allocator (``PoolBackend.stage`` returning ``None``).

Two kinds, as LMCache has an L1 (a memory pool written in place) and L2 adapters (objects
copied in and out of host buffers)::

    PoolBackend (gpu, cpu)                    ObjectBackend (disk, remote)
      buf = b.stage(key, n)   # invisible       b.store(key, obj)        # True: it landed
      ... fill buf ...                          b.load_many(keys, sizes) # tensor or LoadFailure
      b.commit(key)           # now readable    b.remove(keys)           # best effort
        | b.abort(key)        # discarded
      view = b.acquire(key)   # read-locked
      ... copy out ...
      b.release(key)
      b.remove(key)           # never while acquired

Every backend: ``tier`` (class attribute), ``capacity_bytes``, ``footprint(nbytes)``,
``from_config(config)`` (``None`` when the configuration disables it) and ``close(timeout)``.

Threading: every primitive may be called from several threads at once for different keys; one
key is staged or stored by one thread at a time (the store's key stripes guarantee it).
Primitives of an ``ObjectBackend`` block on I/O, never past the backend's I/O timeout.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from sidecar.tiers.types import ChunkKey, Tier

if TYPE_CHECKING:
    import torch

    from sidecar.tiers.config import StoreConfig


class LoadFailure(enum.Enum):
    """Why an object tier returned no object for a key."""

    MISSING = "missing"  # not there: deleted, evicted, never written
    UNREADABLE = "unreadable"  # there, but not readable as the expected object


def round_up(n: int, align: int) -> int:
    """``n`` rounded up to a multiple of ``align`` (the footprint of an aligned pool allocation)."""
    return (n + align - 1) // align * align


class TierBackend(ABC):
    """What every tier backend provides; subclass ``PoolBackend`` or ``ObjectBackend``."""

    #: The tier this backend implements (one backend class per ``Tier``).
    tier: ClassVar[Tier]
    #: Bytes of stored objects the tier may hold, as the store counts them (``footprint``).
    capacity_bytes: int

    @classmethod
    @abstractmethod
    def from_config(cls, config: StoreConfig) -> TierBackend | None:
        """The backend ``config`` asks for, or ``None`` when it disables this tier (capacity 0,
        or a device that is not there: logged). Raises ``ValueError`` for a configuration the
        backend cannot serve (e.g. a disk path another store holds). Called once per store."""

    @abstractmethod
    def footprint(self, nbytes: int) -> int:
        """Capacity one stored object of ``nbytes`` takes here (allocator alignment included).
        Pure: the store reserves this many bytes before writing."""

    @abstractmethod
    def close(self, timeout: float) -> bool:
        """Release the backend; never blocks past ``timeout`` seconds per step. Returns False
        when something was abandoned instead (a hung connection). Called once, after every
        reader and writer finished (or gave up); no primitive is called afterwards."""


class PoolBackend(TierBackend):
    """A pre-allocated memory pool written and read in place (GPU, CPU).

    An object goes through ``stage`` -> ``commit`` (or ``abort``); readers bracket their copy
    with ``acquire`` / ``release``. Views returned by ``stage``/``acquire`` alias the pool: they
    are valid only until ``commit``/``abort`` resp. ``release``.
    """

    @abstractmethod
    def stage(self, key: ChunkKey, nbytes: int) -> torch.Tensor | None:
        """An invisible write buffer of exactly ``nbytes`` for ``key``, or ``None`` when the
        allocator has no contiguous room (full or fragmented: the store demotes a victim and
        retries). ``key`` must be absent (neither staged nor committed): staging a present key
        is a store bug and asserts."""

    @abstractmethod
    def commit(self, key: ChunkKey) -> None:
        """Make the staged object of ``key`` readable. Exactly once per successful ``stage``."""

    @abstractmethod
    def abort(self, key: ChunkKey) -> None:
        """Discard the staged object of ``key`` and free its memory (instead of ``commit``)."""

    @abstractmethod
    def acquire(self, key: ChunkKey) -> torch.Tensor | None:
        """A read-locked view of the committed object of ``key`` (``None``: not there). Every
        non-``None`` result must be paired with one ``release``; ``remove`` fails meanwhile."""

    @abstractmethod
    def release(self, key: ChunkKey) -> None:
        """End one ``acquire`` of ``key``."""

    @abstractmethod
    def remove(self, key: ChunkKey) -> bool:
        """Free the committed object of ``key``; False when it is absent or read-locked (the
        store waits for its own readers first, so False there means "already gone")."""


class ObjectBackend(TierBackend):
    """Whole objects copied in and out of host memory, blocking with a timeout (disk, remote)."""

    @abstractmethod
    def store(self, key: ChunkKey, obj: torch.Tensor) -> bool:
        """Write the complete object ``obj`` (contiguous 1-D uint8, host) under ``key``,
        replacing any leftover; True once it is durable and readable at its full size, False
        when it did not land (I/O error, timeout, backend down: nothing was lost)."""

    @abstractmethod
    def load_many(self, keys: Sequence[ChunkKey], sizes: Sequence[int]) -> list[torch.Tensor | LoadFailure]:
        """Objects of ``keys`` in order, each read into a fresh host tensor of exactly its
        ``sizes`` entry (the caller knows the size from its index or a header), or the
        ``LoadFailure`` saying why not. Raises ``TimeoutError`` when the backend did not answer
        in time (nothing is known to be lost). Contents are NOT verified here: the caller
        checks the header and checksum."""

    @abstractmethod
    def remove(self, keys: Sequence[ChunkKey]) -> bool:
        """Delete the objects of ``keys`` (absent keys are fine: idempotent); True when they
        are known to be gone, False when the backend could not confirm it."""
