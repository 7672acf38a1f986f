from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdmissionPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADMISSION_POLICY_UNSPECIFIED: _ClassVar[AdmissionPolicy]
    ADMISSION_POLICY_EXACT: _ClassVar[AdmissionPolicy]
    ADMISSION_POLICY_POSITION_INDEPENDENT: _ClassVar[AdmissionPolicy]

class RepairScope(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPAIR_SCOPE_UNSPECIFIED: _ClassVar[RepairScope]
    REPAIR_SCOPE_CHUNK: _ClassVar[RepairScope]
    REPAIR_SCOPE_SEGMENT: _ClassVar[RepairScope]

class SegmentKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEGMENT_KIND_UNSPECIFIED: _ClassVar[SegmentKind]
    SEGMENT_KIND_ENGINE_PREFIX: _ClassVar[SegmentKind]
    SEGMENT_KIND_CHUNK_HIT: _ClassVar[SegmentKind]
    SEGMENT_KIND_PREFILL: _ClassVar[SegmentKind]

class Fidelity(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FIDELITY_UNSPECIFIED: _ClassVar[Fidelity]
    FIDELITY_EXACT: _ClassVar[Fidelity]
    FIDELITY_APPROXIMATE: _ClassVar[Fidelity]

class ChunkStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHUNK_STATUS_UNSPECIFIED: _ClassVar[ChunkStatus]
    CHUNK_STATUS_OK: _ClassVar[ChunkStatus]
    CHUNK_STATUS_MISS: _ClassVar[ChunkStatus]

class SpliceMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPLICE_MODE_UNSPECIFIED: _ClassVar[SpliceMode]
    SPLICE_MODE_AMORTIZE: _ClassVar[SpliceMode]
    SPLICE_MODE_FORGET: _ClassVar[SpliceMode]

class OpKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OP_KIND_UNSPECIFIED: _ClassVar[OpKind]
    OP_KIND_FREE: _ClassVar[OpKind]
    OP_KIND_ALLOCATE: _ClassVar[OpKind]
    OP_KIND_PREFILL: _ClassVar[OpKind]
    OP_KIND_ROTATE: _ClassVar[OpKind]
    OP_KIND_MOVE: _ClassVar[OpKind]
    OP_KIND_REFRESH: _ClassVar[OpKind]

class ClaimMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLAIM_MODE_UNSPECIFIED: _ClassVar[ClaimMode]
    CLAIM_MODE_SOFT_PRIORITY: _ClassVar[ClaimMode]
    CLAIM_MODE_HARD_PROTECTED: _ClassVar[ClaimMode]
    CLAIM_MODE_DEMOTABLE: _ClassVar[ClaimMode]
    CLAIM_MODE_OFFLOADABLE: _ClassVar[ClaimMode]
    CLAIM_MODE_EXPIRING: _ClassVar[ClaimMode]
    CLAIM_MODE_BEST_EFFORT: _ClassVar[ClaimMode]

class ClaimDecisionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLAIM_DECISION_UNSPECIFIED: _ClassVar[ClaimDecisionKind]
    CLAIM_DECISION_ACCEPTED: _ClassVar[ClaimDecisionKind]
    CLAIM_DECISION_REJECTED: _ClassVar[ClaimDecisionKind]
    CLAIM_DECISION_CONDITIONALLY_ACCEPTED: _ClassVar[ClaimDecisionKind]

class AdmitDecision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADMIT_DECISION_UNSPECIFIED: _ClassVar[AdmitDecision]
    ADMIT_DECISION_ADMITTED: _ClassVar[AdmitDecision]
    ADMIT_DECISION_DEFERRED: _ClassVar[AdmitDecision]
    ADMIT_DECISION_REFUSED: _ClassVar[AdmitDecision]
ADMISSION_POLICY_UNSPECIFIED: AdmissionPolicy
ADMISSION_POLICY_EXACT: AdmissionPolicy
ADMISSION_POLICY_POSITION_INDEPENDENT: AdmissionPolicy
REPAIR_SCOPE_UNSPECIFIED: RepairScope
REPAIR_SCOPE_CHUNK: RepairScope
REPAIR_SCOPE_SEGMENT: RepairScope
SEGMENT_KIND_UNSPECIFIED: SegmentKind
SEGMENT_KIND_ENGINE_PREFIX: SegmentKind
SEGMENT_KIND_CHUNK_HIT: SegmentKind
SEGMENT_KIND_PREFILL: SegmentKind
FIDELITY_UNSPECIFIED: Fidelity
FIDELITY_EXACT: Fidelity
FIDELITY_APPROXIMATE: Fidelity
CHUNK_STATUS_UNSPECIFIED: ChunkStatus
CHUNK_STATUS_OK: ChunkStatus
CHUNK_STATUS_MISS: ChunkStatus
SPLICE_MODE_UNSPECIFIED: SpliceMode
SPLICE_MODE_AMORTIZE: SpliceMode
SPLICE_MODE_FORGET: SpliceMode
OP_KIND_UNSPECIFIED: OpKind
OP_KIND_FREE: OpKind
OP_KIND_ALLOCATE: OpKind
OP_KIND_PREFILL: OpKind
OP_KIND_ROTATE: OpKind
OP_KIND_MOVE: OpKind
OP_KIND_REFRESH: OpKind
CLAIM_MODE_UNSPECIFIED: ClaimMode
CLAIM_MODE_SOFT_PRIORITY: ClaimMode
CLAIM_MODE_HARD_PROTECTED: ClaimMode
CLAIM_MODE_DEMOTABLE: ClaimMode
CLAIM_MODE_OFFLOADABLE: ClaimMode
CLAIM_MODE_EXPIRING: ClaimMode
CLAIM_MODE_BEST_EFFORT: ClaimMode
CLAIM_DECISION_UNSPECIFIED: ClaimDecisionKind
CLAIM_DECISION_ACCEPTED: ClaimDecisionKind
CLAIM_DECISION_REJECTED: ClaimDecisionKind
CLAIM_DECISION_CONDITIONALLY_ACCEPTED: ClaimDecisionKind
ADMIT_DECISION_UNSPECIFIED: AdmitDecision
ADMIT_DECISION_ADMITTED: AdmitDecision
ADMIT_DECISION_DEFERRED: AdmitDecision
ADMIT_DECISION_REFUSED: AdmitDecision

class CacheIdentity(_message.Message):
    __slots__ = ("model_id", "weights_hash", "tokenizer_hash", "kv_layout", "rope_fingerprint", "block_size", "namespace", "shard")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ROPE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    weights_hash: str
    tokenizer_hash: str
    kv_layout: str
    rope_fingerprint: str
    block_size: int
    namespace: str
    shard: str
    def __init__(self, model_id: _Optional[str] = ..., weights_hash: _Optional[str] = ..., tokenizer_hash: _Optional[str] = ..., kv_layout: _Optional[str] = ..., rope_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., namespace: _Optional[str] = ..., shard: _Optional[str] = ...) -> None: ...

class KVPart(_message.Message):
    __slots__ = ("name", "shape", "dtype", "rotary")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROTARY_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    rotary: bool
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., rotary: bool = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "parts")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    parts: _containers.RepeatedCompositeFieldContainer[KVPart]
    def __init__(self, num_layers: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[KVPart, _Mapping]]] = ...) -> None: ...

