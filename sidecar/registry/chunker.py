"""Content-defined chunking of token sequences (Gear rolling hash) and chunk fingerprints.

Boundary rule (docs/architecture.md, "Chunking and fingerprints"; Irminsul section 4 and
Appendix B)::

    h <- (h << 1) + gear(token)            64-bit rolling state, wraps
    cut after token i when (h & mask) == 0 and the chunk has >= min_size tokens,
    or when the chunk reaches max_size tokens.
    anchor token at i:     cut before i (if the chunk is non-empty), reset h = 0
    marker sequence at i:  cut before i and after its last token, reset h at both

``gear(t) = m ^ (m >> 32)`` with ``m = (t ^ C0) * C1 mod 2^64``: a Gear table over 2^32 token
ids without storing one (one multiply per token). Bit ``b`` of ``h`` depends only on the last ``b + 1`` tokens, so a mask on
the LOW bits decides boundaries from the last few tokens alone (short n-grams: repetitive text
such as indentation or JSON punctuation cuts at every repeat), while a mask on the HIGH bits
looks at a ~64-token window. The default tests the high bits; ``bench/recovery.py`` measures
both on the real traces.

Anchors make chunking stable: identical content after an anchor produces identical chunks
whatever precedes it, because the rolling state is reset and a boundary forced there. Anchors
always cut, even when that leaves a chunk shorter than ``min_size``: honouring the minimum
would make the chunk after the anchor depend on what came before it.

Fingerprints are xxh64 of the chunk's packed little-endian uint32 token bytes, one per seed
(``CacheIdentity.scope_seed``: identity salt and scope); the chained prefix digest (identity
salt only, scope-free) identifies the whole left context of each chunk for exact reuse.

Two implementations produce identical output: ``chunk_tokens`` (numba, compiled, no per-token
Python work: ~25-40 us for 32K tokens with fingerprints) and ``chunk_tokens_reference`` (plain
Python, the executable specification; ~10 ms for 32K tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Sequence

import numba
import numpy as np
import xxhash

from sidecar.registry.entry import MASK64, P1, P2, VARIANT_SEED, chain_reference

P3 = 0x165667B19E3779F9
P4 = 0x85EBCA77C2B2AE63
P5 = 0x27D4EB2F165667C5
_GEAR_C0 = 0x9E3779B97F4A7C15
_GEAR_C1 = 0xBF58476D1CE4E5B9


class MaskPosition(str, Enum):
    """Which bits of the rolling hash the boundary mask tests."""

    HIGH = "high"  # ~64-token window (default)
    LOW = "low"  # last ``mask_bits`` tokens only


#: Largest chunk size: the compiled boundary loop holds sizes in int64 (tests/fuzz found a
#: uint64 ``max_size`` accepted at load that raised OverflowError at the first Lookup).
_MAX_CHUNK = 2**31 - 1


@dataclass(frozen=True, kw_only=True)
class ChunkerConfig:
    """Chunking parameters; part of what two sidecars must agree on to share chunks.

    ``mask_bits`` = 7 gives an expected ~128 tokens between hash boundaries (Irminsul App. B).
    ``anchor_tokens``: token ids that force a boundary before them and reset the rolling state
    (the chat template's special tokens). ``boundary_markers``: token sequences (the Irminsul
    S2 marker) that force boundaries before and after themselves.
    """

    mask_bits: int = 7
    mask_position: MaskPosition = MaskPosition.HIGH
    min_size: int = 32
    max_size: int = 512
    anchor_tokens: tuple[int, ...] = ()
    boundary_markers: tuple[tuple[int, ...], ...] = ()
    _anchors: np.ndarray = field(init=False, repr=False, compare=False)
    _marker_flat: np.ndarray = field(init=False, repr=False, compare=False)
    _marker_offsets: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 1 <= self.mask_bits <= 32:
            raise ValueError(f"chunker.mask_bits must be in [1, 32], got {self.mask_bits}")
        if not 1 <= self.min_size <= self.max_size <= _MAX_CHUNK:
            raise ValueError(f"chunker.min_size/max_size must satisfy 1 <= min <= max <= {_MAX_CHUNK}, "
                             f"got {self.min_size}/{self.max_size}")
        object.__setattr__(self, "mask_position", MaskPosition(self.mask_position))
        anchors = tuple(sorted({int(t) for t in self.anchor_tokens}))
        if any(not 0 <= t < 2**32 for t in anchors):
            raise ValueError("chunker.anchor_tokens must be uint32 token ids")
        markers = tuple(tuple(int(t) for t in m) for m in self.boundary_markers)
        if any(len(m) == 0 for m in markers):
            raise ValueError("chunker.boundary_markers must not contain empty sequences")
        object.__setattr__(self, "anchor_tokens", anchors)
        object.__setattr__(self, "boundary_markers", markers)
        object.__setattr__(self, "_anchors", np.asarray(anchors, dtype=np.uint32))
        flat = [t for m in markers for t in m]
        offsets = np.zeros(len(markers) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(m) for m in markers]) if markers else []
        object.__setattr__(self, "_marker_flat", np.asarray(flat, dtype=np.uint32))
        object.__setattr__(self, "_marker_offsets", offsets)

    @property
    def mask(self) -> int:
        low = (1 << self.mask_bits) - 1
        return low if self.mask_position is MaskPosition.LOW else low << (64 - self.mask_bits)


@dataclass(frozen=True, slots=True)
class Chunks:
    """Chunk boundaries of one token sequence plus per-chunk digests (all numpy, no copies).

    ``bounds``: int64 ``[n_chunks + 1]``, chunk ``i`` is ``tokens[bounds[i]:bounds[i+1]]``.
    ``fingerprints``: uint64 ``[n_seeds, n_chunks]``, xxh64(chunk bytes, seed) per seed.
    ``prefix_digests``: uint64 ``[n_chunks]``, digest of every token before chunk ``i``
    (chained over scope-free chunk hashes; equal digests mean identical left context).
    ``end_digest``: the same digest over the whole sequence (what a chunk after the last one
    would have as its prefix digest).
    """

    bounds: np.ndarray
    fingerprints: np.ndarray
    prefix_digests: np.ndarray
    end_digest: int = 0

    def __len__(self) -> int:
        return len(self.bounds) - 1


# --------------------------------------------------------------------------------------------
# Reference implementation: the executable specification. Plain Python, arbitrary-precision ints
# masked to 64 bits; xxh64 from the xxhash package.
# --------------------------------------------------------------------------------------------


def gear_reference(token: int) -> int:
    z = ((token ^ _GEAR_C0) * _GEAR_C1) & MASK64
    return z ^ (z >> 32)


def boundaries_reference(tokens: Sequence[int], config: ChunkerConfig) -> list[int]:
    """Chunk boundaries [0, ..., n] by the rule in the module docstring."""
    n = len(tokens)
    anchors = set(config.anchor_tokens)
    markers = config.boundary_markers
    mask = config.mask
    bounds = [0]
    start = 0
    h = 0
    pending = -1  # position right after a marker: forced cut + reset there
    for i in range(n):
        t = int(tokens[i])
        force = t in anchors or i == pending
        if not force and markers:
            for m in markers:
                if tuple(int(x) for x in tokens[i : i + len(m)]) == m:
                    force = True
                    pending = i + len(m)
                    break
        if force:
            if i > start:
                bounds.append(i)
                start = i
            h = 0
        h = ((h << 1) + gear_reference(t)) & MASK64
        length = i + 1 - start
        if (length >= config.min_size and (h & mask) == 0) or length >= config.max_size:
            if i + 1 < n:
                bounds.append(i + 1)
                start = i + 1
    bounds.append(n)
    if n == 0:
        return [0]
    return bounds


def chunk_tokens_reference(tokens: np.ndarray, config: ChunkerConfig, seeds: Sequence[int], chain_seed: int) -> Chunks:
    """Reference chunking + fingerprints (see ``chunk_tokens`` for the contract)."""
    tokens = np.ascontiguousarray(tokens, dtype=np.uint32)
    bounds = boundaries_reference(tokens.tolist(), config)
    data = tokens.astype("<u4").tobytes()
    nck = len(bounds) - 1
    fps = np.zeros((len(seeds), nck), dtype=np.uint64)
    prefix = np.zeros(nck, dtype=np.uint64)
    digest = 0
    for c in range(nck):
        h0 = xxhash.xxh64_intdigest(data[4 * bounds[c] : 4 * bounds[c + 1]], seed=chain_seed)
        for s, seed in enumerate(seeds):
            fps[s, c] = chain_reference(seed, h0)
        prefix[c] = digest
        digest = chain_reference(digest, h0)
    return Chunks(np.asarray(bounds, dtype=np.int64), fps, prefix, digest)


# --------------------------------------------------------------------------------------------
# Compiled fast path (numba). Every integer is uint64 on purpose: numba promotes mixed
# signed/unsigned 64-bit arithmetic to float64.
# --------------------------------------------------------------------------------------------

_U = np.uint64
_P1, _P2, _P3, _P4, _P5 = _U(P1), _U(P2), _U(P3), _U(P4), _U(P5)
_G0, _G1 = _U(_GEAR_C0), _U(_GEAR_C1)
_S1, _S7, _S11, _S12, _S18, _S23, _S27, _S29, _S30, _S31, _S32, _S33 = (
    _U(1), _U(7), _U(11), _U(12), _U(18), _U(23), _U(27), _U(29), _U(30), _U(31), _U(32), _U(33)
)
_S64 = _U(64)


@numba.njit(inline="always")
def _rotl(x, r):
    return (x << r) | (x >> (_S64 - r))


@numba.njit(inline="always")
def _round(acc, lane):
    acc = acc + lane * _P2
    acc = _rotl(acc, _S31)
    return acc * _P1


@numba.njit(inline="always")
def _merge(acc, val):
    acc ^= _round(_U(0), val)
    return acc * _P1 + _P4


# Hand-written on purpose: the xxhash package cannot be called from nopython code, and a
# Python call per chunk would put the interpreter back into the compiled CDC pass; the tests pin
# it to xxhash.xxh64 bit for bit.
@numba.njit(inline="always")
def _xxh64_tokens(tok, a, b, seed):
    """xxh64 of the little-endian bytes of tok[a:b] (uint32), identical to XXH64()."""
    nbytes = _U(4 * (b - a))
    i = a
    if b - a >= 8:
        v1 = seed + _P1 + _P2
        v2 = seed + _P2
        v3 = seed
        v4 = seed - _P1
        while i + 8 <= b:
            v1 = _round(v1, _U(tok[i]) | (_U(tok[i + 1]) << _S32))
            v2 = _round(v2, _U(tok[i + 2]) | (_U(tok[i + 3]) << _S32))
            v3 = _round(v3, _U(tok[i + 4]) | (_U(tok[i + 5]) << _S32))
            v4 = _round(v4, _U(tok[i + 6]) | (_U(tok[i + 7]) << _S32))
            i += 8
        h = _rotl(v1, _S1) + _rotl(v2, _S7) + _rotl(v3, _S12) + _rotl(v4, _S18)
        h = _merge(h, v1)
        h = _merge(h, v2)
        h = _merge(h, v3)
        h = _merge(h, v4)
    else:
        h = seed + _P5
    h += nbytes
    while i + 2 <= b:
        h ^= _round(_U(0), _U(tok[i]) | (_U(tok[i + 1]) << _S32))
        h = _rotl(h, _S27) * _P1 + _P4
        i += 2
    if i < b:
        h ^= _U(tok[i]) * _P1
        h = _rotl(h, _S23) * _P2 + _P3
    h ^= h >> _S33
    h *= _P2
    h ^= h >> _S29
    h *= _P3
    h ^= h >> _S32
    return h


@numba.njit(cache=True, nogil=True)
def _chain(prev, chunk_hash):
    x = (prev ^ chunk_hash) * _P1
    x ^= x >> _S29
    x *= _P2
    return x ^ (x >> _S32)


@numba.njit(cache=True, nogil=True)
def _is_anchor(t, anchors):
    """Binary search; the caller has checked anchors[0] <= t <= anchors[-1]."""
    n = anchors.shape[0]
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if anchors[mid] < t:
            lo = mid + 1
        else:
            hi = mid
    return anchors[lo] == t


@numba.njit(cache=True, nogil=True)
def _marker_at(tok, i, flat, offsets):
    """Length of the first marker that starts at tok[i], or 0."""
    n = tok.shape[0]
    for m in range(offsets.shape[0] - 1):
        a = offsets[m]
        ln = offsets[m + 1] - a
        if i + ln > n or tok[i] != flat[a]:
            continue
        ok = True
        for j in range(1, ln):
            if tok[i + j] != flat[a + j]:
                ok = False
                break
        if ok:
            return ln
    return 0


@numba.njit(cache=True, nogil=True)
def _forced_cuts(tok, anchors, marker_flat, marker_offsets):
    """Positions where a boundary is forced and the rolling state reset (anchors, markers).

    Same order of checks as ``boundaries_reference``: a pending marker end or an anchor wins;
    otherwise a marker starting here forces a cut and schedules one after its last token.
    """
    n = tok.shape[0]
    out = np.empty(n + 1, dtype=np.int64)
    nf = 0
    # One unsigned compare per token rejects everything outside [lo, hi] (wrapping subtraction).
    a_lo, a_span = _U(1), _U(0)
    has_anchor = anchors.shape[0] > 0
    if has_anchor:
        a_lo, a_span = _U(anchors[0]), _U(anchors[anchors.shape[0] - 1]) - _U(anchors[0])
    n_markers = marker_offsets.shape[0] - 1
    m_lo, m_hi = _U(0), _U(0)
    for m in range(n_markers):
        first = _U(marker_flat[marker_offsets[m]])
        if m == 0:
            m_lo, m_hi = first, first
        else:
            m_lo, m_hi = min(m_lo, first), max(m_hi, first)
    m_span = m_hi - m_lo
    pending = -1
    for i in range(n):
        tu = _U(tok[i])
        if i == pending or (has_anchor and tu - a_lo <= a_span and _is_anchor(tok[i], anchors)):
            out[nf] = i
            nf += 1
        elif n_markers > 0 and tu - m_lo <= m_span:
            ln = _marker_at(tok, i, marker_flat, marker_offsets)
            if ln > 0:
                out[nf] = i
                nf += 1
                pending = i + ln
    return out[:nf]


@numba.njit(cache=True, nogil=True)
def _boundaries(tok, anchors, marker_flat, marker_offsets, mask, min_size, max_size):
    n = tok.shape[0]
    forced = _forced_cuts(tok, anchors, marker_flat, marker_offsets)
    bounds = np.empty(n + 2, dtype=np.int64)
    bounds[0] = 0
    nb = 1
    seg_start = 0
    for f in range(forced.shape[0] + 1):
        seg_end = forced[f] if f < forced.shape[0] else n
        if seg_end > seg_start and seg_start > 0 and bounds[nb - 1] != seg_start:
            bounds[nb] = seg_start
            nb += 1
        # Gear loop over one segment between forced cuts; the state starts from zero.
        h = _U(0)
        start = seg_start
        for i in range(seg_start, seg_end):
            z = (_U(tok[i]) ^ _G0) * _G1
            h = (h << _S1) + (z ^ (z >> _S32))
            if (h & mask) == 0:
                if i + 1 - start >= min_size:
                    bounds[nb] = i + 1
                    nb += 1
                    start = i + 1
            elif i + 1 - start >= max_size:
                bounds[nb] = i + 1
                nb += 1
                start = i + 1
        seg_start = seg_end
    if n > 0 and bounds[nb - 1] != n:
        bounds[nb] = n
        nb += 1
    return bounds[:nb].copy()


@numba.njit(cache=True, nogil=True)
def _digests(tok, bounds, seeds, chain_seed):
    """One xxh64 pass per chunk (seeded with the identity salt), then per-scope keys.

    key(scope) = mix(scope_seed, h0) is a bijection of h0 for a fixed scope, so two chunks
    collide in a scope exactly when their salted content hashes collide (and every hit is
    token-verified anyway).
    """
    nck = bounds.shape[0] - 1
    nseeds = seeds.shape[0]
    fps = np.empty((nseeds, nck), dtype=np.uint64)
    prefix = np.empty(nck, dtype=np.uint64)
    digest = _U(0)
    for c in range(nck):
        h0 = _xxh64_tokens(tok, bounds[c], bounds[c + 1], chain_seed)
        for s in range(nseeds):
            fps[s, c] = _chain(seeds[s], h0)
        prefix[c] = digest
        digest = _chain(digest, h0)
    return fps, prefix, digest


def chunk_tokens(tokens: np.ndarray, config: ChunkerConfig, seeds: Sequence[int] | np.ndarray, chain_seed: int) -> Chunks:
    """Chunk ``tokens`` (uint32 ``[n]``) and fingerprint every chunk under each seed.

    ``seeds``: one xxh64 seed per scope to search (``CacheIdentity.scope_seed``);
    ``chain_seed``: the scope-free identity salt used for prefix digests. Pure function,
    thread-safe, releases the GIL. Identical output to ``chunk_tokens_reference``.
    """
    tok = np.ascontiguousarray(tokens, dtype=np.uint32)
    seed_arr = np.asarray(seeds, dtype=np.uint64)
    bounds = _boundaries(
        tok, config._anchors, config._marker_flat, config._marker_offsets, _U(config.mask), config.min_size, config.max_size
    )
    fps, prefix, end = _digests(tok, bounds, seed_arr, _U(chain_seed))
    return Chunks(bounds, fps, prefix, int(end))


_VS = _U(VARIANT_SEED)


@numba.njit(inline="always")
def _variant(chunk_key, prefix_digest):
    """``entry.variant_key`` (the planners inline it)."""
    return _chain(prefix_digest ^ _VS, chunk_key)


@numba.njit(cache=True, nogil=True)
def _variant_keys(fps, prefix):
    out = np.empty_like(fps)
    for s in range(fps.shape[0]):
        for c in range(fps.shape[1]):
            out[s, c] = _variant(fps[s, c], prefix[c])
    return out


def variant_keys(chunks: Chunks) -> np.ndarray:
    """uint64 ``[n_seeds, n_chunks]``: per scope and chunk, the key of the chunk's copy computed
    after this very left context (``entry.variant_key(fingerprint, prefix digest)``), which a
    registry holds when that chunk was stored after other text first (its other copies)."""
    return _variant_keys(chunks.fingerprints, chunks.prefix_digests)


def warmup(config: ChunkerConfig | None = None) -> None:
    """Compile (or load from numba's cache) the kernel before the first request."""
    cfg = config or ChunkerConfig()
    variant_keys(chunk_tokens(np.arange(600, dtype=np.uint32), cfg, [1, 2], 3))
