"""vLLM in miniature, as the connector's role classes see it (no vLLM needed).

Like vLLM's own connector tests (``tests/v1/kv_connector/unit/utils.py``): fake requests and a
fake scheduler drive the real scheduler side (``clients.vllm.scheduler_side``) and, when given,
the real worker side over a CPU paged cache in the ``vec`` block layout; the sidecar they talk
to is a real one.

``FakeScheduler`` keeps what the connector depends on from vLLM's scheduler:

* a waiting queue asked in order every step; ``None`` from ``get_num_new_matched_tokens``
  leaves a request waiting (gap-fill sub-requests added meanwhile are asked in the same step);
* a prefix cache of whole blocks: a request's local hit is its longest cached block prefix, at
  most ``n - 1`` tokens; a finished request's full blocks enter it;
* block ids handed out in order (block 0 is vLLM's null block), the cached prefix's blocks
  reused;
* each scheduled request is prefilled in one step (loads, then the forward writes the KV of the
  tokens it computes, then stores) and finishes there (one output token);
* ``SchedulerHooks``: gap-fill sub-requests join the queue (their outputs dropped), the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from clients.vllm.jobs import StepJobs
from clients.vllm.scheduler_side import SchedulerSide
from clients.vllm.worker_side import WorkerSide


@dataclass
class Request:
    """The attributes of ``vllm.v1.request.Request`` the scheduler side reads."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    max_tokens: int = 1


@dataclass
class NewRequestData:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]


@dataclass
class Scheduled:
    """One request as this step scheduled it: ``local`` own hit, ``external`` loaded tokens."""

    request: Request
    block_ids: list[int]
    local: int
    external: int


