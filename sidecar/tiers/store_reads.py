"""The read path of ``TieredStore``: ``get_many`` (pin, batched verified reads, fallback to
the remote copy, chunks other sidecars published) and promotion of hits to the fastest tier,
over the store's core (``StoreCore``: pins, moves, locks)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from sidecar.tiers.backends import LoadFailure
from sidecar.tiers.envelope import HEADER_NBYTES, object_nbytes
from sidecar.tiers.events import EventKind, Reason
from sidecar.tiers.placement import Entry
from sidecar.tiers.store_core import NoRoom, StoreCore, check_key
from sidecar.tiers.tier_io import IOFailure, SourceLost, object_ok
from sidecar.tiers.types import FetchedChunk, Tier

logger = logging.getLogger(__name__)


class Reads:
    """``get_many`` and promotion, over the store's core (see ``sidecar.tiers.store`` for the
    lock model)."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    def get_many(self, keys: Sequence[bytes], *, promote: bool | None = None) -> list[FetchedChunk | None]:
        """``TieredStore.get_many`` (the contract is there): pin what the index holds (index
        lock), read it without the lock, lose what failed and retry it from the remote copy,
        look the rest up as foreign chunks, count, then promote (mover tried, never waited for)."""
        core = self._core
        keys = [check_key(k) for k in keys]
        promote = core.config.promote_on_hit if promote is None else promote
        results: list[FetchedChunk | None] = [None] * len(keys)
        objects: dict[int, torch.Tensor] = {}
        with core.lock:
            core.check_open()
            reads: list[tuple[int, Entry, Tier]] = []
            foreign: list[int] = []
            for i, key in enumerate(keys):
                e = core.place.entries.get(key)
                tier = e.fastest() if e is not None else None
                if e is None or tier is None:
                    if core.io.remote is not None and key not in core.remote_removing:
                        foreign.append(i)
                    continue
                core.pin(e, tier)
                reads.append((i, e, tier))
        failed = self._read(reads, results, objects)
        retry: list[tuple[int, Entry, Tier]] = []
        for i, e, tier, reason in failed:
            core.lose(e, tier, reason)
            with core.lock:
                if e.remote and tier != Tier.REMOTE and core.place.entries.get(e.key) is e:
                    core.pin(e, Tier.REMOTE)
                    retry.append((i, e, Tier.REMOTE))
        for _, e, tier, reason in self._read(retry, results, objects):
            core.lose(e, tier, reason)
        if foreign:
            fetched, bad = core.io.read_foreign([keys[i] for i in foreign])
            for i, (chunk, obj) in zip(foreign, fetched, strict=True):
                if chunk is not None:
                    results[i] = chunk
                    objects[i] = obj
            if bad:
                with core.lock:
                    core.counters.checksum_failures += bad
        with core.lock:
            c = core.counters
            c.gets += len(keys)
            for r in results:
                if r is None:
                    c.misses += 1
                else:
                    c.hits += 1
                    c.get_bytes += r.meta.payload_nbytes
                    c.tiers[r.tier].hits += 1
                    c.tiers[r.tier].read_bytes += object_nbytes(r.meta.payload_nbytes)
        if promote and core.chain:
            self._promote_hits(results, objects)
        return results

    def _read(
        self,
        reads: list[tuple[int, Entry, Tier]],
        results: list[FetchedChunk | None],
        objects: dict[int, torch.Tensor],
    ) -> list[tuple[int, Entry, Tier, Reason]]:
        """Read pinned entries into ``results``; returns the failures. Unpins everything."""
        core = self._core
        io = core.io
        failed: list[tuple[int, Entry, Tier, Reason]] = []
        try:
            batches: dict[Tier, list[tuple[int, Entry]]] = {}
            for i, e, tier in reads:
                if tier in io.mem:
                    payload = io.read_memory(tier, e.key, e.meta)
                    if payload is None:
                        failed.append((i, e, tier, Reason.CORRUPTION))
                    else:
                        results[i] = FetchedChunk(e.meta, tier, payload)
                else:
                    batches.setdefault(tier, []).append((i, e))
            for tier, items in batches.items():
                if not io.available(tier):
                    continue  # misses while the tier is avoided (breaker open); nothing is removed
                try:
                    objs = io.load_batch(tier, [e.key for _, e in items], [e.obj_nbytes for _, e in items])
                except TimeoutError:
                    # Slow, not lost: these are misses this time and nothing is removed.
                    logger.warning("%s read of %d chunks timed out", tier.value, len(items))
                    with core.lock:
                        core.counters.io_errors += 1
                    continue
                for (i, e), obj in zip(items, objs, strict=True):
                    if isinstance(obj, LoadFailure):
                        reason = Reason.MISSING if obj is LoadFailure.MISSING else Reason.CORRUPTION
                        failed.append((i, e, tier, reason))
                    elif not object_ok(obj, e.meta):
                        failed.append((i, e, tier, Reason.CORRUPTION))
                    else:
                        results[i] = FetchedChunk(e.meta, tier, obj[HEADER_NBYTES:])
                        objects[i] = obj
        finally:
            with core.lock:
                for _, e, tier in reads:
                    core.unpin(e, tier)
                core.cv.notify_all()
        return failed

    def _promote_hits(self, results: list[FetchedChunk | None], objects: dict[int, torch.Tensor]) -> None:
        core = self._core
        top = core.chain[0]
        wanted = [(i, r) for i, r in enumerate(results) if r is not None and r.tier != top]
        if not wanted or not core.mover.acquire(blocking=False):
            return
        try:
            if core.closed:
                return
            for i, r in wanted:
                self._promote(r, objects.get(i), top)
        finally:
            core.mover.release()

    def _promote(self, r: FetchedChunk, obj: torch.Tensor | None, top: Tier) -> None:
        """Copy a hit up to ``top`` and drop its slower local copy. Mover held. Skipped while
        the key's stripe is taken: a put of the same key may be placing it (a foreign chunk
        is not in the index yet, so both would stage the key in ``top``)."""
        stripe = self._core.stripe(r.meta.key)
        if not stripe.acquire(blocking=False):
            return
        try:
            self._promote_locked(r, obj, top)
        finally:
            stripe.release()

    def _promote_locked(self, r: FetchedChunk, obj: torch.Tensor | None, top: Tier) -> None:
        core = self._core
        key = r.meta.key
        p = core.place
        with core.lock:
            e = p.entries.get(key)
            if e is None:
                if r.tier != Tier.REMOTE or key in core.remote_removing:
                    return
                quota = core.config.quota_for(r.meta.tenant).max_bytes
                if quota is not None and p.tenant_bytes[r.meta.tenant] + r.meta.payload_nbytes > quota:
                    return
                # A chunk published by another sidecar: this store now tracks its remote copy.
                e = Entry(meta=r.meta, obj_nbytes=object_nbytes(r.meta.payload_nbytes))
                p.add(e)
                p.attach(e, Tier.REMOTE)
            if e.moving or e.fastest() != r.tier or e.meta != r.meta:
                return
            fp = core.io.footprint(top, e.obj_nbytes)
            if not p.could_hold(top, fp, e.tenant) or not p.reclaimable(top, fp, e.tenant):
                return
            e.moving = True
        src = r.tier
        try:
            core.reserve_room(top, fp, e.tenant)
            try:
                if obj is not None:
                    core.write_object(top, key, obj)
                else:
                    core.copy_object(e, src, top)
            except BaseException:
                core.release(top, e.tenant, fp)
                raise
        except (NoRoom, IOFailure, SourceLost) as exc:
            logger.debug("promotion of %s skipped: %s", key.hex(), exc)
            e.moving = False
            return
        with core.lock:
            if src != Tier.REMOTE:
                p.detach(e, src)
            p.attach(e, top, reserved=True)
            core.counters.promotions += 1
            core.counters.tiers[top].promotions_in += 1
            core.counters.tiers[top].write_bytes += e.obj_nbytes
            core.emit(EventKind.PROMOTED, e, src, top, Reason.HIT)
        if src != Tier.REMOTE:
            core.drain_and_remove(e, src)
        e.moving = False
