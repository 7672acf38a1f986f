"""Client SDK: ``SidecarClient`` (asyncio) and ``SyncSidecarClient`` (blocking), both run from
one RPC table (``rpcs``). ``sidecar.client`` is the public path; this package is its layout.

* ``rpcs``: the table, each RPC once: request builder (``sidecar.api``), response converter,
  retry safety, how it streams.
* ``aio`` / ``sync``: the two transports that run the table (``grpc.aio`` / blocking grpc).
* ``channel``: channel, stub, headers, TLS, retry policy, shared-memory buffers, the one
  gRPC-failure -> typed-error conversion.
* ``fetch``: Fetch / FetchSession answers assembled into ``FetchedKV`` / ``FetchedRun``.
* ``results``: the typed answers (frozen dataclasses).
* ``policy``: the Policy SDK (an agent's history rewrite -> span directives).
* ``kit``: the engine-client kit (fail-soft link, plan -> loadable runs, payload views).

Both clients set the tenant and auth headers on every call, accept token ids as numpy arrays
(any integer dtype), lists or packed bytes, convert gRPC errors to the typed errors of
``sidecar.errors`` and retry only transient ones (UNAVAILABLE) of idempotent calls, with
jittered exponential backoff.
"""

from sidecar.sdk.aio import SidecarClient
from sidecar.sdk.channel import RetryPolicy
from sidecar.sdk.results import (
    AdmitActiveResult,
    ClaimDecision,
    ClaimInfo,
    FetchedKV,
    FetchedRun,
    ImportResult,
    RegistryCounters,
    ReportPoolResult,
    SidecarStats,
    StoreResult,
    TierCounters,
    WarmUpEngine,
    WarmUpResult,
    WatchedEvent,
)
from sidecar.sdk.rpcs import RPCS, Kind, KVSidecarRpcs, Rpc
from sidecar.sdk.sync import SyncSidecarClient

__all__ = [
    "RPCS",
    "AdmitActiveResult",
    "ClaimDecision",
    "ClaimInfo",
    "FetchedKV",
    "FetchedRun",
    "ImportResult",
    "KVSidecarRpcs",
    "Kind",
    "RegistryCounters",
    "ReportPoolResult",
    "RetryPolicy",
    "Rpc",
    "SidecarClient",
    "SidecarStats",
    "StoreResult",
    "SyncSidecarClient",
    "TierCounters",
    "WarmUpEngine",
    "WarmUpResult",
    "WatchedEvent",
]
