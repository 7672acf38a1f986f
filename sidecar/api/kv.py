"""Wire <-> domain conversion for sidecar.v1 messages, shared by the server and the client.

Validation of caller input lives here so every RPC reports the same message for the same
mistake, naming the field (``InvalidArgument`` -> INVALID_ARGUMENT at the edge).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from google.protobuf.descriptor import FieldDescriptor as _FieldDescriptor

from sidecar.errors import InvalidArgument
from sidecar.identity import CacheIdentity, KVLayout, KVPart
from sidecar.registry.lookup_plan import (
    SEGMENT_FIELDS,
    AdmissionPolicy,
    FetchSpec,
    LookupPlan,
    LookupSummary,
    RepairScope,
)
from sidecar.v1 import sidecar_pb2 as pb

#: Request metadata keys (docs/architecture.md, "Tenancy and security"); kept here so clients need
#: not import the server's configuration.
TENANT_HEADER = "x-tenant-id"
AUTH_HEADER = "authorization"

if TYPE_CHECKING:
    from sidecar.rotation import RopeSpec

POLICY_FROM_WIRE = {
    pb.ADMISSION_POLICY_EXACT: AdmissionPolicy.EXACT,
    pb.ADMISSION_POLICY_POSITION_INDEPENDENT: AdmissionPolicy.POSITION_INDEPENDENT,
}
POLICY_TO_WIRE = {v: k for k, v in POLICY_FROM_WIRE.items()}
REPAIR_FROM_WIRE = {pb.REPAIR_SCOPE_CHUNK: RepairScope.CHUNK, pb.REPAIR_SCOPE_SEGMENT: RepairScope.SEGMENT}
REPAIR_TO_WIRE = {v: k for k, v in REPAIR_FROM_WIRE.items()}
_U32 = np.dtype("<u4")


# ---------------------------------------------------------------------------------- tokens


def tokens_from_wire(data: bytes, field: str = "tokens", max_tokens: int | None = None) -> np.ndarray:
    """Zero-copy uint32 view of packed little-endian token bytes, validated."""
    if len(data) % 4:
        raise InvalidArgument(f"{field}: length {len(data)} bytes is not a multiple of 4 (packed little-endian uint32)")
    if not data:
        raise InvalidArgument(f"{field}: empty token sequence")
    n = len(data) // 4
    if max_tokens is not None and n > max_tokens:
        raise InvalidArgument(f"{field}: {n} tokens exceeds the configured max_prompt_tokens {max_tokens}")
    return np.frombuffer(data, dtype=_U32)


def tokens_to_wire(tokens: "np.ndarray | Sequence[int] | bytes | bytearray | memoryview") -> bytes:
    """Pack token ids (numpy array of any integer dtype, a list, or bytes) as LE uint32."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        data = bytes(tokens)
        if len(data) % 4:
            raise ValueError(f"tokens: length {len(data)} bytes is not a multiple of 4")
        return data
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D sequence, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"tokens: expected integer token ids, got dtype {arr.dtype}")
    if arr.dtype != _U32:
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 2**32):
            raise ValueError("tokens: ids must fit in uint32")
        arr = arr.astype(_U32)
    return arr.tobytes()


# -------------------------------------------------------------------------------- identity


class IdentityCache:
    """Interns CacheIdentity objects by their wire fields (the salt is hashed once). LRU over
    ``capacity`` identities (``functools.lru_cache``); an identity whose strings total more than
    ``max_key_bytes`` is built every time and never retained (real ones are short: the cache
    must not pin a client's large strings)."""

    def __init__(self, capacity: int = 1024, max_key_bytes: int = 1024) -> None:
        self._build = functools.lru_cache(maxsize=capacity)(_build_identity)
        self._max_key_bytes = max_key_bytes

    def __len__(self) -> int:
        return self._build.cache_info().currsize

    def get(self, msg: pb.CacheIdentity, present: bool) -> CacheIdentity:
        if not present or not msg.model_id:
            raise InvalidArgument("identity.model_id is required")
        key = (msg.model_id, msg.weights_hash, msg.tokenizer_hash, msg.kv_layout, msg.rope_fingerprint,
               msg.block_size, msg.namespace, msg.shard)
        if sum(len(k) for k in key if isinstance(k, str)) <= self._max_key_bytes:
            return self._build(*key)
        return _build_identity(*key)


