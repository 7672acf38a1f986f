"""Domain errors of the tiered store (refusals, not caller mistakes).

Caller mistakes raise ``ValueError``/``TypeError`` naming the offending field (mapped to
INVALID_ARGUMENT at the edge). Refusals raise a ``TierStoreError`` subclass carrying the numbers
an operator needs (mapped to RESOURCE_EXHAUSTED / UNAVAILABLE in the server's single error map).
A refused call leaves the store's contents unchanged.
"""

from __future__ import annotations

from sidecar.tiers.types import Tier


class TierStoreError(Exception):
    """Base class of every refusal raised by ``TieredStore``."""


class QuotaExceededError(TierStoreError):
    """A put would take ``tenant`` over its byte quota (across all tiers of this store)."""

    def __init__(self, *, tenant: str, requested_bytes: int, used_bytes: int, quota_bytes: int) -> None:
        self.tenant = tenant
        self.requested_bytes = requested_bytes
        self.used_bytes = used_bytes
        self.quota_bytes = quota_bytes
        super().__init__(
            f"tenant {tenant!r} quota exceeded: requested {requested_bytes} B, used {used_bytes} B of {quota_bytes} B"
        )


class CapacityError(TierStoreError):
    """No tier could take the chunk without dropping data it must not drop.

    ``tier`` is the tier the chunk was refused from last (``None`` when it fits no tier at all);
    ``pinned_bytes`` are bytes held by in-flight readers that could not be evicted;
    ``guarded_bytes`` bytes that resident claims protect there. Raised
    instead of silently dropping the put (backpressure): the caller may retry later.
    """

    def __init__(
        self,
        *,
        tier: Tier | None,
        requested_bytes: int,
        used_bytes: int,
        capacity_bytes: int,
        pinned_bytes: int = 0,
        reason: str,
        guarded_bytes: int = 0,
    ) -> None:
        self.tier = tier
        self.requested_bytes = requested_bytes
        self.used_bytes = used_bytes
        self.capacity_bytes = capacity_bytes
        self.pinned_bytes = pinned_bytes
        self.reason = reason
        #: Bytes of the tier that resident claims keep from being victims (``Guard``).
        self.guarded_bytes = guarded_bytes
        where = tier.value if tier is not None else "any tier"
        super().__init__(
            f"no room in {where} for {requested_bytes} B ({reason}): used {used_bytes} B of "
            f"{capacity_bytes} B, {pinned_bytes} B pinned by readers"
        )


class TierUnavailableError(TierStoreError):
    """The store is closed, or a backend it needs failed (maps to UNAVAILABLE)."""
