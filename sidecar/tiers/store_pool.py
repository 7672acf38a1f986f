"""The shared pool's side of ``TieredStore`` (``PoolSlots``, over the store's core): reads by
offset under a pin (leases) and writes into slots an engine fills in place (reservations).

Both work on the CPU tier only, and only when its pool is shared (``CpuTier.pool``):

* ``lease(keys)`` pins each key's CPU copy (a victim is never chosen while pinned) and answers
  where its payload is; ``unlease`` drops the pins. The caller (the data plane's lease table)
  bounds how long a pin lives. A chunk moving meanwhile (being demoted) is not leased.
* ``reserve_slot(key, n, tenant)`` reserves the tenant's quota and the tier's room for one
  object, demoting victims as a put would, and stages it under a slot id of its own; the
  engine writes the payload at the slot's offset; ``put_slot`` then checksums it in place,
  writes the header and indexes the chunk (a chunk that another Store indexed meanwhile wins:
  the slot is freed, as a duplicate put changes nothing); ``drop_slot`` frees it unwritten.

The leases and the reserved slots are this part's own state (``leased``, ``_slots``), guarded by
the core's index lock like the rest; an object removed while leased waits in the core's
``graves`` (``StoreCore.drain_and_remove``) for its last ``unlease``.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field, replace

import torch

from sidecar.identity import KVLayout
from sidecar.payload import payload_nbytes
from sidecar.tiers.envelope import HEADER_NBYTES, checksum, object_nbytes, write_header
from sidecar.tiers.errors import CapacityError
from sidecar.tiers.placement import Entry
from sidecar.tiers.store_core import NoRoom, StoreCore, check_key, layout_fingerprint
from sidecar.tiers.types import ChunkKey, ChunkMeta, PutResult, Tier


@dataclass(slots=True)
class PoolRead:
    """One leased chunk: its payload at ``offset`` in the pool; ``stamp`` is the header's."""

    entry: Entry
    offset: int
    stamp: int

    @property
    def meta(self) -> ChunkMeta:
        return self.entry.meta


@dataclass(slots=True)
class Slot:
    """One reserved object: the engine writes ``nbytes`` of payload at ``offset``."""

    key: ChunkKey
    id: bytes
    tenant: str
    nbytes: int
    fp: int
    view: torch.Tensor = field(repr=False)  # the whole object (header + payload)
    offset: int = 0

    def __len__(self) -> int:
        return self.nbytes

    @property
    def payload(self) -> torch.Tensor:
        return self.view[HEADER_NBYTES:]


