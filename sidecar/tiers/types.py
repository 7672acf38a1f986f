"""Names of the tiered store: tiers, keys, chunk metadata, fetch/put results."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, NewType

if TYPE_CHECKING:  # the names here are imported by light modules (config, wire); torch is not
    import torch

#: Store key of one chunk: opaque bytes (1..64), already salted with identity and scope by the
#: registry. ``chunk_key(h)`` turns the registry's 64-bit ``ChunkHash`` into one.
ChunkKey = NewType("ChunkKey", bytes)

MAX_KEY_BYTES = 64


def chunk_key(chunk_hash: int) -> ChunkKey:
    """The store key of a registry ``ChunkHash`` (unsigned 64-bit, big-endian bytes)."""
    return ChunkKey(int(chunk_hash).to_bytes(8, "big", signed=False))


class Tier(str, enum.Enum):
    """A storage tier, fastest first. Compares equal to its wire value (``Tier.CPU == "cpu"``)."""

    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"
    REMOTE = "remote"


#: Fastest first; a chunk evicted from tier i is demoted to the next configured tier after it.
TIER_ORDER: tuple[Tier, ...] = (Tier.GPU, Tier.CPU, Tier.DISK, Tier.REMOTE)


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkMeta:
    """What the store keeps next to every payload (and in every disk file and remote object).

    ``payload_nbytes`` is the KV payload size (``layout.bytes_per_token * num_tokens``), not the
    stored object size. ``checksum`` is the xxh3-64 of the payload, set by the store on put.
    ``source_position`` is the token position the payload was computed at (payloads are stored
    unrotated, at their source position). ``aux`` is opaque registry-owned bytes (<= 1 KiB), for
    example a second digest of the chunk's tokens to verify hits after a restart.
    """

    key: ChunkKey
    tenant: str
    scope: str
    layout_fingerprint: str
    num_tokens: int
    payload_nbytes: int
    source_position: int = 0
    aux: bytes = b""
    checksum: int = 0
    created_at: float = 0.0


@dataclass(frozen=True, slots=True)
class PutResult:
    """Outcome of ``TieredStore.put``.

    ``stored`` is False when the key was already present (puts are idempotent per key: the first
    complete put wins and later ones change nothing). ``tier`` is where the chunk lives now.
    ``published`` says whether a remote copy exists after the call.
    """

    key: ChunkKey
    tier: Tier
    stored: bool
    published: bool


@dataclass(frozen=True, slots=True)
class FetchedChunk:
    """One chunk served by ``TieredStore.get_many``.

    ``payload`` is a 1-D ``torch.uint8`` CPU tensor the caller owns (writable, not shared with the
    store): decode it with ``sidecar.tiers.codec.decode_payload`` and rotate its rotary parts in
    place. ``tier`` is the tier it was served from (before any promotion).
    """

    meta: ChunkMeta
    tier: Tier
    payload: torch.Tensor
