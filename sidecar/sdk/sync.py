"""``SyncSidecarClient``: the RPC table (``sidecar.sdk.rpcs``) run over a blocking grpc channel.

Same requests, answers, errors and retries as ``SidecarClient``. It does not use asyncio, so
it is safe next to an asyncio server in the same process (grpc.aio supports one event loop
per process) and from engine threads.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Self

import grpc

from sidecar.sdk.channel import ClientBase, rpc_error
from sidecar.sdk.fetch import FrameCall
from sidecar.sdk.results import WarmUpEngine, WarmUpResult
from sidecar.sdk.rpcs import Kind, KVSidecarRpcs, Rpc


class SyncSidecarClient(ClientBase, KVSidecarRpcs):
    """Blocking client; the calls and their contracts are ``KVSidecarRpcs``'s. Example::

        with SyncSidecarClient("127.0.0.1:50051", tenant="team-a") as client:
            plan = client.lookup(tokens, identity=ident)
    """

    _open_channel = staticmethod(grpc.insecure_channel)
    _open_secure_channel = staticmethod(grpc.secure_channel)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()
        self._close_shm()

    def _invoke(self, rpc: Rpc, *args: Any, **kwargs: Any) -> Any:
        """Build ``rpc``'s request from the call's arguments, send it (again after a transient
        failure when ``rpc.idempotent``), convert the answer."""
        call = rpc.request(*args, **kwargs)
        send = _SEND[rpc.kind]
        attempt = 0
        while True:
            try:
                answer = send(self, rpc, call)
                break
            except grpc.RpcError as exc:
                err = rpc_error(exc)
                if not (rpc.idempotent and err.transient) or attempt + 1 >= self._retry.attempts:
                    raise err from exc
            time.sleep(self._retry.backoff(attempt))
            attempt += 1
        return rpc.result(answer)

    def _unary(self, rpc: Rpc, req: Any) -> Any:
        return getattr(self._stub, rpc.method)(req, metadata=self._metadata, timeout=self._timeout)

    def _client_stream(self, rpc: Rpc, msgs: Any) -> Any:
        return self._stream_calls[rpc.method](iter(msgs), metadata=self._metadata, timeout=self._timeout)

    def _server_stream(self, rpc: Rpc, req: Any) -> list[Any]:
        return list(getattr(self._stub, rpc.method)(req, metadata=self._metadata, timeout=self._timeout))

    def _frames(self, rpc: Rpc, call: FrameCall) -> list[Any]:
        asm = self._assembler(call)
        for msg in self._frame_calls[rpc.method](call.request, metadata=self._metadata, timeout=self._timeout):
            asm.feed(msg)
        return self._assembled(asm)

    def _watch(self, rpc: Rpc, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """The converted answers of an open stream, without a deadline; a follow watch streams
        until the caller stops iterating (the call is cancelled then)."""
        req = rpc.request(*args, **kwargs)
        call = getattr(self._stub, rpc.method)(req, metadata=self._metadata)
        try:
            for msg in call:
                yield rpc.result(msg)
        except grpc.RpcError as exc:
            raise rpc_error(exc) from exc
        finally:
            call.cancel()

    def warm_up(self, engine: WarmUpEngine, *, shared: bool = False) -> WarmUpResult:
        """Prefill and Store every sequence of the warm-up plan once through ``engine``, on the
        calling thread. The plan is read once: a sequence whose Store is refused is not retried."""
        seqs = self.warm_up_plan(engine.identity, shared=shared)
        stored = sum(engine.warm(q, shared=shared) for q in seqs)
        return WarmUpResult(len(seqs), sum(len(q) for q in seqs), stored)


_SEND = {
    Kind.UNARY: SyncSidecarClient._unary,
    Kind.CLIENT_STREAM: SyncSidecarClient._client_stream,
    Kind.SERVER_STREAM: SyncSidecarClient._server_stream,
    Kind.FRAMES: SyncSidecarClient._frames,
}
