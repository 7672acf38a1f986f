"""Chunker: the fast path equals the reference, boundaries are stable and clamped."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from sidecar.registry.chunker import (
    ChunkerConfig,
    MaskPosition,
    boundaries_reference,
    chunk_tokens,
    chunk_tokens_reference,
)
from tests.conftest import ANCHORS, message, text

SEEDS = [0x1234, 0xDEADBEEF]
CHAIN = 0xC0FFEE


def assert_same(a, b):
    np.testing.assert_array_equal(a.bounds, b.bounds)
    np.testing.assert_array_equal(a.fingerprints, b.fingerprints)
    np.testing.assert_array_equal(a.prefix_digests, b.prefix_digests)


def inputs(rng):
    yield text(rng, 0)
    yield text(rng, 1)
    yield text(rng, 31)
    yield text(rng, 5000)
    yield rng.integers(0, 2**32, size=3000, dtype=np.uint64).astype(np.uint32)  # full uint32 range
    yield np.full(4000, 7, dtype=np.uint32)  # constant: only max-size cuts
    yield np.tile(text(rng, 13), 400)  # short period repetition
    yield np.tile(text(rng, 97), 60)
    mixed = text(rng, 6000)
    mixed[rng.integers(0, 6000, 40)] = ANCHORS[1]
    mixed[100:104] = ANCHORS  # consecutive anchors: 1-token chunks
    yield mixed


@pytest.mark.parametrize("position", list(MaskPosition))
@pytest.mark.parametrize("mask_bits", [4, 7])
def test_fast_equals_reference(rng, position, mask_bits):
    cfg = ChunkerConfig(mask_bits=mask_bits, mask_position=position, anchor_tokens=ANCHORS)
    for toks in inputs(rng):
        assert_same(chunk_tokens(toks, cfg, SEEDS, CHAIN), chunk_tokens_reference(toks, cfg, SEEDS, CHAIN))


def test_fast_equals_reference_with_markers(rng):
    marker = tuple(int(t) for t in text(rng, 8))
    cfg = ChunkerConfig(anchor_tokens=ANCHORS, boundary_markers=(marker, (5, 6)))
    toks = text(rng, 4000)
    toks[500:508] = marker
    toks[2000:2008] = marker
    toks[3000:3002] = (5, 6)
    toks[3990:3998] = marker
    fast = chunk_tokens(toks, cfg, SEEDS, CHAIN)
    assert_same(fast, chunk_tokens_reference(toks, cfg, SEEDS, CHAIN))
    bounds = set(fast.bounds.tolist())
    assert {500, 508, 2000, 2008, 3000, 3002, 3990, 3998} <= bounds


def test_fingerprints_are_xxh64_of_packed_tokens(rng):
    """The scope-free digest is XXH64 of the chunk's LE uint32 bytes, seeded with the salt."""
    from sidecar.registry.chunker import chain_reference

    cfg = ChunkerConfig(anchor_tokens=ANCHORS)
    toks = text(rng, 3000)
    ch = chunk_tokens(toks, cfg, SEEDS, CHAIN)
    data = toks.astype("<u4").tobytes()
    digest = 0
    for c in range(len(ch)):
        a, b = ch.bounds[c], ch.bounds[c + 1]
        h0 = xxhash.xxh64_intdigest(data[4 * a : 4 * b], seed=CHAIN)
        assert ch.prefix_digests[c] == digest
        for s, seed in enumerate(SEEDS):
            assert ch.fingerprints[s, c] == chain_reference(seed, h0)
        digest = chain_reference(digest, h0)


