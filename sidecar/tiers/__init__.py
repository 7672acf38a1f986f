"""Tiered chunk-KV store on LMCache (placeholder docstring, replaced below)."""

from sidecar.tiers.codec import (
    KVPayloadView,
    PartView,
    as_byte_tensor,
    decode_payload,
    encode_payload,
    payload_nbytes,
    rotary_views,
)
from sidecar.tiers.config import RemoteEndpoint, StoreConfig, TenantQuota
from sidecar.tiers.errors import CapacityError, QuotaExceededError, TierStoreError, TierUnavailableError
from sidecar.tiers.events import EventKind, Reason, TierEvent
from sidecar.tiers.stats import StoreStats, TierStats
from sidecar.tiers.store import TieredStore
from sidecar.tiers.types import ChunkKey, ChunkMeta, FetchedChunk, PutResult, Tier, chunk_key

__all__ = [
    "CapacityError",
    "ChunkKey",
    "ChunkMeta",
    "EventKind",
    "FetchedChunk",
    "KVPayloadView",
    "PartView",
    "PutResult",
    "QuotaExceededError",
    "Reason",
    "RemoteEndpoint",
    "StoreConfig",
    "StoreStats",
    "TenantQuota",
    "Tier",
    "TierEvent",
    "TierStats",
    "TierStoreError",
    "TierUnavailableError",
    "TieredStore",
    "as_byte_tensor",
    "chunk_key",
    "decode_payload",
    "encode_payload",
    "payload_nbytes",
    "rotary_views",
]
