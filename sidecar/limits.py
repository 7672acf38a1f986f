"""Per-tenant limits: tokens per request, concurrent streams, sessions, bytes (per tier), and
the tenant's ``forget_by_default`` for edits.

``limits:`` in the configuration holds the defaults; ``limits.tenants.<id>`` overrides any of
them for one tenant (an unset field inherits the default)::

    limits:
      max_tokens_per_request: 32768    # Lookup / Store / OpenSession / AppendSession tokens
      max_concurrent_streams: 64       # RPCs of one tenant in flight at once
      max_sessions: 256                # open Splice sessions (default directives.max_sessions_per_tenant)
      max_bytes: 8589934592            # chunk payload bytes across all tiers
      max_bytes_per_tier: {cpu: 1073741824}
      forget_by_default: false         # plan every edit as forget (content must leave the cache)
      tenants:
        clinic: {max_concurrent_streams: 8, forget_by_default: true}

Every refusal is ``ResourceExhausted`` whose message starts with the limit's dotted name
(``limits.max_tokens_per_request: 40000 > 32768 for tenant 'a'``) and the call changes
nothing. ``max_bytes`` / ``max_bytes_per_tier`` become the tier store's tenant quotas
(``sidecar.tiers.TenantQuota``): a Store past ``max_bytes`` is refused; a tenant's share of
a tier (``max_bytes_per_tier``) is made by demoting the tenant's own least recently used
chunks to a slower tier, and a Store is refused only when no tier can take the chunk.
``directives.forget_tenants`` remains an alias: those tenants' ``forget_by_default`` is true.

``TenantLimiter`` is the runtime side: O(1) per call (a dict probe, a counter), used from the
server's event loop thread only.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Protocol

from sidecar.errors import ResourceExhausted
from sidecar.tiers import StoreConfig, TenantQuota, Tier
from sidecar.tiers.config import UNLIMITED

_COUNTS = ("max_tokens_per_request", "max_concurrent_streams", "max_sessions", "max_bytes")


def _check_counts(obj: object, prefix: str) -> None:
    for name in _COUNTS:
        value = getattr(obj, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{prefix}{name} must be an integer or null, got {value!r}")
        if value < (0 if name == "max_bytes" else 1):
            raise ValueError(f"{prefix}{name} must be >= {0 if name == 'max_bytes' else 1}, got {value}")
    tiers: dict[str, int] = {}
    for tier, limit in dict(obj.max_bytes_per_tier).items():
        try:
            name = Tier(tier).value
        except ValueError:
            raise ValueError(
                f"{prefix}max_bytes_per_tier: unknown tier {tier!r} (one of {[t.value for t in Tier]})"
            ) from None
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"{prefix}max_bytes_per_tier.{name} must be an integer >= 0, got {limit!r}")
        tiers[name] = limit
    object.__setattr__(obj, "max_bytes_per_tier", MappingProxyType(tiers))


@dataclass(frozen=True, kw_only=True)
class TenantLimits:
    """One tenant's overrides; None (or a tier absent from ``max_bytes_per_tier``) inherits."""

    max_tokens_per_request: int | None = None
    max_concurrent_streams: int | None = None
    max_sessions: int | None = None
    max_bytes: int | None = None
    max_bytes_per_tier: Mapping[str, int] = field(default_factory=dict)
    forget_by_default: bool | None = None

    def __post_init__(self) -> None:
        _check_counts(self, "limits.tenants.<id>.")


@dataclass(frozen=True, kw_only=True)
class LimitsConfig:
    """Defaults for every tenant plus per-tenant overrides (see the module docstring).
    None means unlimited, except ``max_sessions`` (None: ``directives.max_sessions_per_tenant``)."""

    max_tokens_per_request: int | None = None
    max_concurrent_streams: int | None = None
    max_sessions: int | None = None
    max_bytes: int | None = None
    max_bytes_per_tier: Mapping[str, int] = field(default_factory=dict)
    forget_by_default: bool = False
    tenants: Mapping[str, TenantLimits] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_counts(self, "limits.")
        tenants = {}
        for tenant, lim in dict(self.tenants).items():
            if not isinstance(tenant, str) or not tenant:
                raise ValueError(f"limits.tenants: tenant ids must be non-empty strings, got {tenant!r}")
            if not isinstance(lim, TenantLimits):
                raise TypeError(f"limits.tenants.{tenant} must be a TenantLimits")
            tenants[tenant] = lim
        object.__setattr__(self, "tenants", MappingProxyType(tenants))

    # ------------------------------------------------------------------ derived settings

    def check(self, *, store: StoreConfig, forget_tenants: tuple[str, ...]) -> None:
        """Cross-section checks: the same setting must not be made twice, differently."""
        for t in forget_tenants:
            lim = self.tenants.get(t)
            if lim is not None and lim.forget_by_default is False:
                raise ValueError(
                    f"limits.tenants.{t}.forget_by_default: false contradicts directives.forget_tenants "
                    f"(which lists {t!r}); set it in one place"
                )
        if self._bytes_set(self) and store.default_quota != UNLIMITED:
            raise ValueError("limits.max_bytes / max_bytes_per_tier and store.default_quota are both set; use one")
        for t, lim in self.tenants.items():
            if self._bytes_set(lim) and t in store.tenant_quotas:
                raise ValueError(
                    f"limits.tenants.{t} byte limits and store.tenant_quotas.{t} are both set; use one"
                )

    @staticmethod
    def _bytes_set(lim: "LimitsConfig | TenantLimits") -> bool:
        return lim.max_bytes is not None or bool(lim.max_bytes_per_tier)

    def _quota(self, lim: TenantLimits | None) -> TenantQuota:
        per_tier = dict(self.max_bytes_per_tier)
        max_bytes = self.max_bytes
        if lim is not None:
            per_tier.update(lim.max_bytes_per_tier)
            if lim.max_bytes is not None:
                max_bytes = lim.max_bytes
        return TenantQuota(max_bytes=max_bytes, max_bytes_per_tier=per_tier)

    def store_config(self, store: StoreConfig) -> StoreConfig:
        """``store`` with the byte limits applied as tenant quotas (unchanged when none are set)."""
        if not self._bytes_set(self) and not any(self._bytes_set(lim) for lim in self.tenants.values()):
            return store
        quotas = dict(store.tenant_quotas)
        default = self._quota(None) if self._bytes_set(self) else store.default_quota
        for t, lim in self.tenants.items():
            if self._bytes_set(lim) or self._bytes_set(self):
                quotas[t] = self._quota(lim)
        return replace(store, tenant_quotas=quotas, default_quota=default)

    def session_ceiling(self, default_sessions: int) -> int:
        """The session table's global per-tenant limit: the largest any tenant may reach (the
        server enforces each tenant's own limit before the table does)."""
        values = [default_sessions, self.max_sessions or 0]
        values += [lim.max_sessions or 0 for lim in self.tenants.values()]
        return max(values)


