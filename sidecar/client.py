"""Client SDK: ``SidecarClient`` (asyncio) and ``SyncSidecarClient`` (a thin blocking wrapper).

* Sets the tenant (``x-tenant-id``) and auth (``authorization: Bearer ...``) headers on every
  call.
* Accepts token ids as numpy arrays (any integer dtype), lists, or packed bytes; sends packed
  little-endian uint32.
* Converts gRPC errors to the typed errors of ``sidecar.errors`` at this boundary and retries
  only transient ones (UNAVAILABLE) with jittered exponential backoff; ``CancelledError`` is
  always re-raised; calls that are not idempotent are not retried.

Example::

    async with SidecarClient("127.0.0.1:50051", tenant="team-a") as client:
        ident = CacheIdentity(model_id="llama-3.1-8b")
        plan = await client.lookup(tokens, identity=ident, engine_prefix_len=512)
        await client.store(tokens, identity=ident)

Span directives (docs/splice.md)::

        session = await client.open_session(tokens, block_size=16)
        plan = await client.splice(session.session_id, session.version, [(120, 180, stub, "amortize")])
        ...  # apply plan.ops in order to the engine's cache
        session = await client.commit_splice(plan.plan_id)   # or abort_splice(plan.plan_id)

Held sessions (the sidecar holds the KV; docs/splice.md "Sessions the sidecar holds")::

        await client.store(tokens, identity=ident, layout=layout, payloads=chunks)
        session = await client.open_session(tokens, block_size=1, identity=ident, held=True)
        ...  # Splice / apply / commit; Store the chunks that hold new tokens
        runs = await client.fetch_session(session.session_id, layout=layout, rope=spec)

None of the session calls is retried (none is idempotent: a retried Splice would meet its own
pending plan), except ``fetch_session`` (a read).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc
import numpy as np

from sidecar.directives import Directive, OpPlan, PlanId, SessionId
from sidecar.errors import SidecarError, error_for_status
from sidecar.policy import (  # the Policy SDK: message-list rewrites -> directives
    EditPolicy,
    MessageDiff,
    Policy,
    Renderer,
    TemplateNotIncremental,
    TokenizerRenderer,
    TruncateOldToolOutputs,
    diff_directives,
    edit_turn,
)
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.registry.plan import AdmissionPolicy, FetchSpec, LookupPlan, RepairScope
from sidecar.shm import ALIGN, SHM_DIR, Lease, SegmentPool, local_target
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc
from sidecar.wire import AUTH_HEADER, POLICY_TO_WIRE, REPAIR_TO_WIRE, TENANT_HEADER, identity_to_wire, layout_to_wire, plan_from_wire, rope_to_wire, tokens_to_wire
from sidecar.wire_directives import SessionState, directives_to_wire, session_from_wire
from sidecar.wire_directives import plan_from_wire as op_plan_from_wire

if TYPE_CHECKING:
    from sidecar.rotation import RopeSpec

T = TypeVar("T")
Tokens = "np.ndarray | Sequence[int] | bytes"
#: A directive: ``Directive(start=, end=, replacement=, mode=)`` or ``(start, end, replacement[, mode])``.
DirectiveLike = "Directive | tuple"


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Retries for transient errors only: attempt i sleeps U(0, min(cap, base * 2**i))."""

    attempts: int = 3
    base_s: float = 0.05
    cap_s: float = 1.0

    def backoff(self, attempt: int) -> float:
        return random.uniform(0, min(self.cap_s, self.base_s * (2**attempt)))


@dataclass(frozen=True, slots=True)
class ImportResult:
    """``ImportManifest``: lines read and what became of the entries (docs/manifests.md)."""

    lines: int
    prefetched: int
    planned: int
    present: int
    malformed: int
    refused: int
    warmup_pending: int


@dataclass(frozen=True, slots=True)
class WarmUpResult:
    """``warm_up``: plan sequences prefilled, their tokens, and chunks the engine Stored."""

    sequences: int
    tokens: int
    chunks_stored: int


class WarmUpEngine(Protocol):
    """What ``warm_up`` needs from an engine: its ``identity`` and ``warm(tokens, shared)``,
    which prefills ``tokens`` once from position 0 and Stores their chunks (into the shared
    scope when ``shared``), returning how many chunks it stored. The reference engine
    (``clients.transformers.Engine``) implements it."""

    identity: CacheIdentity

    def warm(self, tokens: np.ndarray, *, shared: bool = False) -> int: ...


def _import_result(resp: pb.ImportManifestResponse) -> ImportResult:
    return ImportResult(resp.lines, resp.prefetched, resp.planned, resp.present, resp.malformed, resp.refused,
                        resp.warmup_pending)


@dataclass(frozen=True, slots=True)
class StoreResult:
    chunks_total: int
    chunks_registered: int
    chunks_refreshed: int
    chunks_observed: int
    chunks_stored: int = 0
    chunk_bounds: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class FetchedKV:
    """One fetched chunk: ``data`` is its payload (``KVLayout`` order) for ``num_tokens``
    tokens; when ``rotated`` its rotary parts sit at ``target_pos``, else at ``source_pos``
    (rotate by ``delta`` yourself). ``ok`` is False for a miss: prefill those tokens.
    ``data`` is a writable memoryview the caller owns; the payloads of one call share 16 MiB
    blocks, or the call's shared-memory buffer, so keeping one alive keeps its block or buffer
    (copy what you keep for long)."""

    index: int
    chunk_hash: int
    ok: bool
    num_tokens: int = 0
    source_pos: int = 0
    delta: int = 0
    rotated: bool = False
    tier: str = ""
    data: memoryview = field(default_factory=lambda: memoryview(bytearray()))


@dataclass(frozen=True, slots=True)
class FetchedRun:
    """One run of a held session's KV (``fetch_session``): positions ``[target_pos,
    target_pos + num_tokens)`` of the session at ``version``, held as rows ``[chunk_offset,
    chunk_offset + num_tokens)`` of the stored chunk ``chunk_hash``, computed at
    ``source_pos ..``. ``data`` is the payload of those rows (``KVLayout`` order, ``num_tokens``
    tokens); when ``rotated`` its rotary parts sit at ``target_pos ..`` (rotated once by
    ``delta`` from the canonical copy), else at ``source_pos ..`` (raw: rotate by ``delta``)."""

    index: int
    target_pos: int
    num_tokens: int
    chunk_hash: int
    chunk_offset: int
    source_pos: int
    delta: int
    rotated: bool
    tier: str
    version: int
    data: memoryview = field(default_factory=lambda: memoryview(bytearray()))


