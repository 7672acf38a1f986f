"""The write path of ``TieredStore``: ``put`` of a new chunk (reserve, encode, write, index).
Puts of different keys run side by side: only a put that must first make room takes the mover
(``StoreCore.reserve_room``); a remote copy is published by the core (``StoreCore.publish``)."""

from __future__ import annotations

import logging
import time

import torch

from sidecar.identity import KVLayout
from sidecar.payload import as_byte_tensor, payload_nbytes
from sidecar.tiers.envelope import MAX_AUX_BYTES, object_nbytes
from sidecar.tiers.errors import CapacityError, QuotaExceededError, TierUnavailableError
from sidecar.tiers.placement import Entry
from sidecar.tiers.store_core import NoRoom, StoreCore, check_key, check_text, layout_fingerprint
from sidecar.tiers.tier_io import IOFailure, encode_into
from sidecar.tiers.types import ChunkMeta, PutResult, Tier

logger = logging.getLogger(__name__)


class Writes:
    """``put`` and the sequences behind it, over the store's core (see ``sidecar.tiers.store``
    for the lock model)."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    def put(
        self,
        key: bytes,
        payload: object,
        *,
        layout: KVLayout,
        num_tokens: int,
        tenant: str,
        scope: str | None = None,
        source_position: int = 0,
        aux: bytes = b"",
        publish: bool = False,
    ) -> PutResult:
        """``TieredStore.put`` (the contract is there): check the arguments, then under the
        key's stripe decide "is it new?", reserve the tenant's quota and pick the candidate
        tiers (index lock), write without the index lock, and index the chunk."""
        key = check_key(key)
        tenant = check_text("tenant", tenant)
        scope = check_text("scope", scope if scope is not None else tenant)
        if not isinstance(layout, KVLayout):
            raise TypeError("layout must be a KVLayout")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
            raise ValueError("num_tokens must be a positive int")
        if isinstance(source_position, bool) or not isinstance(source_position, int) or source_position < 0:
            raise ValueError("source_position must be a non-negative int")
        if not isinstance(aux, (bytes, bytearray)) or len(aux) > MAX_AUX_BYTES:
            raise ValueError(f"aux must be bytes of at most {MAX_AUX_BYTES}")
        buf = as_byte_tensor(payload)
        expected = payload_nbytes(layout, num_tokens)
        if buf.numel() != expected:
            raise ValueError(
                f"payload is {buf.numel()} bytes but kv_layout x num_tokens ({num_tokens}) needs {expected}"
            )
        if buf.device.type != "cpu":
            buf = buf.cpu()
        meta = ChunkMeta(
            key=key,
            tenant=tenant,
            scope=scope,
            layout_fingerprint=layout_fingerprint(layout),
            num_tokens=num_tokens,
            payload_nbytes=expected,
            source_position=source_position,
            aux=bytes(aux),
            created_at=time.time(),
        )
        obj_nbytes = object_nbytes(expected)
        core = self._core
        with core.stripe(key):
            with core.lock:
                core.check_open()
                existing = core.place.entries.get(key)
                if existing is not None:
                    core.counters.duplicate_puts += 1
                else:
                    try:
                        core.place.reserve_quota(tenant, expected)
                    except QuotaExceededError:
                        core.counters.quota_refusals += 1
                        raise
                    try:
                        candidates = self._candidates(obj_nbytes, tenant)
                    except BaseException:
                        core.place.release_quota(tenant, expected)
                        raise
                    core.active_puts += 1
            if existing is not None:
                published = core.publish(existing) if publish else existing.remote
                return PutResult(key, existing.fastest() or Tier.REMOTE, False, published)
            try:
                placed = self._place_new(candidates, meta, buf, obj_nbytes)
            finally:
                with core.lock:
                    core.active_puts -= 1
                    core.cv.notify_all()
                    entry = core.place.entries.get(key)
            published = (core.publish(entry) if publish else entry.remote) if entry is not None else False
            return PutResult(key, placed, True, published)

    def _candidates(self, obj_nbytes: int, tenant: str) -> list[Tier]:
        """``Placement.candidates``, waiting briefly for readers to unpin; raises
        ``CapacityError`` when no tier could take the object. Index lock held."""
        core = self._core
        p = core.place
        deadline = time.monotonic() + core.config.pin_wait_s
        while True:
            out = p.candidates(obj_nbytes, tenant)
            if out:
                return out
            if not any(p.pinned_bytes(t) for t in core.chain) or not core.wait_unpin(deadline):
                break
        core.counters.capacity_refusals += 1
        tier = p.first_tier_that_holds(obj_nbytes)
        guarded = p.guarded_bytes(tier) if tier is not None else 0
        raise CapacityError(
            tier=tier,
            requested_bytes=obj_nbytes,
            used_bytes=p.used[tier] if tier is not None else 0,
            capacity_bytes=p.capacity[tier] if tier is not None else max(p.capacity.values()),
            pinned_bytes=p.pinned_bytes(tier) if tier is not None else 0,
            reason=("held by resident claims" if guarded else "pinned by readers") if tier is not None
            else "larger than any tier",
            guarded_bytes=guarded,
        )

    def _place_new(self, candidates: list[Tier], meta: ChunkMeta, buf: torch.Tensor, obj_nbytes: int) -> Tier:
        """Write a new chunk to the first candidate tier that takes it and index it; the
        tenant's quota is already reserved (given back on refusal)."""
        core = self._core
        last: NoRoom | None = None
        failed: IOFailure | None = None
        key = meta.key
        for tier in candidates:
            fp = core.io.footprint(tier, obj_nbytes)
            try:
                core.reserve_room(tier, fp, meta.tenant)
            except NoRoom as exc:
                last = exc
                continue
            try:
                meta_written = self._write_new(tier, meta, buf, obj_nbytes)
            except NoRoom as exc:
                core.release(tier, meta.tenant, fp)
                last = exc
                continue
            except IOFailure as exc:
                core.release(tier, meta.tenant, fp)
                logger.warning("write of %s to %s failed; trying the next tier", key.hex(), tier.value)
                failed = exc
                continue
            except BaseException:
                core.release(tier, meta.tenant, fp)
                with core.lock:
                    core.place.release_quota(meta.tenant, meta.payload_nbytes)
                raise
            with core.lock:
                e = Entry(meta=meta_written, obj_nbytes=obj_nbytes)
                core.place.add(e, quota_reserved=True)
                core.place.attach(e, tier, reserved=True)
                c = core.counters
                c.puts += 1
                c.put_bytes += meta.payload_nbytes
                c.tiers[tier].write_bytes += obj_nbytes
            return tier
        p = core.place
        with core.lock:
            p.release_quota(meta.tenant, meta.payload_nbytes)
            if last is None and failed is not None:  # not full: the backend failed every write
                raise TierUnavailableError(f"no tier took the chunk: {failed}")
            core.counters.capacity_refusals += 1
            tier = last.tier if last is not None else (candidates[-1] if candidates else None)
            raise CapacityError(
                tier=tier,
                requested_bytes=obj_nbytes,
                used_bytes=p.used[tier] if tier is not None else 0,
                capacity_bytes=p.capacity[tier] if tier is not None else 0,
                pinned_bytes=p.pinned_bytes(tier) if tier is not None else 0,
                reason=last.reason if last is not None else "larger than any tier",
                guarded_bytes=p.guarded_bytes(tier) if tier is not None else 0,
            )

    def _write_new(self, tier: Tier, meta: ChunkMeta, payload: torch.Tensor, obj_nbytes: int) -> ChunkMeta:
        """Encode (header + payload + checksum) into ``tier``; room is reserved. No lock held
        but the key's stripe: this is the part concurrent puts run side by side."""
        core = self._core
        key = meta.key
        if tier == Tier.CPU:
            mem = core.io.mem[tier]
            dst = core.stage_with_room(tier, key, obj_nbytes)
            try:
                meta = encode_into(dst, meta, payload)
            except BaseException:
                mem.abort(key)
                raise
            mem.commit(key)
            return meta
        host = core.io.scratch(obj_nbytes)
        meta = encode_into(host, meta, payload)
        try:
            core.write_object(tier, key, host)
        except IOFailure:
            core.io.drop_scratch()
            raise
        return meta
