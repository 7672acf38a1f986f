"""Placement: where every chunk is, how full each tier is, and the pure decisions over that.

No I/O and no locks: ``TieredStore`` holds its index lock around every call and moves the
bytes itself (``sidecar.tiers.tier_io``). This is the part of the store that can be tested
with plain numbers (``tests/tiers/test_placement.py``), the way vLLM keeps ``BlockPool``
(bookkeeping) apart from ``KVCacheManager`` (what to do with it).

Accounting, in stored-object footprint bytes per tier (``used``) and per (tenant, tier)
(``tenant_used``), plus payload bytes per tenant across tiers (``tenant_bytes``, what
``TenantQuota.max_bytes`` bounds)::

    reserve(tier)  ─ bytes a write in flight will need: counted in ``used`` before the write
        │            starts, so concurrent writers never overcommit a tier
        ├─ attach(e, tier, reserved=True)   the write landed: the copy joins the tier's LRU
        └─ release(tier)                    the write failed: the bytes are given back
    attach(e, tier) / detach(e, tier)       a copy enters / leaves a tier (recency: LRU order)

Victim selection (``pick_victim``) walks a tier's LRU from the cold end and skips chunks that
are busy (being read or moved) or guarded (resident claims, ``Guard``).
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar.tiers.config import TenantQuota
from sidecar.tiers.errors import QuotaExceededError
from sidecar.tiers.types import ChunkKey, ChunkMeta, Tier


@dataclass(slots=True, eq=False)
class Entry:
    """One chunk: at most one local copy (GPU, CPU or disk) plus optionally a remote copy.
    ``readers``: read pins per tier; ``moving``: a writer is copying it (not a victim meanwhile)."""

    meta: ChunkMeta
    obj_nbytes: int
    local: Tier | None = None
    remote: bool = False
    readers: dict[Tier, int] = field(default_factory=dict)
    moving: bool = False
    leases: int = 0  # of the CPU readers, those that are shared-pool leases (``store_pool``)

    @property
    def key(self) -> ChunkKey:
        return self.meta.key

    @property
    def tenant(self) -> str:
        return self.meta.tenant

    def tiers(self) -> frozenset[Tier]:
        held = {self.local} if self.local is not None else set()
        if self.remote:
            held.add(Tier.REMOTE)
        return frozenset(held)

    def fastest(self) -> Tier | None:
        return self.local if self.local is not None else (Tier.REMOTE if self.remote else None)

    def busy(self, tier: Tier) -> bool:
        return self.moving or tier in self.readers


class Guard(enum.IntEnum):
    """How a claimed chunk may be chosen as a victim: ``SOFT`` gets a second chance (skipped
    once), ``NO_DROP`` may be demoted but never dropped from the last tier, ``HOLD`` is never
    moved."""

    NONE = 0
    SOFT = 1
    NO_DROP = 2
    HOLD = 3


class Placement:
    """The index of one store (see the module docstring). ``footprint(tier, obj_nbytes)`` is
    what an object takes in a tier (allocator alignment included); ``quota_for(tenant)`` the
    tenant's limits."""

    def __init__(
        self,
        chain: tuple[Tier, ...],
        capacity: dict[Tier, int],
        footprint: Callable[[Tier, int], int],
        quota_for: Callable[[str], TenantQuota],
    ) -> None:
        self.chain = chain
        self.capacity = dict(capacity)
        self.footprint = footprint
        self.quota_for = quota_for
        self.entries: dict[ChunkKey, Entry] = {}
        self.used = {t: 0 for t in chain}
        self.lru: dict[Tier, OrderedDict[ChunkKey, Entry]] = {t: OrderedDict() for t in chain}
        self.tenant_lru: dict[tuple[str, Tier], OrderedDict[ChunkKey, Entry]] = {}
        self.tenant_used: Counter[tuple[str, Tier]] = Counter()
        self.tenant_bytes: Counter[str] = Counter()
        self.guards: dict[ChunkKey, Guard] = {}
        self.second_chance: set[ChunkKey] = set()  # SOFT chunks already given their extra lap
        # Footprint of HOLD / NO_DROP chunks per tier, kept up to date by attach, detach and
        # set_guard, so the guarded share of a full tier is O(1) on every Store.
        self.guard_fp: dict[Guard, Counter[Tier]] = {Guard.HOLD: Counter(), Guard.NO_DROP: Counter()}

    # ------------------------------------------------------------------ bookkeeping

    def add(self, e: Entry, *, quota_reserved: bool = False) -> None:
        """Index a new chunk (no copy yet); its payload counts against its tenant from now on
        (already counted when ``quota_reserved`` by ``reserve_quota``)."""
        assert e.key not in self.entries, f"{e.key.hex()} indexed twice; this indicates a placement bug"
        self.entries[e.key] = e
        if not quota_reserved:
            self.tenant_bytes[e.tenant] += e.meta.payload_nbytes

    def forget(self, e: Entry) -> None:
        """Drop ``e`` from the index (its copies must be detached first)."""
        if self.entries.get(e.key) is e:
            del self.entries[e.key]
            self.release_quota(e.tenant, e.meta.payload_nbytes)

    def load(self, tier: Tier, entries: list[Entry]) -> None:
        """``add`` + ``attach`` of many new chunks to ``tier`` at once, oldest first (recovery:
        one pass, no per-chunk guard or share checks beyond the bookkeeping; the byte counts
        are summed per tenant and added once)."""
        lru = self.lru[tier]
        index = self.entries
        known = len(index)
        footprints: dict[int, int] = {}  # by object size: a tier's objects come in a few sizes
        tenants: dict[str, tuple[OrderedDict[ChunkKey, Entry], list[int]]] = {}  # LRU, [footprint, payload]
        guards = self.guards
        for e in entries:
            assert e.local is None, f"{e.key.hex()} loaded while placed; placement bug"
            meta = e.meta
            key = meta.key
            fp = footprints.get(e.obj_nbytes)
            if fp is None:
                fp = footprints[e.obj_nbytes] = self.footprint(tier, e.obj_nbytes)
            e.local = tier
            index[key] = e
            lru[key] = e
            t = tenants.get(meta.tenant)
            if t is None:
                t = tenants[meta.tenant] = (self.tenant_lru.setdefault((meta.tenant, tier), OrderedDict()), [0, 0])
            t[0][key] = e
            sums = t[1]
            sums[0] += fp
            sums[1] += meta.payload_nbytes
            if guards:
                g = self.guard_fp.get(guards.get(key, Guard.NONE))
                if g is not None:
                    g[tier] += fp
        assert len(index) == known + len(entries), "a chunk was loaded twice; placement bug"
        for tenant, (_, (fp, nbytes)) in tenants.items():
            self.used[tier] += fp
            self.tenant_used[(tenant, tier)] += fp
            self.tenant_bytes[tenant] += nbytes

    def reserve_quota(self, tenant: str, nbytes: int) -> None:
        """Count ``nbytes`` of a new chunk against ``tenant`` before it is written; raises
        ``QuotaExceededError`` (nothing counted) past ``max_bytes``."""
        limit = self.quota_for(tenant).max_bytes
        used = self.tenant_bytes[tenant]
        if limit is not None and used + nbytes > limit:
            raise QuotaExceededError(tenant=tenant, requested_bytes=nbytes, used_bytes=used, quota_bytes=limit)
        self.tenant_bytes[tenant] += nbytes

    def release_quota(self, tenant: str, nbytes: int) -> None:
        self.tenant_bytes[tenant] -= nbytes
        if not self.tenant_bytes[tenant]:
            del self.tenant_bytes[tenant]

    def reserve(self, tier: Tier, tenant: str, fp: int) -> None:
        """Count ``fp`` bytes in ``tier`` for a write in flight (see ``fits``)."""
        self.used[tier] += fp
        self.tenant_used[(tenant, tier)] += fp

    def release(self, tier: Tier, tenant: str, fp: int) -> None:
        """Give back a reservation whose write did not land."""
        self.used[tier] -= fp
        self.tenant_used[(tenant, tier)] -= fp

    def attach(self, e: Entry, tier: Tier, *, reserved: bool = False) -> None:
        """Record a copy of ``e`` in ``tier`` (most recently used); ``reserved``: its bytes were
        counted by ``reserve`` when the write started."""
        if tier == Tier.REMOTE:
            assert not e.remote, f"{e.key.hex()} already has a remote copy; placement bug"
            e.remote = True
        else:
            assert e.local is None, f"{e.key.hex()} already has a local copy in {e.local}; placement bug"
            e.local = tier
        fp = self.footprint(tier, e.obj_nbytes)
        self.lru[tier][e.key] = e
        self.tenant_lru.setdefault((e.tenant, tier), OrderedDict())[e.key] = e
        if not reserved:
            self.reserve(tier, e.tenant, fp)
        if self.guards:
            g = self.guard_fp.get(self.guards.get(e.key, Guard.NONE))
            if g is not None:
                g[tier] += fp

    def detach(self, e: Entry, tier: Tier) -> None:
        """Forget the copy of ``e`` in ``tier`` (the bytes are removed separately)."""
        if tier == Tier.REMOTE:
            e.remote = False
        else:
            assert e.local == tier, f"{e.key.hex()} is in {e.local}, not {tier}; placement bug"
            e.local = None
        fp = self.footprint(tier, e.obj_nbytes)
        if self.guards:
            g = self.guard_fp.get(self.guards.get(e.key, Guard.NONE))
            if g is not None:
                g[tier] -= fp
        del self.lru[tier][e.key]
        lru = self.tenant_lru[(e.tenant, tier)]
        del lru[e.key]
        if not lru:
            del self.tenant_lru[(e.tenant, tier)]
        self.release(tier, e.tenant, fp)

    def touch(self, e: Entry, tier: Tier) -> None:
        if self.second_chance:
            self.second_chance.discard(e.key)
        self.lru[tier].move_to_end(e.key)
        self.tenant_lru[(e.tenant, tier)].move_to_end(e.key)

    def set_guard(self, key: ChunkKey, g: Guard) -> None:
        e = self.entries.get(key)
        if e is not None:
            self._account_guard(e, -1)
        if g:
            self.guards[key] = Guard(g)
        else:
            self.guards.pop(key, None)
        self.second_chance.discard(key)
        if e is not None:
            self._account_guard(e, +1)

    def _account_guard(self, e: Entry, sign: int) -> None:
        fp = self.guard_fp.get(self.guards.get(e.key, Guard.NONE))
        if fp is None:
            return
        for tier in e.tiers():
            fp[tier] += sign * self.footprint(tier, e.obj_nbytes)

    # ------------------------------------------------------------------ decisions

    def share(self, tenant: str, tier: Tier) -> int | None:
        return self.quota_for(tenant).max_bytes_per_tier.get(tier)

    def could_hold(self, tier: Tier, fp: int, tenant: str) -> bool:
        """Whether ``fp`` bytes fit ``tier`` (and the tenant's share of it) at all, empty."""
        share = self.share(tenant, tier)
        return fp <= self.capacity[tier] and (share is None or fp <= share)

    def over(self, tier: Tier, fp: int, tenant: str) -> tuple[bool, bool]:
        """(over the tenant's share, over the tier's capacity) if ``fp`` more bytes went in now."""
        share = self.share(tenant, tier)
        over_share = share is not None and self.tenant_used[(tenant, tier)] + fp > share
        return over_share, self.used[tier] + fp > self.capacity[tier]

    def fits(self, tier: Tier, fp: int, tenant: str) -> bool:
        return not any(self.over(tier, fp, tenant))

    def may_take(self, e: Entry, tier: Tier, *, final: bool = False) -> bool:
        """Whether victim selection may move ``e`` out of ``tier`` (its guard allows it).
        ``final``: a planning question (could it be taken at all), where SOFT counts as
        takeable; otherwise a SOFT chunk is takeable once it used its second chance."""
        g = self.guards.get(e.key)
        if not g:
            return True
        if g is Guard.HOLD:
            return False
        if g is Guard.NO_DROP:
            return tier != self.chain[-1]  # demotion keeps it restorable; the last tier would drop it
        return final or e.key in self.second_chance

    def pick_victim(self, tier: Tier, tenant: str | None) -> Entry | None:
        """The least recently used chunk of ``tier`` (of ``tenant``'s, when given) that may be
        moved out now; SOFT-guarded chunks passed over get one more lap (CLOCK-style)."""
        lru = self.lru[tier] if tenant is None else self.tenant_lru.get((tenant, tier), {})
        victim = None
        lapped: list[Entry] = []
        for e in lru.values():
            if e.busy(tier):
                continue
            if self.may_take(e, tier):
                victim = e
                break
            if self.guards.get(e.key) is Guard.SOFT:
                lapped.append(e)
        for e in lapped:
            self.second_chance.add(e.key)
            self.lru[tier].move_to_end(e.key)
            self.tenant_lru[(e.tenant, tier)].move_to_end(e.key)
        return victim if victim is not None or not lapped else self.pick_victim(tier, tenant)

    def reclaimable(self, tier: Tier, fp: int, tenant: str) -> bool:
        """Whether moving unpinned, unguarded chunks out (LRU first) could make ``fp`` bytes of
        room in ``tier`` and in the tenant's share of it."""
        deficit = self.used[tier] + fp - self.capacity[tier]
        share = self.share(tenant, tier)
        tenant_deficit = self.tenant_used[(tenant, tier)] + fp - share if share is not None else 0
        if deficit > 0:
            for e in self.lru[tier].values():
                if not e.busy(tier) and self.may_take(e, tier, final=True):
                    deficit -= self.footprint(tier, e.obj_nbytes)
                    if deficit <= 0:
                        break
        if tenant_deficit > 0:
            for e in self.tenant_lru.get((tenant, tier), {}).values():
                if not e.busy(tier) and self.may_take(e, tier, final=True):
                    tenant_deficit -= self.footprint(tier, e.obj_nbytes)
                    if tenant_deficit <= 0:
                        break
        return deficit <= 0 and tenant_deficit <= 0

    def candidates(self, obj_nbytes: int, tenant: str) -> list[Tier]:
        """Tiers a new object may go to, fastest first: it fits the tier (and the tenant's
        share) and enough unpinned bytes could be moved out of the way."""
        out = []
        for tier in self.chain:
            fp = self.footprint(tier, obj_nbytes)
            if self.could_hold(tier, fp, tenant) and self.reclaimable(tier, fp, tenant):
                out.append(tier)
        return out

    def first_tier_that_holds(self, obj_nbytes: int) -> Tier | None:
        """The fastest tier an object of this size fits at all (what a refusal names)."""
        return next((t for t in self.chain if self.footprint(t, obj_nbytes) <= self.capacity[t]), None)

    def lower(self, tier: Tier) -> tuple[Tier, ...]:
        """Tiers a chunk demoted out of ``tier`` may go to, in order."""
        return self.chain[self.chain.index(tier) + 1:]

    def guarded_bytes(self, tier: Tier) -> int:
        """Footprint in ``tier`` that victim selection may never take (HOLD anywhere, NO_DROP
        in the last tier). O(1)."""
        held = self.guard_fp[Guard.HOLD][tier]
        return held + self.guard_fp[Guard.NO_DROP][tier] if tier == self.chain[-1] else held

    def pinned_bytes(self, tier: Tier) -> int:
        return sum(self.footprint(tier, e.obj_nbytes) for e in self.lru[tier].values() if e.busy(tier))

    def room(self, need: int) -> tuple[int, int, int] | None:
        """None when ``need`` more bytes fit the tiers' free space; otherwise (capacity, used,
        guarded) over all tiers."""
        cap = sum(self.capacity.values())
        used = sum(self.used.values())
        if used + need <= cap:
            return None
        return cap, used, sum(self.guarded_bytes(t) for t in self.chain)