#: Payload bytes per Store/Fetch message (gRPC messages stay well under the 64 MiB limit).
PART_BYTES = 2 << 20


def _as_memoryview(payload: Any) -> memoryview:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return memoryview(payload).cast("B")
    if isinstance(payload, np.ndarray):
        return memoryview(np.ascontiguousarray(payload)).cast("B")
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None
    if torch is not None and isinstance(payload, torch.Tensor):
        t = payload.detach().contiguous().cpu()
        return memoryview(t.view(torch.uint8).numpy()).cast("B")
    raise TypeError(f"payloads: expected bytes, a numpy array or a torch tensor, got {type(payload).__name__}")


def _store_payload_requests(
    tokens: Tokens,
    identity: CacheIdentity,
    layout: KVLayout,
    payloads: Mapping[int, Any],
    register_from: int,
    shared: bool,
    part_bytes: int,
) -> list[pb.StoreRequest]:
    header = pb.StoreHeader(
        tokens=tokens_to_wire(tokens), identity=identity_to_wire(identity), register_from=register_from,
        shared=shared, layout=layout_to_wire(layout),
    )
    msgs = [pb.StoreRequest(header=header)]
    for start in sorted(payloads):
        mv = _as_memoryview(payloads[start])
        n = len(mv)
        off = 0
        while True:
            end = min(n, off + part_bytes)
            msgs.append(pb.StoreRequest(payload=pb.PayloadPart(chunk_start=start, data=bytes(mv[off:end]), last=end >= n)))
            off = end
            if off >= n:
                break
    return msgs


def _store_messages(
    tokens: Tokens,
    identity: CacheIdentity,
    register_from: int,
    shared: bool,
    layout: KVLayout | None,
    payloads: Mapping[int, Any] | None,
) -> Sequence[pb.StoreRequest]:
    if not payloads:
        return _store_requests(tokens, identity, register_from, shared)
    if layout is None:
        raise ValueError("layout: required with payloads")
    return _store_payload_requests(tokens, identity, layout, payloads, register_from, shared, PART_BYTES)


def _fetch_item(it: "tuple[int, int] | FetchSpec") -> pb.FetchItem:
    if isinstance(it, FetchSpec):
        return pb.FetchItem(chunk_hash=it.chunk_hash, target_pos=it.target_pos, num_tokens=it.num_tokens,
                            row_offset=it.row_offset, next_hashes=it.next_hashes)
    return pb.FetchItem(chunk_hash=it[0], target_pos=it[1])


def _fetch_request(
    identity: CacheIdentity, layout: KVLayout, rope: "RopeSpec | None", items: Sequence["tuple[int, int] | FetchSpec"], raw: bool
) -> pb.FetchRequest:
    req = pb.FetchRequest(
        identity=identity_to_wire(identity), layout=layout_to_wire(layout), raw=raw,
        items=[_fetch_item(it) for it in items],
    )
    if rope is not None:
        req.rope.CopyFrom(rope_to_wire(rope))
    return req


def _fetch_need(items: Sequence["tuple[int, int] | FetchSpec"], layout: KVLayout) -> int:
    """Payload bytes span items will return (plain items: unknown until answered), with room
    for the sidecar's alignment of each payload in a shared-memory buffer."""
    rows = sum(it.num_tokens for it in items if isinstance(it, FetchSpec))
    return rows * layout.bytes_per_token + ALIGN * len(items) if rows else 0


def _session_need(start: int, end: int | None, layout: KVLayout) -> int:
    """Payload bytes of a FetchSession range, with alignment room for a run per row at most."""
    return (end - start) * (layout.bytes_per_token + ALIGN) if end is not None and end > start else 0


def _fetch_session_request(
    session_id: str, start: int, end: int | None, layout: KVLayout, rope: "RopeSpec | None", raw: bool
) -> pb.FetchSessionRequest:
    req = pb.FetchSessionRequest(session_id=session_id, start=start, end=end, layout=layout_to_wire(layout), raw=raw)
    if rope is not None:
        req.rope.CopyFrom(rope_to_wire(rope))
    return req


FETCH_METHOD = "/sidecar.v1.KVSidecar/Fetch"
FETCH_SESSION_METHOD = "/sidecar.v1.KVSidecar/FetchSession"


@dataclass(slots=True)
class _FetchFrame:
    """A FetchResponse or FetchSessionResponse (same field numbers where they share a meaning)
    decoded without copying ``data`` (a memoryview into the received frame)."""

    index: int = 0
    status: int = 0
    num_tokens: int = 0
    source_pos: int = 0
    delta: int = 0
    rotated: bool = False
    tier: str = ""
    data: memoryview = memoryview(b"")
    last: bool = False
    target_pos: int = 0  # FetchSessionResponse only (fields 10..13)
    chunk_hash: int = 0
    chunk_offset: int = 0
    version: int = 0
    shm_offset: int = 0  # shm_length > 0: the payload is in the call's shared-memory buffer
    shm_length: int = 0
    more: "list[_FetchFrame] | None" = None  # the next answers, sent in this message (shared memory)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def parse_fetch_frame(frame: bytes | memoryview) -> _FetchFrame:
    """Decode a FetchResponse or FetchSessionResponse (standard protobuf wire format, any field
    order) with its payload left in place: multi-MiB parts are not copied by a protobuf parse
    and a field access."""
    buf = memoryview(frame)
    out = _FetchFrame()
    pos, n = 0, len(buf)
    while pos < n:
        tag, pos = _read_varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
            if field == 1:
                out.index = value
            elif field == 2:
                out.status = value
            elif field == 3:
                out.num_tokens = value
            elif field == 4:
                out.source_pos = value
            elif field == 5:
                out.delta = (value >> 1) ^ -(value & 1)  # sint64 zigzag
            elif field == 6:
                out.rotated = bool(value)
            elif field == 9:
                out.last = bool(value)
            elif field == 10:
                out.target_pos = value
            elif field == 12:
                out.chunk_offset = value
            elif field == 13:
                out.version = value
            elif field == 14:
                out.shm_offset = value
            elif field == 15:
                out.shm_length = value
        elif wire == 2:
            size, pos = _read_varint(buf, pos)
            if field == 7:
                out.tier = bytes(buf[pos : pos + size]).decode()
            elif field == 8:
                out.data = buf[pos : pos + size]
            elif field == 16:
                if out.more is None:
                    out.more = []
                out.more.append(parse_fetch_frame(buf[pos : pos + size]))
            pos += size
        elif wire == 1:
            if field == 11:
                out.chunk_hash = int.from_bytes(buf[pos : pos + 8], "little")
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"FetchResponse: unsupported wire type {wire}")
    return out


