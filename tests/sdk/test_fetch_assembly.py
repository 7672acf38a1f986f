"""Fetch answers assembled on the client: inline parts joined once into a writable buffer in
item order, misses kept as misses, batched answers (``more``) read from the call's buffer."""

from __future__ import annotations

from sidecar.api.frames import fetch_frames, parse_fetch_frame
from sidecar.identity import KVLayout
from sidecar.registry.lookup_plan import FetchSpec
from sidecar.sdk.fetch import FetchAssembler, fetch_need, session_need
from sidecar.shm import ALIGN
from sidecar.v1 import sidecar_pb2 as pb


def test_inline_parts_join_in_item_order():
    items = [(111, 0), (222, 16), (333, 32)]
    pay0, pay2 = bytes(range(256)) * 9, b"\x07" * 300
    frames = [
        *fetch_frames(pb.FetchResponse(index=0, status=pb.CHUNK_STATUS_OK, num_tokens=16, source_pos=4, delta=-4,
                                       rotated=True, tier="cpu"), memoryview(pay0), 1000),  # 3 parts
        pb.FetchResponse(index=1, status=pb.CHUNK_STATUS_MISS, last=True).SerializeToString(),
        *fetch_frames(pb.FetchResponse(index=2, status=pb.CHUNK_STATUS_OK, num_tokens=8, tier="disk"),
                      memoryview(pay2), 1000),
    ]
    asm = FetchAssembler(items)
    for f in frames:
        asm.feed(parse_fetch_frame(f))
    got = asm.out
    assert [(g.index, g.chunk_hash, g.ok, g.tier) for g in got] == [(0, 111, True, "cpu"), (1, 222, False, ""),
                                                                    (2, 333, True, "disk")]
    assert (got[0].num_tokens, got[0].source_pos, got[0].delta, got[0].rotated) == (16, 4, -4, True)
    assert bytes(got[0].data) == pay0 and bytes(got[2].data) == pay2 and len(got[1].data) == 0
    got[0].data[0] = 255  # the caller's own buffer: writable, and no other payload changes
    assert bytes(got[2].data) == pay2


def test_session_runs_without_items():
    msg = pb.FetchSessionResponse(index=0, num_tokens=4, target_pos=10, chunk_hash=5, chunk_offset=2, version=3)
    asm = FetchAssembler()
    for f in fetch_frames(msg, memoryview(b"abcdefgh"), 3):
        asm.feed(parse_fetch_frame(f))
    (run,) = asm.out
    assert (run.target_pos, run.num_tokens, run.chunk_hash, run.chunk_offset, run.version, bytes(run.data)) == (
        10, 4, 5, 2, 3, b"abcdefgh")


def test_payload_bytes_known_before_the_call():
    layout = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
    spans = [FetchSpec(chunk_hash=1, target_pos=0, num_tokens=10), FetchSpec(chunk_hash=2, target_pos=10, num_tokens=6)]
    assert fetch_need(spans, layout) == 16 * layout.bytes_per_token + 2 * ALIGN
    assert fetch_need([(1, 0)], layout) == 0  # plain items: unknown until answered
    assert session_need(0, 8, layout) == 8 * (layout.bytes_per_token + ALIGN)
    assert session_need(4, None, layout) == 0