@dataclass(frozen=True, slots=True)
class EffectiveLimits:
    """One tenant's limits after inheritance (None: unlimited)."""

    max_tokens_per_request: int | None
    max_concurrent_streams: int | None
    max_sessions: int
    forget_by_default: bool


class SessionCounter(Protocol):
    def sessions_of(self, tenant: str) -> int: ...

    def expire(self) -> object: ...


class TenantLimiter:
    """Enforces ``LimitsConfig`` per call (see the module docstring).

    Not thread-safe: the grpc.aio servicer calls it from its event loop only. Limits of tenants
    not named in ``limits.tenants`` are one shared object, so no state grows with the number of
    distinct tenant ids a client may send; the in-flight counter drops a tenant at zero."""

    def __init__(self, config: LimitsConfig, *, default_sessions: int, forget_tenants: tuple[str, ...] = ()) -> None:
        self.config = config
        forget = frozenset(forget_tenants)

        def effective(lim: TenantLimits | None, forced: bool) -> EffectiveLimits:
            def pick(name: str):
                own = getattr(lim, name) if lim is not None else None
                return own if own is not None else getattr(config, name)

            sessions = pick("max_sessions")
            return EffectiveLimits(
                max_tokens_per_request=pick("max_tokens_per_request"),
                max_concurrent_streams=pick("max_concurrent_streams"),
                max_sessions=sessions if sessions is not None else default_sessions,
                forget_by_default=forced or bool(pick("forget_by_default")),
            )

        self._default = effective(None, False)
        self._tenants = {t: effective(config.tenants.get(t), t in forget) for t in {*config.tenants, *forget}}
        self._inflight: Counter[str] = Counter()
        self._idle: dict[str, list[asyncio.Future]] = {}

    def of(self, tenant: str) -> EffectiveLimits:
        return self._tenants.get(tenant, self._default)

    def forget_by_default(self, tenant: str) -> bool:
        return self.of(tenant).forget_by_default

    # ------------------------------------------------------------------ per request

    def check_tokens(self, tenant: str, n: int) -> None:
        cap = self.of(tenant).max_tokens_per_request
        if cap is not None and n > cap:
            raise ResourceExhausted(f"limits.max_tokens_per_request: {n} > {cap} for tenant {tenant!r}")

    def check_sessions(self, tenant: str, table: SessionCounter) -> None:
        """Refuse opening one more session past the tenant's ``max_sessions`` (idle sessions
        past their TTL are expired first and do not count)."""
        cap = self.of(tenant).max_sessions
        if table.sessions_of(tenant) >= cap:
            table.expire()
            n = table.sessions_of(tenant)
            if n >= cap:
                raise ResourceExhausted(
                    f"limits.max_sessions: tenant {tenant!r} has {n} open sessions, the limit is {cap}; "
                    "close sessions or let idle ones expire"
                )

    # ------------------------------------------------------------------ concurrent streams

    def acquire(self, tenant: str) -> None:
        """Take one of the tenant's stream slots; pair with exactly one ``release``."""
        cap = self.of(tenant).max_concurrent_streams
        n = self._inflight[tenant]
        if cap is not None and n >= cap:
            if not n:
                del self._inflight[tenant]
            raise ResourceExhausted(
                f"limits.max_concurrent_streams: {n} calls in flight for tenant {tenant!r}, the limit is {cap}"
            )
        self._inflight[tenant] = n + 1

    def release(self, tenant: str) -> None:
        n = self._inflight[tenant] - 1
        assert n >= 0, f"stream slot of tenant {tenant!r} released twice: a bug in the servicer's try/finally"
        if n:
            self._inflight[tenant] = n
            return
        del self._inflight[tenant]
        for fut in self._idle.pop(tenant, ()):
            if not fut.done():
                fut.set_result(None)

    def inflight(self, tenant: str) -> int:
        return self._inflight.get(tenant, 0)

    async def wait_idle(self, tenant: str) -> None:
        """Return once ``tenant`` has no call in flight (drain, tests)."""
        if not self._inflight.get(tenant):
            return
        fut = asyncio.get_running_loop().create_future()
        self._idle.setdefault(tenant, []).append(fut)
        await fut
