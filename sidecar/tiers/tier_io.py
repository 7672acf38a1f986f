"""Tier I/O: the configured backends and every movement of stored-object bytes between them.

Knows nothing of placement (which tier, which victim, accounting): ``TieredStore`` decides and
calls these. Every method may block on I/O and is safe to call from several threads at once for
different keys (the backends are thread-safe; one key is written by one thread at a time).

Failures are typed for the orchestrator: ``IOFailure`` (a write or read that did not happen:
try elsewhere, nothing is lost), ``SourceLost`` (the bytes to copy are gone or corrupt), and a
``LoadFailure`` value per key for batched loads.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

import numpy as np
import torch

from sidecar.tiers.backends import BACKENDS, DiskTier, LoadFailure, ObjectBackend, PoolBackend, RemoteTier, TierBackend
from sidecar.tiers.breaker import Breaker
from sidecar.tiers.config import StoreConfig
from sidecar.tiers.envelope import HEADER_NBYTES, CorruptChunkError, checksum, object_nbytes, parse_header, write_header
from sidecar.tiers.types import TIER_ORDER, ChunkKey, ChunkMeta, FetchedChunk, Tier

logger = logging.getLogger(__name__)


class IOFailure(Exception):
    """A write or read that did not complete (timeout, backend error); nothing was lost."""


class SourceLost(Exception):
    """The bytes a copy was to read are missing or corrupt in ``tier``."""

    def __init__(self, tier: Tier) -> None:
        super().__init__(tier.value)
        self.tier = tier


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.device.type == "cpu" and src.device.type == "cpu":
        # numpy's memcpy is single-threaded and predictable (and releases the GIL); torch's
        # copy_ spreads one memcpy over the intra-op pool, which collapses on a busy 2-core host.
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


def object_ok(obj: torch.Tensor, meta: ChunkMeta) -> bool:
    """Whether a stored object (header + payload) is intact and is ``meta``'s."""
    try:
        stored = parse_header(obj)
    except CorruptChunkError:
        return False
    return (
        stored.key == meta.key
        and stored.checksum == meta.checksum
        and stored.payload_nbytes == meta.payload_nbytes
        and obj.numel() == object_nbytes(meta.payload_nbytes)
        and checksum(obj[HEADER_NBYTES:]) == meta.checksum
    )


def encode_into(dst: torch.Tensor, meta: ChunkMeta, payload: torch.Tensor) -> ChunkMeta:
    """Write header + payload into ``dst`` (host); the checksum is of the stored bytes."""
    body = dst[HEADER_NBYTES:]
    host_copy(body, payload)
    meta = replace(meta, checksum=checksum(body))
    write_header(dst[:HEADER_NBYTES], meta)
    return meta