class RopeParams(_message.Message):
    __slots__ = ("rotary_dim", "pairing", "layout", "inv_freq", "key_dim", "attention_scaling", "rope_type")
    ROTARY_DIM_FIELD_NUMBER: _ClassVar[int]
    PAIRING_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    INV_FREQ_FIELD_NUMBER: _ClassVar[int]
    KEY_DIM_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_SCALING_FIELD_NUMBER: _ClassVar[int]
    ROPE_TYPE_FIELD_NUMBER: _ClassVar[int]
    rotary_dim: int
    pairing: str
    layout: str
    inv_freq: bytes
    key_dim: int
    attention_scaling: float
    rope_type: str
    def __init__(self, rotary_dim: _Optional[int] = ..., pairing: _Optional[str] = ..., layout: _Optional[str] = ..., inv_freq: _Optional[bytes] = ..., key_dim: _Optional[int] = ..., attention_scaling: _Optional[float] = ..., rope_type: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("tokens", "identity", "engine_prefix_len", "policy", "left_context_window", "recompute_tokens", "dry_run", "repair_scope")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    ENGINE_PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    LEFT_CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    REPAIR_SCOPE_FIELD_NUMBER: _ClassVar[int]
    tokens: bytes
    identity: CacheIdentity
    engine_prefix_len: int
    policy: AdmissionPolicy
    left_context_window: int
    recompute_tokens: int
    dry_run: bool
    repair_scope: RepairScope
    def __init__(self, tokens: _Optional[bytes] = ..., identity: _Optional[_Union[CacheIdentity, _Mapping]] = ..., engine_prefix_len: _Optional[int] = ..., policy: _Optional[_Union[AdmissionPolicy, str]] = ..., left_context_window: _Optional[int] = ..., recompute_tokens: _Optional[int] = ..., dry_run: bool = ..., repair_scope: _Optional[_Union[RepairScope, str]] = ...) -> None: ...

class LookupSummary(_message.Message):
    __slots__ = ("total_tokens", "prefix_tokens", "exact_tokens", "shifted_tokens", "prefill_tokens", "chunks_total", "chunks_hit")
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXACT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHIFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_HIT_FIELD_NUMBER: _ClassVar[int]
    total_tokens: int
    prefix_tokens: int
    exact_tokens: int
    shifted_tokens: int
    prefill_tokens: int
    chunks_total: int
    chunks_hit: int
    def __init__(self, total_tokens: _Optional[int] = ..., prefix_tokens: _Optional[int] = ..., exact_tokens: _Optional[int] = ..., shifted_tokens: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., chunks_total: _Optional[int] = ..., chunks_hit: _Optional[int] = ...) -> None: ...

class LookupPlan(_message.Message):
    __slots__ = ("segments", "summary", "dry_run", "chunk_bounds", "plan_shard")
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    PLAN_SHARD_FIELD_NUMBER: _ClassVar[int]
    segments: bytes
    summary: LookupSummary
    dry_run: bool
    chunk_bounds: bytes
    plan_shard: str
    def __init__(self, segments: _Optional[bytes] = ..., summary: _Optional[_Union[LookupSummary, _Mapping]] = ..., dry_run: bool = ..., chunk_bounds: _Optional[bytes] = ..., plan_shard: _Optional[str] = ...) -> None: ...

class StoreHeader(_message.Message):
    __slots__ = ("tokens", "identity", "register_from", "shared", "layout")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    REGISTER_FROM_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    tokens: bytes
    identity: CacheIdentity
    register_from: int
    shared: bool
    layout: KVLayout
    def __init__(self, tokens: _Optional[bytes] = ..., identity: _Optional[_Union[CacheIdentity, _Mapping]] = ..., register_from: _Optional[int] = ..., shared: bool = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ...) -> None: ...

class PayloadPart(_message.Message):
    __slots__ = ("chunk_start", "data", "last")
    CHUNK_START_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    chunk_start: int
    data: bytes
    last: bool
    def __init__(self, chunk_start: _Optional[int] = ..., data: _Optional[bytes] = ..., last: bool = ...) -> None: ...

class StoreCommit(_message.Message):
    __slots__ = ("chunks", "payload_bytes")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    payload_bytes: int
    def __init__(self, chunks: _Optional[int] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("header", "payload", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: StoreHeader
    payload: PayloadPart
    commit: StoreCommit
    def __init__(self, header: _Optional[_Union[StoreHeader, _Mapping]] = ..., payload: _Optional[_Union[PayloadPart, _Mapping]] = ..., commit: _Optional[_Union[StoreCommit, _Mapping]] = ...) -> None: ...

class StoreResponse(_message.Message):
    __slots__ = ("chunks_total", "chunks_registered", "chunks_refreshed", "chunks_observed", "chunks_stored", "chunk_bounds")
    CHUNKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_REFRESHED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_OBSERVED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_STORED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    chunks_total: int
    chunks_registered: int
    chunks_refreshed: int
    chunks_observed: int
    chunks_stored: int
    chunk_bounds: bytes
    def __init__(self, chunks_total: _Optional[int] = ..., chunks_registered: _Optional[int] = ..., chunks_refreshed: _Optional[int] = ..., chunks_observed: _Optional[int] = ..., chunks_stored: _Optional[int] = ..., chunk_bounds: _Optional[bytes] = ...) -> None: ...

class FetchItem(_message.Message):
    __slots__ = ("chunk_hash", "target_pos", "num_tokens", "row_offset", "next_hashes")
    CHUNK_HASH_FIELD_NUMBER: _ClassVar[int]
    TARGET_POS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NEXT_HASHES_FIELD_NUMBER: _ClassVar[int]
    chunk_hash: int
    target_pos: int
    num_tokens: int
    row_offset: int
    next_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, chunk_hash: _Optional[int] = ..., target_pos: _Optional[int] = ..., num_tokens: _Optional[int] = ..., row_offset: _Optional[int] = ..., next_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("identity", "layout", "rope", "items", "raw", "shm", "plan_identity", "heads")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ROPE_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    PLAN_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    identity: CacheIdentity
    layout: KVLayout
    rope: RopeParams
    items: _containers.RepeatedCompositeFieldContainer[FetchItem]
    raw: bool
    shm: SharedMemory
    plan_identity: CacheIdentity
    heads: HeadRange
    def __init__(self, identity: _Optional[_Union[CacheIdentity, _Mapping]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., rope: _Optional[_Union[RopeParams, _Mapping]] = ..., items: _Optional[_Iterable[_Union[FetchItem, _Mapping]]] = ..., raw: bool = ..., shm: _Optional[_Union[SharedMemory, _Mapping]] = ..., plan_identity: _Optional[_Union[CacheIdentity, _Mapping]] = ..., heads: _Optional[_Union[HeadRange, _Mapping]] = ...) -> None: ...

class HeadRange(_message.Message):
    __slots__ = ("start", "count")
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    start: int
    count: int
    def __init__(self, start: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class SharedMemory(_message.Message):
    __slots__ = ("name", "token")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    token: bytes
    def __init__(self, name: _Optional[str] = ..., token: _Optional[bytes] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("index", "status", "num_tokens", "source_pos", "delta", "rotated", "tier", "data", "last", "shm_offset", "shm_length", "more")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_POS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    ROTATED_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHM_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    index: int
    status: ChunkStatus
    num_tokens: int
    source_pos: int
    delta: int
    rotated: bool
    tier: str
    data: bytes
    last: bool
    shm_offset: int
    shm_length: int
    more: _containers.RepeatedCompositeFieldContainer[FetchResponse]
    def __init__(self, index: _Optional[int] = ..., status: _Optional[_Union[ChunkStatus, str]] = ..., num_tokens: _Optional[int] = ..., source_pos: _Optional[int] = ..., delta: _Optional[int] = ..., rotated: bool = ..., tier: _Optional[str] = ..., data: _Optional[bytes] = ..., last: bool = ..., shm_offset: _Optional[int] = ..., shm_length: _Optional[int] = ..., more: _Optional[_Iterable[_Union[FetchResponse, _Mapping]]] = ...) -> None: ...

class MapPoolRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("name", "size", "lease_ttl_s", "header_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    HEADER_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    lease_ttl_s: float
    header_bytes: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ..., header_bytes: _Optional[int] = ...) -> None: ...

class PoolSlot(_message.Message):
    __slots__ = ("index", "offset", "length", "num_tokens", "row_offset", "rows", "source_pos", "delta", "checksum", "stamp", "tier")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_POS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    STAMP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
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
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., num_tokens: _Optional[int] = ..., row_offset: _Optional[int] = ..., rows: _Optional[int] = ..., source_pos: _Optional[int] = ..., delta: _Optional[int] = ..., checksum: _Optional[int] = ..., stamp: _Optional[int] = ..., tier: _Optional[str] = ...) -> None: ...

class LeaseFetchRequest(_message.Message):
    __slots__ = ("fetch",)
    FETCH_FIELD_NUMBER: _ClassVar[int]
    fetch: FetchRequest
    def __init__(self, fetch: _Optional[_Union[FetchRequest, _Mapping]] = ...) -> None: ...

class LeaseFetchResponse(_message.Message):
    __slots__ = ("pool", "lease", "ttl_s", "slots", "misses")
    POOL_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    pool: str
    lease: str
    ttl_s: float
    slots: _containers.RepeatedCompositeFieldContainer[PoolSlot]
    misses: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool: _Optional[str] = ..., lease: _Optional[str] = ..., ttl_s: _Optional[float] = ..., slots: _Optional[_Iterable[_Union[PoolSlot, _Mapping]]] = ..., misses: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: str
    def __init__(self, lease: _Optional[str] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    def __init__(self, chunks: _Optional[int] = ...) -> None: ...

class ReserveStoreRequest(_message.Message):
    __slots__ = ("header", "chunk_starts")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_STARTS_FIELD_NUMBER: _ClassVar[int]
    header: StoreHeader
    chunk_starts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, header: _Optional[_Union[StoreHeader, _Mapping]] = ..., chunk_starts: _Optional[_Iterable[int]] = ...) -> None: ...

class StoreSlot(_message.Message):
    __slots__ = ("chunk_start", "offset", "length")
    CHUNK_START_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    chunk_start: int
    offset: int
    length: int
    def __init__(self, chunk_start: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ReserveStoreResponse(_message.Message):
    __slots__ = ("pool", "reservation", "ttl_s", "slots", "held", "chunk_bounds")
    POOL_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    reservation: str
    ttl_s: float
    slots: _containers.RepeatedCompositeFieldContainer[StoreSlot]
    held: _containers.RepeatedScalarFieldContainer[int]
    chunk_bounds: bytes
    def __init__(self, pool: _Optional[str] = ..., reservation: _Optional[str] = ..., ttl_s: _Optional[float] = ..., slots: _Optional[_Iterable[_Union[StoreSlot, _Mapping]]] = ..., held: _Optional[_Iterable[int]] = ..., chunk_bounds: _Optional[bytes] = ...) -> None: ...

class CommitStoreRequest(_message.Message):
    __slots__ = ("reservation", "commit")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    reservation: str
    commit: StoreCommit
    def __init__(self, reservation: _Optional[str] = ..., commit: _Optional[_Union[StoreCommit, _Mapping]] = ...) -> None: ...

class AbortStoreRequest(_message.Message):
    __slots__ = ("reservation",)
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    reservation: str
    def __init__(self, reservation: _Optional[str] = ...) -> None: ...

class AbortStoreResponse(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: int
    def __init__(self, slots: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("chunk_hashes", "tier")
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    chunk_hashes: _containers.RepeatedScalarFieldContainer[int]
    tier: str
    def __init__(self, chunk_hashes: _Optional[_Iterable[int]] = ..., tier: _Optional[str] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted",)
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    def __init__(self, evicted: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("chunk_hashes",)
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    chunk_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, chunk_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegistryStats(_message.Message):
    __slots__ = ("entries", "bytes", "capacity_entries", "capacity_bytes", "evictions", "hits", "verify_failures")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    entries: int
    bytes: int
    capacity_entries: int
    capacity_bytes: int
    evictions: int
    hits: int
    verify_failures: int
    def __init__(self, entries: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_entries: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., evictions: _Optional[int] = ..., hits: _Optional[int] = ..., verify_failures: _Optional[int] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "bytes", "objects", "capacity_bytes", "hits", "misses")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    bytes: int
    objects: int
    capacity_bytes: int
    hits: int
    misses: int
    def __init__(self, tier: _Optional[str] = ..., bytes: _Optional[int] = ..., objects: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("version", "registry", "lookups", "lookup_tokens", "recovered_prefix_tokens", "recovered_exact_tokens", "recovered_shifted_tokens", "prefill_tokens", "uptime_s", "tiers", "checksum_failures", "pins_in_flight", "claims_active")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_EXACT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_SHIFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PINS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    version: str
    registry: RegistryStats
    lookups: int
    lookup_tokens: int
    recovered_prefix_tokens: int
    recovered_exact_tokens: int
    recovered_shifted_tokens: int
    prefill_tokens: int
    uptime_s: float
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    checksum_failures: int
    pins_in_flight: int
    claims_active: int
    def __init__(self, version: _Optional[str] = ..., registry: _Optional[_Union[RegistryStats, _Mapping]] = ..., lookups: _Optional[int] = ..., lookup_tokens: _Optional[int] = ..., recovered_prefix_tokens: _Optional[int] = ..., recovered_exact_tokens: _Optional[int] = ..., recovered_shifted_tokens: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., uptime_s: _Optional[float] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., checksum_failures: _Optional[int] = ..., pins_in_flight: _Optional[int] = ..., claims_active: _Optional[int] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "version", "length", "block_size", "live_blocks", "block_table", "pending_plan_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    PENDING_PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    version: int
    length: int
    block_size: int
    live_blocks: int
    block_table: bytes
    pending_plan_id: str
    def __init__(self, session_id: _Optional[str] = ..., version: _Optional[int] = ..., length: _Optional[int] = ..., block_size: _Optional[int] = ..., live_blocks: _Optional[int] = ..., block_table: _Optional[bytes] = ..., pending_plan_id: _Optional[str] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("tokens", "block_size", "identity", "held")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    tokens: bytes
    block_size: int
    identity: CacheIdentity
    held: bool
    def __init__(self, tokens: _Optional[bytes] = ..., block_size: _Optional[int] = ..., identity: _Optional[_Union[CacheIdentity, _Mapping]] = ..., held: bool = ...) -> None: ...

class AppendSessionRequest(_message.Message):
    __slots__ = ("session_id", "tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: bytes
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[bytes] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Directive(_message.Message):
    __slots__ = ("start", "end", "replacement", "mode")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    REPLACEMENT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    replacement: bytes
    mode: SpliceMode
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., replacement: _Optional[bytes] = ..., mode: _Optional[_Union[SpliceMode, str]] = ...) -> None: ...

class SpliceRequest(_message.Message):
    __slots__ = ("session_id", "expected_version", "directives")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    expected_version: int
    directives: _containers.RepeatedCompositeFieldContainer[Directive]
    def __init__(self, session_id: _Optional[str] = ..., expected_version: _Optional[int] = ..., directives: _Optional[_Iterable[_Union[Directive, _Mapping]]] = ...) -> None: ...

class Op(_message.Message):
    __slots__ = ("kind", "slots", "positions", "src_slots", "tokens", "blocks", "delta", "cum_deltas")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SRC_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    CUM_DELTAS_FIELD_NUMBER: _ClassVar[int]
    kind: OpKind
    slots: bytes
    positions: bytes
    src_slots: bytes
    tokens: bytes
    blocks: bytes
    delta: int
    cum_deltas: bytes
    def __init__(self, kind: _Optional[_Union[OpKind, str]] = ..., slots: _Optional[bytes] = ..., positions: _Optional[bytes] = ..., src_slots: _Optional[bytes] = ..., tokens: _Optional[bytes] = ..., blocks: _Optional[bytes] = ..., delta: _Optional[int] = ..., cum_deltas: _Optional[bytes] = ...) -> None: ...

class SessionLayout(_message.Message):
    __slots__ = ("tokens", "slots", "rotations", "cum_deltas")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    ROTATIONS_FIELD_NUMBER: _ClassVar[int]
    CUM_DELTAS_FIELD_NUMBER: _ClassVar[int]
    tokens: bytes
    slots: bytes
    rotations: bytes
    cum_deltas: bytes
    def __init__(self, tokens: _Optional[bytes] = ..., slots: _Optional[bytes] = ..., rotations: _Optional[bytes] = ..., cum_deltas: _Optional[bytes] = ...) -> None: ...

class SpliceSummary(_message.Message):
    __slots__ = ("tokens_before", "tokens_after", "tokens_kept", "tokens_prefilled", "slots_reindexed", "slots_moved", "slots_rotated", "rotations", "blocks_freed", "blocks_allocated", "refresh_proposals")
    TOKENS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_AFTER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_KEPT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PREFILLED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_REINDEXED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_ROTATED_FIELD_NUMBER: _ClassVar[int]
    ROTATIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    REFRESH_PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    tokens_before: int
    tokens_after: int
    tokens_kept: int
    tokens_prefilled: int
    slots_reindexed: int
    slots_moved: int
    slots_rotated: int
    rotations: int
    blocks_freed: int
    blocks_allocated: int
    refresh_proposals: int
    def __init__(self, tokens_before: _Optional[int] = ..., tokens_after: _Optional[int] = ..., tokens_kept: _Optional[int] = ..., tokens_prefilled: _Optional[int] = ..., slots_reindexed: _Optional[int] = ..., slots_moved: _Optional[int] = ..., slots_rotated: _Optional[int] = ..., rotations: _Optional[int] = ..., blocks_freed: _Optional[int] = ..., blocks_allocated: _Optional[int] = ..., refresh_proposals: _Optional[int] = ...) -> None: ...

class OpPlan(_message.Message):
    __slots__ = ("plan_id", "session_id", "base_version", "next_version", "block_size", "ops", "layout", "edits", "summary", "ttl_s")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    NEXT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    EDITS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    session_id: str
    base_version: int
    next_version: int
    block_size: int
    ops: _containers.RepeatedCompositeFieldContainer[Op]
    layout: SessionLayout
    edits: bytes
    summary: SpliceSummary
    ttl_s: float
    def __init__(self, plan_id: _Optional[str] = ..., session_id: _Optional[str] = ..., base_version: _Optional[int] = ..., next_version: _Optional[int] = ..., block_size: _Optional[int] = ..., ops: _Optional[_Iterable[_Union[Op, _Mapping]]] = ..., layout: _Optional[_Union[SessionLayout, _Mapping]] = ..., edits: _Optional[bytes] = ..., summary: _Optional[_Union[SpliceSummary, _Mapping]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class FetchSessionRequest(_message.Message):
    __slots__ = ("session_id", "start", "end", "layout", "rope", "raw", "shm")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ROPE_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    end: int
    layout: KVLayout
    rope: RopeParams
    raw: bool
    shm: SharedMemory
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., rope: _Optional[_Union[RopeParams, _Mapping]] = ..., raw: bool = ..., shm: _Optional[_Union[SharedMemory, _Mapping]] = ...) -> None: ...

class FetchSessionResponse(_message.Message):
    __slots__ = ("index", "num_tokens", "source_pos", "delta", "rotated", "tier", "data", "last", "target_pos", "chunk_hash", "chunk_offset", "version", "shm_offset", "shm_length", "more")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_POS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    ROTATED_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TARGET_POS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHM_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    index: int
    num_tokens: int
    source_pos: int
    delta: int
    rotated: bool
    tier: str
    data: bytes
    last: bool
    target_pos: int
    chunk_hash: int
    chunk_offset: int
    version: int
    shm_offset: int
    shm_length: int
    more: _containers.RepeatedCompositeFieldContainer[FetchSessionResponse]
    def __init__(self, index: _Optional[int] = ..., num_tokens: _Optional[int] = ..., source_pos: _Optional[int] = ..., delta: _Optional[int] = ..., rotated: bool = ..., tier: _Optional[str] = ..., data: _Optional[bytes] = ..., last: bool = ..., target_pos: _Optional[int] = ..., chunk_hash: _Optional[int] = ..., chunk_offset: _Optional[int] = ..., version: _Optional[int] = ..., shm_offset: _Optional[int] = ..., shm_length: _Optional[int] = ..., more: _Optional[_Iterable[_Union[FetchSessionResponse, _Mapping]]] = ...) -> None: ...

class CommitSpliceRequest(_message.Message):
    __slots__ = ("plan_id",)
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    def __init__(self, plan_id: _Optional[str] = ...) -> None: ...

class AbortSpliceRequest(_message.Message):
    __slots__ = ("plan_id",)
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    def __init__(self, plan_id: _Optional[str] = ...) -> None: ...

class ImportManifestRequest(_message.Message):
    __slots__ = ("lines", "shared", "no_prefetch")
    LINES_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    NO_PREFETCH_FIELD_NUMBER: _ClassVar[int]
    lines: bytes
    shared: bool
    no_prefetch: bool
    def __init__(self, lines: _Optional[bytes] = ..., shared: bool = ..., no_prefetch: bool = ...) -> None: ...

class ImportManifestResponse(_message.Message):
    __slots__ = ("lines", "prefetched", "planned", "present", "malformed", "refused", "warmup_pending")
    LINES_FIELD_NUMBER: _ClassVar[int]
    PREFETCHED_FIELD_NUMBER: _ClassVar[int]
    PLANNED_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    MALFORMED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    WARMUP_PENDING_FIELD_NUMBER: _ClassVar[int]
    lines: int
    prefetched: int
    planned: int
    present: int
    malformed: int
    refused: int
    warmup_pending: int
    def __init__(self, lines: _Optional[int] = ..., prefetched: _Optional[int] = ..., planned: _Optional[int] = ..., present: _Optional[int] = ..., malformed: _Optional[int] = ..., refused: _Optional[int] = ..., warmup_pending: _Optional[int] = ...) -> None: ...

class WarmUpPlanRequest(_message.Message):
    __slots__ = ("identity", "shared", "max_sequences")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    identity: CacheIdentity
    shared: bool
    max_sequences: int
    def __init__(self, identity: _Optional[_Union[CacheIdentity, _Mapping]] = ..., shared: bool = ..., max_sequences: _Optional[int] = ...) -> None: ...

class WarmUpPlan(_message.Message):
    __slots__ = ("sequences", "tokens", "pending_chunks")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PENDING_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedScalarFieldContainer[bytes]
    tokens: int
    pending_chunks: int
    def __init__(self, sequences: _Optional[_Iterable[bytes]] = ..., tokens: _Optional[int] = ..., pending_chunks: _Optional[int] = ...) -> None: ...

class ExportManifestRequest(_message.Message):
    __slots__ = ("identity", "include_shared")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_SHARED_FIELD_NUMBER: _ClassVar[int]
    identity: CacheIdentity
    include_shared: bool
    def __init__(self, identity: _Optional[_Union[CacheIdentity, _Mapping]] = ..., include_shared: bool = ...) -> None: ...

class ExportManifestResponse(_message.Message):
    __slots__ = ("lines",)
    LINES_FIELD_NUMBER: _ClassVar[int]
    lines: bytes
    def __init__(self, lines: _Optional[bytes] = ...) -> None: ...

class CapacityProof(_message.Message):
    __slots__ = ("resident", "active", "usable", "shortfall", "unit", "free")
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    USABLE_FIELD_NUMBER: _ClassVar[int]
    SHORTFALL_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    resident: int
    active: int
    usable: int
    shortfall: int
    unit: str
    free: int
    def __init__(self, resident: _Optional[int] = ..., active: _Optional[int] = ..., usable: _Optional[int] = ..., shortfall: _Optional[int] = ..., unit: _Optional[str] = ..., free: _Optional[int] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("claim_id", "identity", "chunk_hashes", "tokens", "session_id", "predicate_min_tokens", "mode", "duration_s", "footprint_blocks", "shared")
    CLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PREDICATE_MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    claim_id: str
    identity: CacheIdentity
    chunk_hashes: _containers.RepeatedScalarFieldContainer[int]
    tokens: bytes
    session_id: str
    predicate_min_tokens: int
    mode: ClaimMode
    duration_s: float
    footprint_blocks: int
    shared: bool
    def __init__(self, claim_id: _Optional[str] = ..., identity: _Optional[_Union[CacheIdentity, _Mapping]] = ..., chunk_hashes: _Optional[_Iterable[int]] = ..., tokens: _Optional[bytes] = ..., session_id: _Optional[str] = ..., predicate_min_tokens: _Optional[int] = ..., mode: _Optional[_Union[ClaimMode, str]] = ..., duration_s: _Optional[float] = ..., footprint_blocks: _Optional[int] = ..., shared: bool = ...) -> None: ...

class ClaimInfo(_message.Message):
    __slots__ = ("claim_id", "mode", "state", "footprint_blocks", "footprint_bytes", "predicate_min_tokens", "leading_tokens", "surviving_chunks", "total_chunks", "materialized", "expires_in_s", "reason", "chunk_hashes")
    CLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICATE_MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEADING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SURVIVING_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    MATERIALIZED_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    claim_id: str
    mode: ClaimMode
    state: str
    footprint_blocks: int
    footprint_bytes: int
    predicate_min_tokens: int
    leading_tokens: int
    surviving_chunks: int
    total_chunks: int
    materialized: bool
    expires_in_s: float
    reason: str
    chunk_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, claim_id: _Optional[str] = ..., mode: _Optional[_Union[ClaimMode, str]] = ..., state: _Optional[str] = ..., footprint_blocks: _Optional[int] = ..., footprint_bytes: _Optional[int] = ..., predicate_min_tokens: _Optional[int] = ..., leading_tokens: _Optional[int] = ..., surviving_chunks: _Optional[int] = ..., total_chunks: _Optional[int] = ..., materialized: bool = ..., expires_in_s: _Optional[float] = ..., reason: _Optional[str] = ..., chunk_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class ClaimDecision(_message.Message):
    __slots__ = ("decision", "reason", "claim")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    decision: ClaimDecisionKind
    reason: str
    claim: ClaimInfo
    def __init__(self, decision: _Optional[_Union[ClaimDecisionKind, str]] = ..., reason: _Optional[str] = ..., claim: _Optional[_Union[ClaimInfo, _Mapping]] = ...) -> None: ...

class ReleaseClaimRequest(_message.Message):
    __slots__ = ("claim_id",)
    CLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    claim_id: str
    def __init__(self, claim_id: _Optional[str] = ...) -> None: ...

class DemoteClaimRequest(_message.Message):
    __slots__ = ("claim_id", "reason")
    CLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    claim_id: str
    reason: str
    def __init__(self, claim_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class GetClaimRequest(_message.Message):
    __slots__ = ("claim_id",)
    CLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    claim_id: str
    def __init__(self, claim_id: _Optional[str] = ...) -> None: ...

class ReportPoolRequest(_message.Message):
    __slots__ = ("usable_blocks", "free_blocks", "block_size", "hard_protection", "engine_id")
    USABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HARD_PROTECTION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    usable_blocks: int
    free_blocks: int
    block_size: int
    hard_protection: bool
    engine_id: str
    def __init__(self, usable_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., hard_protection: bool = ..., engine_id: _Optional[str] = ...) -> None: ...

class ReportPoolResponse(_message.Message):
    __slots__ = ("protected_resident_blocks",)
    PROTECTED_RESIDENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    protected_resident_blocks: int
    def __init__(self, protected_resident_blocks: _Optional[int] = ...) -> None: ...

class AdmitActiveRequest(_message.Message):
    __slots__ = ("request_id", "active_live_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    active_live_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., active_live_blocks: _Optional[int] = ...) -> None: ...

class AdmitActiveResponse(_message.Message):
    __slots__ = ("decision", "blocking_claim_ids", "blocking_other_tenants", "proof", "demoted_claim_ids", "reason", "retry_after_s")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    BLOCKING_CLAIM_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKING_OTHER_TENANTS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_CLAIM_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    decision: AdmitDecision
    blocking_claim_ids: _containers.RepeatedScalarFieldContainer[str]
    blocking_other_tenants: int
    proof: CapacityProof
    demoted_claim_ids: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    retry_after_s: float
    def __init__(self, decision: _Optional[_Union[AdmitDecision, str]] = ..., blocking_claim_ids: _Optional[_Iterable[str]] = ..., blocking_other_tenants: _Optional[int] = ..., proof: _Optional[_Union[CapacityProof, _Mapping]] = ..., demoted_claim_ids: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("since_seq", "follow")
    SINCE_SEQ_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    since_seq: int
    follow: bool
    def __init__(self, since_seq: _Optional[int] = ..., follow: bool = ...) -> None: ...

class ClaimEvent(_message.Message):
    __slots__ = ("seq", "event", "claim_id", "request_id", "time", "blocking_claim_ids", "proof", "leading_tokens", "predicate_min_tokens", "reason", "gap", "mode")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    CLAIM_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    BLOCKING_CLAIM_IDS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    LEADING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICATE_MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    event: str
    claim_id: str
    request_id: str
    time: float
    blocking_claim_ids: _containers.RepeatedScalarFieldContainer[str]
    proof: CapacityProof
    leading_tokens: int
    predicate_min_tokens: int
    reason: str
    gap: int
    mode: ClaimMode
    def __init__(self, seq: _Optional[int] = ..., event: _Optional[str] = ..., claim_id: _Optional[str] = ..., request_id: _Optional[str] = ..., time: _Optional[float] = ..., blocking_claim_ids: _Optional[_Iterable[str]] = ..., proof: _Optional[_Union[CapacityProof, _Mapping]] = ..., leading_tokens: _Optional[int] = ..., predicate_min_tokens: _Optional[int] = ..., reason: _Optional[str] = ..., gap: _Optional[int] = ..., mode: _Optional[_Union[ClaimMode, str]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("lookup", "candidates")
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    lookup: LookupRequest
    candidates: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lookup: _Optional[_Union[LookupRequest, _Mapping]] = ..., candidates: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicaScore(_message.Message):
    __slots__ = ("replica", "prefix_tokens", "exact_tokens", "shifted_tokens", "prefill_tokens", "saved_tokens", "chunks_hit", "tier_tokens")
    class TierTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXACT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHIFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_HIT_FIELD_NUMBER: _ClassVar[int]
    TIER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    prefix_tokens: int
    exact_tokens: int
    shifted_tokens: int
    prefill_tokens: int
    saved_tokens: int
    chunks_hit: int
    tier_tokens: _containers.ScalarMap[str, int]
    def __init__(self, replica: _Optional[str] = ..., prefix_tokens: _Optional[int] = ..., exact_tokens: _Optional[int] = ..., shifted_tokens: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., saved_tokens: _Optional[int] = ..., chunks_hit: _Optional[int] = ..., tier_tokens: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("total_tokens", "scores", "absent")
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    ABSENT_FIELD_NUMBER: _ClassVar[int]
    total_tokens: int
    scores: _containers.RepeatedCompositeFieldContainer[ReplicaScore]
    absent: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, total_tokens: _Optional[int] = ..., scores: _Optional[_Iterable[_Union[ReplicaScore, _Mapping]]] = ..., absent: _Optional[_Iterable[str]] = ...) -> None: ...
