"""The arms of the recovery benchmark (``bench.recovery``): what each cache would serve.

``exact_prefix_hits`` (an engine's block-granular exact-prefix cache), ``LMCacheArm`` (LMCache's
256-token chunk prefix), ``oracle_hits`` (every token whose 64-token window was seen before, the
upper bound), ``SidecarArm`` (the sidecar's own Lookup plans over a real server); token runs are
hashed with a vectorised 64-bit polynomial hash (``PolyHasher``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

EXACT_BLOCK = 16
LMCACHE_CHUNK = 256
ORACLE_WINDOW = 64
GOAL_ORACLE_FRACTION = 0.95
#: no hit segment (and no Fetch item) below this many tokens
MIN_FETCH_TOKENS = 16
TRACE_NAMES = ("tau_bench", "mini_swe")
#: ``--quick`` replays this many trajectories per trace file; the default run replays all of them.
QUICK_TRACE_LIMITS = {"tau_bench": 8, "mini_swe": 3}

# ---------------------------------------------------------------------------------------------
# Vectorised 64-bit hashing of token runs
# ---------------------------------------------------------------------------------------------

_U64 = np.uint64
_MIX1 = _U64(0xBF58476D1CE4E5B9)
_MIX2 = _U64(0x94D049BB133111EB)
_TOKEN_SALT = _U64(0x9E3779B97F4A7C15)
_BASE = 0xD6E8FEB86659FD93  # odd, so invertible mod 2**64
_BASE_INV = pow(_BASE, -1, 1 << 64)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over a uint64 array (wrapping arithmetic, new array)."""
    x = x ^ (x >> _U64(30))
    x *= _MIX1
    x ^= x >> _U64(27)
    x *= _MIX2
    return x ^ (x >> _U64(31))


class PolyHasher:
    """Polynomial hashes mod 2^64 of token runs, all positions at once.

    With ``m_i = mix(token_i)`` and ``S_k = sum_{i<k} m_i * B^i``, the run ``tokens[a:b]`` hashes to
    ``(S_b - S_a) * B^-a`` (= ``sum m_{a+t} B^t``, independent of where the run sits), finished by a
    splitmix64 round. Tokens are mixed first, so the structured inputs that break plain
    polynomial hashing mod 2^64 (Thue-Morse strings) do not arise. Collisions are ~2^-64 per pair.
    Holds the powers of B (grown on demand); not thread-safe.
    """

    def __init__(self) -> None:
        self._pow = np.ones(1, dtype=_U64)
        self._ipow = np.ones(1, dtype=_U64)

    def _powers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self._pow) < n:
            size = max(n, 2 * len(self._pow))
            self._pow = np.concatenate([[_U64(1)], np.cumprod(np.full(size - 1, _BASE, dtype=_U64))])
            self._ipow = np.concatenate([[_U64(1)], np.cumprod(np.full(size - 1, _BASE_INV, dtype=_U64))])
        return self._pow[:n], self._ipow[:n]

    def _prefix_sums(self, tokens: np.ndarray) -> np.ndarray:
        n = len(tokens)
        pw, _ = self._powers(n + 1)
        s = np.zeros(n + 1, dtype=_U64)
        np.cumsum(_mix64(tokens.astype(_U64) + _TOKEN_SALT) * pw[:n], out=s[1:])
        return s

    def window_keys(self, tokens: np.ndarray, width: int) -> np.ndarray:
        """``uint64 [max(0, n - width + 1)]``: key of ``tokens[j:j+width]`` for every start j."""
        n = len(tokens)
        if n < width:
            return np.zeros(0, dtype=_U64)
        s = self._prefix_sums(tokens)
        _, ipw = self._powers(n - width + 1)
        return _mix64((s[width:] - s[: n - width + 1]) * ipw ^ _U64(width))

    def prefix_keys(self, tokens: np.ndarray, block: int) -> np.ndarray:
        """``uint64 [n // block]``: key of the whole prefix ``tokens[:(k+1)*block]`` for each k.

        Equal keys mean equal prefixes, the same matching rule as prefix-chained block hashes.
        """
        nb = len(tokens) // block
        if nb == 0:
            return np.zeros(0, dtype=_U64)
        s = self._prefix_sums(tokens[: nb * block])
        ends = np.arange(1, nb + 1, dtype=np.int64) * block
        return _mix64(s[ends] ^ ends.astype(_U64))


