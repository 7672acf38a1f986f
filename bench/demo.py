"""One-command demo: a sidecar, a workload replayed through the reference engine, three arms.

    python -m bench.demo                       # agent_meta: 1000-token headers before an ~8K body
    python -m bench.demo --workload edit_replay --requests 6
    python -m bench.demo --quick               # 3 requests, shorter fidelity check

What it does:

1. starts ``kv-sidecar serve`` in its own process (chat-template anchors, 3 GiB CPU tier);
2. replays the workload through the engine (``clients.transformers``; Llama architecture, 4
   layers, hidden 512, random weights, fp32) three times per request: cache off, the engine's
   own exact-prefix cache, and the sidecar (Lookup -> Fetch rotated -> assemble -> prefill the
   gaps -> Store); prints recovery and TTFT per turn and per arm, and the sidecar's overhead;
3. scores output fidelity on the workload's second request with a smaller model (batch-invariant
   attention): the full-prefill greedy continuation teacher-forced through each cache path;
4. writes a PNG of TTFT per turn for the three arms (``--plot``; needs matplotlib).

Random weights: TTFT is real (real forward passes); fidelity is a mechanics check, not a
quality claim.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
WORKLOADS = ("agent_meta", "edit_replay", "rerank", "sysvar", "tau_bench")


def build(name: str, template, n: int, seed: int):
    from bench.ttft import BenchWorkload, long_notes_pool, trim_header
    from bench.workloads import TextPool, edit_replay, rerank, sysvar, trace_workload
    from bench.workloads.synthetic import agent_meta

    pool = TextPool.load()
    if name == "agent_meta":
        w = agent_meta(long_notes_pool(pool, 5), template, header_tokens=1000, n_requests=n, seed=seed)
        cuts = np.random.default_rng([seed, 1000, 7]).integers(0, 65, size=n)
        reqs = tuple(trim_header(r, 1000, int(c)) for r, c in zip(w.requests, cuts))
        return BenchWorkload(label="agent_meta[H~1000, body ~8K]", requests=reqs)
    if name == "edit_replay":
        w = edit_replay(pool, template, calls_per_pass=max(1, n // 2), n_requests=2 * max(1, n // 2), seed=seed)
    elif name == "rerank":
        w = rerank(pool, template, n_topics=2, n_requests=n, seed=seed)
    elif name == "sysvar":
        w = sysvar(pool, template, n_sessions=2, n_requests=n, seed=seed)
    else:
        w = trace_workload("tau_bench", template, limit=1)
        return BenchWorkload(label="trace:tau_bench", requests=w.requests[:n], append_only=True)
    return BenchWorkload(label=w.label, requests=w.requests)


def turn_table(records) -> str:
    from bench.ttft import ARMS

    by = {(r.request, r.arm): r for r in records}
    turns = sorted({r.request for r in records})
    head = f"{'turn':>4} {'tokens':>6} | " + " ".join(f"{a + ' ms':>15}" for a in ARMS) + \
        f" | {'exact-prefix hit':>16} {'sidecar recovered':>18} {'sidecar/exact':>13}"
    lines = [head, "-" * len(head)]
    for t in turns:
        rs = {a: by[(t, a)] for a in ARMS}
        sc, ex = rs["sidecar"], rs["exact_prefix"]
        rec = sc.prefix_tokens + sc.exact_tokens + sc.shifted_tokens
        lines.append(
            f"{t:>4} {sc.tokens:>6} | " + " ".join(f"{rs[a].ttft_s * 1e3:>15.0f}" for a in ARMS)
            + f" | {ex.prefix_tokens / ex.tokens:>16.1%} {rec / sc.tokens:>18.1%} {sc.ttft_s / ex.ttft_s:>13.2f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=WORKLOADS, default="agent_meta")
    p.add_argument("--requests", type=int, default=None, help="requests to replay (default 5; quick 3)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--new-tokens", type=int, default=None, help="fidelity continuation length (default 16; quick 8)")
    p.add_argument("--no-fidelity", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=RESULTS / "demo.png")
    args = p.parse_args(argv)
    n = args.requests or (3 if args.quick else 5)
    new_tokens = args.new_tokens or (8 if args.quick else 16)
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

    from bench.harness import sidecar_process
    from bench.tokenizer import ChatTemplate
    from bench.ttft import RotationMeter, bench_model, free_port, plot, run_workload, sidecar_flags, summarize
    from clients.transformers import Engine, weights_fingerprint
    from clients.transformers.fidelity import ARMS, DISCLAIMER, evaluate, format_table
    from sidecar.client import SyncSidecarClient

    t0 = time.perf_counter()
    template = ChatTemplate()
    w = build(args.workload, template, n, args.seed)
    print(f"workload {w.label}: {len(w.requests)} requests, {sum(len(r) for r in w.requests)} tokens")
    model = bench_model(argparse.Namespace(threads=0, layers=4, hidden=512, device=None))
    mport = free_port()
    with sidecar_process(*sidecar_flags(template, 3 << 30, mport)) as target, \
            SyncSidecarClient(target, tenant="demo", timeout_s=300.0) as client:
        print(f"sidecar serving on {target} (metrics on 127.0.0.1:{mport})")
        meter = RotationMeter(mport)
        records = run_workload(model, weights_fingerprint(model), client, meter, w, prefix_cache_bytes=1 << 30)
        s = summarize(w, records)
        print()
        print("TTFT per turn (ms) and recovery (% of prompt tokens served from cache):")
        print(turn_table(records))
        b = s.breakdown_ms
        frac = "-" if s.overhead_fraction is None else f"{s.overhead_fraction:.1%}"
        print(f"\nturns 1..: TTFT p50 cache_off {s.ttft_p50_ms['cache_off']:.0f} ms, exact_prefix "
              f"{s.ttft_p50_ms['exact_prefix']:.0f} ms, sidecar {s.ttft_p50_ms['sidecar']:.0f} ms "
              f"(sidecar/exact {s.ratio_sidecar_exact:.2f}); recovered exact_prefix {s.recovered_pct['exact_prefix']:.1f}% "
              f"sidecar {s.recovered_pct['sidecar']:.1f}%")
        print(f"sidecar overhead per request: Lookup {b['lookup']:.1f} ms, Fetch {b['fetch_transfer']:.1f} ms, "
              f"rotation {b['rotation']:.1f} ms, assembly {b['assembly']:.1f} ms = {b['overhead']:.1f} ms against "
              f"{s.prefill_saved_ms:.0f} ms of prefill saved ({frac}); Store after the first token {b['store_after_ttft']:.1f} ms")

        if not args.no_fidelity and len(w.requests) >= 2:
            from bench.fidelity import build_models

            fmodel = build_models(4, 256)["gqa (llama)"]
            engine = Engine(fmodel, sidecar=client, namespace=f"demo-fidelity-{time.time_ns()}")
            arms = {k: ARMS[k] for k in ("full_prefill", "exact_prefix", "sidecar", "sidecar_k32", "sidecar_w32",
                                         "naive_no_rotation")}
            print(f"\nfidelity on request 1 after request 0, {new_tokens} teacher-forced tokens "
                  f"(llama 4x256, batch-invariant attention):")
            rows = evaluate(engine, w.requests[:1], w.requests[1], new_tokens=new_tokens, arms=arms)
            print(format_table(rows))
            print(DISCLAIMER)
    png = plot(records, [w.label], args.plot, title="TTFT per turn: cache off / exact prefix / sidecar")
    if png:
        print(f"\nwrote {png}")
    print(f"demo took {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
