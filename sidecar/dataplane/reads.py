"""Chunk reads: registry entries (scope-checked) -> tier reads in bounded windows -> rotated payloads.

``ChunkReads`` reads plain per-chunk Fetch items for the data plane (``fetch_query`` builds a
Fetch's answers on it): it reads the plane's ``index`` and ``store``, counts into its
``counters`` and calls its ``synced`` after reading. Results stream item by item: every
validation error and the ``max_fetch_bytes`` refusal come with the first result; a chunk
shared by several items is read once and kept only while needed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import torch

from sidecar.dataplane.records import DataPlaneCounters, FetchResult
from sidecar.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from sidecar.identity import SHARED_SCOPE, CacheIdentity, KVLayout
from sidecar.registry.chunk_index import ChunkIndex
from sidecar.registry.entry import ChunkEntry, EntryState
from sidecar.tiers import FetchedChunk, Tier, TieredStore, chunk_key

#: Fetch reads chunks in windows of about this many payload bytes (not all items at once)
_FETCH_WINDOW_BYTES = 32 << 20
#: Fetch windows with at most this many rotary-part bytes rotate on the event loop thread, not
#: in a worker (a 128-token DeepSeek-V2-Lite chunk has 0.4 MiB of k_pe: ~0.06 ms of kernel)
_INLINE_ROTATION_BYTES = 1 << 20


class ChunkReads:
    def __init__(self, index: ChunkIndex, store: TieredStore, counters: DataPlaneCounters,
                 synced: Callable[[], Awaitable[None]]) -> None:
        self.index = index
        self.store = store
        self.counters = counters
        #: the plane's ``synced``: tier events applied to the registry after each read
        self.synced = synced

    async def stream(
        self,
        tenant: str,
        identity: CacheIdentity,
        layout: KVLayout,
        rope,  # RopeSpec | None
        items: Sequence[tuple[int, int]],
        raw: bool,
        max_bytes: int | None = None,
    ) -> AsyncIterator[FetchResult]:
        """Payloads for ``items`` in order, rotated to their target positions unless ``raw``,
        yielded one item at a time.

        An item whose chunk is unknown, belongs to another scope, or whose bytes are gone is a
        miss (``payload`` None). Nothing is changed except tier promotions (the Lookup that
        planned these hits already refreshed their registry recency and hit counts).

        Memory: chunks are read in windows of about ``_FETCH_WINDOW_BYTES``, the next window
        while the current one is answered (at most two in memory); a chunk named by
        several items is read once and kept only until its last item (one rotated copy per
        distinct delta), so 4,096 copies of one chunk cost one read, not 4,096. Results that
        share a chunk and delta share their payload: callers must not write to it.
        ``max_bytes``: the answered payload bytes (every hit item counted) may not exceed it,
        checked before anything is read (ResourceExhausted naming ``max_fetch_bytes``).
        Validation errors are raised before the first result."""
        check_layout(identity, layout)
        reg = self.index.registry
        per_token = layout.bytes_per_token
        entries: dict[int, ChunkEntry] = {}
        plan: list[tuple[int, ChunkEntry | None, int]] = []  # (hash, entry or None, delta) per item
        total = 0
        shifted = False
        for h, target in items:
            e = entries.get(h)
            if e is None:
                e = reg.peek(h)
                if e is None or e.state is not EntryState.RESIDENT or e.scope not in (tenant, SHARED_SCOPE):
                    plan.append((h, None, 0))
                    continue
                entries[h] = e
            delta = target - e.source_pos
            shifted = shifted or bool(delta)
            total += e.num_tokens * per_token
            plan.append((h, e, delta))
        if shifted and not raw:
            if rope is None:
                raise InvalidArgument("rope: required to rotate shifted chunks (or set raw)")
            check_rope(identity, layout, rope)
        check_fetch_bytes(total, max_bytes)
        # Uses left of each chunk (raw payload) and of each (chunk, delta) (its rotated copy).
        left: dict[int, int] = {}
        left_rot: dict[tuple[int, int], int] = {}
        for h, e, delta in plan:
            if e is not None:
                left[h] = left.get(h, 0) + 1
                if delta and not raw:
                    left_rot[(h, delta)] = left_rot.get((h, delta), 0) + 1
        held: dict[int, FetchedChunk | None] = {}  # chunks read, kept until their last item
        rotated: dict[tuple[int, int], torch.Tensor] = {}
        counters = self.counters
        # Windows: items until the chunks still to read reach the window size; each chunk is
        # read in the first window that names it and held until its last item.
        windows: list[tuple[int, int, list[int]]] = []
        seen: set[int] = set()
        i = 0
        while i < len(plan):
            j, want, size = i, [], 0
            while j < len(plan) and (j == i or size < _FETCH_WINDOW_BYTES):
                h, e, _ = plan[j]
                if e is not None and h not in seen:
                    seen.add(h)
                    want.append(h)
                    size += e.num_tokens * per_token
                j += 1
            windows.append((i, j, want))
            i = j

        def read(want: list[int]) -> asyncio.Future | None:
            if not want:
                return None
            return asyncio.ensure_future(asyncio.to_thread(self.store.get_many, [chunk_key(h) for h in want]))

        # The next window is read while this one is sent (two windows in memory at most): a
        # remote tier's round trips overlap the stream instead of adding to it.
        pending = read(windows[0][2]) if windows else None
        try:
            for w, (i, j, want) in enumerate(windows):
                got = await pending if pending is not None else []
                pending = read(windows[w + 1][2]) if w + 1 < len(windows) else None
                for h, g in zip(want, got):
                    held[h] = self._checked_chunk(entries[h], g, layout)
                window: list[FetchResult] = []
                to_rotate: list[FetchResult] = []
                raw_here: set[int] = set()  # chunks whose raw payload an item of this window holds
                for k in range(i, j):
                    h, e, delta = plan[k]
                    r = FetchResult(index=k)
                    window.append(r)
                    g = held.get(h) if e is not None else None
                    if g is not None:
                        r.entry, r.delta, r.tier = e, delta, g.tier.value
                        if delta and not raw:
                            r.rotated = True
                            copy = rotated.get((h, delta))
                            if copy is None:
                                # In place when no other use of the raw payload is left, and no
                                # earlier item of this window (not yet sent) holds it raw.
                                own = left[h] == left_rot[(h, delta)] and h not in raw_here
                                copy = rotated[(h, delta)] = g.payload if own else g.payload.clone()
                                r.payload = copy
                                to_rotate.append(r)
                            r.payload = copy
                        else:
                            r.payload = g.payload
                            raw_here.add(h)
                    if e is not None:
                        left[h] -= 1
                        if not left[h]:
                            held.pop(h, None)
                        if delta and not raw:
                            left_rot[(h, delta)] -= 1
                            if not left_rot[(h, delta)]:
                                rotated.pop((h, delta), None)
                if to_rotate:
                    rotary = sum(p.bytes_per_token for p in layout.parts if p.rotary) * layout.num_layers
                    if sum(r.entry.num_tokens for r in to_rotate) * rotary <= _INLINE_ROTATION_BYTES:
                        # ~0.1 ms of kernel work: less than the worker-thread hop would cost
                        counters.rotated_bytes += _rotate_all(to_rotate, layout, rope, counters)
                    else:
                        counters.rotated_bytes += await asyncio.to_thread(_rotate_all, to_rotate, layout, rope, counters)
                for r in window:
                    if r.payload is None:
                        counters.fetch_misses += 1
                    else:
                        counters.fetched_chunks += 1
                        counters.fetched_bytes += r.payload.numel()
                    yield r
        finally:
            if pending is not None:  # the caller stopped early: the read in flight ends first
                await asyncio.wait([pending])
            await self.synced()

    def _checked_chunk(self, e: ChunkEntry, got: FetchedChunk | None, layout: KVLayout) -> FetchedChunk | None:
        """``got`` if it is the entry's chunk as the caller's layout reads it, else None (a miss)."""
        # got.meta.scope: the bytes must have been stored under the entry's scope (a 64-bit key
        # collision across scopes must not serve one tenant's KV to another).
        if got is None or got.meta.num_tokens != e.num_tokens or got.meta.layout_fingerprint != layout.fingerprint() \
                or got.meta.scope != e.scope:
            if got is None and e.tier == Tier.REMOTE.value and not self.store.contains(chunk_key(e.key)):
                # A peer's chunk (shared registry) whose remote copy is gone: stop planning it.
                self.index.registry.set_state(e, EntryState.OBSERVED, None)
            return None
        return got


def check_layout(identity: CacheIdentity, layout: KVLayout) -> None:
    fp = layout.fingerprint()
    if identity.kv_layout != fp:
        raise FailedPrecondition(
            f"identity.kv_layout: {identity.kv_layout!r} does not match the layout's fingerprint {fp!r} "
            "(payloads are only stored and served under an identity that names their layout)"
        )


def check_fetch_bytes(total: int, max_bytes: int | None) -> None:
    """A Fetch (or lease) whose hits hold ``total`` payload bytes, against ``max_fetch_bytes``
    (None: unbounded): RESOURCE_EXHAUSTED naming it, checked before anything is read."""
    if max_bytes is not None and total > max_bytes:
        raise ResourceExhausted(
            f"max_fetch_bytes: the hits of this Fetch hold {total} payload bytes, more than {max_bytes}; "
            "split it into smaller Fetches"
        )


def check_rope(identity: CacheIdentity, layout: KVLayout, rope) -> None:
    if identity.rope_fingerprint and identity.rope_fingerprint != rope.fingerprint:
        raise FailedPrecondition(
            f"identity.rope_fingerprint: {identity.rope_fingerprint!r} does not match rope's fingerprint {rope.fingerprint!r}"
        )
    for part in layout.parts:
        if part.rotary and part.shape[-1] != rope.key_dim:
            raise InvalidArgument(
                f"rope.key_dim: {rope.key_dim} does not match the last dim {part.shape[-1]} of rotary part {part.name!r}"
            )


def _rotate_all(results: list[FetchResult], layout: KVLayout, rope, counters: DataPlaneCounters) -> int:
    """Rotate the rotary parts of each fetched payload in place by its delta (fp32 math): one
    batched kernel call over every chunk and layer of the window (``rotate_payloads_``)."""
    from sidecar.rotation import rotate_payloads_

    done = rotate_payloads_([(r.payload, r.entry.num_tokens, r.delta) for r in results], layout, rope)
    counters.rotation_seconds += done.seconds
    return done.rotated_bytes