def _build_identity(model_id: str, weights_hash: str, tokenizer_hash: str, kv_layout: str, rope_fingerprint: str,
                    block_size: int, namespace: str, shard: str) -> CacheIdentity:
    return CacheIdentity(
        model_id=model_id, weights_hash=weights_hash, tokenizer_hash=tokenizer_hash, kv_layout=kv_layout,
        rope_fingerprint=rope_fingerprint, block_size=block_size, namespace=namespace, shard=shard,
    )


#: string fields that hold a prompt's text, bounded by its handler (``max_prompt_tokens``), not
#: by ``wire.max_string_bytes``
FREE_TEXT = frozenset({"indexer.v1.GetPodScoresRequest.prompt"})


class RequestLimits:
    """Checks a decoded request against ``WireConfig``: every string field at most
    ``max_string_bytes`` UTF-8 bytes, every repeated field at most ``max_repeated`` entries, at
    any depth. Only the fields a message sets are visited (``ListFields``), and only message
    types that can hold a string or a repeated field are descended into. Bytes fields are not
    checked here (tokens and payloads have their own, field-specific limits)."""

    def __init__(self, max_string_bytes: int, max_repeated: int) -> None:
        self.max_string_bytes = max_string_bytes
        self.max_repeated = max_repeated
        self._relevant: dict[str, bool] = {}

    def error(self, msg, path: str = "") -> str | None:
        """The refusal message (``field: ...``) of the first field past a limit, or None."""
        FD = _FieldDescriptor
        for fd, value in msg.ListFields():
            name = f"{path}{fd.name}"
            if _is_repeated(fd):
                if len(value) > self.max_repeated:
                    return f"{name}: {len(value)} entries exceeds wire.max_repeated {self.max_repeated}"
                if fd.type == FD.TYPE_STRING:
                    for i, v in enumerate(value):
                        if len(v) > self.max_string_bytes // 4 and len(v.encode()) > self.max_string_bytes:
                            return f"{name}[{i}]: {len(v.encode())} bytes exceeds wire.max_string_bytes {self.max_string_bytes}"
                elif fd.type == FD.TYPE_MESSAGE and self._descend(fd.message_type):
                    for i, v in enumerate(value):
                        err = self.error(v, f"{name}[{i}].")
                        if err is not None:
                            return err
            elif fd.type == FD.TYPE_STRING and fd.full_name not in FREE_TEXT:
                # len(str) <= UTF-8 bytes <= 4 x len(str): encode only when it could be too long
                if len(value) > self.max_string_bytes // 4 and len(value.encode()) > self.max_string_bytes:
                    return f"{name}: {len(value.encode())} bytes exceeds wire.max_string_bytes {self.max_string_bytes}"
            elif fd.type == FD.TYPE_MESSAGE and self._descend(fd.message_type):
                err = self.error(value, f"{name}.")
                if err is not None:
                    return err
        return None

    def _descend(self, desc) -> bool:
        """Whether messages of ``desc`` can hold a string or a repeated field (cached)."""
        known = self._relevant.get(desc.full_name)
        if known is None:
            self._relevant[desc.full_name] = False  # recursion guard
            FD = _FieldDescriptor
            known = any(
                _is_repeated(f) or f.type == FD.TYPE_STRING
                or (f.type == FD.TYPE_MESSAGE and self._descend(f.message_type))
                for f in desc.fields
            )
            self._relevant[desc.full_name] = known
        return known


def _is_repeated(fd) -> bool:
    is_rep = getattr(fd, "is_repeated", None)  # protobuf >= 5.28; ``label`` is deprecated there
    return is_rep if isinstance(is_rep, bool) else fd.label == _FieldDescriptor.LABEL_REPEATED


def identity_to_wire(identity: CacheIdentity) -> pb.CacheIdentity:
    return pb.CacheIdentity(
        model_id=identity.model_id, weights_hash=identity.weights_hash, tokenizer_hash=identity.tokenizer_hash,
        kv_layout=identity.kv_layout, rope_fingerprint=identity.rope_fingerprint, block_size=identity.block_size,
        namespace=identity.namespace, shard=identity.shard,
    )


