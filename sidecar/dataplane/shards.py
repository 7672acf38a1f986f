"""Serving one shard's Fetch from another shard's plan (tensor-parallel ranks, pipeline stages).

Each tensor-parallel rank of an engine holds its own KV heads, each pipeline stage its own
layers, so each Stores its chunks under its own identity (``CacheIdentity.shard``), and keys
never mix. One Lookup, under rank 0 of stage 0, plans for every shard: a shard fetches with its
own identity and names the plan's identity (``FetchRequest.plan_identity``); each planned key is
translated to the key of the chunk with the same tokens in the same scope under the shard's
identity. A chunk key is
``chain(scope_seed, xxh64(chunk tokens, identity salt))``, so the translation needs the planned
entry's tokens (a recovered entry without tokens is a miss) and no second Lookup. A planned copy
of a chunk computed after another left context (``ChunkEntry.base_key``; its key mixes in the
identity-salted prefix digest, which another shard's differs from) translates to the shard's
copy of the same chunk computed at the same position (``copy_at``), the canonical one else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import xxhash

from sidecar.errors import InvalidArgument
from sidecar.identity import CacheIdentity
from sidecar.registry.entry import ChunkEntry, chain_reference

#: the identity fields two shards of one model share (not the KV layout: a pipeline stage holds
#: its own layers, a tensor-parallel rank its own heads; each Fetch names its own layout)
_SHARED_FIELDS = ("model_id", "weights_hash", "tokenizer_hash", "rope_fingerprint", "block_size", "namespace")

#: the key no chunk has: a planned chunk that cannot be translated is a miss
UNKNOWN = 0


def check_shards(identity: CacheIdentity, plan_identity: CacheIdentity) -> None:
    """``plan_identity`` must be another shard of ``identity`` (INVALID_ARGUMENT naming the
    first field that differs)."""
    for name in _SHARED_FIELDS:
        if getattr(identity, name) != getattr(plan_identity, name):
            raise InvalidArgument(f"plan_identity.{name}: differs from identity.{name}; plan_identity must be "
                                  "another shard of the same model")


def translate(hashes: Iterable[int], identity: CacheIdentity, peek: Callable[[int], ChunkEntry | None],
              scopes: tuple[str, ...], copy_at: Callable[[int, int], int] | None = None) -> dict[int, int]:
    """Planned key -> the key of the same tokens' chunk under ``identity`` in the same scope
    (``UNKNOWN`` when the planned chunk is not in ``scopes`` or has no tokens); for a planned
    copy (``base_key``), ``copy_at(that key, the copy's source position)`` (the registry's:
    the shard's copy computed there, if any). Python per distinct chunk, never per token: one
    xxh64 over the chunk's token bytes."""
    out: dict[int, int] = {}
    seeds: dict[str, int] = {}
    for h in hashes:
        if h in out:
            continue
        e = peek(h)
        if e is None or e.scope not in scopes or not e.tokens:
            out[h] = UNKNOWN
            continue
        seed = seeds.get(e.scope)
        if seed is None:
            seed = seeds[e.scope] = int(identity.scope_seed(e.scope))
        key = chain_reference(seed, xxhash.xxh64_intdigest(e.tokens, seed=identity.salt))
        out[h] = copy_at(key, e.source_pos) if e.base_key and copy_at is not None else key
    return out
