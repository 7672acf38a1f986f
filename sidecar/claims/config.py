"""``claims:`` configuration section (docs/claims.md, "Guard rails")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ClaimsConfig:
    """Per-tenant caps, durations and the event buffer.

    ``max_claims_per_tenant`` / ``max_claimed_bytes_per_tenant`` bound a tenant's live claims
    (None: unlimited bytes); every claim expires (``default_duration_s`` when the request names
    none, at most ``max_duration_s``); ``event_buffer`` events are retained for watchers (a
    watcher further behind is dropped with a counted gap); ``sweep_interval_s`` is how often
    expiry is checked in the background (every claims call also checks it);
    ``defer_retry_s`` is the hint sent with a deferred AdmitActive."""

    max_claims_per_tenant: int = 16_384
    max_claimed_bytes_per_tenant: int | None = None
    max_chunks_per_claim: int = 4096
    default_duration_s: float = 3600.0
    max_duration_s: float = 86_400.0
    event_buffer: int = 4096
    sweep_interval_s: float = 1.0
    defer_retry_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("max_claims_per_tenant", "max_chunks_per_claim", "event_buffer"):
            if getattr(self, name) < 1:
                raise ValueError(f"claims.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_claimed_bytes_per_tenant is not None and self.max_claimed_bytes_per_tenant < 0:
            raise ValueError("claims.max_claimed_bytes_per_tenant must be >= 0 or null")
        for name in ("default_duration_s", "max_duration_s", "sweep_interval_s", "defer_retry_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"claims.{name} must be > 0, got {getattr(self, name)}")
        if self.default_duration_s > self.max_duration_s:
            raise ValueError("claims.default_duration_s must be <= claims.max_duration_s")