def _item_hash(it: "tuple[int, int] | FetchSpec") -> int:
    return it.chunk_hash if isinstance(it, FetchSpec) else it[0]


#: Payload buffers are carved out of numpy blocks of at least this size: numpy backs allocations
#: of 4 MiB and more with transparent huge pages, so filling one takes a few page faults instead
#: of one per 4 KiB. A fresh ``bytearray`` per chunk made the client's copy of an 8K-token Fetch
#: (32 MiB) cost ~25 ms instead of ~7 on the 2-core VM (issue 14, TTFT overhead).
_PAYLOAD_BLOCK = 16 << 20


class _PayloadArena:
    """Writable payload buffers for one Fetch call, carved from shared numpy blocks (a block is
    freed when no buffer cut from it is referenced any more)."""

    def __init__(self) -> None:
        self._block = memoryview(bytearray())
        self._off = 0

    def take(self, n: int) -> memoryview:
        if self._off + n > len(self._block):
            self._block = memoryview(np.empty(max(n, _PAYLOAD_BLOCK), dtype=np.uint8))
            self._off = 0
        out = self._block[self._off : self._off + n]
        self._off += n
        return out


class _FetchAssembler:
    """Joins a Fetch response stream into ``FetchedKV`` results, in item order (or, without
    ``items``, a FetchSession stream into ``FetchedRun`` results, in position order). A payload
    the sidecar wrote into the call's shared-memory ``lease`` is a view of it (no copy); one
    that came inline is copied once, into a writable buffer the caller owns (``_PayloadArena``)."""

    def __init__(self, items: Sequence["tuple[int, int] | FetchSpec"] | None = None, lease: Lease | None = None) -> None:
        self.items = items
        self.lease = lease
        self.out: list[Any] = []
        self._first: _FetchFrame | None = None
        self._parts: list[memoryview] = []
        self._arena = _PayloadArena()

    def feed(self, msg: _FetchFrame) -> None:
        if self._first is None:
            self._first = msg
        self._parts.append(msg.data)
        if msg.last:
            f = self._first
            if msg.shm_length:
                if self.lease is None:
                    raise ValueError("shm_length: a payload in shared memory, but this call named no buffer")
                data = self.lease.payload(msg.shm_offset, msg.shm_length)
            else:
                data = self._arena.take(sum(len(p) for p in self._parts))
                off = 0
                for p in self._parts:
                    data[off : off + len(p)] = p
                    off += len(p)
                if self.lease is not None:
                    self.lease.inline += off
            if self.items is None:
                self.out.append(
                    FetchedRun(
                        index=f.index, target_pos=f.target_pos, num_tokens=f.num_tokens, chunk_hash=f.chunk_hash,
                        chunk_offset=f.chunk_offset, source_pos=f.source_pos, delta=f.delta, rotated=f.rotated,
                        tier=f.tier, version=f.version, data=data,
                    )
                )
            else:
                self.out.append(
                    FetchedKV(
                        index=f.index, chunk_hash=_item_hash(self.items[f.index]), ok=f.status == pb.CHUNK_STATUS_OK,
                        num_tokens=f.num_tokens, source_pos=f.source_pos, delta=f.delta, rotated=f.rotated,
                        tier=f.tier, data=data,
                    )
                )
            self._first = None
            self._parts = []
        for nxt in msg.more or ():
            self.feed(nxt)


def _trailers(exc: grpc.RpcError) -> tuple:
    """Trailing metadata of a failed call (claim refusals carry their proof there)."""
    try:
        return tuple(exc.trailing_metadata() or ())
    except Exception:  # noqa: BLE001 - some transport errors have none
        return ()


_CLAIM_MODES = {
    "soft_priority": pb.CLAIM_MODE_SOFT_PRIORITY, "hard_protected": pb.CLAIM_MODE_HARD_PROTECTED,
    "demotable": pb.CLAIM_MODE_DEMOTABLE, "offloadable": pb.CLAIM_MODE_OFFLOADABLE,
    "expiring": pb.CLAIM_MODE_EXPIRING, "best_effort": pb.CLAIM_MODE_BEST_EFFORT,
}


def _claim_request(
    claim_id: str,
    identity: CacheIdentity,
    mode: str,
    *,
    chunk_hashes: Sequence[int] = (),
    tokens: Tokens | None = None,
    session_id: str = "",
    predicate_min_tokens: int = 0,
    duration_s: float | None = None,
    footprint_blocks: int = 0,
    shared: bool = False,
) -> pb.ClaimRequest:
    if mode not in _CLAIM_MODES:
        raise ValueError(f"mode: one of {sorted(_CLAIM_MODES)}, got {mode!r}")
    req = pb.ClaimRequest(
        claim_id=claim_id, identity=identity_to_wire(identity), chunk_hashes=[int(h) for h in chunk_hashes],
        tokens=tokens_to_wire(tokens) if tokens is not None else b"", session_id=session_id,
        predicate_min_tokens=predicate_min_tokens, mode=_CLAIM_MODES[mode], footprint_blocks=footprint_blocks,
        shared=shared,
    )
    if duration_s is not None:
        req.duration_s = duration_s
    return req


