"""Fuzzing every RPC's decoding over real gRPC on loopback.

A real sidecar runs on its own event loop in a thread (hypothesis drives plain functions, so the
calls are synchronous raw-bytes calls: no client-side encoding or validation). Two tenants: the
victim stored a conversation with KV (its chunk keys are read from the server, the perfect
"crafted 64-bit collision"); mallory sends random, truncated and huge bytes, and valid protobuf
with adversarial field values, to every method. Expected for every call:

* a clear status: never UNKNOWN or INTERNAL, never a hang (every call has a deadline; only
  ``WatchEvents(follow=true)`` may legitimately run until it);
* a refusal changes nothing (registry entries and bytes, tier bytes and objects, pins, claims:
  an operator's ``Stats`` before and after);
* nothing mallory sends changes what the victim sees (its Lookup summary) or reads the victim's
  KV (a Fetch of the victim's exact keys is a miss for mallory).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.api.kv import identity_to_wire
from sidecar.client import SyncSidecarClient
from sidecar.config import AuthConfig
from sidecar.tiers import StoreConfig
from sidecar.v1 import sidecar_pb2 as pb
from tests.conftest import make_config
from tests.dataplane.test_dataplane import IDENT, LAYOUT, payloads_for
from tests.fuzz.conftest import examples

SERVICE = "/sidecar.v1.KVSidecar/"
MiB = 1 << 20
CALL_TIMEOUT_S = 10
UNARY = ["Lookup", "Evict", "Delete", "Stats", "Ping", "OpenSession", "AppendSession", "GetSession", "CloseSession",
         "Splice", "CommitSplice", "AbortSplice", "ImportManifest", "GetWarmUpPlan", "Claim", "ReleaseClaim",
         "DemoteClaim", "GetClaim", "ReportPool", "AdmitActive"]
SERVER_STREAM = ["Fetch", "FetchSession", "ExportManifest", "WatchEvents"]
#: Statuses that are never a clear answer to client input.
UNCLEAR = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE,
           grpc.StatusCode.DATA_LOSS, grpc.StatusCode.CANCELLED}
U32 = (0, 1, 2**31 - 1, 2**31, 2**32 - 1)
U64 = (0, 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1)


@dataclasses.dataclass
class Live:
    server: object
    target: str
    channel: grpc.Channel
    victim_tokens: np.ndarray
    victim_keys: list[int]
    mallory_session: str

    def call(self, method: str, raw: bytes, tenant: str = "mallory") -> tuple[grpc.StatusCode, list[bytes]]:
        """One raw call; (status, response messages)."""
        md = (("x-tenant-id", tenant),)
        try:
            if method == "Store":
                out = [self.channel.stream_unary(SERVICE + method)(iter(raw), timeout=CALL_TIMEOUT_S, metadata=md)]
            elif method in SERVER_STREAM:
                out = list(self.channel.unary_stream(SERVICE + method)(raw, timeout=CALL_TIMEOUT_S, metadata=md))
            else:
                out = [self.channel.unary_unary(SERVICE + method)(raw, timeout=CALL_TIMEOUT_S, metadata=md)]
            return grpc.StatusCode.OK, out
        except grpc.RpcError as e:
            return e.code(), []

    def snapshot(self) -> tuple:
        """Everything a refused call must leave as it was (an operator's global Stats)."""
        code, (raw,) = self.call("Stats", b"", tenant="op")
        s = pb.StatsResponse.FromString(raw)
        tiers = tuple((t.tier, t.bytes, t.objects) for t in s.tiers)
        return (s.registry.entries, s.registry.bytes, tiers, s.pins_in_flight, s.claims_active,
                len(self.server.index.registry))

    def victim_view(self):
        with SyncSidecarClient(self.target, tenant="victim") as c:
            return c.lookup(self.victim_tokens, identity=IDENT).summary


@pytest.fixture(scope="module")
def live():
    from sidecar.app import create_server
    from tests.conftest import ANCHORS, message

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzz-sidecar", daemon=True)
    thread.start()
    config = make_config(store=StoreConfig(cpu_bytes=64 * MiB), auth=AuthConfig(operators=("op",)))
    server, port = asyncio.run_coroutine_threadsafe(create_server(config), loop).result(60)
    target = f"127.0.0.1:{port}"
    rng = np.random.default_rng(13)
    tokens = np.concatenate([message(rng, 300, ANCHORS[0]), message(rng, 400, ANCHORS[1])]).astype(np.uint32)
    with SyncSidecarClient(target, tenant="victim") as c:
        meta = c.store(tokens, identity=IDENT)
        c.store(tokens, identity=IDENT, layout=LAYOUT, payloads=payloads_for(meta.chunk_bounds))
        keys = [h.chunk_hash for h in c.lookup(tokens, identity=IDENT).hits()]
    assert keys, "the victim's chunks must be resident for the collision cases"
    with SyncSidecarClient(target, tenant="mallory") as c:
        session = c.open_session(tokens[:64], block_size=16, identity=IDENT).session_id
    channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 128 * MiB)])
    try:
        yield Live(server, target, channel, tokens, keys, session)
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(server.stop(0.2), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def check(live: Live, method: str, raw, *, may_run_to_deadline: bool = False) -> grpc.StatusCode:
    before, view = live.snapshot(), live.victim_view()
    code, out = live.call(method, raw)
    assert code not in UNCLEAR, f"{method}: {code} for {raw!r:.200}"
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        assert may_run_to_deadline, f"{method} hung for {CALL_TIMEOUT_S} s on {raw!r:.200}"
    if code is not grpc.StatusCode.OK:
        assert live.snapshot() == before, f"{method} refused with {code} but changed state"
    assert live.victim_view() == view, f"{method} from another tenant changed the victim's Lookup"
    if method == "Fetch":
        for frame in out:
            r = pb.FetchResponse.FromString(frame)
            assert r.status != pb.CHUNK_STATUS_OK or not set(live.victim_keys) & _fetch_keys(raw), \
                "mallory read the victim's KV"
    return code


def _fetch_keys(raw: bytes) -> set[int]:
    try:
        return {i.chunk_hash for i in pb.FetchRequest.FromString(raw).items}
    except Exception:
        return set()


# ------------------------------------------------------------------ random and truncated bytes

garbage = st.one_of(
    st.binary(max_size=300),
    st.binary(min_size=1, max_size=16).map(lambda b: b * 4096),  # repeated, ~64 KiB
    st.sampled_from([b"\xff" * 11, b"\x0a\xff\xff\xff\x0f", b"\x0b", b"\x08" + b"\xff" * 9 + b"\x01", b"\x12\x80\x80\x80\x80\x10"]),
)


@settings(max_examples=examples(15))
@given(raw=garbage)
@pytest.mark.parametrize("method", UNARY + SERVER_STREAM)
def test_random_bytes(live, method, raw) -> None:
    check(live, method, raw, may_run_to_deadline=method == "WatchEvents")


@settings(max_examples=examples(25))
@given(parts=st.lists(garbage, min_size=1, max_size=4), header_first=st.booleans())
def test_random_store_streams(live, parts, header_first) -> None:
    header = pb.StoreRequest(header=pb.StoreHeader(tokens=live.victim_tokens[:100].tobytes())).SerializeToString()
    check(live, "Store", [header, *parts] if header_first else parts)


@settings(max_examples=examples(30))
@given(cut=st.floats(0, 1, exclude_max=True), method=st.sampled_from(["Lookup", "Fetch", "Claim", "Splice", "OpenSession"]))
def test_truncated_valid_messages(live, cut, method) -> None:
    full = {
        "Lookup": pb.LookupRequest(tokens=live.victim_tokens.tobytes(), identity=identity_to_wire(IDENT)),
        "Fetch": pb.FetchRequest(identity=identity_to_wire(IDENT), items=[pb.FetchItem(chunk_hash=k) for k in live.victim_keys]),
        "Claim": pb.ClaimRequest(claim_id="c1", identity=identity_to_wire(IDENT), tokens=live.victim_tokens.tobytes()),
        "Splice": pb.SpliceRequest(session_id=live.mallory_session, directives=[pb.Directive(start=1, end=3)]),
        "OpenSession": pb.OpenSessionRequest(tokens=live.victim_tokens.tobytes(), block_size=16, identity=identity_to_wire(IDENT)),
    }[method].SerializeToString()
    check(live, method, full[: int(len(full) * cut)])


# ------------------------------------------------------------------ valid protobuf, adversarial values

u32 = st.sampled_from(U32) | st.integers(0, 2**32 - 1)
u64 = st.sampled_from(U64) | st.integers(0, 2**64 - 1)
ident_str = st.one_of(st.text(max_size=12), st.sampled_from(["", "x" * 70_000, "\x00", "../../etc", "é" * 1000]))
enum_val = st.integers(-3, 12) | st.sampled_from([2**31 - 1, -(2**31)])


def token_bytes(live_tokens: np.ndarray):
    return st.one_of(
        st.binary(max_size=64),  # often not a multiple of 4
        st.lists(u32, max_size=64).map(lambda xs: np.array(xs, dtype="<u4").tobytes()),
        st.just(live_tokens.tobytes()),
        st.just(live_tokens.tobytes()[:-1]),
        st.integers(1, 300_000).map(lambda n: np.zeros(n, dtype="<u4").tobytes()),  # past max_prompt_tokens
    )


@st.composite
def identities(draw):
    if draw(st.booleans()):
        return identity_to_wire(IDENT)
    return pb.CacheIdentity(model_id=draw(ident_str), weights_hash=draw(ident_str), tokenizer_hash=draw(ident_str),
                            kv_layout=draw(ident_str | st.just(IDENT.kv_layout)), rope_fingerprint=draw(ident_str),
                            block_size=draw(u32), namespace=draw(ident_str))


@st.composite
def layouts(draw):
    if draw(st.booleans()):
        from sidecar.api.kv import layout_to_wire

        return layout_to_wire(LAYOUT)
    parts = [pb.KVPart(name=draw(st.text(max_size=4)), shape=draw(st.lists(u32, max_size=3)),
                       dtype=draw(st.sampled_from(["float16", "float32", "int4", "", "uint8"])), rotary=draw(st.booleans()))
             for _ in range(draw(st.integers(0, 3)))]
    return pb.KVLayout(num_layers=draw(u32), parts=parts)


@st.composite
def hashes(draw, live):
    pool = st.sampled_from(live.victim_keys) | u64
    xs = draw(st.lists(pool, max_size=8))
    return xs + xs[: draw(st.integers(0, len(xs)))]  # duplicates


@st.composite
def requests(draw, live):
    method = draw(st.sampled_from(["Lookup", "Evict", "Delete", "Fetch", "Splice", "Claim", "FetchSession", "OpenSession",
                                   "AppendSession", "ReportPool", "AdmitActive", "GetWarmUpPlan"]))
    tb = token_bytes(live.victim_tokens)
    sid = st.sampled_from([live.mallory_session, "", "x" * 5000, "nope"])
    if method == "Lookup":
        msg = pb.LookupRequest(tokens=draw(tb), identity=draw(identities()), engine_prefix_len=draw(st.just(0) | u32),
                               policy=draw(st.sampled_from([0, 1, 2]) | enum_val), dry_run=draw(st.booleans()))
        if draw(st.booleans()):
            msg.left_context_window = draw(u32)
            msg.recompute_tokens = draw(u32)
    elif method in ("Evict", "Delete"):
        cls = pb.EvictRequest if method == "Evict" else pb.DeleteRequest
        msg = cls(chunk_hashes=draw(hashes(live)))
        if method == "Evict":
            msg.tier = draw(st.sampled_from(["", "cpu", "disk", "gpu", "remote", "CPU", "x" * 1000]))
    elif method == "Fetch":
        items = [pb.FetchItem(chunk_hash=h, target_pos=draw(u32)) for h in draw(hashes(live))]
        msg = pb.FetchRequest(identity=draw(identities()), layout=draw(layouts()), items=items, raw=draw(st.booleans()))
    elif method == "Splice":
        ds = [pb.Directive(start=draw(u32), end=draw(u32), replacement=draw(st.binary(max_size=17)), mode=draw(enum_val))
              for _ in range(draw(st.integers(0, 4)))]
        msg = pb.SpliceRequest(session_id=draw(sid), expected_version=draw(u64), directives=ds)
    elif method == "Claim":
        msg = pb.ClaimRequest(claim_id=draw(st.text(max_size=10) | st.just("c" * 200)), identity=draw(identities()),
                              chunk_hashes=draw(hashes(live)), tokens=draw(tb), session_id=draw(sid),
                              predicate_min_tokens=draw(u32), mode=draw(enum_val), footprint_blocks=draw(u64),
                              shared=draw(st.booleans()))
        if draw(st.booleans()):
            msg.duration_s = draw(st.floats(allow_nan=True, allow_infinity=True))
    elif method == "FetchSession":
        msg = pb.FetchSessionRequest(session_id=draw(sid), start=draw(u32), layout=draw(layouts()), raw=draw(st.booleans()))
        if draw(st.booleans()):
            msg.end = draw(u32)
    elif method == "OpenSession":
        msg = pb.OpenSessionRequest(tokens=draw(tb), block_size=draw(u32), identity=draw(identities()), held=draw(st.booleans()))
    elif method == "AppendSession":
        msg = pb.AppendSessionRequest(session_id=draw(sid), tokens=draw(tb))
    elif method == "ReportPool":
        msg = pb.ReportPoolRequest(usable_blocks=draw(u64), free_blocks=draw(u64), block_size=draw(u32),
                                   hard_protection=draw(st.booleans()))
    elif method == "AdmitActive":
        msg = pb.AdmitActiveRequest(request_id=draw(ident_str), active_live_blocks=draw(u64))
    else:
        msg = pb.WarmUpPlanRequest(identity=draw(identities()), shared=draw(st.booleans()))
    return method, msg


@settings(max_examples=examples(200))
@given(data=st.data())
def test_adversarial_valid_messages(live, data) -> None:
    method, msg = data.draw(requests(live))
    check(live, method, msg.SerializeToString())


@settings(max_examples=examples(60))
@given(data=st.data())
def test_adversarial_store_streams(live, data) -> None:
    from sidecar.api.kv import layout_to_wire

    t = live.victim_tokens
    header = pb.StoreHeader(tokens=data.draw(token_bytes(t)), identity=data.draw(identities()),
                            register_from=data.draw(st.just(0) | u32), shared=data.draw(st.booleans()))
    if data.draw(st.booleans()):
        header.layout.CopyFrom(data.draw(layouts()) if data.draw(st.booleans()) else layout_to_wire(LAYOUT))
    parts = [pb.StoreRequest(payload=pb.PayloadPart(chunk_start=data.draw(u32), data=data.draw(st.binary(max_size=64)),
                                                    last=data.draw(st.booleans())))
             for _ in range(data.draw(st.integers(0, 4)))]
    msgs = [pb.StoreRequest(header=header), *parts]
    # Mallory's header-only Stores of real tokens succeed and register metadata: state may change
    # then, but never the victim's view (check()).
    if data.draw(st.booleans()):
        msgs.append(pb.StoreRequest(header=header))  # a second header
    if data.draw(st.booleans()):
        msgs.append(pb.StoreRequest(commit=pb.StoreCommit(chunks=data.draw(st.integers(0, 4)))))
    check(live, "Store", [m.SerializeToString() for m in msgs])


def test_colliding_keys_do_not_cross_tenants(live) -> None:
    """Mallory names the victim's exact 64-bit chunk keys: Evict and Delete affect nothing, Fetch
    answers misses, and the victim still reads its chunks."""
    before = live.victim_view()
    dup = live.victim_keys * 3
    for method, msg in [("Evict", pb.EvictRequest(chunk_hashes=dup)), ("Delete", pb.DeleteRequest(chunk_hashes=dup))]:
        code, (raw,) = live.call(method, msg.SerializeToString())
        assert code is grpc.StatusCode.OK
        assert (pb.EvictResponse if method == "Evict" else pb.DeleteResponse).FromString(raw).ListFields() == []
    from sidecar.api.kv import layout_to_wire

    fetch = pb.FetchRequest(identity=identity_to_wire(IDENT), layout=layout_to_wire(LAYOUT), raw=True,
                            items=[pb.FetchItem(chunk_hash=k) for k in live.victim_keys])
    code, frames = live.call("Fetch", fetch.SerializeToString())
    assert code is grpc.StatusCode.OK
    statuses = {pb.FetchResponse.FromString(f).status for f in frames}
    assert statuses == {pb.CHUNK_STATUS_MISS}
    assert live.victim_view() == before
    code, frames = live.call("Fetch", fetch.SerializeToString(), tenant="victim")
    assert code is grpc.StatusCode.OK and pb.CHUNK_STATUS_OK in {pb.FetchResponse.FromString(f).status for f in frames}
