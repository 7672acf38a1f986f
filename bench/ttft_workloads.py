"""The TTFT benchmark's workloads (``bench.ttft``): agent_meta (a changing header over long
notes), the agent traces with the truncation policy, and the profiles that size them."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import numpy as np

ARMS = ("cache_off", "exact_prefix", "sidecar")
APPEND_ONLY = "trace:tau_bench"


@dataclass(frozen=True, kw_only=True)
class BenchWorkload:
    label: str
    requests: tuple[np.ndarray, ...]
    append_only: bool = False
    description: str = ""
    repeats: int = 1  # measurements per request and arm (the fastest counts): short prompts are noisy
    repeat_arms: tuple[str, ...] = ARMS  # the arms ``repeats`` applies to (the others run once)


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Workload sizes for one model (``PROFILES``)."""

    notes_docs: int  # documents per agent_meta reference note (``long_notes_pool``)
    headers: tuple[int, ...] = (50, 250, 1000, 2000)
    requests: int = 5  # default --requests (per synthetic workload; H=1000 gets 2 more)
    sweep_requests: int | None = None  # agent_meta headers other than H=1000 (None: --requests)
    trace_calls: int = 10
    edit_calls_per_pass: int = 4
    edit_requests: int = 8
    short_repeats: int = 2  # repeats of sysvar, rerank and edit replay
    trace_repeats: int = 2
    repeat_arms: tuple[str, ...] = ARMS
    max_prompt_tokens: int | None = None  # the model's positions: longer prompts are an error


PROFILES = {
    # ~4.5K-token body + two 5-document notes = ~8K with the offline tokenizer; short prompts.
    "random": Profile(notes_docs=5),
    # Real model at ~600 prefill tokens/s: agent_meta's body with two single-document notes is
    # ~5K SmolLM2 tokens (tools 2.7K, policy 1.3K), so H=2000 still fits in 8192 positions. Long
    # prompts: full prefills run once; only the traces' cheap cache arms are measured twice.
    "smollm2": Profile(notes_docs=1, requests=4, sweep_requests=3, trace_calls=8, edit_calls_per_pass=3,
                       edit_requests=6, short_repeats=1, repeat_arms=("exact_prefix", "sidecar"),
                       max_prompt_tokens=8192),
}


def long_notes_pool(pool, docs_per_note: int):
    """The same text pool with each reference document replaced by ``docs_per_note`` joined
    ones (agent_meta's body, policy + tools + two notes, grows from ~4.5K to ~8K offline tokens
    with 5). ``docs_per_note=1`` is the pool itself."""
    if docs_per_note == 1:
        return pool
    docs = pool.documents
    joined = tuple(
        "\n\n".join(docs[(i + j) % len(docs)] for j in range(docs_per_note)) for i in range(0, len(docs), docs_per_note)
    )
    return dataclasses.replace(pool, documents=joined)


#: agent_meta's header sits at tokens [3, 3 + H): after "<|im_start|><|system|>\n" (offline
#: template) or "<|im_start|>system\n" (SmolLM2's ChatML template: also three ids).
HEADER_START = 3


def trim_header(tokens: np.ndarray, header_tokens: int, cut: int) -> np.ndarray:
    """An agent_meta prompt with the last ``cut`` tokens of its ``header_tokens``-token header
    removed: everything after the header moves by ``-cut`` (agent_meta's headers all have the
    same length, so without this the shared body would sit at the same position in every
    request and no rotation would ever run)."""
    end = HEADER_START + header_tokens
    return np.concatenate([tokens[: end - cut], tokens[end:]]).astype(np.uint32)


def agent_meta_workload(pool, template, *, header_tokens: int, n_requests: int, seed: int,
                        notes_docs: int) -> BenchWorkload:
    """agent_meta with ``notes_docs``-document notes and headers trimmed by 0..min(64, H/2)
    tokens per request (so the shared body moves)."""
    from workloads import agent_meta

    h = header_tokens
    w = agent_meta(long_notes_pool(pool, notes_docs), template, header_tokens=h, n_requests=n_requests, seed=seed)
    rng = np.random.default_rng([seed, h, 7])
    cuts = rng.integers(0, min(64, h // 2) + 1, size=n_requests)
    reqs = tuple(trim_header(r, h, int(c)) for r, c in zip(w.requests, cuts))
    body = {1: "~5K", 5: "~8K"}.get(notes_docs, f"{notes_docs}-document notes")
    desc = w.description.replace("~4.5K", body).replace(
        f"unique {h}-token header", f"unique header of {h} minus 0..{min(64, h // 2)} tokens")
    return BenchWorkload(label=w.label, requests=reqs, description=desc)


def build_workloads(args: argparse.Namespace, template, profile: Profile | None = None) -> list[BenchWorkload]:
    from workloads import TextPool, TruncateOldToolOutputs, edit_replay, rerank, sysvar, trace_workload

    prof = profile or PROFILES["random"]
    pool = TextPool.load()
    n = args.requests
    out: list[BenchWorkload] = []
    headers = (1000,) if args.quick else prof.headers
    for h in headers:
        k = n + 2 if h == 1000 else (prof.sweep_requests or n)
        out.append(agent_meta_workload(pool, template, header_tokens=h, n_requests=k, seed=args.seed,
                                       notes_docs=prof.notes_docs))
    short = dict(repeats=prof.short_repeats, repeat_arms=prof.repeat_arms)
    if not args.quick:
        # Two topics (not rerank's default 12) so a handful of requests already repeats documents.
        for w in (sysvar(pool, template, n_requests=n, seed=args.seed),
                  rerank(pool, template, n_topics=2, n_requests=n, seed=args.seed)):
            out.append(BenchWorkload(label=w.label, requests=w.requests, description=w.description, **short))
        w = edit_replay(pool, template, calls_per_pass=prof.edit_calls_per_pass, n_requests=prof.edit_requests,
                        seed=args.seed)
        out.append(BenchWorkload(label=w.label, requests=w.requests, description=w.description, **short))
    calls = 4 if args.quick else args.trace_calls
    traces = dict(repeats=prof.trace_repeats, repeat_arms=prof.repeat_arms)
    w = trace_workload("tau_bench", template, limit=1)
    out.append(BenchWorkload(label=APPEND_ONLY, requests=w.requests[:calls], append_only=True, **traces,
                             description=f"first {calls} calls of a tau-bench trajectory as recorded (append-only)"))
    if not args.quick:
        w = trace_workload("mini_swe", template, limit=1, policy=TruncateOldToolOutputs())
        reqs = w.requests[8 : 8 + calls]  # calls 8.. have long enough prompts (~2.7K-4.4K offline tokens)
        out.append(BenchWorkload(label="trace:mini_swe[truncated]", requests=reqs, **traces,
                                 description=f"{calls} calls of a mini-swe trajectory, old tool outputs truncated"))
    if prof.max_prompt_tokens is not None:
        for w in out:
            longest = max(len(r) for r in w.requests)
            if longest >= prof.max_prompt_tokens:
                raise ValueError(f"{w.label}: a {longest}-token prompt does not fit the model's "
                                 f"{prof.max_prompt_tokens} positions")
    return out