def test_clamps(rng):
    cfg = ChunkerConfig(anchor_tokens=ANCHORS)
    for toks in inputs(rng):
        b = np.asarray(boundaries_reference(toks.tolist(), cfg))
        sizes = np.diff(b)
        assert b[0] == 0 and b[-1] == len(toks)
        assert (sizes <= cfg.max_size).all()
        # Every chunk shorter than min_size ends at an anchor or at the end of the input.
        for start, end in zip(b[:-1], b[1:]):
            if end - start < cfg.min_size:
                assert end == len(toks) or toks[end] in ANCHORS
    const = np.full(2000, 7, dtype=np.uint32)
    sizes = np.diff(chunk_tokens(const, cfg, SEEDS, CHAIN).bounds)
    assert (sizes[:-1] >= cfg.min_size).all() and (sizes <= cfg.max_size).all()


def test_expected_chunk_size(rng):
    cfg = ChunkerConfig()
    sizes = np.diff(chunk_tokens(text(rng, 200_000), cfg, SEEDS, CHAIN).bounds)
    # min_size + ~2^mask_bits expected: 32 + 128 = 160 (geometric tail, clamped at 512).
    assert 130 < sizes.mean() < 190


@pytest.mark.parametrize("position", list(MaskPosition))
def test_stable_after_anchor(rng, position):
    """Identical content after an anchor chunks identically whatever precedes it."""
    cfg = ChunkerConfig(anchor_tokens=ANCHORS, mask_position=position)
    body = np.concatenate([message(rng, 700), message(rng, 40), message(rng, 2500)])
    for head_len in (0, 1, 5, 50, 333, 1000):
        head = text(rng, head_len)
        toks = np.concatenate([head, body])
        ch = chunk_tokens(toks, cfg, SEEDS, CHAIN)
        ref = chunk_tokens(body, cfg, SEEDS, CHAIN)
        bounds = ch.bounds.tolist()
        assert head_len in bounds or head_len == 0
        i = bounds.index(head_len)
        np.testing.assert_array_equal(ch.bounds[i:] - head_len, ref.bounds)
        np.testing.assert_array_equal(ch.fingerprints[:, i:], ref.fingerprints)


def test_resync_without_anchor_high_mask(rng):
    """Without anchors, high-bit boundaries depend on a 64-token window: shifted content
    re-synchronises after its first boundary past 64 tokens."""
    cfg = ChunkerConfig()
    body = text(rng, 8000)
    a = chunk_tokens(body, cfg, SEEDS, CHAIN)
    b = chunk_tokens(np.concatenate([text(rng, 77), body]), cfg, SEEDS, CHAIN)
    common = set(a.fingerprints[0].tolist()) & set(b.fingerprints[0].tolist())
    assert len(common) >= len(a) - 3


def test_prefix_digest_identifies_left_context(rng):
    cfg = ChunkerConfig(anchor_tokens=ANCHORS)
    body = np.concatenate([message(rng, 300), message(rng, 300)])
    a = chunk_tokens(np.concatenate([message(rng, 50), body]), cfg, SEEDS, CHAIN)
    b = chunk_tokens(np.concatenate([message(rng, 50), body]), cfg, SEEDS, CHAIN)
    same = set(a.fingerprints[0].tolist()) & set(b.fingerprints[0].tolist())
    assert same  # content matches
    assert not set(a.prefix_digests[1:].tolist()) & set(b.prefix_digests[1:].tolist())  # contexts differ


def test_scope_seeds_separate_keys(identity, rng):
    cfg = ChunkerConfig(anchor_tokens=ANCHORS)
    toks = text(rng, 1000)
    a = chunk_tokens(toks, cfg, [identity.scope_seed("a")], identity.salt)
    b = chunk_tokens(toks, cfg, [identity.scope_seed("b")], identity.salt)
    assert not set(a.fingerprints[0].tolist()) & set(b.fingerprints[0].tolist())
    np.testing.assert_array_equal(a.prefix_digests, b.prefix_digests)


@pytest.mark.parametrize(
    "kwargs",
    [dict(mask_bits=0), dict(min_size=0), dict(min_size=600, max_size=512), dict(anchor_tokens=(-1,)),
     dict(boundary_markers=((),))],
)
def test_bad_config(kwargs):
    with pytest.raises(ValueError, match="chunker"):
        ChunkerConfig(**kwargs)
