"""Fetch frames (``sidecar.api.frames``): the server's encoder and the SDK's decoder read each
other, and both read as standard protobuf."""

from sidecar.api.frames import Framer, fetch_frames, parse_fetch_frame
from sidecar.v1 import sidecar_pb2 as pb


def test_fetch_frames_are_protobuf():
    """Pre-encoded Fetch frames parse as the FetchResponse messages they stand for."""
    payload = bytes(range(256)) * 41  # 10496 bytes -> 3 parts of 4096
    meta = pb.FetchResponse(index=3, status=pb.CHUNK_STATUS_OK, num_tokens=12, source_pos=7, delta=-5,
                            rotated=True, tier="cpu")
    frames = [pb.FetchResponse.FromString(f) for f in fetch_frames(meta, memoryview(payload), 4096)]
    assert [f.last for f in frames] == [False, False, True]
    assert all(f.index == 3 for f in frames)
    assert (frames[0].delta, frames[0].tier, frames[0].num_tokens, frames[0].rotated) == (-5, "cpu", 12, True)
    assert b"".join(f.data for f in frames) == payload
    big = list(fetch_frames(pb.FetchResponse(index=0), memoryview(bytes(300)), 1 << 20))
    assert pb.FetchResponse.FromString(big[0]).data == bytes(300)  # multi-byte varint length


def test_round_trip_encoder_to_decoder():
    """Every part the encoder writes decodes to the same metadata and, joined, the same payload,
    for Fetch and FetchSession answers (FetchSession's own fields 10..13 included)."""
    payload = bytes(range(251)) * 97  # 24347 bytes: 6 parts of 4096, the last one short
    answers = [
        pb.FetchResponse(index=5, status=pb.CHUNK_STATUS_OK, num_tokens=33, source_pos=64, delta=-31,
                         rotated=True, tier="disk"),
        pb.FetchSessionResponse(index=2, num_tokens=33, source_pos=64, delta=300, rotated=False, tier="cpu",
                                target_pos=364, chunk_hash=0xDEADBEEF12345678, chunk_offset=7, version=9),
    ]
    for meta in answers:
        frames = [parse_fetch_frame(f) for f in fetch_frames(meta, memoryview(payload), 4096)]
        assert [f.last for f in frames] == [False] * 5 + [True]
        assert {f.index for f in frames} == {meta.index}
        first = frames[0]
        assert (first.num_tokens, first.source_pos, first.delta, first.rotated, first.tier) == (
            meta.num_tokens, meta.source_pos, meta.delta, meta.rotated, meta.tier)
        if isinstance(meta, pb.FetchSessionResponse):
            assert (first.target_pos, first.chunk_hash, first.chunk_offset, first.version) == (
                364, 0xDEADBEEF12345678, 7, 9)
        assert b"".join(bytes(f.data) for f in frames) == payload


def test_framer_without_shared_memory_keeps_order():
    """Without a shared-memory buffer a miss is one metadata frame and a hit its parts, in order."""
    framer = Framer(1024, None)
    out = framer.add(pb.FetchResponse(index=0, status=pb.CHUNK_STATUS_MISS, last=True), None)
    out += framer.add(pb.FetchResponse(index=1, status=pb.CHUNK_STATUS_OK, num_tokens=2), memoryview(bytes(2500)))
    out += framer.flush()
    decoded = [parse_fetch_frame(f) for f in out]
    assert [(f.index, f.status, f.last, len(f.data)) for f in decoded] == [
        (0, pb.CHUNK_STATUS_MISS, True, 0), (1, pb.CHUNK_STATUS_OK, False, 1024),
        (1, 0, False, 1024), (1, 0, True, 452)]
