"""Plain counters of the tiered store; the Prometheus exporter reads snapshots at the edge."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from sidecar.tiers.events import Reason
from sidecar.tiers.types import Tier


@dataclass(frozen=True, kw_only=True, slots=True)
class TierStats:
    """One tier at one instant. Bytes are stored-object bytes (header + payload, CPU aligned)."""

    tier: Tier
    capacity_bytes: int
    used_bytes: int
    objects: int
    hits: int
    misses: int
    promotions_in: int
    demotions_in: int
    evictions: int
    read_bytes: int
    write_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreStats:
    """Snapshot of ``TieredStore`` counters (monotonic except the gauges in ``tiers``)."""

    tiers: Mapping[Tier, TierStats]
    puts: int
    put_bytes: int
    duplicate_puts: int
    gets: int
    get_bytes: int
    hits: int
    misses: int
    promotions: int
    demotions: int
    evictions_by_reason: Mapping[Reason, int]
    losses_by_reason: Mapping[Reason, int]
    checksum_failures: int
    quota_refusals: int
    capacity_refusals: int
    io_errors: int
    events_dropped: int
    recovered_chunks: int
    remote_reconnects: int


@dataclass
class _TierCounters:
    hits: int = 0
    misses: int = 0
    promotions_in: int = 0
    demotions_in: int = 0
    evictions: int = 0
    read_bytes: int = 0
    write_bytes: int = 0


@dataclass
class Counters:
    """Mutable counters; the store mutates them under its index lock."""

    tiers: dict[Tier, _TierCounters] = field(default_factory=lambda: {t: _TierCounters() for t in Tier})
    puts: int = 0
    put_bytes: int = 0
    duplicate_puts: int = 0
    gets: int = 0
    get_bytes: int = 0
    hits: int = 0
    misses: int = 0
    promotions: int = 0
    demotions: int = 0
    evictions: Counter = field(default_factory=Counter)
    losses: Counter = field(default_factory=Counter)
    checksum_failures: int = 0
    quota_refusals: int = 0
    capacity_refusals: int = 0
    io_errors: int = 0
    recovered_chunks: int = 0

    def snapshot(
        self,
        *,
        capacity: Mapping[Tier, int],
        used: Mapping[Tier, int],
        objects: Mapping[Tier, int],
        events_dropped: int,
        remote_reconnects: int,
    ) -> StoreStats:
        tiers = {
            tier: TierStats(
                tier=tier,
                capacity_bytes=capacity[tier],
                used_bytes=used[tier],
                objects=objects[tier],
                hits=c.hits,
                misses=c.misses,
                promotions_in=c.promotions_in,
                demotions_in=c.demotions_in,
                evictions=c.evictions,
                read_bytes=c.read_bytes,
                write_bytes=c.write_bytes,
            )
            for tier, c in self.tiers.items()
            if tier in capacity
        }
        return StoreStats(
            tiers=MappingProxyType(tiers),
            puts=self.puts,
            put_bytes=self.put_bytes,
            duplicate_puts=self.duplicate_puts,
            gets=self.gets,
            get_bytes=self.get_bytes,
            hits=self.hits,
            misses=self.misses,
            promotions=self.promotions,
            demotions=self.demotions,
            evictions_by_reason=MappingProxyType(dict(self.evictions)),
            losses_by_reason=MappingProxyType(dict(self.losses)),
            checksum_failures=self.checksum_failures,
            quota_refusals=self.quota_refusals,
            capacity_refusals=self.capacity_refusals,
            io_errors=self.io_errors,
            events_dropped=events_dropped,
            recovered_chunks=self.recovered_chunks,
            remote_reconnects=remote_reconnects,
        )
