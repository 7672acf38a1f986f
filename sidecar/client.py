"""Client SDK: ``SidecarClient`` (asyncio) and ``SyncSidecarClient`` (a thin blocking wrapper).

* Sets the tenant (``x-tenant-id``) and auth (``authorization: Bearer ...``) headers on every
  call.
* Accepts token ids as numpy arrays (any integer dtype), lists, or packed bytes; sends packed
  little-endian uint32.
* Converts gRPC errors to the typed errors of ``sidecar.errors`` at this boundary and retries
  only transient ones (UNAVAILABLE) with jittered exponential backoff; ``CancelledError`` is
  always re-raised; calls that are not idempotent are not retried.

Example::

    async with SidecarClient("127.0.0.1:50051", tenant="team-a") as client:
        ident = CacheIdentity(model_id="llama-3.1-8b")
        plan = await client.lookup(tokens, identity=ident, engine_prefix_len=512)
        await client.store(tokens, identity=ident)
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np

from sidecar.errors import SidecarError, error_for_status
from sidecar.identity import CacheIdentity
from sidecar.registry.plan import AdmissionPolicy, LookupPlan
from sidecar.tenancy import AUTH_HEADER, TENANT_HEADER
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc
from sidecar.wire import POLICY_TO_WIRE, identity_to_wire, plan_from_wire, tokens_to_wire

T = TypeVar("T")
Tokens = "np.ndarray | Sequence[int] | bytes"


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Retries for transient errors only: attempt i sleeps U(0, min(cap, base * 2**i))."""

    attempts: int = 3
    base_s: float = 0.05
    cap_s: float = 1.0

    def backoff(self, attempt: int) -> float:
        return random.uniform(0, min(self.cap_s, self.base_s * (2**attempt)))


@dataclass(frozen=True, slots=True)
class StoreResult:
    chunks_total: int
    chunks_registered: int
    chunks_refreshed: int
    chunks_observed: int


def _lookup_request(
    tokens: Tokens,
    identity: CacheIdentity,
    engine_prefix_len: int = 0,
    policy: AdmissionPolicy | str | None = None,
    left_context_window: int = 0,
    recompute_tokens: int = 0,
    dry_run: bool = False,
) -> pb.LookupRequest:
    return pb.LookupRequest(
        tokens=tokens_to_wire(tokens),
        identity=identity_to_wire(identity),
        engine_prefix_len=engine_prefix_len,
        policy=POLICY_TO_WIRE[AdmissionPolicy(policy)] if policy is not None else pb.ADMISSION_POLICY_UNSPECIFIED,
        left_context_window=left_context_window,
        recompute_tokens=recompute_tokens,
        dry_run=dry_run,
    )


def _store_requests(
    tokens: Tokens, identity: CacheIdentity, register_from: int = 0, shared: bool = False
) -> tuple[pb.StoreRequest, ...]:
    header = pb.StoreHeader(
        tokens=tokens_to_wire(tokens), identity=identity_to_wire(identity), register_from=register_from, shared=shared
    )
    return (pb.StoreRequest(header=header),)


def _store_result(resp: pb.StoreResponse) -> StoreResult:
    return StoreResult(resp.chunks_total, resp.chunks_registered, resp.chunks_refreshed, resp.chunks_observed)


def _headers(tenant: str | None, token: str | None) -> tuple[tuple[str, str], ...]:
    md: list[tuple[str, str]] = []
    if tenant:
        md.append((TENANT_HEADER, tenant))
    if token:
        md.append((AUTH_HEADER, f"Bearer {token}"))
    return tuple(md)