class TierIO:
    """The backends of one store (``sidecar.tiers.backends``), fastest first: memory pools
    (``mem``: GPU, CPU), then object tiers (disk, remote), each behind a breaker."""

    def __init__(self, config: StoreConfig) -> None:
        self._config = config
        self.backends: dict[Tier, TierBackend] = {}
        self.mem: dict[Tier, PoolBackend] = {}
        self.disk: DiskTier | None = None
        self.remote: RemoteTier | None = None
        self._scratch = threading.local()  # per-thread host buffer for encoding (writers run in parallel)
        self.breakers = {  # sidecar/tiers/breaker.py
            t: Breaker(t.value) for t in TIER_ORDER if issubclass(BACKENDS[t], ObjectBackend)
        }
        try:
            self._open(config)
        except BaseException:
            self.close()
            raise
        self.chain: tuple[Tier, ...] = tuple(self.backends)

    def _open(self, config: StoreConfig) -> None:
        for tier in TIER_ORDER:
            backend = BACKENDS[tier].from_config(config)
            if backend is None:
                continue
            self.backends[tier] = backend
            if isinstance(backend, PoolBackend):
                self.mem[tier] = backend
        self.disk = self.backends.get(Tier.DISK)
        self.remote = self.backends.get(Tier.REMOTE)
        if self.remote is not None:  # re-admitted as soon as Redis answers a PING again
            self.breakers[Tier.REMOTE] = Breaker(Tier.REMOTE.value, probe=self.remote.probe)

    def has(self, tier: Tier) -> bool:
        return tier in self.backends

    def backend(self, tier: Tier):
        backend = self.backends.get(tier)
        assert backend is not None, f"tier {tier.value} is not configured; this indicates a placement bug"
        return backend

    def footprint(self, tier: Tier, obj_nbytes: int) -> int:
        return self.backend(tier).footprint(obj_nbytes)

    def scratch(self, nbytes: int) -> torch.Tensor:
        """This thread's host buffer for encoding an object bound for the GPU, disk or remote
        tier (each write completes before the thread's next one)."""
        buf = getattr(self._scratch, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._scratch.buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]

    def drop_scratch(self) -> None:
        """A timed-out write may still read this thread's buffer: never reuse it."""
        self._scratch.buf = None

    def available(self, tier: Tier) -> bool:
        """False while ``tier``'s breaker is open (its I/O failed recently): treat it as absent."""
        breaker = self.breakers.get(tier)
        return breaker is None or not breaker.is_open()

    def store_l2(self, tier: Tier, key: ChunkKey, obj: torch.Tensor) -> None:
        """Write a complete object to the disk or remote tier; ``IOFailure`` if it did not land
        (at once, without trying, while the tier's breaker is open)."""
        breaker = self.breakers[tier]
        if breaker.is_open():
            raise IOFailure(f"{tier.value} tier unavailable (backing off after I/O failures)")
        host = obj if obj.device.type == "cpu" else obj.cpu()
        if not self.backend(tier).store(key, host):
            breaker.failed()
            raise IOFailure(f"{tier.value} write of {key.hex()} failed")
        breaker.succeeded()

    def load_object(self, tier: Tier, key: ChunkKey, obj_nbytes: int, meta: ChunkMeta) -> torch.Tensor:
        """One verified object from the disk or remote tier (``SourceLost`` / ``IOFailure``)."""
        if not self.available(tier):
            raise IOFailure(f"{tier.value} tier unavailable (backing off after I/O failures)")
        try:
            (obj,) = self.backend(tier).load_many([key], [obj_nbytes])
        except TimeoutError as exc:
            self.breakers[tier].failed()
            raise IOFailure(str(exc)) from exc
        if isinstance(obj, LoadFailure) or not object_ok(obj, meta):
            raise SourceLost(tier)
        return obj

    def read_memory(self, tier: Tier, key: ChunkKey, meta: ChunkMeta) -> torch.Tensor | None:
        """A fresh copy of the payload held in a memory tier; ``None`` if gone or corrupt."""
        mem = self.mem[tier]
        view = mem.acquire(key)
        if view is None:  # only after a writer gave up waiting for this reader (logged there)
            return None
        try:
            out = torch.empty(meta.payload_nbytes, dtype=torch.uint8)
            host_copy(out, view[HEADER_NBYTES:])
        finally:
            mem.release(key)
        if self._config.verify_memory_reads and checksum(out) != meta.checksum:
            return None
        return out

    def load_batch(self, tier: Tier, keys: list[ChunkKey], sizes: list[int]) -> list[torch.Tensor | LoadFailure]:
        """Objects of ``keys`` from the disk or remote tier, one task; ``TimeoutError`` if slow
        (callers skip a tier that is not ``available``)."""
        try:
            return self.backend(tier).load_many(keys, sizes)
        except TimeoutError:
            self.breakers[tier].failed()
            raise

    def read_foreign(self, keys: list[ChunkKey]) -> tuple[list[tuple[FetchedChunk | None, torch.Tensor | None]], int]:
        """Chunks another sidecar published to the remote tier, in one round trip (each object
        carries its own header: size, layout, checksum); also returns how many failed
        verification."""
        out: list[tuple[FetchedChunk | None, torch.Tensor | None]] = [(None, None)] * len(keys)
        if not keys:
            return out, 0
        assert self.remote is not None
        if not self.available(Tier.REMOTE):
            return out, 0
        try:
            objs = self.remote.load_objects(keys)
        except TimeoutError:  # Redis is down or went away: misses
            logger.warning("remote read of %d foreign chunks timed out", len(keys))
            self.breakers[Tier.REMOTE].failed()
            return out, 0
        bad = 0
        for i, (key, obj) in enumerate(zip(keys, objs, strict=True)):
            if obj is None:
                continue
            meta = None
            if obj.numel() >= HEADER_NBYTES:
                try:
                    meta = parse_header(obj)
                except CorruptChunkError as exc:
                    logger.warning("corrupt remote header for %s: %s", key.hex(), exc)
            if meta is None or meta.key != key or not object_ok(obj, meta):
                bad += 1
                continue
            out[i] = (FetchedChunk(meta, Tier.REMOTE, obj[HEADER_NBYTES:]), obj)
        return out, bad

    def remove(self, tier: Tier, key: ChunkKey) -> bool:
        """Remove one object's bytes; False only when a remote delete could not be confirmed."""
        if tier in self.mem:
            self.mem[tier].remove(key)
        elif tier == Tier.REMOTE:
            assert self.remote is not None
            if not self.available(Tier.REMOTE):
                return True  # skipped while Redis is avoided: the object stays until Redis evicts it
            if not self.remote.remove([key]):
                self.breakers[Tier.REMOTE].failed()
                return False
        else:  # a local object tier (disk): its remove is best effort and makes sure of the bytes
            self.backend(tier).remove([key])
        return True

    def close(self, free_memory: bool = True) -> None:
        timeout = self._config.close_timeout_s
        for breaker in self.breakers.values():
            breaker.close()
        # Each LMCache adapter joins its demux thread (up to 0.5 s); close them side by side.
        closers = [
            threading.Thread(target=b.close, args=(timeout,), name="kv-sidecar-close", daemon=True)
            for b in reversed(self.backends.values())
            if isinstance(b, ObjectBackend)
        ]
        for t in closers:
            t.start()
        for t in closers:
            t.join(timeout + 1.0)
        if not free_memory:
            logger.error("tiered store closed with operations in flight: memory pools not freed")
            return
        for mem in self.mem.values():
            mem.close(timeout)