def seen_earlier(keys: Sequence[np.ndarray]) -> list[np.ndarray]:
    """For each request's keys, whether each key occurred in a strictly earlier request.

    One stable sort over all keys of the workload: within a group of equal keys the first
    element belongs to the earliest request holding it.
    """
    lens = np.fromiter((len(k) for k in keys), dtype=np.int64, count=len(keys))
    if lens.sum() == 0:
        return [np.zeros(0, dtype=bool) for _ in keys]
    allk = np.concatenate([np.asarray(k, dtype=_U64) for k in keys])
    req = np.repeat(np.arange(len(keys), dtype=np.int64), lens)
    order = np.argsort(allk, kind="stable")
    sk = allk[order]
    first = np.empty(len(sk), dtype=bool)
    first[0] = True
    np.not_equal(sk[1:], sk[:-1], out=first[1:])
    group = np.cumsum(first) - 1
    sreq = req[order]
    earliest = sreq[first]
    out = np.empty(len(sk), dtype=bool)
    out[order] = earliest[group] < sreq
    return np.split(out, np.cumsum(lens)[:-1])


def _leading_true(mask: np.ndarray) -> int:
    """Length of the leading run of True."""
    if mask.all():
        return len(mask)
    return int(np.argmin(mask))


# ---------------------------------------------------------------------------------------------
# Arms
# ---------------------------------------------------------------------------------------------


def _engine_cap(n: int, block: int) -> int:
    """Most tokens an engine takes from its cache for an ``n``-token prompt: whole blocks of
    the first ``n - 1`` tokens (the last token is always computed to get logits; vLLM and
    LMCache's vLLM connector both hold one token back on a full hit)."""
    return max(n - 1, 0) // block * block


def exact_prefix_hits(requests: Sequence[np.ndarray], hasher: PolyHasher, block: int = EXACT_BLOCK) -> np.ndarray:
    """vLLM APC: tokens in the longest run of leading full blocks seen before, per request."""
    seen = seen_earlier([hasher.prefix_keys(r, block) for r in requests])
    hits = [min(_leading_true(s) * block, _engine_cap(len(r), block)) for r, s in zip(requests, seen)]
    return np.asarray(hits, dtype=np.int64)


