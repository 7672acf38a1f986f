"""The shared pool's RPCs: MapPool, LeaseFetch, ReleaseLease, ReserveStore, CommitStore, AbortStore.

Thin handlers over ``DataPlane.pool`` (``sidecar.dataplane.pool``), for engines on this host
only: a caller that is not on loopback or a unix socket is FAILED_PRECONDITION naming ``pool``
(it cannot map this host's memory; it uses Fetch and Store). Leases and reservations are the
caller tenant's; the timer (``run_reaper``) ends those their engines never released.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

import sidecar.api.pool as wire
from sidecar.api.kv import required_layout
from sidecar.dataplane import DataPlane
from sidecar.errors import FailedPrecondition, InvalidArgument
from sidecar.server.edge import Edge, rpc
from sidecar.server.kv import KVHandlers
from sidecar.shm import local_peer
from sidecar.tiers.envelope import HEADER_NBYTES

logger = logging.getLogger(__name__)


class PoolHandlers:
    def __init__(self, edge: Edge, kv: KVHandlers, dataplane: DataPlane) -> None:
        self.edge = edge
        self.kv = kv
        self.pool = dataplane.pool

    def _local(self, context: grpc.aio.ServicerContext) -> None:
        if not local_peer(context.peer()):
            raise FailedPrecondition("pool: the caller is not on the sidecar's host; use Fetch and Store")

    @rpc
    async def MapPool(self, request: wire.MapPoolRequest, context: grpc.aio.ServicerContext) -> wire.PoolInfo:
        self.edge.tenancy.resolve(context)
        if not local_peer(context.peer()):
            return wire.PoolInfo()
        return wire.PoolInfo(name=self.pool.name, size=self.pool.size, lease_ttl_s=self.pool.lease_ttl_s,
                             header_bytes=HEADER_NBYTES)

    @rpc
    async def LeaseFetch(self, request: wire.LeaseFetchRequest, context: grpc.aio.ServicerContext
                         ) -> wire.LeaseFetchResponse:
        tenant = self.edge.tenancy.resolve(context)
        self._local(context)
        f = request.fetch
        if f.HasField("heads"):
            raise InvalidArgument("fetch.heads: a lease answers whole chunks; read your heads from their slots")
        query = self.kv.fetch_query(f, tenant, "fetch.")
        t0 = time.perf_counter()
        got = await self.pool.lease_fetch(query)
        m = self.kv.metrics
        m.fetch_seconds.observe(time.perf_counter() - t0)
        m.fetch_bytes.inc(sum(s.rows for s in got.slots) * query.layout.bytes_per_token)
        return wire.LeaseFetchResponse(
            pool=got.pool, lease=got.lease, ttl_s=got.ttl_s, misses=got.misses,
            slots=[wire.PoolSlot(index=s.index, offset=s.read.offset, length=s.read.meta.payload_nbytes,
                                 num_tokens=s.read.meta.num_tokens, row_offset=s.row_offset, rows=s.rows,
                                 source_pos=s.source_pos, delta=s.delta, checksum=s.read.meta.checksum,
                                 stamp=s.read.stamp, tier=s.tier)
                   for s in got.slots],
        )

    @rpc
    async def ReleaseLease(self, request: wire.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
                           ) -> wire.ReleaseLeaseResponse:
        tenant = self.edge.tenancy.resolve(context)
        lease = wire.check_id(request.lease, "lease")
        return wire.ReleaseLeaseResponse(chunks=await self.pool.release(tenant, lease))

    @rpc
    async def ReserveStore(self, request: wire.ReserveStoreRequest, context: grpc.aio.ServicerContext
                           ) -> wire.ReserveStoreResponse:
        tenant = self.edge.tenancy.resolve(context)
        self._local(context)
        header = request.header
        tokens, identity, scope = self.kv.store_header(header, tenant)
        layout = required_layout(header, "header.layout")
        res = await self.pool.reserve_store(tenant, tokens, header.tokens, identity, scope, layout,
                                            header.register_from, list(request.chunk_starts))
        return wire.ReserveStoreResponse(
            pool=self.pool.name, reservation=res.id, ttl_s=self.pool.reservation_ttl_s, held=res.held,
            slots=[wire.StoreSlot(chunk_start=start, offset=s.offset, length=s.nbytes) for start, s in res.slots.items()],
            chunk_bounds=wire.bounds_to_wire(res.bounds),
        )

    @rpc
    async def CommitStore(self, request: wire.CommitStoreRequest, context: grpc.aio.ServicerContext):
        tenant = self.edge.tenancy.resolve(context)
        rid = wire.check_id(request.reservation, "reservation")
        if not request.HasField("commit"):
            raise InvalidArgument("commit: required (the counts of the slots written)")
        t0 = time.perf_counter()
        # Committed by the client: it completes (or is refused whole) even if the call is cancelled.
        work = self.pool.commit_store(tenant, rid, request.commit.chunks, request.commit.payload_bytes)
        out, identity = await self.kv.committed(work)
        return self.kv.store_response(out, identity, time.perf_counter() - t0)

    @rpc
    async def AbortStore(self, request: wire.AbortStoreRequest, context: grpc.aio.ServicerContext
                         ) -> wire.AbortStoreResponse:
        tenant = self.edge.tenancy.resolve(context)
        rid = wire.check_id(request.reservation, "reservation")
        return wire.AbortStoreResponse(slots=await self.pool.abort_store(tenant, rid))


async def run_reaper(dataplane: DataPlane, every_s: float) -> None:
    """End expired leases and reservations every ``every_s`` seconds (until cancelled)."""
    while True:
        await asyncio.sleep(every_s)
        try:
            leases, reservations = await dataplane.pool.reap()
        except Exception:  # noqa: BLE001 - the next tick tries again
            logger.exception("shared pool: reaping expired leases failed")
            continue
        if leases or reservations:
            logger.info("shared pool: %d leases and %d reservations expired (their engines never ended them)",
                        leases, reservations)
