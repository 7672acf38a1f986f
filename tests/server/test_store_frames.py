"""The Store stream's payload frames (``sidecar.api.store_frames``): the SDK writes each payload
part straight into its outgoing frame, the server reads the part in place. Both are protobuf's
wire format (a raw stub's ``StoreRequest`` reads the same); a malformed frame is refused naming
its field and stores nothing; a Store cut into many parts lands bit for bit."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from sidecar.api.kv import store_messages
from sidecar.api.store_frames import STORE_METHOD, StorePart, parse_store_request, store_frames
from sidecar.app import create_server
from sidecar.client import SidecarClient
from sidecar.errors import InvalidArgument
from sidecar.v1 import sidecar_pb2 as pb
from tests.claims.helpers import BLOCK, IDENT, LAYOUT, blocks, config
from tests.dataplane.test_store_faults import quiesce

PER_CHUNK = LAYOUT.bytes_per_token * BLOCK  # 4 KiB
N = 4  # chunks per Store


def chunk_payloads(n: int = N, seed: int = 0) -> dict[int, np.ndarray]:
    """Random bytes per chunk start (no two chunks alike)."""
    rng = np.random.default_rng(seed)
    return {c * BLOCK: rng.integers(0, 256, PER_CHUNK, dtype=np.uint8) for c in range(n)}


def frames_of(payloads: dict[int, np.ndarray], part_bytes: int, tokens: np.ndarray | None = None) -> list[bytes]:
    toks = blocks(N, 0) if tokens is None else tokens
    return list(store_frames(toks, IDENT, layout=LAYOUT, payloads=payloads, part_bytes=part_bytes))


# ------------------------------------------------------------------------ encoder / decoder


def test_frames_are_the_protobuf_store_requests() -> None:
    """Every frame the SDK sends is the protobuf encoding of the message ``store_messages``
    builds (what a raw-stub client sends): the wire is unchanged."""
    pl = chunk_payloads()
    for part_bytes in (1000, PER_CHUNK, 1 << 20):
        frames = frames_of(pl, part_bytes)
        assert all(isinstance(f, bytes) for f in frames)
        expected = store_messages(blocks(N, 0), IDENT, layout=LAYOUT, payloads=pl, part_bytes=part_bytes)
        assert [pb.StoreRequest.FromString(f) for f in frames] == expected
    header_only = list(store_frames(blocks(N, 0), IDENT))
    assert [pb.StoreRequest.FromString(f) for f in header_only] == store_messages(blocks(N, 0), IDENT)


def test_parts_are_read_in_place() -> None:
    """The server's decoder answers a payload part as a view of the received frame (no copy);
    protobuf's own encoding (other field order, defaults left out) reads the same; headers and
    commits are protobuf messages."""
    pl = chunk_payloads()
    frames = frames_of(pl, 1000)
    got: dict[int, bytearray] = {}
    for f in frames[1:-1]:
        part = parse_store_request(f)
        assert isinstance(part, StorePart)
        assert part.data.obj is f  # a slice of the received bytes
        got.setdefault(part.chunk_start, bytearray()).extend(part.data)
    assert {s: bytes(b) for s, b in got.items()} == {s: a.tobytes() for s, a in pl.items()}
    for msg in store_messages(blocks(N, 0), IDENT, layout=LAYOUT, payloads=pl, part_bytes=1000)[1:-1]:
        part = parse_store_request(msg.SerializeToString())
        p = msg.payload
        assert (part.chunk_start, bytes(part.data), part.last) == (p.chunk_start, p.data, p.last)
    for msg in (pb.StoreRequest(payload=pb.PayloadPart()), pb.StoreRequest(payload=pb.PayloadPart(chunk_start=7, last=True))):
        part = parse_store_request(msg.SerializeToString())
        assert (part.chunk_start, bytes(part.data), part.last) == (msg.payload.chunk_start, b"", msg.payload.last)
    assert parse_store_request(frames[0]) == pb.StoreRequest.FromString(frames[0])
    assert parse_store_request(frames[-1]) == pb.StoreRequest.FromString(frames[-1])
    assert parse_store_request(b"") == pb.StoreRequest()


def test_truncated_part_names_the_field() -> None:
    frame = frames_of(chunk_payloads(), 1000)[1]
    for cut in (1, 7, 500):  # inside the data: the data field's length is past the end
        with pytest.raises(InvalidArgument, match=r"^payload\.data: declares 1000 bytes but .*truncated.*sidecar\.v1\.StoreRequest"):
            parse_store_request(frame[:-cut])
    # only the part's own length left: the payload field's length is past the end
    with pytest.raises(InvalidArgument, match=r"^payload: declares \d+ bytes but 0 follow .*truncated"):
        parse_store_request(frame[:3])


# ------------------------------------------------------------------------ over real gRPC


@pytest.fixture
async def served():
    server, port = await create_server(config(200))
    yield server, f"127.0.0.1:{port}"
    await server.stop(0.1)


def state(server) -> tuple[int, int, dict]:
    store = server.dataplane.store
    return len(server.index.registry), len(store.list_chunks()), store.tenant_tier_usage("default")


def _commit(frames: list[bytes], chunks: int | None = None, nbytes: int | None = None) -> list[bytes]:
    """``frames`` with their commit replaced (counts as given, else as carried)."""
    c = pb.StoreRequest.FromString(frames[-1]).commit
    commit = pb.StoreCommit(chunks=c.chunks if chunks is None else chunks,
                            payload_bytes=c.payload_bytes if nbytes is None else nbytes)
    return [*frames[:-1], pb.StoreRequest(commit=commit).SerializeToString()]


def _part(start: int, data: bytes, last: bool) -> bytes:
    return pb.StoreRequest(payload=pb.PayloadPart(chunk_start=start, data=data, last=last)).SerializeToString()


HALF = PER_CHUNK // 2
MALFORMED = [
    # a part cut short in transit: its data declares more bytes than the message holds
    ("payload.data", lambda f: [*f[:2], f[2][:-100], *f[3:]]),
    ("payload.data", lambda f: [*f[:-2], f[-2][:-1], f[-1]]),
    # a chunk sent longer than its header declares (layout x tokens)
    ("payload.data", lambda f: [*f[:2], _part(0, b"\1", False), *f[2:]]),
    ("payload.data", lambda f: [f[0], _part(BLOCK, b"\1" * (PER_CHUNK + 1), True), *f[1:]]),
    # a part after its chunk's last one
    ("payload.chunk_start", lambda f: [*f[:3], _part(0, b"\1", True), *f[3:]]),
    # a chunk whose last part never comes
    ("payload.last", lambda f: [f[0], _part(0, b"\1" * HALF, False), *f[3:]]),
    # counts that do not match what the stream carried
    ("commit.chunks", lambda f: _commit(f, chunks=N + 1)),
    ("commit.chunks", lambda f: _commit(f[:1] + f[3:], chunks=N)),
    ("commit.payload_bytes", lambda f: _commit(f, nbytes=N * PER_CHUNK - 1)),
]


@pytest.mark.parametrize("field,mangle", MALFORMED)
async def test_malformed_frames_refused_by_field(served, field, mangle) -> None:
    server, target = served
    frames = frames_of(chunk_payloads(), HALF)
    assert len(frames) == 2 + 2 * N
    before = state(server)
    async with grpc.aio.insecure_channel(target) as ch:
        store = ch.stream_unary(STORE_METHOD)  # the bytes as they are
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await store(iter(mangle(frames)), timeout=10)
        assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
        assert ei.value.details().startswith(field), ei.value.details()
        await quiesce(server)
        assert state(server) == before
        # the same frames as sent: stored whole
        r = pb.StoreResponse.FromString(await store(iter(frames), timeout=10))
        assert r.chunks_stored == N and state(server)[:2] == (N, N)


@pytest.mark.parametrize("part_bytes", [999, HALF, PER_CHUNK, 3 * PER_CHUNK])
async def test_store_in_many_parts_lands_bit_identical(served, part_bytes) -> None:
    """Parts that cut chunks anywhere (999 B), in halves, whole chunks, and frames larger than
    a chunk: every stored payload reads back bit for bit."""
    server, target = served
    tokens = blocks(N, 10_000 + part_bytes)
    pl = chunk_payloads(seed=part_bytes)
    async with SidecarClient(target, shared_memory=False) as c:
        res = await c.store(tokens, identity=IDENT, layout=LAYOUT, payloads=pl, part_bytes=part_bytes)
        assert res.chunks_stored == N
        hits = (await c.lookup(tokens, identity=IDENT)).hits()
        assert len(hits) == N
        got = await c.fetch([(h.chunk_hash, h.start - h.chunk_offset) for h in hits], identity=IDENT, layout=LAYOUT,
                            raw=True)
    assert sorted(f.source_pos for f in got) == sorted(pl)
    for f in got:
        assert f.ok and bytes(f.data) == pl[f.source_pos].tobytes(), f.source_pos
