"""The write path of ``TieredStore``: ``put`` of a new chunk (reserve, encode, write, index)
and publication of a remote copy. Puts of different keys run side by side: only a put that
must first make room takes the mover (``store_moves``)."""

from __future__ import annotations

import logging
import time

import torch

from sidecar.identity import KVLayout
from sidecar.payload import as_byte_tensor, payload_nbytes
from sidecar.tiers.envelope import MAX_AUX_BYTES, object_nbytes
from sidecar.tiers.errors import CapacityError, QuotaExceededError, TierUnavailableError
from sidecar.tiers.events import Reason
from sidecar.tiers.placement import Entry
from sidecar.tiers.store_moves import NoRoom, StoreMoves, check_key, check_text, layout_fingerprint
from sidecar.tiers.tier_io import IOFailure, SourceLost, encode_into
from sidecar.tiers.types import ChunkMeta, PutResult, Tier

logger = logging.getLogger(__name__)


class StoreWrites(StoreMoves):
    """``put`` and the sequences behind it (see ``sidecar.tiers.store`` for the lock model)."""

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
        """Store one chunk payload atomically (readers see it only once complete and checksummed).

        Idempotent per key: if ``key`` is already held nothing changes and ``stored`` is False
        (with ``publish`` a missing remote copy is still written). ``payload`` is bytes-like, a
        numpy array or a contiguous tensor of exactly ``layout.bytes_per_token * num_tokens``
        bytes. ``publish`` also writes a remote copy for other sidecars. Puts of different
        keys run in parallel (see the lock model in the module docstring).

        Raises ``ValueError``/``TypeError`` for bad arguments, ``QuotaExceededError`` when the
        tenant's ``max_bytes`` would be exceeded, ``CapacityError`` when no tier can take the
        chunk without dropping data it must keep; all of these leave the store unchanged.
        """
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
        with self._stripe(key):
            with self._lock:
                self._check_open()
                existing = self._place.entries.get(key)
                if existing is not None:
                    self._counters.duplicate_puts += 1
                else:
                    try:
                        self._place.reserve_quota(tenant, expected)
                    except QuotaExceededError:
                        self._counters.quota_refusals += 1
                        raise
                    try:
                        candidates = self._candidates(obj_nbytes, tenant)
                    except BaseException:
                        self._place.release_quota(tenant, expected)
                        raise
                    self._active_puts += 1
            if existing is not None:
                published = self._publish(existing) if publish else existing.remote
                return PutResult(key, existing.fastest() or Tier.REMOTE, False, published)
            try:
                placed = self._place_new(candidates, meta, buf, obj_nbytes)
            finally:
                with self._lock:
                    self._active_puts -= 1
                    self._cv.notify_all()
                    entry = self._place.entries.get(key)
            published = (self._publish(entry) if publish else entry.remote) if entry is not None else False
            return PutResult(key, placed, True, published)

    def _candidates(self, obj_nbytes: int, tenant: str) -> list[Tier]:
        """``Placement.candidates``, waiting briefly for readers to unpin; raises
        ``CapacityError`` when no tier could take the object. Index lock held."""
        p = self._place
        deadline = time.monotonic() + self._config.pin_wait_s
        while True:
            out = p.candidates(obj_nbytes, tenant)
            if out:
                return out
            if not any(p.pinned_bytes(t) for t in self._chain) or not self._wait_unpin(deadline):
                break
        self._counters.capacity_refusals += 1
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
        last: NoRoom | None = None
        failed: IOFailure | None = None
        key = meta.key
        for tier in candidates:
            fp = self._io.footprint(tier, obj_nbytes)
            try:
                self._reserve_room(tier, fp, meta.tenant)
            except NoRoom as exc:
                last = exc
                continue
            try:
                meta_written = self._write_new(tier, meta, buf, obj_nbytes)
            except NoRoom as exc:
                self._release(tier, meta.tenant, fp)
                last = exc
                continue
            except IOFailure as exc:
                self._release(tier, meta.tenant, fp)
                logger.warning("write of %s to %s failed; trying the next tier", key.hex(), tier.value)
                failed = exc
                continue
            except BaseException:
                self._release(tier, meta.tenant, fp)
                with self._lock:
                    self._place.release_quota(meta.tenant, meta.payload_nbytes)
                raise
            with self._lock:
                e = Entry(meta=meta_written, obj_nbytes=obj_nbytes)
                self._place.add(e, quota_reserved=True)
                self._place.attach(e, tier, reserved=True)
                c = self._counters
                c.puts += 1
                c.put_bytes += meta.payload_nbytes
                c.tiers[tier].write_bytes += obj_nbytes
            return tier
        p = self._place
        with self._lock:
            p.release_quota(meta.tenant, meta.payload_nbytes)
            if last is None and failed is not None:  # not full: the backend failed every write
                raise TierUnavailableError(f"no tier took the chunk: {failed}")
            self._counters.capacity_refusals += 1
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
        key = meta.key
        if tier == Tier.CPU:
            mem = self._io.mem[tier]
            dst = self._stage_with_room(tier, key, obj_nbytes)
            try:
                meta = encode_into(dst, meta, payload)
            except BaseException:
                mem.abort(key)
                raise
            mem.commit(key)
            return meta
        host = self._io.scratch(obj_nbytes)
        meta = encode_into(host, meta, payload)
        try:
            self._write_object(tier, key, host)
        except IOFailure:
            self._io.drop_scratch()
            raise
        return meta

    def _publish(self, e: Entry) -> bool:
        """Give ``e`` a remote copy (best effort; False when there is no remote or it failed)."""
        if self._io.remote is None or e.remote:
            return e.remote
        with self._mover:
            with self._lock:
                if self._closed or self._place.entries.get(e.key) is not e or e.local is None or e.remote or e.moving:
                    return e.remote
                src = e.local
                e.moving = True
            fp = self._io.footprint(Tier.REMOTE, e.obj_nbytes)
            try:
                if fp > self._place.capacity[Tier.REMOTE]:
                    return False
                self._reserve_room(Tier.REMOTE, fp, e.tenant)
                try:
                    self._copy_object(e, src, Tier.REMOTE)
                except BaseException:
                    self._release(Tier.REMOTE, e.tenant, fp)
                    raise
            except SourceLost as lost:
                e.moving = False
                self._lose(e, lost.tier, Reason.CORRUPTION)
                return False
            except (NoRoom, IOFailure) as exc:
                logger.warning("publishing %s to the remote tier failed: %s", e.key.hex(), exc)
                return False
            finally:
                e.moving = False
            with self._lock:
                self._place.attach(e, Tier.REMOTE, reserved=True)
                self._counters.tiers[Tier.REMOTE].write_bytes += e.obj_nbytes
            return True