def policy_from_wire(value: int, default: AdmissionPolicy) -> AdmissionPolicy:
    if value == pb.ADMISSION_POLICY_UNSPECIFIED:
        return default
    policy = POLICY_FROM_WIRE.get(value)
    if policy is None:
        raise InvalidArgument(f"policy: unknown AdmissionPolicy value {value}")
    return policy


def repair_from_wire(value: int, default: RepairScope) -> RepairScope:
    if value == pb.REPAIR_SCOPE_UNSPECIFIED:
        return default
    scope = REPAIR_FROM_WIRE.get(value)
    if scope is None:
        raise InvalidArgument(f"repair_scope: unknown RepairScope value {value}")
    return scope


# ------------------------------------------------------------------------------------ plan


def lookup_plan_to_wire(plan: LookupPlan) -> pb.LookupPlan:
    msg = pb.LookupPlan(
        segments=plan.table.astype("<u8", copy=False).tobytes(),
        dry_run=plan.dry_run,
        chunk_bounds=plan.chunk_bounds.astype("<u4", copy=False).tobytes(),
    )
    s = plan.summary
    ms = msg.summary
    ms.total_tokens = s.total_tokens
    ms.prefix_tokens = s.prefix_tokens
    ms.exact_tokens = s.exact_tokens
    ms.shifted_tokens = s.shifted_tokens
    ms.prefill_tokens = s.prefill_tokens
    ms.chunks_total = s.chunks_total
    ms.chunks_hit = s.chunks_hit
    if plan.plan_shard is not None:
        msg.plan_shard = plan.plan_shard
    return msg


_RECORD = 8 * SEGMENT_FIELDS


def lookup_plan_from_wire(msg: pb.LookupPlan) -> LookupPlan:
    s = msg.summary
    if len(msg.segments) % _RECORD or len(msg.chunk_bounds) % 4:
        raise ValueError("LookupPlan: segments/chunk_bounds are not whole packed records")
    return LookupPlan(
        table=np.frombuffer(msg.segments, dtype="<u8").reshape(-1, SEGMENT_FIELDS),
        summary=LookupSummary(
            total_tokens=s.total_tokens, prefix_tokens=s.prefix_tokens, exact_tokens=s.exact_tokens,
            shifted_tokens=s.shifted_tokens, prefill_tokens=s.prefill_tokens, chunks_total=s.chunks_total,
            chunks_hit=s.chunks_hit,
        ),
        dry_run=msg.dry_run,
        chunk_bounds=np.frombuffer(msg.chunk_bounds, dtype="<u4"),
        plan_shard=msg.plan_shard if msg.HasField("plan_shard") else None,
    )


# ------------------------------------------------------------------------- layout and rope


