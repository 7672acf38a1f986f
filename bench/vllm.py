"""vLLM (CPU build) with and without the sidecar connector: TTFT, recovery, plan realized, answers.

Two arms per workload, each a fresh vLLM engine process (``clients.vllm.run``, bf16, block size
32, ``enforce_eager``, in-process engine core so the worker's background Stores are flushed
between requests, outside the timed path):

    vllm       vLLM alone, its own prefix caching on (APC)
    sidecar    vLLM + ``SidecarConnector`` + the gap-fill scheduler plug-in, against a real
               ``kv-sidecar serve`` (main environment; SmolLM2's chunker anchor; default
               admission guards, so recompute_tokens = 4, bridged by the connector)
    sidecar_guard  the same with ``bridge_recompute`` off: the k = 4 guard tokens of every
               shifted chunk are prefilled, each through a gap-fill round (up to 64 rounds)

Each sidecar arm gets a fresh sidecar (cold), so every arm's first request is a full prefill.

Requests run one at a time in workload order. Per request: TTFT (vLLM's own request metric,
arrival to first token: the gap-fill sub-requests, Lookup, Fetch and the copies into the paged
cache are inside it), recovery (prompt tokens not prefilled: vLLM's cached tokens for the
``vllm`` arm; for ``sidecar`` the tokens neither the request nor its gap-fill sub-requests
computed), the share of the sidecar's plan realized (those tokens / the first Lookup's
recovered tokens: vLLM's own hit plus the sidecar's hits), and whether the greedy answer equals
the ``vllm`` arm's. Statistics use the requests after each workload's first (which no cache
serves).

Workloads: agent_meta (a ~1000-token per-agent header, trimmed by 0..64 tokens per request,
before the shared ~5K-token body of policy, tools and notes; ``bench.ttft``'s builder; an
~8K body does not fit SmolLM2's 8192 positions), sysvar (tau-bench sessions whose system
prompt carries a per-call clock line) and the two real traces (mini-SWE-agent and tau-bench, old
tool outputs truncated; the last calls that fit the context).

Run: ``./dev bench vllm`` (the engine environment; ``--quick``: 3 agent_meta requests and 3
mini-SWE calls; ``--only agent_meta,sysvar``). Writes bench/results/vllm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench.harness import server_python, sidecar_process
from clients.vllm.run import model_dir, run_engine

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


#: SmolLM2's context (vLLM's max_model_len here); agent_meta's body is ~5K tokens, not
#: ~8K, because a 1000-token header + 8K body does not fit 8192 positions
MAX_MODEL_LEN = 8192


def workloads(model: str, args: argparse.Namespace) -> list[tuple[str, str, list[np.ndarray]]]:
    from transformers import AutoTokenizer

    from bench.ttft_workloads import agent_meta_workload
    from workloads import TextPool, TruncateOldToolOutputs, sysvar, trace_workload
    from workloads.hf_chat import HFChatTemplate

    tpl = HFChatTemplate(AutoTokenizer.from_pretrained(model))
    pool = TextPool.load()
    fits = MAX_MODEL_LEN - args.max_tokens
    out = []
    w = agent_meta_workload(pool, tpl, header_tokens=1000, n_requests=args.agent_requests, seed=args.seed, notes_docs=1)
    out.append(("agent_meta[H=1000]", w.description, list(w.requests)))
    if not args.quick:
        w = sysvar(pool, tpl, n_requests=args.agent_requests, seed=args.seed)
        out.append(("sysvar", w.description, list(w.requests)))
    names = ("mini_swe",) if args.quick else ("mini_swe", "tau_bench")
    for name in names:
        t = trace_workload(name, tpl, limit=1, policy=TruncateOldToolOutputs())
        # the last calls of the trajectory that fit the context (the longest histories)
        idx = [i for i, r in enumerate(t.requests) if len(r) < fits][-args.trace_calls:]
        reqs = [t.requests[i] for i in idx]
        out.append((f"trace:{name}[truncated]", f"calls {idx[0]}..{idx[-1]} of a {name} trajectory, old tool "
                    "outputs truncated (the last calls that fit the context)", reqs))
    return out


def _p50(xs: Sequence[float]) -> float | None:
    return float(np.percentile(xs, 50)) if len(xs) else None


def summarize(label: str, desc: str, prompts: list[np.ndarray], plain: dict, side: dict) -> dict[str, Any]:
    """One sidecar arm against the ``vllm`` arm."""
    rows = []
    for i, (p, a, b) in enumerate(zip(prompts, plain["results"], side["results"])):
        info = b["sidecar"] or {}
        n = len(p)
        reused_sc = int(info.get("reused_tokens", 0))
        plan = int(info.get("plan_recovered_tokens", 0))
        rows.append({
            "request": i, "prompt_tokens": n,
            "ttft_vllm_s": a["ttft_s"], "ttft_sidecar_s": b["ttft_s"],
            "recovery_vllm": (a["num_cached_tokens"] or 0) / n, "recovery_sidecar": reused_sc / n,
            "plan_recovered_tokens": plan, "reused_tokens": reused_sc,
            "plan_realized": (reused_sc / plan) if plan else None,
            # without the recompute-guard tokens the connector served from their chunk (bridged)
            "plan_realized_strict": ((reused_sc - int(info.get("bridged_tokens") or 0)) / plan) if plan else None,
            "claimed_tokens": info.get("claimed_tokens"), "local_tokens": info.get("local_tokens"),
            "bridged_tokens": info.get("bridged_tokens"), "gap_fills": info.get("gap_fills"),
            "lookup_ms": info.get("lookup_ms"),
            "answer_equal": a["token_ids"] == b["token_ids"],
            "answer_shared_prefix": next((k for k, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y),
                                         min(len(a["token_ids"]), len(b["token_ids"]))),
        })
    m = rows[1:]
    tv = [r["ttft_vllm_s"] for r in m]
    ts = [r["ttft_sidecar_s"] for r in m]
    plan_tok = sum(r["plan_recovered_tokens"] for r in m)
    return {
        "workload": label, "description": desc, "requests": rows,
        "ttft_p50_vllm_s": _p50(tv), "ttft_p50_sidecar_s": _p50(ts),
        "ttft_ratio_p50": (_p50(ts) / _p50(tv)) if tv and ts else None,
        "recovery_vllm": sum(r["recovery_vllm"] * r["prompt_tokens"] for r in m) / max(1, sum(r["prompt_tokens"] for r in m)),
        "recovery_sidecar": sum(r["reused_tokens"] for r in m) / max(1, sum(r["prompt_tokens"] for r in m)),
        "plan_realized": (sum(r["reused_tokens"] for r in m) / plan_tok) if plan_tok else None,
        "plan_realized_strict": (sum(r["reused_tokens"] - (r["bridged_tokens"] or 0) for r in m) / plan_tok)
        if plan_tok else None,
        "answers_equal": f"{sum(r['answer_equal'] for r in m)}/{len(m)}",
        "engine_startup_s": {"vllm": plain["startup_s"], "sidecar": side["startup_s"]},
        "worker_stats": side.get("worker_stats"), "scheduler_stats": side.get("scheduler_stats"),
    }


def table(summaries: list[dict]) -> str:
    lines = ["| workload | arm | TTFT p50 vLLM | vLLM + sidecar | ratio | recovery vLLM / sidecar | plan realized "
             "(strict) | answers equal |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        pr = (f"{s['plan_realized']:.1%} ({s['plan_realized_strict']:.1%})" if s["plan_realized"] is not None else "-")
        lines.append(f"| {s['workload']} | {s['arm']} | {s['ttft_p50_vllm_s']:.2f} s | {s['ttft_p50_sidecar_s']:.2f} s | "
                     f"{s['ttft_ratio_p50']:.2f} | {s['recovery_vllm']:.1%} / {s['recovery_sidecar']:.1%} | {pr} | "
                     f"{s['answers_equal']} |")
    return "\n".join(lines)


#: sidecar arms: the connector's defaults (the recompute guard's tokens bridged: served from the
#: chunk), and the guard honoured (claims stop at every recompute gap, which the gap-fill
#: plug-in prefills one round per gap)
ARMS = {
    "sidecar": {},
    "sidecar_guard": {"bridge_recompute": False, "max_gap_fills": 64, "min_gap_run": 32},
}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--agent-requests", type=int, default=None, help="agent_meta requests (default 4; quick 3)")
    p.add_argument("--trace-calls", type=int, default=None, help="trace calls (default 5; quick 3)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the engine (vLLM's default on 2 cores is 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="comma-separated workload label prefixes (e.g. agent_meta,sysvar)")
    p.add_argument("--no-guard-arm", dest="guard_arm", action="store_false",
                   help="skip the sidecar_guard arm (recompute guard honoured through gap-fills)")
    p.add_argument("--out", type=Path, default=RESULTS / "vllm.json")
    args = p.parse_args(argv)
    args.agent_requests = args.agent_requests or (3 if args.quick else 4)
    args.trace_calls = args.trace_calls or (3 if args.quick else 5)
    t_start = time.time()
    model = model_dir()
    summaries = []
    only = [x for x in args.only.split(",") if x]
    for label, desc, prompts in workloads(model, args):
        if only and not any(label.startswith(x) for x in only):
            continue
        reqs = [{"prompt_token_ids": [int(t) for t in r], "max_tokens": args.max_tokens} for r in prompts]
        print(f"{label}: {len(reqs)} requests, {[len(r) for r in prompts]} tokens", flush=True)
        plain = run_engine({"model": model, "sidecar": None, "requests": reqs}, args.threads)
        for arm, extra in ARMS.items():
            if arm == "sidecar_guard" and not args.guard_arm:
                continue
            # a fresh sidecar per arm: each arm starts cold
            with sidecar_process("--set", "chunker.anchor_tokens=[1]", "--set", "store.cpu_bytes=2147483648",
                                 "--set", "max_prompt_tokens=262144", python=server_python()) as target:
                side = run_engine({"model": model, "sidecar": target, "gap_fill": True,
                                   "extra": {"tenant": "bench", "store": "async", **extra}, "requests": reqs},
                                  args.threads)
            s = {"arm": arm, **summarize(label, desc, prompts, plain, side)}
            summaries.append(s)
            print(table([s]), flush=True)
    out = {
        "benchmark": "vllm", "model": "SmolLM2-135M-Instruct (bf16, vLLM CPU)", "model_dir": model,
        "engine": {"vllm": _vllm_version(), "block_size": 32, "enforce_eager": True, "dtype": "bfloat16",
                   "omp_threads": args.threads, "prefix_caching": True},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "workloads": summaries, "table": table(summaries), "minutes": (time.time() - t_start) / 60,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(table(summaries))
    print(f"wrote {args.out} ({out['minutes']:.1f} min)")
    return 0


def _vllm_version() -> str:
    try:
        import vllm

        return vllm.__version__
    except Exception:  # noqa: BLE001
        return "?"


if __name__ == "__main__":
    sys.exit(main())
