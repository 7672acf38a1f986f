"""What both clients share below the RPC table: the channel, the stub, headers, the deadline,
the retry policy, the shared-memory buffers of Fetch calls, and the one conversion of a gRPC
failure to a typed error (``sidecar.errors``, through ``sidecar.api.status``). ``sidecar.sdk.aio``
and ``sidecar.sdk.sync`` choose the channel kind and run the table's entries over it.

This is the SDK's one importer of the generated stub class (``sidecar.v1``): the wire
messages themselves are built and read in ``sidecar.api``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import methodcaller
from typing import Any

import grpc

from sidecar.api.frames import FETCH_METHOD, FETCH_SESSION_METHOD, parse_fetch_frame
from sidecar.api.kv import AUTH_HEADER, TENANT_HEADER, StoreResponse
from sidecar.api.service import Stub
from sidecar.api.status import error_for_status
from sidecar.api.store_frames import STORE_METHOD, serialize_store
from sidecar.errors import SidecarError
from sidecar.sdk.fetch import FetchAssembler, FrameCall
from sidecar.shm import SHM_DIR, SegmentPool, local_target


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Retries for transient errors only: attempt i sleeps U(0, min(cap, base * 2**i)) seconds
    (full jitter); ``attempts`` counts the first try."""

    attempts: int = 3
    base_s: float = 0.05
    cap_s: float = 1.0

    def backoff(self, attempt: int) -> float:
        return random.uniform(0, min(self.cap_s, self.base_s * (2**attempt)))


def rpc_error(exc: grpc.RpcError) -> SidecarError:
    """The typed error for a failed call, with the proof a claim refusal carries in its
    trailing metadata."""
    try:
        trailers = tuple(exc.trailing_metadata() or ())
    except Exception:  # noqa: BLE001 - some transport errors have none
        trailers = ()
    return error_for_status(exc.code(), exc.details() or "", trailers)


def headers(tenant: str | None, token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata: the tenant (``x-tenant-id``) and the bearer token, when given."""
    md: list[tuple[str, str]] = []
    if tenant:
        md.append((TENANT_HEADER, tenant))
    if token:
        md.append((AUTH_HEADER, f"Bearer {token}"))
    return tuple(md)


_CHANNEL_OPTIONS = (("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20))
_serialize = methodcaller("SerializeToString")


class ClientBase:
    """Channel, stub, headers, timeout and retry policy shared by both clients; subclasses
    choose the channel kind (``grpc.aio`` or synchronous).

    TLS (docs/operations.md, "TLS and mTLS"): ``tls=True`` or any of ``root_ca`` (PEM bytes or
    a file path; None: the system roots), ``client_cert`` + ``client_key`` (mTLS) opens a
    ``grpc.ssl_channel_credentials`` channel; otherwise the channel is plaintext.

    Shared memory (docs/operations.md, "Shared-memory Fetch"): with ``shared_memory`` (None: on
    when ``target`` is loopback or a unix socket and /dev/shm exists) Fetch and FetchSession
    payloads arrive through buffers in /dev/shm (``shared_memory_bytes`` to start with, grown up
    to ``shared_memory_max_bytes`` when a call did not fit) instead of the stream. Such a
    payload is a view of a buffer lent to that call; the buffer is reused once every payload
    of the call has been dropped, so keep a payload only while you need it. ``close()`` removes
    the buffers' names."""

    _open_channel: Callable[..., Any]
    _open_secure_channel: Callable[..., Any]

    def __init__(
        self,
        target: str,
        *,
        tenant: str | None = None,
        token: str | None = None,
        timeout_s: float = 10.0,
        retry: RetryPolicy = RetryPolicy(),
        channel_options: Sequence[tuple[str, Any]] = (),
        tls: bool = False,
        root_ca: str | bytes | None = None,
        client_cert: str | bytes | None = None,
        client_key: str | bytes | None = None,
        shared_memory: bool | None = None,
        shared_memory_bytes: int = 64 << 20,
        shared_memory_max_bytes: int = 1 << 30,
    ) -> None:
        options = [*_CHANNEL_OPTIONS, *channel_options]
        if shared_memory is None:  # on for a sidecar on this host
            shared_memory = local_target(target) and os.path.isdir(SHM_DIR)
        self._shm = SegmentPool(size=shared_memory_bytes, max_bytes=shared_memory_max_bytes) if shared_memory else None
        if tls or root_ca is not None or client_cert is not None or client_key is not None:
            from sidecar.auth.tls import channel_credentials

            creds = channel_credentials(root_ca, client_cert, client_key)
            self._channel = type(self)._open_secure_channel(target, creds, options=options)
        else:
            self._channel = type(self)._open_channel(target, options=options)
        self._stub = Stub(self._channel)
        # Fetch answers are decoded in place (sidecar.api.frames), not by a protobuf parse.
        self._fetch = self._channel.unary_stream(
            FETCH_METHOD, request_serializer=_serialize, response_deserializer=parse_fetch_frame
        )
        self._fetch_session = self._channel.unary_stream(
            FETCH_SESSION_METHOD, request_serializer=_serialize, response_deserializer=parse_fetch_frame
        )
        self._frame_calls = {"Fetch": self._fetch, "FetchSession": self._fetch_session}
        # Store streams wire frames (sidecar.api.store_frames): each payload part copied once.
        self._stream_calls = {"Store": self._channel.stream_unary(
            STORE_METHOD, request_serializer=serialize_store, response_deserializer=StoreResponse.FromString
        )}
        self._metadata = headers(tenant, token)
        self._timeout = timeout_s
        self._retry = retry

    @property
    def stub(self) -> Stub:
        """The generated stub on this client's channel (raw messages: no conversion, no
        retries); send ``metadata`` with each call."""
        return self._stub

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The tenant and auth headers every call of this client sends."""
        return self._metadata

    def _assembler(self, call: FrameCall) -> FetchAssembler:
        """One attempt's assembler, with a shared-memory buffer lent to it when one is free
        (named in the request; without one the payloads come inline)."""
        lease = self._shm.lease(call.need) if self._shm is not None else None
        req = call.request
        if lease is None:
            req.ClearField("shm")
        else:
            req.shm.name, req.shm.token = lease.segment.name, lease.segment.token
        return FetchAssembler(call.items, lease)

    def _assembled(self, asm: FetchAssembler) -> list[Any]:
        if asm.lease is not None:
            self._shm.done(asm.lease)
        return asm.out

    def _close_shm(self) -> None:
        if self._shm is not None:
            self._shm.close()
