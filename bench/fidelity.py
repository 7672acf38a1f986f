"""Fidelity benchmark: output consistency of each cache path against full prefill.

For every scenario and model: warm-up requests fill the engine's own prefix cache and the
sidecar; then the target prompt's full-prefill greedy continuation (``--new-tokens``) is
teacher-forced through every arm (``clients.transformers.fidelity.ARMS``) and compared token by
token with full prefill: mean / max KL(p_full || p_arm), argmax agreement, first divergence,
and whether the arm is bit-identical. Arms: full prefill, exact-prefix reuse, sidecar
position-independent reuse, the sidecar's exact policy alone, recompute_tokens 8 and 32, the
left-context window guard (W=32), and naive reuse without rotation (the control).

Scenarios (workloads/, offline chat template):
    agent_meta     a second agent: new (shorter) header, the shared body shifted behind it
    edit_replay    a conversation replayed with an early user turn edited (exact prefix up to
                   the edit, the rest shifted)
    rerank         the same retrieved documents in another order
    sysvar         a session's next call with a new clock line in the system prompt
    append         the next call of a recorded tau-bench trajectory (append-only: pure prefix reuse)

Models: Llama-architecture GQA and DeepSeek-V2-architecture MLA, 4 layers, hidden 256, random
weights (initializer_range 0.08), batch-invariant attention (so prefix reuse can be checked bit
for bit). RANDOM WEIGHTS: a mechanics check of the cache paths, not a quality claim.

Checks (exit status 1 if any fails): exact-prefix reuse and the sidecar's EXACT-only reuse
(``sidecar_exact``, no own prefix cache) are bit-identical to full prefill everywhere, and on
the append scenario the latter really served the prefix from the sidecar;
naive reuse without rotation has a higher mean KL than rotated reuse wherever chunks shifted.

Run: ``python -m bench.fidelity`` (a few minutes on 2 cores), ``--quick`` for a smoke run.
Writes bench/results/fidelity.json. ``--model smollm2`` (or any ``load_model`` source) runs the
real-model quality benchmark instead (``bench/quality.py``: answer agreement, the default
admission chosen from data); ``--model random`` is this one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    description: str
    warm: tuple[np.ndarray, ...]
    target: np.ndarray


def build_scenarios(template, *, quick: bool = False, seed: int = 0) -> list[Scenario]:
    from bench.ttft_workloads import trim_header
    from workloads import TextPool, agent_meta, edit_replay, rerank, sysvar, trace_workload

    pool = TextPool.load()
    out = []
    w = agent_meta(pool, template, header_tokens=250, n_requests=2, seed=seed)
    out.append(Scenario(name="agent_meta", description="second agent: new 213-token header, shared body shifted by -37",
                        warm=w.requests[:1], target=trim_header(w.requests[1], 250, 37)))
    w = edit_replay(pool, template, calls_per_pass=3, n_requests=6, seed=seed)
    out.append(Scenario(name="edit_replay", description="third call replayed with an early user turn edited",
                        warm=w.requests[:3], target=w.requests[5]))
    if not quick:
        w = rerank(pool, template, n_topics=1, n_requests=6, seed=seed)
        target = next(r for r in w.requests[1:] if len(r) != len(w.requests[0]) or not np.array_equal(r, w.requests[0]))
        out.append(Scenario(name="rerank", description="the same documents, reordered",
                            warm=w.requests[:1], target=target))
        w = sysvar(pool, template, n_sessions=1, n_requests=3, seed=seed)
        out.append(Scenario(name="sysvar", description="next call, new clock line in the system prompt",
                            warm=w.requests[:2], target=w.requests[2]))
    w = trace_workload("tau_bench", template, limit=1)
    out.append(Scenario(name="append", description="next call of a recorded tau-bench trajectory (append-only)",
                        warm=w.requests[:2], target=w.requests[2]))
    return out


def build_models(layers: int, hidden: int):
    from clients.transformers import INVARIANT_ATTENTION, build_model, deepseek_v2_config, llama_config

    return {
        "gqa (llama)": build_model(llama_config(hidden_size=hidden, num_layers=layers, num_heads=hidden // 64,
                                                num_kv_heads=max(1, hidden // 128)),
                                   seed=0, attn_implementation=INVARIANT_ATTENTION),
        "mla (deepseek_v2)": build_model(deepseek_v2_config(hidden_size=hidden, num_layers=layers,
                                                            num_heads=hidden // 64),
                                         seed=0, attn_implementation=INVARIANT_ATTENTION),
    }


def run(model, client, scenarios: Sequence[Scenario], *, new_tokens: int, tag: str) -> list[dict]:
    from clients.transformers import Engine
    from clients.transformers.fidelity import evaluate, format_table

    out = []
    for sc in scenarios:
        t0 = time.perf_counter()
        engine = Engine(model, sidecar=client, namespace=f"fidelity-{tag}-{sc.name}-{time.time_ns()}")
        rows = evaluate(engine, sc.warm, sc.target, new_tokens=new_tokens)
        dt = time.perf_counter() - t0
        print(format_table(rows, f"\n{tag} / {sc.name}: {sc.description} ({len(sc.target)} tokens, {dt:.0f}s)"),
              flush=True)
        out.append({"model": tag, "scenario": sc.name, "description": sc.description,
                    "prompt_tokens": int(len(sc.target)), "seconds": round(dt, 1),
                    "arms": [r.as_dict() for r in rows]})
    return out


def checks(results: Sequence[dict]) -> list[tuple[str, bool]]:
    out = []
    for r in results:
        arms = {a["arm"]: a for a in r["arms"]}
        where = f"{r['model']} / {r['scenario']}"
        out.append((f"{where}: exact_prefix bit-identical to full prefill", arms["exact_prefix"]["bit_identical"]))
        out.append((f"{where}: sidecar_exact (EXACT hits only) bit-identical to full prefill",
                    arms["sidecar_exact"]["bit_identical"]))
        if r["scenario"] == "append":
            out.append((f"{where}: sidecar_exact served the prefix from the sidecar",
                        arms["sidecar_exact"]["recovered_tokens"] >= arms["exact_prefix"]["recovered_tokens"] - 64))
        if arms["sidecar"]["shifted_tokens"] > 0:
            out.append((f"{where}: naive_no_rotation mean KL > sidecar mean KL",
                        arms["naive_no_rotation"]["mean_kl"] > arms["sidecar"]["mean_kl"]))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", default="random")
    if pre.parse_known_args(argv)[0].model != "random":
        from bench import quality  # a real model: the quality benchmark

        return quality.main(argv)
    p = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random",
                   help="random (this benchmark) or a real model, e.g. smollm2 (bench/quality.py)")
    p.add_argument("--quick", action="store_true", help="smoke run: agent_meta, edit_replay and append; 8 tokens")
    p.add_argument("--new-tokens", type=int, default=None, help="teacher-forced continuation length (default 32)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "fidelity.json")
    args = p.parse_args(argv)
    new_tokens = args.new_tokens or (8 if args.quick else 32)
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

    from bench.fidelity_config import sidecar_config
    from bench.harness import machine
    from clients.transformers.fidelity import DISCLAIMER
    from sidecar.app import ServerThread
    from sidecar.client import SyncSidecarClient
    from workloads.chat_template import ChatTemplate

    t0 = time.perf_counter()
    template = ChatTemplate()
    scenarios = build_scenarios(template, quick=args.quick, seed=args.seed)
    models = build_models(args.layers, args.hidden)
    print(DISCLAIMER)
    results: list[dict] = []
    with ServerThread(sidecar_config(template)) as st, SyncSidecarClient(st.target, tenant="fidelity", timeout_s=120) as client:
        for tag, model in models.items():
            results += run(model, client, scenarios, new_tokens=new_tokens, tag=tag)
    ch = checks(results)
    print()
    for what, ok in ch:
        print(f"check {'ok  ' if ok else 'FAIL'} {what}")
    total = time.perf_counter() - t0
    print(f"\n{DISCLAIMER}\ntotal {total:.0f}s")
    doc = {
        "benchmark": "fidelity: teacher-forced output consistency vs full prefill",
        "disclaimer": DISCLAIMER,
        "metrics": {
            "mean_kl / max_kl": "KL(p_full || p_arm) per generated token, nats",
            "agreement": "share of steps where argmax p_arm equals the full-prefill greedy token",
            "first_divergence": "first step where they differ (null: never)",
            "bit_identical": "every log-probability equal, bit for bit",
            "recovered/shifted/prefill_tokens": "of the prompt, on that arm's path",
        },
        "models": {tag: {"model_type": m.config.model_type, "layers": m.config.num_hidden_layers,
                         "hidden": m.config.hidden_size, "initializer_range": m.config.initializer_range,
                         "attention": m.config._attn_implementation} for tag, m in models.items()},
        "new_tokens": new_tokens,
        "results": results,
        "checks": [{"check": w, "ok": ok} for w, ok in ch],
        "checks_passed": all(ok for _, ok in ch),
        "runtime_s": round(total, 1),
        "host": machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if doc["checks_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