def kv_rows(tokens: np.ndarray, positions: np.ndarray, num_layers: int, heads: int, head_size: int,
            dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The KV the fake model computes for ``positions``: ``[L, 2, n, H, D]``, small integers
    (exact in bf16) depending on the token, its position, the layer, K/V, head and dim."""
    t = torch.as_tensor(tokens[positions].astype(np.int64)).view(1, 1, -1, 1, 1)
    p = torch.as_tensor(positions.astype(np.int64)).view(1, 1, -1, 1, 1)
    li = torch.arange(num_layers).view(-1, 1, 1, 1, 1)
    kv = torch.arange(2).view(1, 2, 1, 1, 1)
    h = torch.arange(heads).view(1, 1, 1, -1, 1)
    d = torch.arange(head_size).view(1, 1, 1, 1, -1)
    return (((t * 7 + p * 3 + li * 5 + kv * 11 + h * 13 + d) % 251) - 125).to(dtype)


def latent_rows(tokens: np.ndarray, positions: np.ndarray, num_layers: int, width: int,
                dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The MLA latent rows the fake model computes: ``[L, n, C]`` small integers (exact in bf16)."""
    t = torch.as_tensor(tokens[positions].astype(np.int64)).view(1, -1, 1)
    p = torch.as_tensor(positions.astype(np.int64)).view(1, -1, 1)
    li = torch.arange(num_layers).view(-1, 1, 1)
    c = torch.arange(width).view(1, 1, -1)
    return (((t * 5 + p * 3 + li * 7 + c * 11) % 241) - 120).to(dtype)


class FakeScheduler:
    """See the module docstring. ``take(rid, offered)`` is how many of the offered external
    tokens vLLM takes (default: all); ``before_forward(jobs)`` runs between scheduling and the
    worker's loads (a test's chance to change the sidecar under the step)."""

    def __init__(
        self,
        side: SchedulerSide,
        worker: WorkerSide | list[WorkerSide] | None = None,
        *,
        pool: tuple[int, int] | None = (1000, 900),
        bind: bool = True,
        take: Callable[[str, int], int] | None = None,
        before_forward: Callable[[StepJobs], None] | None = None,
    ) -> None:
        self.side = side
        # tensor-parallel ranks in order: rank r holds heads [r * H, (r + 1) * H) of the model
        self.workers = [] if worker is None else list(worker) if isinstance(worker, list) else [worker]
        self.worker = self.workers[0] if self.workers else None
        self.block_size = side.block_size
        self.pool = pool
        self.take = take
        self.before_forward = before_forward
        self.waiting: list[Request] = []
        self.internal: set[str] = set()
        self.gap_fill_requests: list[tuple[str, Request]] = []  # (parent id, sub-request)
        self.prefix_cache: dict[bytes, int] = {}  # block-aligned token prefix -> its last block's id
        self.next_block = 1
        self.outputs: dict[str, dict[str, Any] | None] = {}  # finished client requests' kv_transfer_params
        self.steps: list[tuple[list[Scheduled], StepJobs]] = []
        if bind:
            side.bind(self)

    # ------------------------------------------------------------------ SchedulerHooks

    def add_gap_fill_request(self, parent: Request, request_id: str, prompt_token_ids: list[int],
                             kv_transfer_params: dict[str, Any]) -> None:
        sub = Request(request_id, prompt_token_ids, kv_transfer_params, max_tokens=1)
        self.gap_fill_requests.append((parent.request_id, sub))
        self.internal.add(request_id)
        self.waiting.append(sub)

    def kv_pool_blocks(self) -> tuple[int, int] | None:
        return self.pool

    # ------------------------------------------------------------------ the engine loop

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def local_hit(self, tokens: list[int]) -> tuple[int, list[int]]:
        """vLLM's own prefix hit (whole blocks, at most n - 1 tokens) and its blocks."""
        B, blocks = self.block_size, []
        arr = np.asarray(tokens, dtype=np.uint32)
        for k in range(1, (len(tokens) - 1) // B + 1):
            bid = self.prefix_cache.get(arr[: k * B].tobytes())
            if bid is None:
                break
            blocks.append(bid)
        return len(blocks) * B, blocks

    def step(self) -> StepJobs:
        """Schedule what the connector lets run, then load, compute, store and finish it."""
        scheduled: list[Scheduled] = []
        i = 0
        while i < len(self.waiting):  # a gap-fill sub-request added on the way is asked this step
            req = self.waiting[i]
            local, cached = self.local_hit(req.prompt_token_ids)
            m, load_async = self.side.get_num_new_matched_tokens(req, local)
            assert load_async is False, "the sidecar connector loads synchronously"
            if m is None:
                i += 1
                continue
            self.waiting.pop(i)
            if self.take is not None:
                m = self.take(req.request_id, m)
            n = len(req.prompt_token_ids)
            fresh = -(-n // self.block_size) - len(cached)
            blocks = cached + list(range(self.next_block, self.next_block + fresh))
            self.next_block += fresh
            self.side.update_state_after_alloc(req, m)
            scheduled.append(Scheduled(req, blocks, local, m))
        out = SchedulerOutput(
            [NewRequestData(s.request.request_id, (list(s.block_ids),), s.local + s.external) for s in scheduled],
            CachedRequestData(),
            {s.request.request_id: len(s.request.prompt_token_ids) - s.local - s.external for s in scheduled},
        )
        jobs = self.side.build_jobs(out)
        if self.before_forward is not None:
            self.before_forward(jobs)
        if self.workers:
            failed: set[int] = set()
            for w in self.workers:  # vLLM recomputes the blocks any rank failed to load, on every rank
                w.load(jobs.loads)
                failed |= w.take_load_errors()
            for s in scheduled:
                self._forward(s, failed)
            for w in self.workers:
                w.save(jobs.stores)
        for s in scheduled:
            self._finish(s)
        self.steps.append((scheduled, jobs))
        return jobs

    def run(self, max_steps: int = 8) -> None:
        """Step until nothing waits."""
        for _ in range(max_steps):
            if not self.waiting:
                return
            self.step()
        raise AssertionError(f"requests still waiting after {max_steps} steps: {[r.request_id for r in self.waiting]}")

    def _forward(self, s: Scheduled, failed: set[int]) -> None:
        """The model computes the tokens after the loaded run (and recomputes failed blocks)."""
        tokens = np.asarray(s.request.prompt_token_ids, dtype=np.uint32)
        B, n = self.block_size, len(tokens)
        pos = np.arange(s.local + s.external, n)
        redo = [p for i, b in enumerate(s.block_ids) if b in failed for p in range(i * B, min((i + 1) * B, n))]
        if redo:
            pos = np.union1d(pos, np.asarray(redo))
        shape = self.worker.shape
        h = shape.num_kv_heads
        stages = self.stage_layers()
        if shape.mla:  # every tensor-parallel rank holds the same latent rows of its stage's layers
            rows = latent_rows(tokens, pos, sum(stages.values()), shape.head_size, self.worker.paged.dtype)
            for w in self.workers:
                lo = sum(n for stage, n in stages.items() if stage < w.shape.pp_rank)
                w.paged.scatter(rows[lo:lo + w.shape.num_layers], torch.tensor(s.block_ids, dtype=torch.int64),
                                torch.from_numpy(pos.astype(np.int64)))
            return
        rows = kv_rows(tokens, pos, sum(stages.values()), h * shape.tp_size, shape.head_size, self.worker.paged.dtype)
        for w in self.workers:
            ws = w.shape
            lo = sum(n for stage, n in stages.items() if stage < ws.pp_rank)
            w.paged.scatter(rows[lo:lo + ws.num_layers, :, :, ws.tp_rank * h:(ws.tp_rank + 1) * h],
                            torch.tensor(s.block_ids, dtype=torch.int64), torch.from_numpy(pos.astype(np.int64)))

    def stage_layers(self) -> dict[int, int]:
        """Pipeline stage -> its number of layers (each worker holds its stage's layers and its
        tensor-parallel rank's heads of the model's KV)."""
        return {w.shape.pp_rank: w.shape.num_layers for w in self.workers}

    def _finish(self, s: Scheduled) -> None:
        req = s.request
        arr = np.asarray(req.prompt_token_ids, dtype=np.uint32)
        for k in range(1, len(arr) // self.block_size + 1):
            self.prefix_cache.setdefault(arr[: k * self.block_size].tobytes(), s.block_ids[k - 1])
        _, params = self.side.request_finished(req)
        if req.request_id in self.internal:
            self.internal.discard(req.request_id)  # a gap-fill sub-request: its output is dropped
            return
        self.outputs[req.request_id] = params
