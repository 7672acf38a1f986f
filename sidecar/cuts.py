"""Tensor-parallel cuts of a model's KV heads: where a shard sits and which ranks of another cut
hold its heads. A tensor-parallel rank Stores its own KV heads under its own shard name
(``CacheIdentity.shard``: "tp{rank}of{size}", "" unsharded, with ".pp{stage}of{stages}" under
pipeline parallelism); the sidecar serves a chunk stored under one cut to workers of any other
(``sidecar.dataplane.cuts``, docs/vllm.md "Re-sharding"), and engine clients use these to ask for
exactly their share.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from sidecar.identity import CacheIdentity, KVLayout

_TP = re.compile(r"tp(\d+)of(\d+)")


@dataclass(frozen=True, slots=True)
class Cut:
    """Where a shard sits: tensor-parallel ``rank`` of ``size``, and the rest of its shard name
    (the pipeline stage, or "")."""

    rank: int
    size: int
    rest: str

    def shard(self, rank: int | None = None, size: int | None = None) -> str:
        r = self.rank if rank is None else rank
        n = self.size if size is None else size
        return ".".join(([f"tp{r}of{n}"] if n > 1 else []) + ([self.rest] if self.rest else []))


def cut_of(shard: str) -> Cut | None:
    """The cut a shard name describes (None: not a name this module reads)."""
    parts = shard.split(".") if shard else []
    tp = [p for p in parts if _TP.fullmatch(p)]
    rest = [p for p in parts if not _TP.fullmatch(p)]
    if len(tp) > 1 or len(rest) > 1 or (rest and not rest[0].startswith("pp")):
        return None
    if not tp:
        return Cut(0, 1, rest[0] if rest else "")
    rank, size = map(int, _TP.fullmatch(tp[0]).groups())
    if not (size > 1 and 0 <= rank < size):
        return None
    return Cut(rank, size, rest[0] if rest else "")


#: the identity fields two cuts of one model share (``kv_layout`` holds the rank's heads)
MODEL_FIELDS = ("model_id", "weights_hash", "tokenizer_hash", "rope_fingerprint", "block_size", "namespace")


def model_key(identity: CacheIdentity, cut: Cut) -> tuple:
    """What every cut of ``identity``'s model (at ``cut``'s pipeline stage) shares."""
    return tuple(getattr(identity, f) for f in MODEL_FIELDS) + (cut.rest,)


def other_leads(identity: CacheIdentity, identities) -> list[CacheIdentity]:
    """Of ``identities`` (engines' identities: a heartbeat's, this sidecar's), the rank-0 identity
    of each other TP size of ``identity``'s model, smallest size first (rank-0 shards are named
    from any rank's identity: every rank of one size has the same ``kv_layout``)."""
    cut = cut_of(identity.shard)
    if cut is None:
        return []
    key = model_key(identity, cut)
    out: dict[int, CacheIdentity] = {}
    for other in identities:
        c = cut_of(other.shard)
        if c is None or c.size == cut.size or c.size in out or model_key(other, c) != key:
            continue
        out[c.size] = lead_of(other, c)
    return [out[n] for n in sorted(out)]


def lead_of(identity: CacheIdentity, cut: Cut) -> CacheIdentity:
    """The identity of rank 0 of ``identity``'s cut (``cut``: its ``cut_of``): every rank of one
    TP size has the same ``kv_layout``, so only the shard differs."""
    return identity if cut.rank == 0 else replace(identity, shard=cut.shard(0))


def heads_layout(layout: KVLayout, count: int) -> KVLayout:
    """``layout`` with ``count`` KV heads per part."""
    return replace(layout, parts=tuple(replace(p, shape=(count, *p.shape[1:])) for p in layout.parts))


def covering(heads: int, rank: int, size: int, source_size: int) -> list[tuple[int, int, int, int]] | None:
    """Which ranks of a ``source_size``-way cut hold the KV heads of ``rank`` of ``size`` (a
    model of ``heads`` KV heads): ``(source rank, first head there, count, first head here)``
    per source rank, in head order; None when a cut does not divide the heads."""
    if heads % size or heads % source_size:
        return None
    per, src_per = heads // size, heads // source_size
    lo, hi = rank * per, (rank + 1) * per
    out = []
    for s in range(lo // src_per, (hi - 1) // src_per + 1):
        a, b = max(lo, s * src_per), min(hi, (s + 1) * src_per)
        out.append((s, a - s * src_per, b - a, a - lo))
    return out