class LMCacheArm:
    """LMCache's own chunk keys (``lmcache.v1.token_database.ChunkedTokenDatabase``).

    Built from ``LMCacheEngineConfig.from_defaults(chunk_size=256)``: default hash
    (``builtin`` without vLLM installed: Python's hash of (prefix_hash, token tuple, extras),
    deterministic for int tuples) and ``save_unfull_chunk=False``, so only full chunks are keys.
    A request's hit is its longest run of leading keys that an earlier request stored.
    """

    def __init__(self, chunk_size: int = LMCACHE_CHUNK) -> None:
        # LMCache warns about PYTHONHASHSEED on construction; Python's hash of int tuples does
        # not depend on it, so the keys are stable across processes anyway.
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.token_database import ChunkedTokenDatabase

        db_logger = logging.getLogger("lmcache.v1.token_database")
        level = db_logger.level
        db_logger.setLevel(logging.ERROR)
        try:
            self.config = LMCacheEngineConfig.from_defaults(chunk_size=chunk_size)
            self.db = ChunkedTokenDatabase(self.config, None)
        finally:
            db_logger.setLevel(level)
        self.chunk_size = chunk_size

    def keys(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(keys, chunk ends) as LMCache computes them for ``tokens``."""
        rows = list(self.db.process_tokens(tokens=tokens.tolist(), make_key=False))
        keys = np.asarray([h & 0xFFFFFFFFFFFFFFFF for _, _, h in rows], dtype=_U64)
        ends = np.asarray([e for _, e, _ in rows], dtype=np.int64)
        return keys, ends

    def hits(self, requests: Sequence[np.ndarray]) -> np.ndarray:
        per = [self.keys(r) for r in requests]
        seen = seen_earlier([k for k, _ in per])
        out = np.zeros(len(requests), dtype=np.int64)
        for i, ((_, ends), s) in enumerate(zip(per, seen)):  # per chunk, not per token
            run = _leading_true(s)
            out[i] = min(ends[run - 1] if run else 0, _engine_cap(len(requests[i]), self.chunk_size))
        return out


def oracle_hits(
    requests: Sequence[np.ndarray], hasher: PolyHasher, prefix_hits: np.ndarray, window: int = ORACLE_WINDOW
) -> np.ndarray:
    """Tokens covered by a ``window``-token run seen in an earlier request, union the exact prefix."""
    seen = seen_earlier([hasher.window_keys(r, window) for r in requests])
    out = np.zeros(len(requests), dtype=np.int64)
    for i, (r, s) in enumerate(zip(requests, seen)):
        n = len(r)
        diff = np.zeros(n + 1, dtype=np.int32)
        starts = np.flatnonzero(s)
        diff[starts] += 1
        diff[starts + window] -= 1
        covered = np.cumsum(diff[:n]) > 0
        covered[: prefix_hits[i]] = True
        out[i] = int(covered.sum())
    return out


@dataclass(frozen=True, kw_only=True)
class SidecarCounts:
    """Per-request token counts from the sidecar's Lookup summaries (``int64 [n_requests]``)."""

    prefix: np.ndarray
    exact: np.ndarray
    shifted: np.ndarray
    evictions: int
    verify_failures: int
    #: hit segments (coalesced runs of chunk hits, ``LookupPlan.hit_segments``) per request
    segments: np.ndarray
    #: the length of every hit segment of the workload, in tokens
    segment_tokens: np.ndarray
    #: CHUNK_HIT rows (one Fetch item each) and their lengths
    hit_rows: np.ndarray

    @property
    def recovered(self) -> np.ndarray:
        return self.prefix + self.exact + self.shifted


class SidecarArm:
    """A fresh in-process sidecar (real gRPC server on loopback) per workload run.

    Per request: ``Lookup(tokens, engine_prefix_len=exact16 hit, position_independent,
    dry_run=True)`` then ``Store(tokens)`` (metadata only). The registry is sized so that
    nothing is evicted; evictions and verification failures are reported regardless.
    """

    def __init__(self, anchor_tokens: Sequence[int], *, mask_position: str = "high", **registry) -> None:
        from sidecar.config import SidecarConfig
        from sidecar.registry.chunker import ChunkerConfig
        from sidecar.registry.registry import RegistryConfig

        self.chunker = ChunkerConfig(anchor_tokens=tuple(anchor_tokens), mask_position=mask_position)
        self.config = SidecarConfig(
            port=0,
            metrics_port=-1,
            log_level="WARNING",
            chunker=self.chunker,
            registry=RegistryConfig(capacity_entries=50_000_000, capacity_bytes=1 << 40, **registry),
        )

    def mean_chunk_tokens(self, requests: Sequence[np.ndarray]) -> float:
        """Mean chunk length this arm's chunker produces over ``requests`` (same code as the server)."""
        from sidecar.registry.chunker import chunk_tokens

        chunks = sum(len(chunk_tokens(r, self.chunker, (0,), 0)) for r in requests)
        return sum(len(r) for r in requests) / max(chunks, 1)

    def run(self, requests: Sequence[np.ndarray], engine_prefix: np.ndarray) -> SidecarCounts:
        from sidecar.app import ServerThread
        from sidecar.client import SyncSidecarClient
        from sidecar.identity import CacheIdentity

        ident = CacheIdentity(model_id="bench")
        n = len(requests)
        prefix, exact, shifted, segments = (np.zeros(n, dtype=np.int64) for _ in range(4))
        seg_tokens: list[np.ndarray] = []
        rows: list[np.ndarray] = []
        with ServerThread(self.config) as st, SyncSidecarClient(st.target, tenant="bench", timeout_s=120.0) as client:
            for i, tokens in enumerate(requests):
                plan = client.lookup(
                    tokens,
                    identity=ident,
                    engine_prefix_len=int(engine_prefix[i]),
                    policy="position_independent",
                    dry_run=True,
                )
                s = plan.summary
                if s.prefix_tokens + s.exact_tokens + s.shifted_tokens + s.prefill_tokens != len(tokens):
                    raise AssertionError(f"sidecar plan summary does not add up to the prompt at request {i}: {s}")
                prefix[i], exact[i], shifted[i] = s.prefix_tokens, s.exact_tokens, s.shifted_tokens
                segs = plan.hit_segments()
                segments[i] = len(segs)
                seg_tokens.append(segs[:, 1] - segs[:, 0])
                hit = plan.table[plan.table[:, 0] == 2].astype(np.int64)
                rows.append(hit[:, 2] - hit[:, 1])
                client.store(tokens, identity=ident)
            stats = client.stats()
        return SidecarCounts(
            prefix=prefix,
            exact=exact,
            shifted=shifted,
            evictions=int(stats.registry.evictions),
            verify_failures=int(stats.registry.verify_failures),
            segments=segments,
            segment_tokens=np.concatenate(seg_tokens) if seg_tokens else np.zeros(0, dtype=np.int64),
            hit_rows=np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64),
        )


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


