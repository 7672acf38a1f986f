"""``SidecarClient``: the RPC table (``sidecar.sdk.rpcs``) run over a ``grpc.aio`` channel.

Every call is a coroutine (``watch_events``: an async iterator). ``CancelledError`` is always
re-raised, never retried; a transient failure of an idempotent call is retried after the
policy's backoff. grpc.aio supports one event loop per process: next to an asyncio server in
the same process, use ``SyncSidecarClient`` from a worker thread instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Self

import grpc

from sidecar.sdk.channel import ClientBase, rpc_error
from sidecar.sdk.fetch import FrameCall
from sidecar.sdk.results import WarmUpEngine, WarmUpResult
from sidecar.sdk.rpcs import Kind, KVSidecarRpcs, Rpc


class SidecarClient(ClientBase, KVSidecarRpcs):
    """Asyncio client; the calls and their contracts are ``KVSidecarRpcs``'s. Example::

        async with SidecarClient("127.0.0.1:50051", tenant="team-a") as client:
            plan = await client.lookup(tokens, identity=ident, engine_prefix_len=512)
    """

    _open_channel = staticmethod(grpc.aio.insecure_channel)
    _open_secure_channel = staticmethod(grpc.aio.secure_channel)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()
        self._close_shm()

    async def _invoke(self, rpc: Rpc, *args: Any, **kwargs: Any) -> Any:
        """Build ``rpc``'s request from the call's arguments, send it (again after a transient
        failure when ``rpc.idempotent``), convert the answer."""
        call = rpc.request(*args, **kwargs)
        send = _SEND[rpc.kind]
        attempt = 0
        while True:
            try:
                answer = await send(self, rpc, call)
                break
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                err = rpc_error(exc)
                if not (rpc.idempotent and err.transient) or attempt + 1 >= self._retry.attempts:
                    raise err from exc
            await asyncio.sleep(self._retry.backoff(attempt))
            attempt += 1
        return rpc.result(answer)

    async def _unary(self, rpc: Rpc, req: Any) -> Any:
        return await getattr(self._stub, rpc.method)(req, metadata=self._metadata, timeout=self._timeout)

    async def _client_stream(self, rpc: Rpc, msgs: Any) -> Any:
        return await self._stream_calls[rpc.method](iter(msgs), metadata=self._metadata, timeout=self._timeout)

    async def _server_stream(self, rpc: Rpc, req: Any) -> list[Any]:
        return [m async for m in getattr(self._stub, rpc.method)(req, metadata=self._metadata, timeout=self._timeout)]

    async def _frames(self, rpc: Rpc, call: FrameCall) -> list[Any]:
        asm = self._assembler(call)
        async for msg in self._frame_calls[rpc.method](call.request, metadata=self._metadata, timeout=self._timeout):
            asm.feed(msg)
        return self._assembled(asm)

    async def _watch(self, rpc: Rpc, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """The converted answers of an open stream, without a deadline (a follow watch runs
        until the caller stops iterating); a failure ends it with the typed error."""
        req = rpc.request(*args, **kwargs)
        try:
            async for msg in getattr(self._stub, rpc.method)(req, metadata=self._metadata):
                yield rpc.result(msg)
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc) from exc

    async def warm_up(self, engine: WarmUpEngine, *, shared: bool = False) -> WarmUpResult:
        """Prefill and Store every sequence of the warm-up plan once through ``engine`` (run in a
        worker thread: engines are synchronous). The plan is read once: a sequence whose Store
        is refused is not retried."""
        seqs = await self.warm_up_plan(engine.identity, shared=shared)
        stored = 0
        for q in seqs:
            stored += await asyncio.to_thread(engine.warm, q, shared=shared)
        return WarmUpResult(len(seqs), sum(len(q) for q in seqs), stored)


_SEND = {
    Kind.UNARY: SidecarClient._unary,
    Kind.CLIENT_STREAM: SidecarClient._client_stream,
    Kind.SERVER_STREAM: SidecarClient._server_stream,
    Kind.FRAMES: SidecarClient._frames,
}
