"""Held sessions: a session's tokens -> canonical stored copies -> runs served by FetchSession.

``HeldReads`` (the data plane's ``held``) resolves each token of a held session to its
canonical stored copy (chunk, row, source position) and serves a span of the session's current
layout from those copies, each run rotated ONCE from its canonical source position, so a held
copy never drifts however many edits moved it (docs/splice.md, "Sessions the sidecar holds").
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np
import torch

from sidecar.dataplane.reads import check_layout, check_rope
from sidecar.dataplane.records import DataPlaneCounters, SessionRun
from sidecar.directives.held import HeldKV, HeldRuns, HeldSpan
from sidecar.errors import FailedPrecondition, InvalidArgument
from sidecar.identity import SHARED_SCOPE, CacheIdentity, KVLayout
from sidecar.registry.chunk_index import ChunkIndex, LookupQuery
from sidecar.registry.entry import ChunkEntry, EntryState
from sidecar.registry.lookup_plan import (
    SEG_END,
    SEG_HASH,
    SEG_KIND,
    SEG_OFFSET,
    SEG_SOURCE,
    SEG_START,
    AdmissionPolicy,
    SegmentKind,
)
from sidecar.tiers import TieredStore, chunk_key, decode_payload


class HeldReads:
    def __init__(self, index: ChunkIndex, store: TieredStore, counters: DataPlaneCounters,
                 synced: Callable[[], Awaitable[None]]) -> None:
        self.index = index
        self.store = store
        self.counters = counters
        #: the plane's ``synced``: tier events applied to the registry after each read
        self.synced = synced

    def resolve(
        self, tenant: str, identity: CacheIdentity, tokens: np.ndarray, refs: HeldKV, start: int, end: int
    ) -> HeldKV:
        """The references of a held session with ``[start, end)`` brought up to date (the
        ``sidecar.directives.Resolver`` contract; runs on the event loop, changes nothing else
        than registry recency).

        1. A backed token whose chunk is no longer served (evicted from every tier, deleted,
           or no longer in the tenant's or the shared scope) becomes unbacked; one whose chunk
           was re-Stored elsewhere follows the registry's canonical source position.
        2. Unbacked tokens are looked up exactly as Lookup finds chunks (``ChunkIndex.lookup``
           over the session's whole current sequence: same chunking, own scope then shared,
           token verification, RESIDENT chunks only), with no left-context window and no
           recompute: ``position_independent`` (positions below the carve-out are then only
           backed by chunks computed at their own position), or ``exact`` for tokens marked
           ``exact`` (re-prefilled by a FORGET directive). Backed tokens keep their reference:
           a kept token's canonical copy is never replaced by a copy the engine Stored after
           rotating it.
        """
        reg = self.index.registry
        backed = refs.backed[start:end]
        if backed.any():
            pos = np.flatnonzero(backed) + start
            uniq, inverse = np.unique(refs.chunk_hash[pos], return_inverse=True)
            served = np.zeros(len(uniq), dtype=bool)
            chunk_src = np.zeros(len(uniq), dtype=np.int64)
            for i, h in enumerate(uniq.tolist()):  # per chunk, not per token
                e = reg.peek(h)
                if e is not None and e.state is EntryState.RESIDENT and e.scope in (tenant, SHARED_SCOPE):
                    served[i] = True
                    chunk_src[i] = e.source_pos
            src = chunk_src[inverse] + refs.row[pos]
            moved = served[inverse] & (src != refs.source_pos[pos])
            # a copy computed elsewhere is not an exact copy any more
            ok = served[inverse] & ~(moved & refs.exact[pos])
            moved &= ok
            if moved.any():
                refs = refs.filled(pos[moved], refs.chunk_hash[pos[moved]], refs.row[pos[moved]], src[moved])
            refs = refs.dropped(pos[~ok])
        miss = ~refs.backed[start:end]
        if not miss.any():
            return refs
        data = tokens.astype("<u4", copy=False).tobytes()
        exact = refs.exact[start:end]
        for policy, want in (
            (AdmissionPolicy.POSITION_INDEPENDENT, miss & ~exact),
            (AdmissionPolicy.EXACT, miss & exact),
        ):
            if want.any():
                refs = self._resolve_with(tenant, identity, tokens, data, refs, start + int(np.argmax(want)), policy)
        return refs

    def _resolve_with(
        self,
        tenant: str,
        identity: CacheIdentity,
        tokens: np.ndarray,
        data: bytes,
        refs: HeldKV,
        first: int,
        policy: AdmissionPolicy,
    ) -> HeldKV:
        """Fill the unbacked tokens from ``first`` on whose ``exact`` flag matches ``policy``
        with the chunk hits a Lookup of the session's tokens returns under ``policy``."""
        plan = self.index.lookup(LookupQuery(
            tokens=tokens, data=data, identity=identity, scope=tenant, engine_prefix_len=first, policy=policy,
            left_context_window=0, recompute_tokens=0,
        ))
        hits = plan.table[plan.table[:, SEG_KIND] == SegmentKind.CHUNK_HIT]
        if not len(hits):
            return refs
        seg_start = hits[:, SEG_START].astype(np.int64)
        lengths = hits[:, SEG_END].astype(np.int64) - seg_start
        # One entry per token of every hit segment: its position, chunk, row and source.
        rel = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        pos = np.repeat(seg_start, lengths) + rel
        want = ~refs.backed[pos] & (refs.exact[pos] == (policy is AdmissionPolicy.EXACT))
        pos, rel = pos[want], rel[want]
        each = np.repeat(np.arange(len(hits)), lengths)[want]
        return refs.filled(
            pos,
            hits[each, SEG_HASH],
            hits[each, SEG_OFFSET].astype(np.int64) + rel,
            hits[each, SEG_SOURCE].astype(np.int64) + rel,
        )

    async def fetch(self, span: HeldSpan, layout: KVLayout, rope, raw: bool) -> list[SessionRun]:
        """The KV of ``span`` (a held session's range, every position backed): per run, its
        rows gathered from the run's canonical chunk and its rotary parts rotated ONCE by the
        run's ``delta`` (session position - canonical source position), unless ``raw``.

        Each chunk is read once, however many runs use it. A chunk whose bytes are gone since
        the span was resolved raises ``FailedPrecondition`` naming the positions (the registry
        learns the loss, so the next call resolves them again). Nothing is changed except tier
        promotions and that."""
        identity = span.identity
        check_layout(identity, layout)
        runs = span.runs
        deltas = runs.delta
        if not raw and deltas.any():
            if rope is None:
                raise InvalidArgument("rope: required to rotate the session's shifted rows (or set raw)")
            check_rope(identity, layout, rope)
        reg = self.index.registry
        hashes = list(dict.fromkeys(runs.chunk_hash.tolist()))  # each chunk once, in first-use order
        entries = [reg.peek(h) for h in hashes]
        fetched = await asyncio.to_thread(self.store.get_many, [chunk_key(h) for h in hashes]) if hashes else []
        chunks: dict[int, tuple[ChunkEntry, torch.Tensor, str]] = {}
        for h, e, got in zip(hashes, entries, fetched):
            if e is not None and got is not None and got.meta.num_tokens == e.num_tokens and (
                got.meta.layout_fingerprint == layout.fingerprint()
            ) and got.meta.scope == e.scope:
                chunks[h] = (e, got.payload, got.tier.value)
        await self.synced()
        for i, h in enumerate(runs.chunk_hash.tolist()):
            if h not in chunks:
                a = int(runs.target_pos[i])
                raise FailedPrecondition(
                    f"session {span.session_id}: positions [{a}, {a + int(runs.num_tokens[i])}) lost their stored KV "
                    f"(chunk {h:016x} is no longer held); Store them again"
                )
        out = await asyncio.to_thread(_gather_runs, runs, chunks, layout, rope, raw, self.counters)
        self.counters.fetched_bytes += sum(r.payload.numel() for r in out)
        return out


def _gather_runs(
    runs: HeldRuns, chunks: dict, layout: KVLayout, rope, raw: bool, counters: DataPlaneCounters
) -> list[SessionRun]:
    """Copy each run's rows out of its chunk into a payload of its own, rotating the rotary
    parts on the way (``rotate_keys`` reads the canonical rows and writes the run's buffer:
    one pass, one rounding). Runs in a worker thread."""
    import time

    from sidecar.rotation import rotate_keys

    seconds = 0.0
    rotated_bytes = 0
    views = {h: decode_payload(payload, layout, e.num_tokens) for h, (e, payload, _) in chunks.items()}
    out: list[SessionRun] = []
    per_token = layout.bytes_per_token
    cols = zip(runs.target_pos.tolist(), runs.num_tokens.tolist(), runs.chunk_hash.tolist(), runs.row.tolist(),
               runs.source_pos.tolist())
    for i, (target, n, h, row, src) in enumerate(cols):
        delta = target - src
        rotate = bool(delta) and not raw
        buf = torch.empty(n * per_token, dtype=torch.uint8)
        dst = decode_payload(buf, layout, n)
        for s_part, d_part in zip(views[h].parts, dst.parts):
            rows = s_part.tensor[row : row + n]
            if rotate and s_part.rotary:
                t0 = time.perf_counter()
                rotate_keys(rows, delta, rope, out=d_part.tensor)
                seconds += time.perf_counter() - t0
                rotated_bytes += d_part.tensor.numel() * d_part.tensor.element_size()
            else:
                d_part.tensor.copy_(rows)
        dst.write_back()
        out.append(SessionRun(
            index=i, target_pos=target, num_tokens=n, chunk_hash=h, chunk_offset=row, source_pos=src, delta=delta,
            rotated=rotate, tier=chunks[h][2], payload=buf,
        ))
    counters.rotated_bytes += rotated_bytes
    counters.rotation_seconds += seconds
    return out
