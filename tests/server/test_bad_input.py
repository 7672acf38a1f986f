"""Bad input: INVALID_ARGUMENT naming the field, nothing registered, the server keeps serving."""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest

from sidecar.api.kv import identity_to_wire, layout_to_wire
from sidecar.app import create_server
from sidecar.client import SidecarClient
from sidecar.identity import KVLayout
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc
from tests.conftest import make_config, message

MAX_TOKENS = 4096


@pytest.fixture
async def small_server():
    server, port = await create_server(make_config(max_prompt_tokens=MAX_TOKENS))
    yield server, f"127.0.0.1:{port}"
    await server.stop(0.1)


def good_tokens(rng, n=300) -> bytes:
    return message(rng, n).astype("<u4").tobytes()


def lookup_cases(identity, rng):
    ident = identity_to_wire(identity)
    ok = good_tokens(rng)
    return [
        ("tokens", pb.LookupRequest(tokens=ok[:-1], identity=ident), "multiple of 4"),
        ("tokens", pb.LookupRequest(tokens=b"", identity=ident), "empty"),
        ("tokens", pb.LookupRequest(tokens=b"\0" * 4 * (MAX_TOKENS + 1), identity=ident), "max_prompt_tokens"),
        ("identity.model_id", pb.LookupRequest(tokens=ok), "required"),
        ("identity.model_id", pb.LookupRequest(tokens=ok, identity=pb.CacheIdentity(namespace="x")), "required"),
        ("policy", pb.LookupRequest(tokens=ok, identity=ident, policy=7), "unknown"),
        ("repair_scope", pb.LookupRequest(tokens=ok, identity=ident, repair_scope=7), "unknown"),
        ("engine_prefix_len", pb.LookupRequest(tokens=ok, identity=ident, engine_prefix_len=10_000), "exceeds"),
        ("left_context_window", pb.LookupRequest(tokens=ok, identity=ident, left_context_window=100_000), "exceeds"),
        ("recompute_tokens", pb.LookupRequest(tokens=ok, identity=ident, recompute_tokens=100_000), "exceeds"),
        ("policy", pb.LookupRequest(tokens=ok, identity=ident, policy=pb.ADMISSION_POLICY_EXACT, recompute_tokens=8),
         "position_independent"),
    ]


def store_cases(identity, rng):
    ident = identity_to_wire(identity)
    kv = KVLayout.gqa(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16")
    layout = layout_to_wire(kv)
    named = identity_to_wire(dataclasses.replace(identity, kv_layout=kv.fingerprint()))  # names the layout
    ok = good_tokens(rng)
    H = lambda **kw: pb.StoreRequest(header=pb.StoreHeader(**kw))  # noqa: E731
    C = pb.StoreRequest(commit=pb.StoreCommit())
    cases = [
        ("header.tokens", [H(tokens=ok[:-2], identity=ident)], "multiple of 4"),
        ("header.tokens", [H(tokens=b"", identity=ident)], "empty"),
        ("header.tokens", [H(tokens=b"\0" * 4 * (MAX_TOKENS + 1), identity=ident)], "max_prompt_tokens"),
        ("identity.model_id", [H(tokens=ok)], "required"),
        ("header.register_from", [H(tokens=ok, identity=ident, register_from=10_000)], "exceeds"),
        ("header", [], "no header"),
        ("header", [H(tokens=ok, identity=ident), H(tokens=ok, identity=ident)], "more than once"),
        ("header", [pb.StoreRequest(payload=pb.PayloadPart(data=b"x"))], "first Store message"),
        ("header.layout", [H(tokens=ok, identity=ident), pb.StoreRequest(payload=pb.PayloadPart(data=b"x", last=True))],
         "required when payload"),
        ("payload.last", [H(tokens=ok, identity=named, layout=layout), pb.StoreRequest(payload=pb.PayloadPart(data=b"x"))],
         "never received"),
        ("payload.chunk_start", [H(tokens=ok, identity=named, layout=layout),
                                 pb.StoreRequest(payload=pb.PayloadPart(chunk_start=1, data=b"x"))], "chunk boundary"),
        ("payload.data", [H(tokens=ok, identity=named, layout=layout),
                          pb.StoreRequest(payload=pb.PayloadPart(data=b"x", last=True))], "need"),
        ("msg", [H(tokens=ok, identity=ident), pb.StoreRequest()], "neither header nor payload"),
        ("commit.chunks", [H(tokens=ok, identity=ident), pb.StoreRequest(commit=pb.StoreCommit(chunks=1))], "carried 0"),
        ("commit.payload_bytes", [H(tokens=ok, identity=ident), pb.StoreRequest(commit=pb.StoreCommit(payload_bytes=9))],
         "carried 0"),
    ]
    # every stream committed (its error is the one named), and one valid stream that never commits
    return [(f, [*m, C] if not f.startswith("commit") else m, w) for f, m, w in cases] + [
        ("commit", [H(tokens=ok, identity=ident)], "without a commit message"),
    ]


async def test_bad_lookups(small_server, identity, rng):
    server, target = small_server
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.KVSidecarStub(ch)
        await stub.Store(iter([pb.StoreRequest(header=pb.StoreHeader(tokens=good_tokens(rng), identity=identity_to_wire(identity))),
                               pb.StoreRequest(commit=pb.StoreCommit())]))
        entries = len(server.index.registry)
        for field, req, words in lookup_cases(identity, rng):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.Lookup(req)
            assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT, field
            assert ei.value.details().startswith(field), (field, ei.value.details())
            assert words in ei.value.details(), (field, ei.value.details())
        assert len(server.index.registry) == entries
        await stub.Ping(pb.PingRequest())  # still serving


async def test_bad_stores_register_nothing(small_server, identity, rng):
    server, target = small_server
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.KVSidecarStub(ch)
        for field, msgs, words in store_cases(identity, rng):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.Store(iter(msgs))
            assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT, field
            assert ei.value.details().startswith(field), (field, ei.value.details())
            assert words in ei.value.details(), (field, ei.value.details())
            assert len(server.index.registry) == 0, field
        await stub.Ping(pb.PingRequest())


async def test_bad_tenant_header(small_server, identity, rng):
    from sidecar.errors import InvalidArgument

    _, target = small_server
    for bad in ("shared", "bad tenant!", "x" * 200):
        async with SidecarClient(target, tenant=bad) as c:
            with pytest.raises(InvalidArgument, match="x-tenant-id"):
                await c.lookup(message(rng, 40), identity=identity)


def test_client_side_token_validation(identity):
    from sidecar.api.kv import tokens_to_wire

    with pytest.raises(ValueError, match="uint32"):
        tokens_to_wire([1, -2])
    with pytest.raises(ValueError, match="integer"):
        tokens_to_wire(np.array([1.5]))
    with pytest.raises(ValueError, match="1-D"):
        tokens_to_wire(np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="multiple of 4"):
        tokens_to_wire(b"abc")
    assert tokens_to_wire([1, 2**32 - 1]) == b"\x01\0\0\0\xff\xff\xff\xff"
