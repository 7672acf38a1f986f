"""The reference engine's options and results: reuse policy, rotation placement, sampling,
AdmitActive gating; timings and the outcome of one prefill or generation (``engine.py``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import torch

from clients.transformers.cache import SequenceCache
from sidecar.client import FetchedKV
from sidecar.registry.lookup_plan import Fidelity, LookupPlan


class Rotation(str, Enum):
    """Who re-positions the keys of a shifted hit."""

    SERVER = "server"  # Fetch rotates (fp32, one rounding): the default
    CLIENT = "client"  # raw Fetch, the engine rotates (same kernel); timed separately
    NONE = "none"  # raw Fetch, no rotation at all: the naive control, wrong on purpose


@dataclass(frozen=True, kw_only=True)
class ReusePolicy:
    """Which caches a request may use and how (engine default, overridable per request).

    ``store=False`` leaves no trace: nothing is Stored and the own prefix cache is not updated
    (the fidelity harness evaluates every arm against the same cache state this way).
    ``min_fetch_tokens``: when a plan's hits add up to fewer tokens than this, they are
    prefilled instead (a Fetch round trip costs more than prefilling a handful of tokens; on
    append-only traffic the only hits are often the few tokens between the own prefix cache's
    last whole block and the next chunk boundary).
    """

    prefix_cache: bool = True
    sidecar: bool = True
    admission: str = "position_independent"
    left_context_window: int | None = None  # None: the sidecar's default_left_context_window
    recompute_tokens: int | None = None  # None: the sidecar's default_recompute_tokens
    repair_scope: str | None = None  # "chunk" / "segment"; None: the sidecar's default_repair_scope
    rotation: Rotation = Rotation.SERVER
    store: bool = True
    min_fetch_tokens: int = 32
    store_shared: bool = False  # Store into the shared scope (operator-granted tenants; warm-up)
    #: on the sidecar's host, move KV through its shared pool (``sidecar.sdk.pool``: leased
    #: Fetch rotated by the engine, reserved Store) when the Fetch rotates (``Rotation.SERVER``)
    #: and the layout is GQA / MHA; otherwise, or when there is no pool, Fetch and Store. Off by
    #: default here: on the TTFT bench's small random model (48 span items of 4-layer fp32 KV)
    #: the pooled Fetch took 80 ms against 21 ms through the shared-memory buffer (per-chunk
    #: work in the client); the pool pays off on large KV (``./dev bench dataplane``)
    shared_pool: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "rotation", Rotation(self.rotation))


#: The three TTFT arms.
CACHE_OFF = ReusePolicy(prefix_cache=False, sidecar=False)
EXACT_PREFIX = ReusePolicy(prefix_cache=True, sidecar=False)
SIDECAR = ReusePolicy(prefix_cache=True, sidecar=True)


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """``temperature == 0``: greedy. Otherwise softmax(logits / T) restricted to ``top_k`` /
    ``top_p`` and drawn with a ``torch.Generator`` seeded by ``seed`` (same seed, same tokens)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("sampling: temperature >= 0, 0 < top_p <= 1, top_k >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class Timings:
    """Seconds. ``ttft_s`` is request start to first-token logits (what the engine waits for);
    ``store_s`` and ``decode_s`` come after it."""

    prefix_s: float = 0.0  # own prefix-cache match + copy
    lookup_s: float = 0.0
    fetch_s: float = 0.0  # the Fetch RPC (includes server-side rotation)
    rotate_s: float = 0.0  # client-side rotation (Rotation.CLIENT)
    assemble_s: float = 0.0  # decoding payloads and writing them into the cache
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    store_s: float = 0.0
    decode_s: float = 0.0

    @property
    def overhead_s(self) -> float:
        """Sidecar overhead on the TTFT path: Lookup + Fetch + rotation + cache assembly."""
        return self.lookup_s + self.fetch_s + self.rotate_s + self.assemble_s


@dataclass(slots=True)
class Step:
    """One executed segment: ``prefill`` or ``hit`` (with its fetched chunk)."""

    kind: str
    start: int
    end: int
    fidelity: Fidelity = Fidelity.NONE
    fetched: FetchedKV | None = None
    offset: int = 0


@dataclass(slots=True)
class PrefillResult:
    """One prompt through the engine. ``cache`` holds its KV (positions 0..n-1); after a
    ``prefill`` with ``reuse.store`` the own prefix cache shares it, so do not modify it."""

    tokens: np.ndarray
    cache: SequenceCache
    logits: torch.Tensor | None  # float32 [vocab]: next-token logits after the last prompt token
    plan: LookupPlan | None
    steps: list[Step]
    timings: Timings
    prefix_tokens: int = 0
    exact_tokens: int = 0
    shifted_tokens: int = 0
    prefill_tokens: int = 0
    fetch_misses: int = 0
    fetch_bytes: int = 0
    stored_chunks: int = 0

    @property
    def recovered_tokens(self) -> int:
        return self.prefix_tokens + self.exact_tokens + self.shifted_tokens


@dataclass(slots=True)
class Generation:
    prompt: PrefillResult
    tokens: list[int] = field(default_factory=list)  # generated ids, first one included
    #: float32 [len(tokens), vocab] log-probabilities of each step (``return_logprobs=True``)
    logprobs: torch.Tensor | None = None

    @property
    def ttft_s(self) -> float:
        return self.prompt.timings.ttft_s


@dataclass(slots=True)
class Scored:
    logprobs: torch.Tensor  # float32 [T, vocab]
    prompt: PrefillResult


def _as_tokens(tokens: Any) -> np.ndarray:
    arr = np.ascontiguousarray(np.asarray(tokens), dtype=np.int64)
    if arr.ndim != 1 or len(arr) == 0:
        raise ValueError("tokens: expected a non-empty 1-D sequence of token ids")
    if arr.min() < 0 or arr.max() >= 1 << 32:
        raise ValueError("tokens: ids must fit uint32")
    return arr.astype(np.uint32)


@dataclass(frozen=True)
class ActiveAdmission:
    """Ask the sidecar before a large prefill (docs/claims.md, "What the engines do").

    Before a prefill whose live KV (prompt + ``reserve``) is at least ``min_blocks`` blocks of
    ``block_size`` tokens, the engine calls ``AdmitActive``: *admitted* runs; *deferred* waits
    ``retry_after_s`` (``sleep``) and asks again, at most ``max_deferrals`` times, then raises
    ``ActiveRefused``; *refused* raises ``ActiveRefused`` at once (with the blocking claim ids
    and the capacity proof): the request is not run, so protected resident KV is never evicted
    to make room for it. ``pool_blocks``: the engine's KV budget reported with ``ReportPool``
    before each ask (None: report nothing, another party reports the pool). The reference
    engine runs one sequence and holds claimed KV only through the sidecar, so it reports
    ``hard_protection`` (victim exclusion is the sidecar's, C1)."""

    min_blocks: int = 1
    block_size: int = 16
    pool_blocks: int | None = None
    max_deferrals: int = 20
    sleep: Any = time.sleep


class ActiveRefused(RuntimeError):
    """AdmitActive refused the request (or deferred it past ``max_deferrals``): not run."""

    def __init__(self, request_id: str, decision: str, blocking: tuple[str, ...], proof: Any, reason: str) -> None:
        super().__init__(
            f"request {request_id} {decision} by the sidecar: {reason} (blocking claims {list(blocking)})"
        )
        self.request_id = request_id
        self.decision = decision
        self.blocking_claim_ids = blocking
        self.proof = proof


