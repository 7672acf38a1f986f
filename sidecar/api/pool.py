"""Wire <-> domain for the shared pool's RPCs (MapPool, LeaseFetch, ReleaseLease, ReserveStore,
CommitStore, AbortStore), for the server and the SDK."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sidecar.api.kv import fetch_request, identity_to_wire, layout_to_wire, tokens_to_wire
from sidecar.errors import InvalidArgument
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.registry.lookup_plan import FetchSpec
from sidecar.v1 import sidecar_pb2 as pb

MapPoolRequest = pb.MapPoolRequest
PoolInfo = pb.PoolInfo
LeaseFetchRequest = pb.LeaseFetchRequest
LeaseFetchResponse = pb.LeaseFetchResponse
PoolSlot = pb.PoolSlot
ReleaseLeaseRequest = pb.ReleaseLeaseRequest
ReleaseLeaseResponse = pb.ReleaseLeaseResponse
ReserveStoreRequest = pb.ReserveStoreRequest
ReserveStoreResponse = pb.ReserveStoreResponse
StoreSlot = pb.StoreSlot
CommitStoreRequest = pb.CommitStoreRequest
AbortStoreRequest = pb.AbortStoreRequest
AbortStoreResponse = pb.AbortStoreResponse

#: ids of leases and reservations: 32 lowercase hex digits
_ID_CHARS = frozenset("0123456789abcdef")


def check_id(value: str, field: str) -> str:
    if len(value) != 32 or not set(value) <= _ID_CHARS:
        raise InvalidArgument(f"{field}: must be 32 lowercase hex digits, got {value[:40]!r}")
    return value


def map_pool_request() -> pb.MapPoolRequest:
    return pb.MapPoolRequest()


def release_lease_request(lease: str) -> pb.ReleaseLeaseRequest:
    return pb.ReleaseLeaseRequest(lease=check_id(lease, "lease"))


def commit_store_request(reservation: str, chunks: int, payload_bytes: int) -> pb.CommitStoreRequest:
    return pb.CommitStoreRequest(reservation=check_id(reservation, "reservation"),
                                 commit=pb.StoreCommit(chunks=chunks, payload_bytes=payload_bytes))


def abort_store_request(reservation: str) -> pb.AbortStoreRequest:
    return pb.AbortStoreRequest(reservation=check_id(reservation, "reservation"))


def lease_fetch_request(identity: CacheIdentity, layout: KVLayout, items: Sequence[tuple[int, int] | FetchSpec],
                        plan_identity: CacheIdentity | None = None) -> pb.LeaseFetchRequest:
    return pb.LeaseFetchRequest(fetch=fetch_request(identity, layout, None, items, True, plan_identity))


def reserve_store_request(tokens, identity: CacheIdentity, layout: KVLayout, *, register_from: int = 0,
                          shared: bool = False, chunk_starts: Sequence[int] = ()) -> pb.ReserveStoreRequest:
    header = pb.StoreHeader(tokens=tokens_to_wire(tokens), identity=identity_to_wire(identity),
                            register_from=register_from, shared=shared, layout=layout_to_wire(layout))
    return pb.ReserveStoreRequest(header=header, chunk_starts=list(chunk_starts))


@dataclass(frozen=True, slots=True)
class LeasedChunk:
    """One chunk of a leased Fetch answer (the SDK's view of a ``PoolSlot``)."""

    index: int
    offset: int
    length: int
    num_tokens: int
    row_offset: int
    rows: int
    source_pos: int
    delta: int
    checksum: int
    stamp: int
    tier: str


def leased_from_wire(msg: pb.LeaseFetchResponse) -> list[LeasedChunk]:
    return [LeasedChunk(s.index, s.offset, s.length, s.num_tokens, s.row_offset, s.rows, s.source_pos, s.delta,
                        s.checksum, s.stamp, s.tier) for s in msg.slots]


def bounds_to_wire(bounds: Sequence[int]) -> bytes:
    return np.asarray(bounds, dtype="<u4").tobytes()
