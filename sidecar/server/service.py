"""The KVSidecar service on a grpc.aio server, registered from the service descriptor.

Every method the proto declares is bound to the handler of the same name on one of the API
areas' handler objects (``kv``, ``sessions``, ``claims``, ``manifests``); a method without a
handler, or with two, fails at startup, not at its first call. Compared with the generated
``add_KVSidecarServicer_to_server``:

* undecodable request bytes, and requests past a ``wire`` limit, become INVALID_ARGUMENT
  (counted, no handler runs) instead of gRPC's UNKNOWN / INTERNAL and an ERROR log record;
* the serializers of Fetch and FetchSession accept pre-encoded frames (``sidecar.api.frames``),
  so multi-MiB payload parts are copied once, not three times;
* Store's deserializer reads payload parts in place (``sidecar.api.store_frames``): the handler
  gets each part's data as a view of the received message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc

from sidecar.api.frames import serialize_fetch
from sidecar.api.kv import RequestLimits
from sidecar.api.service import METHODS, SERVICE_NAME, Method
from sidecar.api.store_frames import StorePart, parse_store_request
from sidecar.errors import InvalidArgument
from sidecar.server.edge import Edge

#: Streaming methods whose responses are pre-serialized frames (``sidecar.api.frames``).
_FRAMED = frozenset(("Fetch", "FetchSession"))
#: Methods whose requests are decoded by hand: Store's payload parts are read in place
#: (``sidecar.api.store_frames``), not copied by a protobuf parse and a field read.
_DECODERS = {"Store": parse_store_request}
_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class _Undecodable:
    """A request message that is not valid protobuf of its type, or is past a ``wire`` limit
    (the deserializer never raises: gRPC would answer UNKNOWN / INTERNAL and log an ERROR
    record for a client's bad bytes)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(cls: type, limits: RequestLimits, decode: Callable[[bytes], Any] | None = None) -> Callable[[bytes], Any]:
    """``cls``'s request deserializer (``decode``: another parser of ``cls``'s wire format)."""
    decode = decode or cls.FromString

    def parse(data: bytes) -> Any:
        try:
            msg = decode(data)
        except InvalidArgument as exc:  # the decoder named the field (a Store part cut short)
            return _Undecodable(str(exc))
        except Exception as exc:  # noqa: BLE001 - DecodeError and friends: the client's bytes
            return _Undecodable(f"request: not a valid {cls.DESCRIPTOR.full_name} message ({type(exc).__name__})")
        if type(msg) is StorePart:
            return msg  # no string or repeated field to bound
        # String / repeated field bounds (wire.*), refused like undecodable bytes: before any
        # handler sees (or caches) the oversized value.
        err = limits.error(msg)
        return msg if err is None else _Undecodable(err)

    return parse


def _checked(edge: Edge, name: str, behaviour: Callable, client_streaming: bool, server_streaming: bool) -> Callable:
    """``behaviour`` behind a check for undecodable messages: INVALID_ARGUMENT, counted, nothing run."""
    rejected = edge.metrics.requests.labels(name, "INVALID_ARGUMENT")

    async def refuse(context: grpc.aio.ServicerContext, bad: _Undecodable) -> None:
        rejected.inc()
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad.error)

    if client_streaming:  # Store: each message checked as it arrives; the handler's own error path applies
        async def messages(it: AsyncIterator[Any]) -> AsyncIterator[Any]:
            async for msg in it:
                if isinstance(msg, _Undecodable):
                    raise InvalidArgument(msg.error)
                yield msg

        async def stream_in(request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            return await behaviour(messages(request_iterator), context)

        return stream_in
    if server_streaming:
        async def stream_out(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await refuse(context, request)
            async for msg in behaviour(request, context):
                yield msg

        return stream_out

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await refuse(context, request)
        return await behaviour(request, context)

    return unary


def bind(areas: Iterable[object], methods: tuple[Method, ...] = METHODS) -> dict[str, Callable]:
    """Method name -> handler, for every method of the service. Raises ``TypeError`` naming the
    method when one has no handler among ``areas`` or more than one."""
    areas = tuple(areas)
    bound = {}
    for m in methods:
        found = [getattr(a, m.name) for a in areas if callable(getattr(a, m.name, None))]
        if len(found) != 1:
            owners = [type(a).__name__ for a in areas if callable(getattr(a, m.name, None))]
            raise TypeError(f"{m.path}: expected one handler, found {owners or 'none'}")
        bound[m.name] = found[0]
    return bound


def add_service(server: grpc.aio.Server, edge: Edge, areas: Iterable[object], limits: RequestLimits,
                methods: tuple[Method, ...] = METHODS, service_name: str = SERVICE_NAME) -> None:
    """Register the KVSidecar service (or another, ``methods`` of ``service_name``) on
    ``server`` with the handlers ``bind`` finds."""
    handlers = {}
    bound = bind(areas, methods)
    for m in methods:
        kind = (m.client_streaming, m.server_streaming)
        handlers[m.name] = _KINDS[kind](
            _checked(edge, m.name, bound[m.name], *kind),
            request_deserializer=_lenient(m.request, limits, _DECODERS.get(m.name)),
            response_serializer=serialize_fetch if m.name in _FRAMED else m.response.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