def _lookup_request(
    tokens: Tokens,
    identity: CacheIdentity,
    engine_prefix_len: int = 0,
    policy: AdmissionPolicy | str | None = None,
    left_context_window: int | None = None,
    recompute_tokens: int | None = None,
    dry_run: bool = False,
    repair_scope: RepairScope | str | None = None,
) -> pb.LookupRequest:
    # None leaves the optional field unset: the server applies its configured default.
    return pb.LookupRequest(
        tokens=tokens_to_wire(tokens),
        identity=identity_to_wire(identity),
        engine_prefix_len=engine_prefix_len,
        policy=POLICY_TO_WIRE[AdmissionPolicy(policy)] if policy is not None else pb.ADMISSION_POLICY_UNSPECIFIED,
        left_context_window=left_context_window,
        recompute_tokens=recompute_tokens,
        dry_run=dry_run,
        repair_scope=REPAIR_TO_WIRE[RepairScope(repair_scope)] if repair_scope is not None else pb.REPAIR_SCOPE_UNSPECIFIED,
    )


def _store_requests(
    tokens: Tokens, identity: CacheIdentity, register_from: int = 0, shared: bool = False
) -> tuple[pb.StoreRequest, ...]:
    header = pb.StoreHeader(
        tokens=tokens_to_wire(tokens), identity=identity_to_wire(identity), register_from=register_from, shared=shared
    )
    return (pb.StoreRequest(header=header),)


def _store_result(resp: pb.StoreResponse) -> StoreResult:
    return StoreResult(
        resp.chunks_total, resp.chunks_registered, resp.chunks_refreshed, resp.chunks_observed, resp.chunks_stored,
        tuple(np.frombuffer(resp.chunk_bounds, dtype="<u4").tolist()),
    )


def _open_session_request(
    tokens: Tokens, block_size: int, identity: CacheIdentity | None, held: bool = False
) -> pb.OpenSessionRequest:
    req = pb.OpenSessionRequest(tokens=tokens_to_wire(tokens), block_size=block_size, held=held)
    if identity is not None:
        req.identity.CopyFrom(identity_to_wire(identity))
    return req


def _splice_request(session_id: str, expected_version: int, directives: Sequence[DirectiveLike]) -> pb.SpliceRequest:
    return pb.SpliceRequest(
        session_id=session_id, expected_version=expected_version, directives=directives_to_wire(directives)
    )


def _headers(tenant: str | None, token: str | None) -> tuple[tuple[str, str], ...]:
    md: list[tuple[str, str]] = []
    if tenant:
        md.append((TENANT_HEADER, tenant))
    if token:
        md.append((AUTH_HEADER, f"Bearer {token}"))
    return tuple(md)


