"""Names of the tiered store: the tier list, keys, chunk metadata, fetch/put results.

Light on purpose (no torch at runtime): the registry, the configuration and the API layer
import the tier list from here.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
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
    """A storage tier, fastest first. Compares (and hashes) equal to its wire value
    (``Tier.CPU == "cpu"``), the name used in config, metrics labels, the API and registry records.

    The one list of tiers: ``TIER_ORDER``, ``TIER_NAMES`` and ``TIER_RANK`` derive from it. The
    order of the members is the demotion order (a chunk evicted from one tier goes to the next
    configured tier after it); a new tier is inserted where it belongs by speed, and its backend
    registered in ``sidecar.tiers.backends.BACKENDS``.
    """

    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"
    REMOTE = "remote"


#: Fastest first; a chunk evicted from tier i is demoted to the next configured tier after it.
TIER_ORDER: tuple[Tier, ...] = tuple(Tier)
#: The tiers' names (``"gpu"``, ...), fastest first: what a request, a config key or a label may say.
TIER_NAMES: tuple[str, ...] = tuple(t.value for t in TIER_ORDER)
#: Position of each tier in ``TIER_ORDER`` (0: fastest); a ``Tier`` or its name both look it up.
TIER_RANK: Mapping[Tier, int] = MappingProxyType({t: i for i, t in enumerate(TIER_ORDER)})


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
    store): decode it with ``sidecar.payload.decode_payload`` and rotate its rotary parts in
    place. ``tier`` is the tier it was served from (before any promotion).
    """

    meta: ChunkMeta
    tier: Tier
    payload: torch.Tensor
