"""What every handler shares: the call's tenant, its stream slot, the status of its error.

``Edge`` is built once by the composition root (``sidecar.app``) and handed to each API area's
handlers in their constructor. ``rpc`` and ``streaming`` wrap a handler so that:

* the tenant is resolved (``Tenancy``) and one of its stream slots taken
  (``limits.max_concurrent_streams``) before the handler runs, and released on every path
  (error, cancellation) by a ``finally``;
* any exception leaves through ``Edge.abort``: ``sidecar.api.status.status_for`` maps it to a
  status (the one map of domain errors to statuses), the call is counted by method and code,
  a broken invariant counts in ``cache_invariant_violations_total`` and INTERNAL is logged.

Handlers are methods named after the RPC on an object with an ``edge`` attribute.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from sidecar.api.kv import FetchRequest, IdentityCache
from sidecar.api.service import METHOD_NAMES
from sidecar.api.splice import FetchSessionRequest
from sidecar.api.status import status_for, trailers_for
from sidecar.errors import InvariantViolation
from sidecar.limits import TenantLimiter
from sidecar.server.metrics import Metrics
from sidecar.server.tenancy import Tenancy
from sidecar.shm import ShmWriter, open_writer

logger = logging.getLogger("sidecar.server")



class Edge:
    """Tenancy, per-tenant limits, the identity cache and the per-method counters of one server."""

    def __init__(self, tenancy: Tenancy, limits: TenantLimiter, metrics: Metrics, *, shared_memory: bool) -> None:
        self.tenancy = tenancy
        self.limits = limits
        self.metrics = metrics
        self.identities = IdentityCache()
        self.shared_memory = shared_memory
        #: per-method children, made for every RPC up front
        self.ok = {m: metrics.requests.labels(m, "OK") for m in METHOD_NAMES}
        self._inflight = {m: metrics.inflight.labels(m) for m in METHOD_NAMES}

    def enter(self, method: str, context: grpc.aio.ServicerContext) -> str:
        """Resolve the call's tenant and take one of its stream slots (refused past the limit)."""
        tenant = self.tenancy.resolve(context)
        self.limits.acquire(tenant)
        self._inflight[method].inc()
        return tenant

    def leave(self, method: str, tenant: str) -> None:
        self._inflight[method].dec()
        self.limits.release(tenant)

    async def abort(self, method: str, exc: Exception, context: grpc.aio.ServicerContext) -> None:
        """End the call with the status ``status_for`` maps ``exc`` to; count it (and any broken
        invariant); log internal errors."""
        code, message = status_for(exc)
        if isinstance(exc, InvariantViolation):
            self.metrics.invariant_violations.inc()
        if code is grpc.StatusCode.INTERNAL:
            logger.exception("%s failed", method)
        self.metrics.requests.labels(method, code.name).inc()
        trailers = trailers_for(exc)
        await context.abort(code, message, trailers)

    def open_shm(self, request: FetchRequest | FetchSessionRequest, context: grpc.aio.ServicerContext
                 ) -> ShmWriter | None:
        """The writer into the caller's shared-memory buffer (sidecar/shm), or None: no buffer
        named, or its payloads go inline (counted by reason)."""
        if not request.HasField("shm"):
            return None
        writer, why = open_writer(request.shm.name, request.shm.token, context.peer(), enabled=self.shared_memory)
        if writer is None:
            self.metrics.shm_fallbacks.labels(why).inc()
        return writer

    def close_shm(self, writer: ShmWriter | None) -> None:
        if writer is None:
            return
        writer.close()
        self.metrics.shm_bytes.inc(writer.bytes)
        if writer.failed or writer.spilled:
            self.metrics.shm_fallbacks.labels("write_failed" if writer.failed else "full").inc()


def rpc(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """A unary or client-streaming handler behind ``Edge``: tenant, stream slot, status map."""
    method = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        edge: Edge = self.edge
        try:
            tenant = edge.enter(method, context)
            try:
                result = await fn(self, request, context)
            finally:
                edge.leave(method, tenant)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error leaves through abort
            await edge.abort(method, exc, context)
        edge.ok[method].inc()
        return result

    return wrapper


def streaming(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """``rpc``'s stream slot for server-streaming handlers (async generators that map their own
    errors through ``Edge.abort`` and count their own success): taken before the first message,
    released when the generator ends, fails, or is closed because the client cancelled."""
    method = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        edge: Edge = self.edge
        try:
            tenant = edge.enter(method, context)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error leaves through abort
            await edge.abort(method, exc, context)
        try:
            async for msg in fn(self, request, context):
                yield msg
        finally:
            edge.leave(method, tenant)

    return wrapper