_CHANNEL_OPTIONS = (("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20))


class _ClientBase:
    """Channel, stub, headers, timeout and retry policy shared by both clients; subclasses
    choose the channel kind (``grpc.aio`` or synchronous).

    TLS (docs/operations.md, "TLS and mTLS"): ``tls=True`` or any of ``root_ca`` (PEM bytes or
    a file path; None: the system roots), ``client_cert`` + ``client_key`` (mTLS) opens a
    ``grpc.ssl_channel_credentials`` channel; otherwise the channel is plaintext.

    Shared memory (docs/operations.md, "Shared-memory Fetch"): with ``shared_memory`` (None: on
    when ``target`` is loopback or a unix socket and /dev/shm exists) Fetch and FetchSession
    payloads arrive through buffers in /dev/shm (``shared_memory_bytes`` to start with, grown up
    to ``shared_memory_max_bytes`` when a call did not fit) instead of the stream. Such a
    payload is a view of a buffer lent to that call; the buffer is reused once every payload
    of the call has been dropped, so keep a payload only while you need it. ``close()`` removes
    the buffers' names."""

    _open_channel: Callable[..., Any]
    _open_secure_channel: Callable[..., Any]

    def __init__(
        self,
        target: str,
        *,
        tenant: str | None = None,
        token: str | None = None,
        timeout_s: float = 10.0,
        retry: RetryPolicy = RetryPolicy(),
        channel_options: Sequence[tuple[str, Any]] = (),
        tls: bool = False,
        root_ca: str | bytes | None = None,
        client_cert: str | bytes | None = None,
        client_key: str | bytes | None = None,
        shared_memory: bool | None = None,
        shared_memory_bytes: int = 64 << 20,
        shared_memory_max_bytes: int = 1 << 30,
    ) -> None:
        options = [*_CHANNEL_OPTIONS, *channel_options]
        if shared_memory is None:  # on for a sidecar on this host
            shared_memory = local_target(target) and os.path.isdir(SHM_DIR)
        self._shm = SegmentPool(size=shared_memory_bytes, max_bytes=shared_memory_max_bytes) if shared_memory else None
        if tls or root_ca is not None or client_cert is not None or client_key is not None:
            from sidecar.auth.tls import channel_credentials

            creds = channel_credentials(root_ca, client_cert, client_key)
            self._channel = type(self)._open_secure_channel(target, creds, options=options)
        else:
            self._channel = type(self)._open_channel(target, options=options)
        self._stub = pb_grpc.KVSidecarStub(self._channel)
        self._fetch = self._channel.unary_stream(
            FETCH_METHOD, request_serializer=pb.FetchRequest.SerializeToString, response_deserializer=parse_fetch_frame
        )
        self._fetch_session = self._channel.unary_stream(
            FETCH_SESSION_METHOD, request_serializer=pb.FetchSessionRequest.SerializeToString,
            response_deserializer=parse_fetch_frame,
        )
        self._metadata = _headers(tenant, token)
        self._timeout = timeout_s
        self._retry = retry

    def _assembler(self, req: pb.FetchRequest | pb.FetchSessionRequest,
                   items: Sequence["tuple[int, int] | FetchSpec"] | None = None, need: int = 0) -> _FetchAssembler:
        """One attempt's assembler, with a shared-memory buffer lent to it when one is free
        (named in ``req``; without one the payloads come inline); ``need``: the payload bytes
        the call is known to return (0: unknown)."""
        lease = self._shm.lease(need) if self._shm is not None else None
        if lease is None:
            req.ClearField("shm")
        else:
            req.shm.name, req.shm.token = lease.segment.name, lease.segment.token
        return _FetchAssembler(items, lease)

    def _assembled(self, asm: _FetchAssembler) -> list[Any]:
        if asm.lease is not None:
            self._shm.done(asm.lease)
        return asm.out

    def _close_shm(self) -> None:
        if self._shm is not None:
            self._shm.close()


class SidecarClient(_ClientBase):
    _open_channel = staticmethod(grpc.aio.insecure_channel)
    _open_secure_channel = staticmethod(grpc.aio.secure_channel)

    async def __aenter__(self) -> "SidecarClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()
        self._close_shm()

    @property
    def stub(self) -> pb_grpc.KVSidecarStub:
        return self._stub

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def _call(self, fn: Callable[[], Awaitable[T]], *, idempotent: bool = True) -> T:
        attempt = 0
        while True:
            try:
                return await fn()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                err = error_for_status(exc.code(), exc.details() or "", _trailers(exc))
                if not (idempotent and err.transient) or attempt + 1 >= self._retry.attempts:
                    raise err from exc
            await asyncio.sleep(self._retry.backoff(attempt))
            attempt += 1

    async def lookup(
        self,
        tokens: Tokens,
        *,
        identity: CacheIdentity,
        engine_prefix_len: int = 0,
        policy: AdmissionPolicy | str | None = None,
        left_context_window: int | None = None,
        recompute_tokens: int | None = None,
        dry_run: bool = False,
        repair_scope: RepairScope | str | None = None,
    ) -> LookupPlan:
        """Plan which parts of ``tokens`` the engine can skip. Idempotent when ``dry_run``;
        otherwise it refreshes recency of the hits it returns (safe to retry).
        ``left_context_window`` / ``recompute_tokens`` / ``repair_scope``: None = the server's
        defaults."""
        req = _lookup_request(
            tokens, identity, engine_prefix_len, policy, left_context_window, recompute_tokens, dry_run, repair_scope
        )
        msg = await self._call(lambda: self._stub.Lookup(req, metadata=self._metadata, timeout=self._timeout))
        return plan_from_wire(msg)

    async def store(
        self,
        tokens: Tokens,
        *,
        identity: CacheIdentity,
        register_from: int = 0,
        shared: bool = False,
        layout: KVLayout | None = None,
        payloads: Mapping[int, Any] | None = None,
    ) -> StoreResult:
        """Register the chunks of ``tokens`` (the whole sequence from position 0) starting at or
        after ``register_from``; with ``layout`` and ``payloads`` ({chunk start: KV bytes at
        that chunk's positions, ``KVLayout`` order}) also store their KV. Chunk starts come
        from ``LookupPlan.chunk_bounds`` or a previous ``StoreResult.chunk_bounds``. Each chunk
        becomes visible only once its payload is complete and verified. Idempotent."""
        msgs = _store_messages(tokens, identity, register_from, shared, layout, payloads)
        resp = await self._call(lambda: self._stub.Store(iter(msgs), metadata=self._metadata, timeout=self._timeout))
        return _store_result(resp)

    async def fetch(
        self,
        items: Sequence["tuple[int, int] | FetchSpec"],
        *,
        identity: CacheIdentity,
        layout: KVLayout,
        rope: "RopeSpec | None" = None,
        raw: bool = False,
    ) -> list[FetchedKV]:
        """Fetch chunk KV: ``items`` are ``(chunk_hash, target_pos)`` with ``target_pos`` the
        position of the chunk's first token in the new sequence (``seg.start -
        seg.chunk_offset``), or ``FetchSpec`` spans (``plan.fetch_spans()``: one item per hit
        segment, its KV rows in position order, ``num_tokens`` = the segment's length). Results
        come in item order; misses have ``ok=False``. With ``raw`` the payloads stay at their
        source position. Idempotent (retried when transient)."""
        req = _fetch_request(identity, layout, rope, items, raw)

        async def run() -> list[FetchedKV]:
            asm = self._assembler(req, items, _fetch_need(items, layout))
            async for msg in self._fetch(req, metadata=self._metadata, timeout=self._timeout):
                asm.feed(msg)
            return self._assembled(asm)

        return await self._call(run)

    async def evict(self, chunk_hashes: Sequence[int], *, tier: str = "") -> int:
        resp = await self._call(
            lambda: self._stub.Evict(pb.EvictRequest(chunk_hashes=list(chunk_hashes), tier=tier),
                                     metadata=self._metadata, timeout=self._timeout),
            idempotent=False,  # each call demotes one tier: a retry would demote twice
        )
        return resp.evicted

    async def delete(self, chunk_hashes: Sequence[int]) -> int:
        resp = await self._call(
            lambda: self._stub.Delete(pb.DeleteRequest(chunk_hashes=list(chunk_hashes)),
                                      metadata=self._metadata, timeout=self._timeout)
        )
        return resp.deleted

    async def stats(self) -> pb.StatsResponse:
        return await self._call(lambda: self._stub.Stats(pb.StatsRequest(), metadata=self._metadata, timeout=self._timeout))

    async def ping(self) -> None:
        await self._call(lambda: self._stub.Ping(pb.PingRequest(), metadata=self._metadata, timeout=self._timeout))

    # ------------------------------------------------------------------- manifests

    async def import_manifest(self, lines: bytes, *, shared: bool = False, prefetch: bool = True) -> ImportResult:
        """Import manifest JSONL ``lines`` (whole lines; split big manifests into several calls)
        into this tenant's scope, or the shared scope with ``shared`` (operator permission).
        Idempotent: entries already served count as ``present``."""
        req = pb.ImportManifestRequest(lines=bytes(lines), shared=shared, no_prefetch=not prefetch)
        return _import_result(await self._call(
            lambda: self._stub.ImportManifest(req, metadata=self._metadata, timeout=self._timeout)))

    async def warm_up_plan(self, identity: CacheIdentity, *, shared: bool = False, max_sequences: int = 0
                           ) -> list[np.ndarray]:
        """Token sequences (uint32) still to prefill and Store for ``identity``."""
        req = pb.WarmUpPlanRequest(identity=identity_to_wire(identity), shared=shared, max_sequences=max_sequences)
        resp = await self._call(lambda: self._stub.GetWarmUpPlan(req, metadata=self._metadata, timeout=self._timeout))
        return [np.frombuffer(q, dtype="<u4") for q in resp.sequences]

    async def export_manifest(self, identity: CacheIdentity, *, include_shared: bool = False) -> bytes:
        """This tenant's chunks registered under ``identity`` (and the shared scope's) as JSONL."""
        req = pb.ExportManifestRequest(identity=identity_to_wire(identity), include_shared=include_shared)

        async def run() -> bytes:
            parts = [m.lines async for m in self._stub.ExportManifest(req, metadata=self._metadata, timeout=self._timeout)]
            return b"".join(parts)

        return await self._call(run)

    async def warm_up(self, engine: WarmUpEngine, *, shared: bool = False) -> WarmUpResult:
        """Prefill and Store every sequence of the warm-up plan once through ``engine`` (run in a
        worker thread: engines are synchronous). The plan is read once: a sequence whose Store
        is refused is not retried."""
        seqs = await self.warm_up_plan(engine.identity, shared=shared)
        stored = 0
        for q in seqs:
            stored += await asyncio.to_thread(engine.warm, q, shared=shared)
        return WarmUpResult(len(seqs), sum(len(q) for q in seqs), stored)

    # ------------------------------------------------------------------------- claims
    # docs/claims.md. Responses are the wire messages (ClaimDecision, ClaimInfo, ...). A Store or
    # call refused because of claims raises ResourceExhausted with ``blocking_claim_ids`` and
    # ``capacity_proof`` set. Claim / Release / Demote are not retried (they change state).

    async def claim(self, claim_id: str, *, identity: CacheIdentity, mode: str, **kwargs: Any) -> pb.ClaimDecision:
        """Submit a claim: ``chunk_hashes`` (ordered), ``tokens`` or ``session_id`` names the object;
        ``predicate_min_tokens``, ``duration_s``, ``footprint_blocks``, ``shared`` as in the proto."""
        req = _claim_request(claim_id, identity, mode, **kwargs)
        return await self._call(lambda: self._stub.Claim(req, metadata=self._metadata, timeout=self._timeout),
                                idempotent=False)

    async def release_claim(self, claim_id: str) -> pb.ClaimInfo:
        req = pb.ReleaseClaimRequest(claim_id=claim_id)
        return await self._call(lambda: self._stub.ReleaseClaim(req, metadata=self._metadata, timeout=self._timeout),
                                idempotent=False)

    async def demote_claim(self, claim_id: str, reason: str = "") -> pb.ClaimInfo:
        req = pb.DemoteClaimRequest(claim_id=claim_id, reason=reason)
        return await self._call(lambda: self._stub.DemoteClaim(req, metadata=self._metadata, timeout=self._timeout),
                                idempotent=False)

    async def get_claim(self, claim_id: str) -> pb.ClaimInfo:
        req = pb.GetClaimRequest(claim_id=claim_id)
        return await self._call(lambda: self._stub.GetClaim(req, metadata=self._metadata, timeout=self._timeout))

    async def report_pool(self, *, usable_blocks: int, free_blocks: int, block_size: int, hard_protection: bool,
                          engine_id: str = "") -> pb.ReportPoolResponse:
        req = pb.ReportPoolRequest(usable_blocks=usable_blocks, free_blocks=free_blocks, block_size=block_size,
                                   hard_protection=hard_protection, engine_id=engine_id)
        return await self._call(lambda: self._stub.ReportPool(req, metadata=self._metadata, timeout=self._timeout))

    async def admit_active(self, request_id: str, active_live_blocks: int) -> pb.AdmitActiveResponse:
        req = pb.AdmitActiveRequest(request_id=request_id, active_live_blocks=active_live_blocks)
        return await self._call(lambda: self._stub.AdmitActive(req, metadata=self._metadata, timeout=self._timeout),
                                idempotent=False)

    async def watch_events(self, *, since_seq: int = 0, follow: bool = False):
        """Async iterator of ``pb.ClaimEvent`` (no timeout: a follow watch runs until cancelled)."""
        req = pb.WatchEventsRequest(since_seq=since_seq, follow=follow)
        try:
            async for ev in self._stub.WatchEvents(req, metadata=self._metadata):
                yield ev
        except grpc.aio.AioRpcError as exc:
            raise error_for_status(exc.code(), exc.details() or "", _trailers(exc)) from exc

    # ------------------------------------------------------------------- sessions / Splice

    async def _session_call(self, method: str, req: Any) -> Any:
        rpc = getattr(self._stub, method)
        return await self._call(lambda: rpc(req, metadata=self._metadata, timeout=self._timeout), idempotent=False)

    async def open_session(
        self, tokens: Tokens = (), *, block_size: int, identity: CacheIdentity | None = None, held: bool = False
    ) -> SessionState:
        """Mirror an engine session holding ``tokens`` at positions ``0..n-1`` in a pool of
        ``block_size``-token blocks (1 for token pools). Returns version 0 and the block table
        (the session's block ids, which the engine binds to its own blocks). ``held``: the
        sidecar also holds the session's KV (chunks Stored under ``identity``, required then)
        and serves it with ``fetch_session``."""
        req = _open_session_request(tokens, block_size, identity, held)
        return session_from_wire(await self._session_call("OpenSession", req))

    async def append_session(self, session_id: str, tokens: Tokens) -> SessionState:
        """The engine computed ``tokens`` after the session's end. The version is unchanged."""
        req = pb.AppendSessionRequest(session_id=session_id, tokens=tokens_to_wire(tokens))
        return session_from_wire(await self._session_call("AppendSession", req))

    async def get_session(self, session_id: str) -> SessionState:
        """The session now, with its pending plan's id (``pending_plan_id``) if any."""
        return session_from_wire(await self._session_call("GetSession", pb.GetSessionRequest(session_id=session_id)))

    async def close_session(self, session_id: str) -> None:
        """Forget the session (a pending plan is aborted). NotFound if already gone."""
        await self._session_call("CloseSession", pb.CloseSessionRequest(session_id=session_id))

    async def splice(self, session_id: str, expected_version: int, directives: Sequence[DirectiveLike]) -> OpPlan:
        """Plan ``directives`` against the session at ``expected_version``. The answer is a
        ``sidecar.directives.OpPlan`` (numpy arrays): apply its ops in order, then
        ``commit_splice(plan.plan_id)``, or ``abort_splice``. The plan is pending (no other
        Splice or append on the session) until then, or until the server's plan TTL passes."""
        req = _splice_request(session_id, expected_version, directives)
        return op_plan_from_wire(await self._session_call("Splice", req))

    async def commit_splice(self, plan_id: str) -> SessionState:
        """The engine applied the plan: the session takes its layout and next version."""
        return session_from_wire(await self._session_call("CommitSplice", pb.CommitSpliceRequest(plan_id=plan_id)))

    async def abort_splice(self, plan_id: str) -> SessionState:
        """Drop the pending plan; returns the session as it was before the Splice."""
        return session_from_wire(await self._session_call("AbortSplice", pb.AbortSpliceRequest(plan_id=plan_id)))

    async def fetch_session(
        self,
        session_id: str,
        *,
        start: int = 0,
        end: int | None = None,
        layout: KVLayout,
        rope: "RopeSpec | None" = None,
        raw: bool = False,
    ) -> list[FetchedRun]:
        """The KV of positions ``[start, end)`` (``end`` None: the whole session) of a held
        session's committed layout, as ``FetchedRun``s tiling the range in position order:
        each row comes from its canonical stored copy, rotated once to its position (with
        ``raw``, left at its source position). FailedPrecondition when positions in the range
        have no stored KV (Store them first). Idempotent (retried when transient)."""
        req = _fetch_session_request(session_id, start, end, layout, rope, raw)

        async def run() -> list[FetchedRun]:
            asm = self._assembler(req, need=_session_need(start, end, layout))
            async for msg in self._fetch_session(req, metadata=self._metadata, timeout=self._timeout):
                asm.feed(msg)
            return self._assembled(asm)

        return await self._call(run)


class SyncSidecarClient(_ClientBase):
    """Blocking client on grpc's synchronous channel (same requests, errors and retries).

    It does not use asyncio, so it is safe next to an asyncio server in the same process
    (grpc.aio supports one event loop per process).
    """

    _open_channel = staticmethod(grpc.insecure_channel)
    _open_secure_channel = staticmethod(grpc.secure_channel)

    def _call(self, fn: Callable[[], T], *, idempotent: bool = True) -> T:
        attempt = 0
        while True:
            try:
                return fn()
            except grpc.RpcError as exc:
                err = error_for_status(exc.code(), exc.details() or "", _trailers(exc))
                if not (idempotent and err.transient) or attempt + 1 >= self._retry.attempts:
                    raise err from exc
            time.sleep(self._retry.backoff(attempt))
            attempt += 1

    def lookup(self, tokens: Tokens, *, identity: CacheIdentity, **kwargs: Any) -> LookupPlan:
        req = _lookup_request(tokens, identity, **kwargs)
        return plan_from_wire(self._call(lambda: self._stub.Lookup(req, metadata=self._metadata, timeout=self._timeout)))

    def store(
        self,
        tokens: Tokens,
        *,
        identity: CacheIdentity,
        register_from: int = 0,
        shared: bool = False,
        layout: KVLayout | None = None,
        payloads: Mapping[int, Any] | None = None,
    ) -> StoreResult:
        """See ``SidecarClient.store``."""
        msgs = _store_messages(tokens, identity, register_from, shared, layout, payloads)
        return _store_result(
            self._call(lambda: self._stub.Store(iter(msgs), metadata=self._metadata, timeout=self._timeout))
        )

    def fetch(
        self,
        items: Sequence["tuple[int, int] | FetchSpec"],
        *,
        identity: CacheIdentity,
        layout: KVLayout,
        rope: "RopeSpec | None" = None,
        raw: bool = False,
    ) -> list[FetchedKV]:
        """See ``SidecarClient.fetch``."""
        req = _fetch_request(identity, layout, rope, items, raw)

        def run() -> list[FetchedKV]:
            asm = self._assembler(req, items, _fetch_need(items, layout))
            for msg in self._fetch(req, metadata=self._metadata, timeout=self._timeout):
                asm.feed(msg)
            return self._assembled(asm)

        return self._call(run)

    def evict(self, chunk_hashes: Sequence[int], *, tier: str = "") -> int:
        return self._call(
            lambda: self._stub.Evict(pb.EvictRequest(chunk_hashes=list(chunk_hashes), tier=tier),
                                     metadata=self._metadata, timeout=self._timeout),
            idempotent=False,  # each call demotes one tier: a retry would demote twice
        ).evicted

    def delete(self, chunk_hashes: Sequence[int]) -> int:
        return self._call(
            lambda: self._stub.Delete(pb.DeleteRequest(chunk_hashes=list(chunk_hashes)),
                                      metadata=self._metadata, timeout=self._timeout)
        ).deleted

    def stats(self) -> pb.StatsResponse:
        return self._call(lambda: self._stub.Stats(pb.StatsRequest(), metadata=self._metadata, timeout=self._timeout))

    def ping(self) -> None:
        self._call(lambda: self._stub.Ping(pb.PingRequest(), metadata=self._metadata, timeout=self._timeout))

    def import_manifest(self, lines: bytes, *, shared: bool = False, prefetch: bool = True) -> ImportResult:
        req = pb.ImportManifestRequest(lines=bytes(lines), shared=shared, no_prefetch=not prefetch)
        return _import_result(self._call(
            lambda: self._stub.ImportManifest(req, metadata=self._metadata, timeout=self._timeout)))

    def warm_up_plan(self, identity: CacheIdentity, *, shared: bool = False, max_sequences: int = 0) -> list[np.ndarray]:
        req = pb.WarmUpPlanRequest(identity=identity_to_wire(identity), shared=shared, max_sequences=max_sequences)
        resp = self._call(lambda: self._stub.GetWarmUpPlan(req, metadata=self._metadata, timeout=self._timeout))
        return [np.frombuffer(q, dtype="<u4") for q in resp.sequences]

    def export_manifest(self, identity: CacheIdentity, *, include_shared: bool = False) -> bytes:
        req = pb.ExportManifestRequest(identity=identity_to_wire(identity), include_shared=include_shared)
        return self._call(lambda: b"".join(
            m.lines for m in self._stub.ExportManifest(req, metadata=self._metadata, timeout=self._timeout)))

    def warm_up(self, engine: WarmUpEngine, *, shared: bool = False) -> WarmUpResult:
        """See ``SidecarClient.warm_up`` (runs the engine on the calling thread)."""
        seqs = self.warm_up_plan(engine.identity, shared=shared)
        stored = sum(engine.warm(q, shared=shared) for q in seqs)
        return WarmUpResult(len(seqs), sum(len(q) for q in seqs), stored)

    # ------------------------------------------------------------------------- claims
    # See SidecarClient for the contracts.

    def claim(self, claim_id: str, *, identity: CacheIdentity, mode: str, **kwargs: Any) -> pb.ClaimDecision:
        req = _claim_request(claim_id, identity, mode, **kwargs)
        return self._call(lambda: self._stub.Claim(req, metadata=self._metadata, timeout=self._timeout),
                          idempotent=False)

    def release_claim(self, claim_id: str) -> pb.ClaimInfo:
        req = pb.ReleaseClaimRequest(claim_id=claim_id)
        return self._call(lambda: self._stub.ReleaseClaim(req, metadata=self._metadata, timeout=self._timeout),
                          idempotent=False)

    def demote_claim(self, claim_id: str, reason: str = "") -> pb.ClaimInfo:
        req = pb.DemoteClaimRequest(claim_id=claim_id, reason=reason)
        return self._call(lambda: self._stub.DemoteClaim(req, metadata=self._metadata, timeout=self._timeout),
                          idempotent=False)

    def get_claim(self, claim_id: str) -> pb.ClaimInfo:
        req = pb.GetClaimRequest(claim_id=claim_id)
        return self._call(lambda: self._stub.GetClaim(req, metadata=self._metadata, timeout=self._timeout))

    def report_pool(self, *, usable_blocks: int, free_blocks: int, block_size: int, hard_protection: bool,
                    engine_id: str = "") -> pb.ReportPoolResponse:
        req = pb.ReportPoolRequest(usable_blocks=usable_blocks, free_blocks=free_blocks, block_size=block_size,
                                   hard_protection=hard_protection, engine_id=engine_id)
        return self._call(lambda: self._stub.ReportPool(req, metadata=self._metadata, timeout=self._timeout))

    def admit_active(self, request_id: str, active_live_blocks: int) -> pb.AdmitActiveResponse:
        req = pb.AdmitActiveRequest(request_id=request_id, active_live_blocks=active_live_blocks)
        return self._call(lambda: self._stub.AdmitActive(req, metadata=self._metadata, timeout=self._timeout),
                          idempotent=False)

    def watch_events(self, *, since_seq: int = 0, follow: bool = False):
        """Iterator of ``pb.ClaimEvent``; ``follow`` streams until the caller stops iterating."""
        req = pb.WatchEventsRequest(since_seq=since_seq, follow=follow)
        call = self._stub.WatchEvents(req, metadata=self._metadata)
        try:
            yield from call
        except grpc.RpcError as exc:
            raise error_for_status(exc.code(), exc.details() or "", _trailers(exc)) from exc
        finally:
            call.cancel()

    # ------------------------------------------------------------------- sessions / Splice
    # See SidecarClient for the contracts.

    def _session_call(self, method: str, req: Any) -> Any:
        rpc = getattr(self._stub, method)
        return self._call(lambda: rpc(req, metadata=self._metadata, timeout=self._timeout), idempotent=False)

    def open_session(
        self, tokens: Tokens = (), *, block_size: int, identity: CacheIdentity | None = None, held: bool = False
    ) -> SessionState:
        req = _open_session_request(tokens, block_size, identity, held)
        return session_from_wire(self._session_call("OpenSession", req))

    def append_session(self, session_id: str, tokens: Tokens) -> SessionState:
        req = pb.AppendSessionRequest(session_id=session_id, tokens=tokens_to_wire(tokens))
        return session_from_wire(self._session_call("AppendSession", req))

    def get_session(self, session_id: str) -> SessionState:
        return session_from_wire(self._session_call("GetSession", pb.GetSessionRequest(session_id=session_id)))

    def close_session(self, session_id: str) -> None:
        self._session_call("CloseSession", pb.CloseSessionRequest(session_id=session_id))

    def splice(self, session_id: str, expected_version: int, directives: Sequence[DirectiveLike]) -> OpPlan:
        return op_plan_from_wire(self._session_call("Splice", _splice_request(session_id, expected_version, directives)))

    def commit_splice(self, plan_id: str) -> SessionState:
        return session_from_wire(self._session_call("CommitSplice", pb.CommitSpliceRequest(plan_id=plan_id)))

    def abort_splice(self, plan_id: str) -> SessionState:
        return session_from_wire(self._session_call("AbortSplice", pb.AbortSpliceRequest(plan_id=plan_id)))

    def fetch_session(
        self,
        session_id: str,
        *,
        start: int = 0,
        end: int | None = None,
        layout: KVLayout,
        rope: "RopeSpec | None" = None,
        raw: bool = False,
    ) -> list[FetchedRun]:
        req = _fetch_session_request(session_id, start, end, layout, rope, raw)

        def run() -> list[FetchedRun]:
            asm = self._assembler(req, need=_session_need(start, end, layout))
            for msg in self._fetch_session(req, metadata=self._metadata, timeout=self._timeout):
                asm.feed(msg)
            return self._assembled(asm)

        return self._call(run)

    def close(self) -> None:
        self._channel.close()
        self._close_shm()

    def __enter__(self) -> "SyncSidecarClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "Directive",
    "EditPolicy",
    "FetchedKV",
    "FetchedRun",
    "MessageDiff",
    "OpPlan",
    "PlanId",
    "Policy",
    "Renderer",
    "RetryPolicy",
    "SessionId",
    "SessionState",
    "SidecarClient",
    "SidecarError",
    "StoreResult",
    "SyncSidecarClient",
    "TemplateNotIncremental",
    "TokenizerRenderer",
    "TruncateOldToolOutputs",
    "diff_directives",
    "edit_turn",
]