def layout_to_wire(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(
        num_layers=layout.num_layers,
        parts=[pb.KVPart(name=p.name, shape=list(p.shape), dtype=p.dtype, rotary=p.rotary) for p in layout.parts],
    )


def layout_from_wire(msg: pb.KVLayout, field: str = "layout") -> KVLayout:
    try:
        return KVLayout(
            num_layers=msg.num_layers,
            parts=tuple(KVPart(name=p.name, shape=tuple(p.shape), dtype=p.dtype, rotary=p.rotary) for p in msg.parts),
        )
    except ValueError as exc:
        raise InvalidArgument(f"{field}: {exc}") from exc


def required_layout(msg, field: str = "layout") -> KVLayout:
    """The ``layout`` field of ``msg`` (a FetchRequest, FetchSessionRequest, StoreHeader),
    decoded; INVALID_ARGUMENT naming ``field`` when it is unset or malformed."""
    if not msg.HasField("layout"):
        raise InvalidArgument(f"{field}: required")
    return layout_from_wire(msg.layout, field)


def rope_to_wire(spec: "RopeSpec") -> pb.RopeParams:
    return pb.RopeParams(
        rotary_dim=spec.rotary_dim,
        pairing=spec.pairing.value,
        layout=spec.layout.value,
        inv_freq=np.asarray(spec.inv_freq, dtype="<f4").tobytes(),
        key_dim=spec.key_dim,
        attention_scaling=spec.attention_scaling,
        rope_type=spec.rope_type,
    )


def rope_from_wire(msg: pb.RopeParams, field: str = "rope") -> "RopeSpec":
    from sidecar.rotation import RopeSpec

    if len(msg.inv_freq) % 4:
        raise InvalidArgument(f"{field}.inv_freq: length {len(msg.inv_freq)} is not a multiple of 4 (packed float32)")
    try:
        return RopeSpec(
            rotary_dim=msg.rotary_dim,
            key_dim=msg.key_dim,
            layout=msg.layout,
            pairing=msg.pairing,
            inv_freq=tuple(np.frombuffer(msg.inv_freq, dtype="<f4").tolist()),
            attention_scaling=msg.attention_scaling if msg.attention_scaling else 1.0,
            rope_type=msg.rope_type or "default",
        )
    except ValueError as exc:
        raise InvalidArgument(f"{field}: {exc}") from exc


# ===================================================================================
# Client-side request builders (the SDK's; sidecar.sdk.rpcs names them in its RPC table).
# Each builds the request of one KV call from the caller's arguments; engine clients that
# drive the stub themselves (the SGLang HiCache backend) call them directly.
# ===================================================================================

#: Payload bytes per Store message (gRPC messages stay well under the 64 MiB limit).
PART_BYTES = 2 << 20


def lookup_request(
    tokens: np.ndarray | Sequence[int] | bytes,
    identity: CacheIdentity,
    engine_prefix_len: int = 0,
    policy: AdmissionPolicy | str | None = None,
    left_context_window: int | None = None,
    recompute_tokens: int | None = None,
    dry_run: bool = False,
    repair_scope: RepairScope | str | None = None,
) -> pb.LookupRequest:
    """A ``LookupRequest``. None leaves an optional field unset: the server applies its
    configured default (``policy``, ``left_context_window``, ``recompute_tokens``,
    ``repair_scope``)."""
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


def payload_view(payload: object) -> memoryview:
    """The bytes of one chunk payload (bytes-like, a numpy array or a torch tensor), flat,
    without a copy where the object is contiguous (a torch tensor is moved to the CPU)."""
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


def store_messages(
    tokens: np.ndarray | Sequence[int] | bytes,
    identity: CacheIdentity,
    register_from: int = 0,
    shared: bool = False,
    layout: KVLayout | None = None,
    payloads: Mapping[int, object] | None = None,
    part_bytes: int = PART_BYTES,
) -> list[pb.StoreRequest]:
    """The client stream of one Store: a header (the whole sequence from position 0, chunks
    registered from ``register_from``), then, with ``layout`` and ``payloads`` ({chunk start:
    KV bytes at that chunk's positions, ``KVLayout`` order}), each payload in parts of at most
    ``part_bytes`` in chunk order, the last part of each marked ``last``; then the commit (the
    server registers and stores nothing for a stream that ends without it). For callers of the
    generated stub; the SDK sends the same stream as wire frames (``sidecar.api.store_frames``:
    each payload copied once, not by protobuf four times)."""
    header = pb.StoreHeader(
        tokens=tokens_to_wire(tokens), identity=identity_to_wire(identity), register_from=register_from, shared=shared
    )
    if not payloads:
        return [pb.StoreRequest(header=header), pb.StoreRequest(commit=pb.StoreCommit())]
    if layout is None:
        raise ValueError("layout: required with payloads")
    header.layout.CopyFrom(layout_to_wire(layout))
    msgs = [pb.StoreRequest(header=header)]
    total = 0
    for start in sorted(payloads):
        mv = payload_view(payloads[start])
        n = len(mv)
        total += n
        off = 0
        while True:
            end = min(n, off + part_bytes)
            msgs.append(pb.StoreRequest(payload=pb.PayloadPart(chunk_start=start, data=bytes(mv[off:end]), last=end >= n)))
            off = end
            if off >= n:
                break
    msgs.append(pb.StoreRequest(commit=pb.StoreCommit(chunks=len(payloads), payload_bytes=total)))
    return msgs


def fetch_item(item: tuple[int, int] | FetchSpec) -> pb.FetchItem:
    """A Fetch item: ``(chunk_hash, target_pos)`` or a ``FetchSpec`` span."""
    if isinstance(item, FetchSpec):
        return pb.FetchItem(chunk_hash=item.chunk_hash, target_pos=item.target_pos, num_tokens=item.num_tokens,
                            row_offset=item.row_offset, next_hashes=item.next_hashes)
    return pb.FetchItem(chunk_hash=item[0], target_pos=item[1])


def fetch_items_from_wire(items: Sequence[pb.FetchItem], max_items: int, field: str = "items"
                          ) -> list[tuple[int, int]] | list[FetchSpec]:
    """A Fetch's items: ``(chunk_hash, target_pos)`` pairs, or, when any item is a span, a
    ``FetchSpec`` per item (at most ``max_items``: INVALID_ARGUMENT naming the field)."""
    if len(items) > max_items:
        raise InvalidArgument(f"{field}: {len(items)} exceeds max_fetch_items {max_items}")
    if any(it.num_tokens or it.next_hashes or it.row_offset for it in items):
        return [FetchSpec(it.chunk_hash, it.target_pos, it.num_tokens, it.row_offset, tuple(it.next_hashes))
                for it in items]
    return [(it.chunk_hash, it.target_pos) for it in items]


def fetch_request(
    identity: CacheIdentity,
    layout: KVLayout,
    rope: RopeSpec | None,
    items: Sequence[tuple[int, int] | FetchSpec],
    raw: bool = False,
    plan_identity: CacheIdentity | None = None,
    heads: tuple[int, int] | None = None,
) -> pb.FetchRequest:
    """A ``FetchRequest`` for ``items`` in order (no shared-memory buffer named: the SDK names
    one per attempt); ``plan_identity``: the shard of ``identity`` the items were planned under;
    ``heads``: ``(start, count)``, only those KV heads of each payload."""
    req = pb.FetchRequest(
        identity=identity_to_wire(identity), layout=layout_to_wire(layout), raw=raw,
        items=[fetch_item(it) for it in items],
    )
    if rope is not None:
        req.rope.CopyFrom(rope_to_wire(rope))
    if plan_identity is not None:
        req.plan_identity.CopyFrom(identity_to_wire(plan_identity))
    if heads is not None:
        req.heads.start, req.heads.count = heads
    return req


def evict_request(chunk_hashes: Sequence[int], tier: str = "") -> pb.EvictRequest:
    """An ``EvictRequest``: drop the copies of ``chunk_hashes`` from ``tier`` ("": each one's
    top tier)."""
    return pb.EvictRequest(chunk_hashes=[int(h) for h in chunk_hashes], tier=tier)


def delete_request(chunk_hashes: Sequence[int]) -> pb.DeleteRequest:
    """A ``DeleteRequest``: delete ``chunk_hashes`` from every tier."""
    return pb.DeleteRequest(chunk_hashes=[int(h) for h in chunk_hashes])


def stats_request() -> pb.StatsRequest:
    return pb.StatsRequest()


def ping_request() -> pb.PingRequest:
    return pb.PingRequest()


#: ``FetchResponse.status`` of a chunk that was served (anything else is a miss: prefill it).
CHUNK_OK = pb.CHUNK_STATUS_OK


# The messages of this area's RPCs, for the server's handlers (which import no stubs).
CHUNK_STATUS_MISS = pb.CHUNK_STATUS_MISS
CHUNK_STATUS_OK = pb.CHUNK_STATUS_OK
DeleteRequest = pb.DeleteRequest
DeleteResponse = pb.DeleteResponse
EvictRequest = pb.EvictRequest
EvictResponse = pb.EvictResponse
FetchRequest = pb.FetchRequest
FetchResponse = pb.FetchResponse
LookupPlanMsg = pb.LookupPlan  # the domain type is LookupPlan
LookupRequest = pb.LookupRequest
PingRequest = pb.PingRequest
PingResponse = pb.PingResponse
RegistryStats = pb.RegistryStats
StatsRequest = pb.StatsRequest
StatsResponse = pb.StatsResponse
StoreHeader = pb.StoreHeader
StoreRequest = pb.StoreRequest
StoreResponse = pb.StoreResponse
TierStats = pb.TierStats
