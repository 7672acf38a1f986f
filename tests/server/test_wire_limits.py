"""Every string and repeated field of a request is bounded (``wire.max_string_bytes``,
``wire.max_repeated``) and refused with INVALID_ARGUMENT naming the field, before any handler
runs; the identity cache is LRU and keeps no large strings."""

from __future__ import annotations

import grpc
import pytest

from sidecar.api.kv import IdentityCache, RequestLimits
from sidecar.app import create_server
from sidecar.config import WireConfig
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc
from tests.conftest import make_config

LONG = "m" * 5000  # past the default 4,096 bytes
TOK = b"\1\0\0\0" * 64


@pytest.fixture
async def served():
    server, port = await create_server(make_config(wire=WireConfig(max_repeated=100)))
    yield server, f"127.0.0.1:{port}"
    await server.stop(0.1)


def ident(**kw) -> pb.CacheIdentity:
    return pb.CacheIdentity(**{"model_id": "m", **kw})


CASES = [
    ("Lookup", pb.LookupRequest(tokens=TOK, identity=ident(model_id=LONG)), "identity.model_id", "max_string_bytes"),
    ("Lookup", pb.LookupRequest(tokens=TOK, identity=ident(namespace="é" * 2100)), "identity.namespace",
     "4200 bytes"),  # UTF-8 bytes, not characters
    ("Fetch", pb.FetchRequest(identity=ident(kv_layout=LONG)), "identity.kv_layout", "max_string_bytes"),
    ("Fetch", pb.FetchRequest(identity=ident(), layout=pb.KVLayout(parts=[pb.KVPart(name=LONG)])),
     "layout.parts[0].name", "max_string_bytes"),
    ("Fetch", pb.FetchRequest(identity=ident(), items=[pb.FetchItem()] * 101), "items", "max_repeated 100"),
    ("Evict", pb.EvictRequest(chunk_hashes=range(101)), "chunk_hashes", "101 entries"),
    ("Evict", pb.EvictRequest(tier=LONG), "tier", "max_string_bytes"),
    ("Delete", pb.DeleteRequest(chunk_hashes=range(500)), "chunk_hashes", "max_repeated"),
    ("GetSession", pb.GetSessionRequest(session_id=LONG), "session_id", "max_string_bytes"),
    ("CloseSession", pb.CloseSessionRequest(session_id=LONG), "session_id", "max_string_bytes"),
    ("Splice", pb.SpliceRequest(session_id="s", directives=[pb.Directive()] * 101), "directives", "max_repeated"),
    ("CommitSplice", pb.CommitSpliceRequest(plan_id=LONG), "plan_id", "max_string_bytes"),
    ("Claim", pb.ClaimRequest(claim_id="c", chunk_hashes=range(101)), "chunk_hashes", "max_repeated"),
    ("ReleaseClaim", pb.ReleaseClaimRequest(claim_id=LONG), "claim_id", "max_string_bytes"),
    ("DemoteClaim", pb.DemoteClaimRequest(claim_id="c", reason=LONG), "reason", "max_string_bytes"),
    ("AdmitActive", pb.AdmitActiveRequest(request_id=LONG), "request_id", "max_string_bytes"),
]


@pytest.mark.parametrize("method,req,field,words", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
async def test_oversized_fields_refused_naming_the_field(served, method, req, field, words, caplog):
    server, target = served
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.KVSidecarStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            call = getattr(stub, method)(req)
            if method == "Fetch":
                async for _ in call:
                    pass
            else:
                await call
        assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.details().startswith(f"{field}: "), ei.value.details()
        assert words in ei.value.details()
        assert len(server.edge.identities) == 0  # nothing reached a handler
        assert not [r for r in caplog.records if r.levelname == "ERROR"]
        await stub.Ping(pb.PingRequest())


async def test_store_header_strings_are_bounded(served):
    server, target = served
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.KVSidecarStub(ch)
        msgs = [pb.StoreRequest(header=pb.StoreHeader(tokens=TOK, identity=ident(weights_hash=LONG)))]
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Store(iter(msgs))
        assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.details().startswith("header.identity.weights_hash: "), ei.value.details()
        assert len(server.index.registry) == 0 and len(server.edge.identities) == 0
        # within the limits: served
        ok = [pb.StoreRequest(header=pb.StoreHeader(tokens=TOK, identity=ident(weights_hash="w" * 4096))),
              pb.StoreRequest(commit=pb.StoreCommit())]
        assert (await stub.Store(iter(ok))).chunks_total >= 1


def test_request_limits_accept_what_fits():
    lim = RequestLimits(max_string_bytes=8, max_repeated=2)
    assert lim.error(pb.EvictRequest(chunk_hashes=[1, 2], tier="12345678")) is None
    assert lim.error(pb.EvictRequest(chunk_hashes=[1, 2, 3])).startswith("chunk_hashes: 3 entries")
    assert lim.error(pb.AdmitActiveRequest()) is None
    assert lim.error(pb.PingRequest()) is None


def test_identity_cache_is_lru_and_keeps_no_large_strings():
    cache = IdentityCache(capacity=2, max_key_bytes=64)
    a, b, c = ident(model_id="a"), ident(model_id="b"), ident(model_id="c")
    ia = cache.get(a, True)
    cache.get(b, True)
    assert cache.get(a, True) is ia  # a is now the most recently used
    cache.get(c, True)  # evicts b, not a
    assert cache.get(a, True) is ia
    ib = cache.get(b, True)  # evicts c (a was used after it)
    assert cache.get(b, True) is ib and cache.get(a, True) is ia and len(cache) == 2
    big = ident(model_id="x" * 65)
    assert cache.get(big, True).model_id == "x" * 65
    # big was never cached, so it evicted nothing
    assert len(cache) == 2 and cache.get(a, True) is ia and cache.get(b, True) is ib