class PoolSlots:
    """``lease``/``unlease`` and ``reserve_slot``/``put_slot``/``drop_slot`` over the store's
    core (see the module docstring; ``sidecar.tiers.store`` for the lock model)."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core
        self._slots: dict[bytes, Slot] = {}  # reserved in the shared pool, by slot id
        self._leased = 0  # chunks pinned by leases (index lock)

    @property
    def pool(self):
        """The shared pool (``sidecar.shm.pool.PoolFile``), or None when there is none."""
        cpu = self._core.io.mem.get(Tier.CPU)
        return getattr(cpu, "pool", None)

    # ------------------------------------------------------------------ leases

    def lease(self, keys: list[bytes]) -> list[PoolRead | None]:
        """``TieredStore.lease``: under the index lock, each CPU copy that is not moving is
        pinned as a reader (victim selection skips it) and counted as a lease."""
        core = self._core
        cpu = core.io.mem.get(Tier.CPU)
        out: list[PoolRead | None] = [None] * len(keys)
        if self.pool is None:
            return out
        with core.lock:
            core.check_open()
            for i, key in enumerate(keys):
                e = core.place.entries.get(check_key(key))
                if e is None or e.local is not Tier.CPU or e.moving:
                    continue
                # Where it is, read under the index lock: a Delete may unname the object as soon
                # as the pin is visible (its memory stays, the name goes).
                view = cpu.acquire(e.key)
                if view is None:
                    continue
                try:
                    read = PoolRead(e, cpu.offset(view) + HEADER_NBYTES,
                                    int.from_bytes(view[32:40].numpy().tobytes(), "little"))
                finally:
                    cpu.release(e.key)
                e.readers[Tier.CPU] = e.readers.get(Tier.CPU, 0) + 1
                e.leases += 1
                self._leased += 1
                core.place.touch(e, Tier.CPU)
                out[i] = read
        return out

    def unlease(self, reads: list[PoolRead]) -> None:
        """``TieredStore.unlease``: the pins dropped under the index lock, the objects whose
        last lease this was (the core's ``graves``) freed after it."""
        core = self._core
        freed = []
        with core.lock:
            for r in reads:
                e = r.entry
                n = e.readers.get(Tier.CPU, 0) - 1
                if n > 0:
                    e.readers[Tier.CPU] = n
                else:
                    e.readers.pop(Tier.CPU, None)
                e.leases -= 1
                self._leased -= 1
                if not e.leases and id(e) in core.graves:
                    freed.append(core.graves.pop(id(e))[1])
            core.cv.notify_all()
        cpu = core.io.mem.get(Tier.CPU)
        for okey in freed:
            cpu.free(okey)

    @property
    def leased(self) -> int:
        """Chunks pinned by leases now."""
        return self._leased

    # ------------------------------------------------------------------ slots

    def reserve_slot(self, key: bytes, nbytes: int, tenant: str) -> Slot | None:
        """``TieredStore.reserve_slot``: the tenant's quota reserved (index lock), room made and
        the object staged as a put's would be (``StoreCore.reserve_room``, ``stage_with_room``),
        counted as a put in flight meanwhile (``close`` waits for it)."""
        core = self._core
        key = check_key(key)
        cpu = core.io.mem.get(Tier.CPU)
        if self.pool is None:
            return None
        obj_nbytes = object_nbytes(nbytes)
        with core.lock:
            core.check_open()
            if key in core.place.entries:
                return None
            core.place.reserve_quota(tenant, nbytes)
            core.active_puts += 1
        fp = core.io.footprint(Tier.CPU, obj_nbytes)
        slot_id = secrets.token_bytes(16)
        try:
            core.reserve_room(Tier.CPU, fp, tenant)
            try:
                view = core.stage_with_room(Tier.CPU, key, obj_nbytes, stage=lambda: cpu.stage_slot(slot_id, obj_nbytes))
            except BaseException:
                core.release(Tier.CPU, tenant, fp)
                raise
        except BaseException as exc:
            with core.lock:
                core.place.release_quota(tenant, nbytes)
                core.active_puts -= 1
                core.cv.notify_all()
                if isinstance(exc, NoRoom):
                    p = core.place
                    core.counters.capacity_refusals += 1
                    raise CapacityError(
                        tier=Tier.CPU, requested_bytes=obj_nbytes, used_bytes=p.used[Tier.CPU],
                        capacity_bytes=p.capacity[Tier.CPU], pinned_bytes=p.pinned_bytes(Tier.CPU),
                        reason=exc.reason, guarded_bytes=p.guarded_bytes(Tier.CPU),
                    ) from None
            raise
        view[:HEADER_NBYTES].zero_()  # no stale stamp: nothing reads this object before its commit
        slot = Slot(key, slot_id, tenant, nbytes, fp, view, cpu.offset(view) + HEADER_NBYTES)
        with core.lock:
            core.active_puts -= 1
            self._slots[slot_id] = slot
            core.cv.notify_all()
        return slot

    def _take_slot(self, slot: Slot) -> None:
        with self._core.lock:
            if self._slots.pop(slot.id, None) is None:
                raise ValueError("slot: not reserved here (committed, dropped or expired)")

    def drop_slot(self, slot: Slot) -> bool:
        """``TieredStore.drop_slot``."""
        try:
            self._take_slot(slot)
        except ValueError:
            return False
        self._free_slot(slot)
        return True

    def _free_slot(self, slot: Slot) -> None:
        core = self._core
        core.io.mem[Tier.CPU].abort_slot(slot.id)
        core.release(Tier.CPU, slot.tenant, slot.fp)
        with core.lock:
            core.place.release_quota(slot.tenant, slot.nbytes)

    def put_slot(self, slot: Slot, *, layout: KVLayout, num_tokens: int, tenant: str, scope: str | None = None,
                 source_position: int = 0, aux: bytes = b"", publish: bool = False,
                 payload_checksum: int | None = None) -> PutResult:
        """``TieredStore.put_slot``: under the key's stripe, "is it new?", then the header
        written and the chunk indexed as ``Writes.put`` indexes one (or the slot freed)."""
        core = self._core
        self._take_slot(slot)
        key = slot.key
        expected = payload_nbytes(layout, num_tokens)
        if expected != slot.nbytes or tenant != slot.tenant:
            self._free_slot(slot)
            raise ValueError(f"slot: reserved for {slot.nbytes} B of tenant {slot.tenant!r}, committed as "
                             f"{expected} B of {tenant!r}")
        meta = ChunkMeta(key=key, tenant=tenant, scope=scope if scope is not None else tenant,
                         layout_fingerprint=layout_fingerprint(layout), num_tokens=num_tokens,
                         payload_nbytes=expected, source_position=source_position, aux=bytes(aux),
                         created_at=time.time())
        with core.stripe(key):
            with core.lock:
                existing = core.place.entries.get(key)
                closed = core.closed
            if closed or existing is not None:
                self._free_slot(slot)
                core.check_open()
                with core.lock:
                    core.counters.duplicate_puts += 1
                published = core.publish(existing) if publish else existing.remote
                return PutResult(key, existing.fastest() or Tier.REMOTE, False, published)
            meta = replace(meta, checksum=checksum(slot.payload) if payload_checksum is None else payload_checksum)
            write_header(slot.view[:HEADER_NBYTES], meta)
            core.io.mem[Tier.CPU].commit_slot(slot.id, key)
            with core.lock:
                e = Entry(meta=meta, obj_nbytes=object_nbytes(slot.nbytes))
                core.place.add(e, quota_reserved=True)
                core.place.attach(e, Tier.CPU, reserved=True)
                c = core.counters
                c.puts += 1
                c.put_bytes += meta.payload_nbytes
                c.tiers[Tier.CPU].write_bytes += e.obj_nbytes
        published = core.publish(e) if publish else False
        return PutResult(key, Tier.CPU, True, published)

    def drop_all_slots(self) -> None:
        """Free every reserved slot (``TieredStore.close``)."""
        with self._core.lock:
            slots, self._slots = list(self._slots.values()), {}
        for slot in slots:
            self._free_slot(slot)


async def slot_checksums(slots: list[Slot]) -> list[int]:
    """The payload checksum of each filled slot, computed on worker threads side by side (the
    hash releases the GIL: a commit's checksums take the cores the engine left idle)."""
    return list(await asyncio.gather(*(asyncio.to_thread(checksum, s.payload) for s in slots)))

