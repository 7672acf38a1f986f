"""Typed configuration of the tiered store (no environment reads; the CLI builds it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from urllib.parse import urlsplit

from sidecar.tiers.types import Tier

MiB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class TenantQuota:
    """Byte limits of one tenant in one store.

    ``max_bytes`` bounds the tenant's chunks across all tiers (a chunk counts once, by payload
    size, wherever it lives): a put past it is refused with ``QuotaExceededError``.
    ``max_bytes_per_tier`` bounds the tenant's share of a tier (stored object bytes): past it the
    tenant's own least recently used chunks in that tier are demoted to make room, so one tenant
    cannot flush another tenant's chunks out of a fast tier. ``None``/absent means unlimited.
    """

    max_bytes: int | None = None
    max_bytes_per_tier: Mapping[Tier, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_bytes is not None and self.max_bytes < 0:
            raise ValueError("tenant_quota.max_bytes must be >= 0")
        per_tier = {}
        for tier, limit in dict(self.max_bytes_per_tier).items():
            tier = Tier(tier)
            if int(limit) < 0:
                raise ValueError(f"tenant_quota.max_bytes_per_tier[{tier.value}] must be >= 0")
            per_tier[tier] = int(limit)
        object.__setattr__(self, "max_bytes_per_tier", MappingProxyType(per_tier))


UNLIMITED = TenantQuota()


@dataclass(frozen=True, kw_only=True)
class RemoteEndpoint:
    """A RESP (Redis/Valkey) endpoint parsed from ``redis://[user[:password]@]host:port[/db]``."""

    host: str
    port: int
    username: str = ""
    password: str = ""
    db: int = 0

    @classmethod
    def parse(cls, url: str) -> RemoteEndpoint:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "valkey"):
            raise ValueError(f"remote_url must be redis://host:port, got scheme {parts.scheme!r}")
        if not parts.hostname or not parts.port:
            raise ValueError(f"remote_url must name a host and a port, got {url!r}")
        db = parts.path.strip("/") or "0"
        if not db.isdigit():
            raise ValueError(f"remote_url: the path must be a database number, got {parts.path!r}")
        return cls(
            host=parts.hostname,
            port=int(parts.port),
            username=parts.username or "",
            password=parts.password or "",
            db=int(db),
        )


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Tiers, capacities and policies of one ``TieredStore``.

    A tier with capacity 0 (or no path/url) is disabled; at least one tier must be enabled.
    Capacities are bytes of stored objects (payload plus a 4 KiB header; the CPU tier also counts
    its allocator alignment). ``gpu_bytes`` needs a CUDA device at ``gpu_device``; without CUDA
    the GPU tier is skipped with a warning (``gpu_device="cpu"`` runs the same device-pool code on
    host memory, for tests). One store owns ``disk_path`` exclusively (a lock file enforces it).
    ``pin_wait_s`` is how long a write waits for readers to unpin chunks it must move before
    refusing with ``CapacityError``; ``io_timeout_s`` bounds every disk/remote call.
    """

    namespace: str = "kvsidecar"
    gpu_bytes: int = 0
    gpu_device: str = "cuda"
    cpu_bytes: int = 256 * MiB
    cpu_align_bytes: int = 4096
    #: the CPU pool in POSIX shared memory that engines on this host map (``sidecar.shm.pool``);
    #: private when /dev/shm has no room for it (logged)
    cpu_shared: bool = True
    disk_path: str | None = None
    disk_bytes: int = 0
    disk_workers: int = 2
    remote_url: str | None = None
    remote_bytes: int = 0
    remote_workers: int = 2
    tenant_quotas: Mapping[str, TenantQuota] = field(default_factory=dict)
    default_quota: TenantQuota = UNLIMITED
    promote_on_hit: bool = True
    verify_memory_reads: bool = True
    io_timeout_s: float = 5.0
    pin_wait_s: float = 0.5
    close_timeout_s: float = 5.0
    max_events: int = 65536

    def __post_init__(self) -> None:
        if not self.namespace or any(c in self.namespace for c in "@/\\\x00"):
            raise ValueError("store.namespace must be non-empty without '@', '/', '\\' or NUL")
        for name in ("gpu_bytes", "cpu_bytes", "disk_bytes", "remote_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"store.{name} must be >= 0")
        align = self.cpu_align_bytes
        if align < 64 or align & (align - 1):
            raise ValueError("store.cpu_align_bytes must be a power of two >= 64")
        if self.disk_bytes > 0 and not self.disk_path:
            raise ValueError("store.disk_path is required when store.disk_bytes > 0")
        if self.remote_bytes > 0 and not self.remote_url:
            raise ValueError("store.remote_url is required when store.remote_bytes > 0")
        if self.remote_url:
            RemoteEndpoint.parse(self.remote_url)
        for name in ("disk_workers", "remote_workers", "max_events"):
            if getattr(self, name) <= 0:
                raise ValueError(f"store.{name} must be > 0")
        if self.pin_wait_s < 0:
            raise ValueError("store.pin_wait_s must be >= 0")
        for name in ("io_timeout_s", "close_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"store.{name} must be > 0")
        if not any((self.gpu_bytes, self.cpu_bytes, self.disk_bytes, self.remote_bytes)):
            raise ValueError("store: at least one of gpu/cpu/disk/remote _bytes must be > 0")
        quotas = {}
        for tenant, quota in dict(self.tenant_quotas).items():
            if not isinstance(quota, TenantQuota):
                raise TypeError(f"store.tenant_quotas[{tenant!r}] must be a TenantQuota")
            quotas[str(tenant)] = quota
        object.__setattr__(self, "tenant_quotas", MappingProxyType(quotas))

    def quota_for(self, tenant: str) -> TenantQuota:
        return self.tenant_quotas.get(tenant, self.default_quota)

    def capacity(self, tier: Tier) -> int:
        return {
            Tier.GPU: self.gpu_bytes,
            Tier.CPU: self.cpu_bytes,
            Tier.DISK: self.disk_bytes,
            Tier.REMOTE: self.remote_bytes,
        }[tier]