_CHANNEL_OPTIONS = (("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20))


class SidecarClient:
    def __init__(
        self,
        target: str,
        *,
        tenant: str | None = None,
        token: str | None = None,
        timeout_s: float = 10.0,
        retry: RetryPolicy = RetryPolicy(),
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._channel = grpc.aio.insecure_channel(target, options=[*_CHANNEL_OPTIONS, *channel_options])
        self._stub = pb_grpc.KVSidecarStub(self._channel)
        self._metadata = _headers(tenant, token)
        self._timeout = timeout_s
        self._retry = retry

    async def __aenter__(self) -> "SidecarClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    @property
    def stub(self) -> pb_grpc.KVSidecarStub:
        return self._stub

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def _call(self, fn: Callable[[], Awaitable[T]], *, idempotent: bool = True) -> T:
        attempt = 0
        while True:
            try:
                return await fn()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                err = error_for_status(exc.code(), exc.details() or "")
                if not (idempotent and err.transient) or attempt + 1 >= self._retry.attempts:
                    raise err from exc
            await asyncio.sleep(self._retry.backoff(attempt))
            attempt += 1

    async def lookup(
        self,
        tokens: Tokens,
        *,
        identity: CacheIdentity,
        engine_prefix_len: int = 0,
        policy: AdmissionPolicy | str | None = None,
        left_context_window: int = 0,
        recompute_tokens: int = 0,
        dry_run: bool = False,
    ) -> LookupPlan:
        """Plan which parts of ``tokens`` the engine can skip. Idempotent when ``dry_run``;
        otherwise it refreshes recency of the hits it returns (safe to retry)."""
        req = _lookup_request(
            tokens, identity, engine_prefix_len, policy, left_context_window, recompute_tokens, dry_run
        )
        msg = await self._call(lambda: self._stub.Lookup(req, metadata=self._metadata, timeout=self._timeout))
        return plan_from_wire(msg)

    async def store(
        self, tokens: Tokens, *, identity: CacheIdentity, register_from: int = 0, shared: bool = False
    ) -> StoreResult:
        """Register the chunks of ``tokens`` (metadata only). Idempotent: re-registering
        refreshes recency."""
        msgs = _store_requests(tokens, identity, register_from, shared)
        resp = await self._call(lambda: self._stub.Store(iter(msgs), metadata=self._metadata, timeout=self._timeout))
        return _store_result(resp)

    async def stats(self) -> pb.StatsResponse:
        return await self._call(lambda: self._stub.Stats(pb.StatsRequest(), metadata=self._metadata, timeout=self._timeout))

    async def ping(self) -> None:
        await self._call(lambda: self._stub.Ping(pb.PingRequest(), metadata=self._metadata, timeout=self._timeout))


class SyncSidecarClient:
    """Blocking client on grpc's synchronous channel (same requests, errors and retries).

    It does not use asyncio, so it is safe next to an asyncio server in the same process
    (grpc.aio supports one event loop per process).
    """

    def __init__(
        self,
        target: str,
        *,
        tenant: str | None = None,
        token: str | None = None,
        timeout_s: float = 10.0,
        retry: RetryPolicy = RetryPolicy(),
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._channel = grpc.insecure_channel(target, options=[*_CHANNEL_OPTIONS, *channel_options])
        self._stub = pb_grpc.KVSidecarStub(self._channel)
        self._metadata = _headers(tenant, token)
        self._timeout = timeout_s
        self._retry = retry

    def _call(self, fn: Callable[[], T], *, idempotent: bool = True) -> T:
        attempt = 0
        while True:
            try:
                return fn()
            except grpc.RpcError as exc:
                err = error_for_status(exc.code(), exc.details() or "")
                if not (idempotent and err.transient) or attempt + 1 >= self._retry.attempts:
                    raise err from exc
            time.sleep(self._retry.backoff(attempt))
            attempt += 1

    def lookup(self, tokens: Tokens, *, identity: CacheIdentity, **kwargs: Any) -> LookupPlan:
        req = _lookup_request(tokens, identity, **kwargs)
        return plan_from_wire(self._call(lambda: self._stub.Lookup(req, metadata=self._metadata, timeout=self._timeout)))

    def store(
        self, tokens: Tokens, *, identity: CacheIdentity, register_from: int = 0, shared: bool = False
    ) -> StoreResult:
        msgs = _store_requests(tokens, identity, register_from, shared)
        return _store_result(
            self._call(lambda: self._stub.Store(iter(msgs), metadata=self._metadata, timeout=self._timeout))
        )

    def stats(self) -> pb.StatsResponse:
        return self._call(lambda: self._stub.Stats(pb.StatsRequest(), metadata=self._metadata, timeout=self._timeout))

    def ping(self) -> None:
        self._call(lambda: self._stub.Ping(pb.PingRequest(), metadata=self._metadata, timeout=self._timeout))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "SyncSidecarClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["RetryPolicy", "SidecarClient", "SidecarError", "StoreResult", "SyncSidecarClient"]
