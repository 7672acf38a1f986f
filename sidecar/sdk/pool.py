"""The engine's side of the shared pool: Fetch by lease and Store by reservation, bytes in place.

An engine on the sidecar's host maps the sidecar's CPU pool once (``PoolClient(client)``: the
``MapPool`` RPC, then ``sidecar.shm.pool.MappedPool``) and from then on moves KV through it::

    fetched = pool.lease(plan.fetch_spans(), identity=ident, layout=layout)   # descriptors only
    for item in fetched.items:
        if item.ok:
            pool.read_into(item, staging[:, :, a:b], layout, rope)   # rotate + place, one pass
    if not pool.intact(fetched): ...    # an expired lease's bytes were reused: recompute them
    pool.release(fetched)

    w = pool.reserve(tokens, identity=ident, layout=layout, chunk_starts=starts)
    for start, slot in w.slots.items(): slot.copy_(...)    # gather the chunk's KV into the pool,
    result = w.commit()                                       # before w.deadline: checksummed, registered

Leases and reservations end by themselves after the sidecar's TTL; ``release`` / ``commit`` /
``abort`` end them at once. ``store`` and ``fetch`` are the same with the caller's buffers
(one copy each way): drop-in for ``client.store`` / ``client.fetch`` where that is simpler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash

from sidecar.api.pool import LeasedChunk, leased_from_wire
from sidecar.errors import NotFound
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.payload import as_byte_tensor, is_stacked, stacked_view
from sidecar.registry.lookup_plan import FetchSpec
from sidecar.sdk.results import FetchedKV, StoreResult
from sidecar.shm.pool import MappedPool

if TYPE_CHECKING:
    from sidecar.rotation import RopeSpec

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LeasedItem:
    """One Fetch item's answer: its rows are ``chunks`` (each: rows ``[row_offset, row_offset +
    rows)`` of a stored chunk's payload in the pool, at its source position, to rotate by
    ``delta``), in order; ``ok`` False for a miss."""

    index: int
    ok: bool
    chunks: list[LeasedChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.rows for c in self.chunks)

    @property
    def delta(self) -> int:
        return self.chunks[0].delta if self.chunks else 0

    @property
    def source_pos(self) -> int:
        return self.chunks[0].source_pos if self.chunks else 0


@dataclass(slots=True)
class LeasedFetch:
    pool: str
    lease: str
    items: list[LeasedItem]


class PoolStore:
    """An open reservation: write each chunk's payload into ``slots[start]`` (a uint8 view of
    the pool, ``KVLayout`` order at the chunk's own positions), then ``commit`` (or ``abort``).
    ``held``: chunks the sidecar holds already (nothing to write)."""

    def __init__(self, pool: PoolClient, msg: Any, layout: KVLayout, asked_at: float) -> None:
        self._pool = pool
        #: write and commit before this (``time.monotonic``): the sidecar aborts the
        #: reservation after its TTL and may reuse the slots' memory
        self.deadline = asked_at + msg.ttl_s
        self.reservation = msg.reservation
        self.layout = layout
        self.slots: dict[int, torch.Tensor] = {s.chunk_start: pool.mapped.view(s.offset, s.length) for s in msg.slots}
        self.held = set(msg.held)
        self.chunk_bounds = tuple(memoryview(msg.chunk_bounds).cast("I").tolist()) if msg.chunk_bounds else ()
        self._open = True

    def stacked(self, start: int) -> torch.Tensor:
        """``slots[start]`` as ``[L, P, n, *shape]`` (GQA / MHA layouts)."""
        slot = self.slots[start]
        return stacked_view(slot, self.layout, slot.numel() // self.layout.bytes_per_token)

    def write(self, start: int, payload: Any) -> None:
        """Copy ``payload`` (bytes-like, array or tensor) into the slot of chunk ``start``."""
        self._alive("write")
        self.slots[start].copy_(as_byte_tensor(payload))

    def write_rows(self, start: int, rows: torch.Tensor) -> None:
        """Copy ``rows`` (``[L, P, n, *shape]``, any strides: e.g. a slice of rows gathered from
        an engine's cache) into the slot of chunk ``start``, in ``KVLayout`` order."""
        self._alive("write")
        _copy(self.stacked(start), rows)

    def _alive(self, what: str) -> None:
        if time.monotonic() >= self.deadline:
            self._open = False
            raise ValueError(f"reservation: {what} after the reservation's TTL; the sidecar aborted it and may "
                             "have reused its slots (nothing of it was stored)")

    def commit(self) -> StoreResult:
        self._alive("commit")
        self._open = False
        return self._pool.client.commit_store(self.reservation, len(self.slots),
                                              sum(s.numel() for s in self.slots.values()))

    def abort(self) -> int:
        if not self._open:
            return 0
        self._open = False
        return self._pool.client.abort_store(self.reservation)


class PoolClient:
    """The shared pool through ``client`` (a ``SyncSidecarClient`` to a sidecar on this host).
    ``available`` is False when the sidecar has none, or is on another host: use Fetch and
    Store then."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.mapped: MappedPool | None = None
        self.name = ""
        self.remap()

    def remap(self) -> bool:
        """(Re)map the sidecar's pool (a restarted sidecar has a new one); whether there is one."""
        info = self.client.map_pool()
        self.name = info.name
        self.mapped = None
        if info.name:
            try:
                self.mapped = MappedPool(info.name, info.size, info.header_bytes)
            except (OSError, ValueError) as exc:
                logger.warning("the sidecar's shared pool %s cannot be mapped here (%s): KV moves over the stream",
                               info.name, exc)
                self.name = ""
        return self.mapped is not None

    @property
    def available(self) -> bool:
        return self.mapped is not None

    def _check(self, pool: str) -> MappedPool:
        if self.mapped is None or pool != self.name:
            if not self.remap() or pool != self.name:
                raise ValueError(f"pool: the answer names pool {pool!r}, this engine mapped {self.name!r} "
                                 "(the sidecar restarted meanwhile: call again)")
        return self.mapped  # type: ignore[return-value]

    # ------------------------------------------------------------------ Fetch

    def lease(self, items: Sequence[tuple[int, int] | FetchSpec], *, identity: CacheIdentity, layout: KVLayout,
              plan_identity: CacheIdentity | None = None) -> LeasedFetch:
        """Lease the hits of ``items`` (as ``client.fetch`` takes them): where each one's rows
        are in the pool. Nothing is copied."""
        msg = self.client.lease_fetch(identity, layout, items, plan_identity)
        mapped = self._check(msg.pool) if msg.slots else self.mapped
        out = [LeasedItem(i, True) for i in range(len(items))]
        for i in msg.misses:
            out[i].ok = False
        for c in leased_from_wire(msg):
            mapped.view(c.offset, c.length)  # bounds-checked here, once
            out[c.index].chunks.append(c)
        for it in out:
            if it.ok and not it.chunks:
                it.ok = False
        return LeasedFetch(msg.pool, msg.lease, out)

    def chunk_view(self, c: LeasedChunk) -> torch.Tensor:
        return self.mapped.view(c.offset, c.length)  # type: ignore[union-attr]

    def read_into(self, item: LeasedItem, dst: torch.Tensor, layout: KVLayout, rope: RopeSpec | None = None) -> None:
        """Place ``item``'s rows into ``dst`` (``[L, P, item.num_tokens, *shape]``, GQA / MHA
        layouts), rotated by their delta on the way (``rope`` required for a shifted item): one
        pass over the bytes, no intermediate copy."""
        if not is_stacked(layout):
            raise ValueError("kv_layout: read_into takes stacked (GQA / MHA) layouts; use read_parts")
        from sidecar.rotation import rotate_keys  # noqa: PLC0415 - numba loads only when rotating

        at = 0
        rotary = [i for i, p in enumerate(layout.parts) if p.rotary]
        for c in item.chunks:
            src = stacked_view(self.chunk_view(c), layout, c.num_tokens)[:, :, c.row_offset : c.row_offset + c.rows]
            out = dst[:, :, at : at + c.rows]
            if not c.delta:
                _copy(out, src)
            else:
                if rope is None:
                    raise ValueError("rope: required to place a shifted item")
                for p in range(len(layout.parts)):
                    if p in rotary:
                        for layer in range(layout.num_layers):
                            target = out[layer, p]
                            if target.is_contiguous():
                                rotate_keys(src[layer, p], c.delta, rope, out=target)
                            else:
                                target.copy_(rotate_keys(src[layer, p], c.delta, rope))
                    else:
                        _copy(out[:, p], src[:, p])
            at += c.rows

    def _copy_rows(self, item: LeasedItem, buf: torch.Tensor, layout: KVLayout) -> None:
        """``item``'s rows, at their source position, into ``buf`` (a payload of
        ``item.num_tokens`` rows, ``KVLayout`` order): one strided copy per chunk and part."""
        n, at = item.num_tokens, 0
        widths = [p.bytes_per_token for p in layout.parts]
        dst = buf.view(layout.num_layers, -1)  # per layer: each part's n rows, back to back
        for c in item.chunks:
            src = self.chunk_view(c).view(layout.num_layers, -1)
            s_off = d_off = 0
            for w in widths:
                _copy(dst[:, d_off + at * w : d_off + (at + c.rows) * w],
                      src[:, s_off + c.row_offset * w : s_off + (c.row_offset + c.rows) * w])
                s_off += c.num_tokens * w
                d_off += n * w
            at += c.rows

    def intact(self, fetched: LeasedFetch, *, verify: bool = False) -> bool:
        """Whether every leased chunk still holds the bytes it was leased with: check after
        reading. The stamps tell whether the sidecar freed a chunk's memory meanwhile (a lease
        that expired mid-read); ``verify`` also checksums each chunk's bytes (one more read at
        xxh3 speed), which catches a write by some other process that maps the pool, e.g. an
        engine writing a reservation after its TTL."""
        if not fetched.lease:
            return True
        mapped = self._check(fetched.pool)
        chunks = [c for it in fetched.items for c in it.chunks]
        if not all(mapped.stamp_ok(c.offset, c.stamp) for c in chunks):
            return False
        return not verify or all(_checksum(mapped.view(c.offset, c.length)) == c.checksum for c in chunks)

    def release(self, fetched: LeasedFetch) -> bool:
        """End the lease; False when it had expired already (the sidecar released it: check
        ``intact`` before trusting what was read)."""
        if not fetched.lease:
            return True
        lease, fetched.lease = fetched.lease, ""
        try:
            self.client.release_lease(lease)
        except NotFound:
            return False
        return True

    def fetch(self, items: Sequence[tuple[int, int] | FetchSpec], *, identity: CacheIdentity, layout: KVLayout,
              rope: RopeSpec | None = None, plan_identity: CacheIdentity | None = None,
              verify: bool = False) -> list[FetchedKV]:
        """``client.fetch`` through the pool: each hit copied (and rotated) once, from the pool
        into a buffer the caller owns; a chunk whose lease expired before the copy is a miss
        (and, with ``verify``, one whose bytes fail their checksum: ``intact``)."""
        fetched = self.lease(items, identity=identity, layout=layout, plan_identity=plan_identity)
        out: list[FetchedKV] = []
        shifted: list[tuple[torch.Tensor, int, int]] = []
        # one allocation for the call (numpy backs big ones with huge pages: a few page faults,
        # not one per 4 KiB); each result is a view of it, so holding one holds the block
        block = torch.from_numpy(np.empty(sum(it.num_tokens for it in fetched.items if it.ok)
                                          * layout.bytes_per_token, dtype=np.uint8))
        at = 0
        try:
            for it in fetched.items:
                h = items[it.index].chunk_hash if isinstance(items[it.index], FetchSpec) else items[it.index][0]
                if not it.ok:
                    out.append(FetchedKV(index=it.index, chunk_hash=h, ok=False))
                    continue
                n = it.num_tokens
                buf = block[at : at + n * layout.bytes_per_token]
                at += n * layout.bytes_per_token
                self._copy_rows(it, buf, layout)
                if it.delta:
                    shifted.append((buf, n, it.delta))
                out.append(FetchedKV(index=it.index, chunk_hash=h, ok=True, num_tokens=n, source_pos=it.source_pos,
                                     delta=it.delta, rotated=True, tier=it.chunks[0].tier, data=memoryview(buf.numpy())))
            if shifted:  # every shifted item's keys in one batched kernel call, in the caller's buffers
                if rope is None:
                    raise ValueError("rope: required to place shifted items")
                from sidecar.rotation import rotate_payloads_  # noqa: PLC0415 - numba loads only when rotating

                rotate_payloads_(shifted, layout, rope)
            if not self.intact(fetched, verify=verify):
                for r, it in zip(out, fetched.items, strict=True):
                    one = LeasedFetch(fetched.pool, fetched.lease, [it])
                    if r.ok and not self.intact(one, verify=verify):
                        out[r.index] = FetchedKV(index=r.index, chunk_hash=r.chunk_hash, ok=False)
        finally:
            self.release(fetched)
        return out

    # ------------------------------------------------------------------ Store

    def reserve(self, tokens: Any, *, identity: CacheIdentity, layout: KVLayout, chunk_starts: Sequence[int] = (),
                register_from: int = 0, shared: bool = False) -> PoolStore:
        """Slots for the chunks of ``tokens`` starting at ``chunk_starts`` (empty: every chunk at
        or after ``register_from``) that the sidecar does not hold yet."""
        asked = time.monotonic()
        msg = self.client.reserve_store(tokens, identity, layout, register_from=register_from, shared=shared,
                                        chunk_starts=chunk_starts)
        self._check(msg.pool)
        return PoolStore(self, msg, layout, asked)

    def store(self, tokens: Any, *, identity: CacheIdentity, layout: KVLayout, payloads: Mapping[int, Any],
              register_from: int = 0, shared: bool = False) -> StoreResult:
        """``client.store`` through the pool: each payload copied once, into its slot."""
        if not payloads:  # metadata only: nothing to move
            return self.client.store(tokens, identity=identity, register_from=register_from, shared=shared)
        w = self.reserve(tokens, identity=identity, layout=layout, chunk_starts=sorted(payloads),
                         register_from=register_from, shared=shared)
        try:
            for start in w.slots:
                w.write(start, payloads[start])
        except BaseException:
            w.abort()
            raise
        return w.commit()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for host tensors as one single-threaded strided memcpy (numpy, GIL
    released): torch spreads a copy over its intra-op threads, which collapses on a busy host."""
    if dst.device.type == "cpu" and dst.dtype == src.dtype and dst.stride(-1) == 1 and src.stride(-1) == 1:
        np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
    else:
        dst.copy_(src)


def _checksum(view: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(view.numpy()))


__all__ = ["LeasedFetch", "LeasedItem", "PoolClient", "PoolStore"]
