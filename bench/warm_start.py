"""Cross-tenant warm start (the Leyline seed's App. S experiment, past 2 tenants).

Workload: T tenants, each with its own system prompt, ask questions about articles drawn from
a Zipf mix (s = 1.1) over K shared articles (real agent text: ``workloads.TextPool``
documents). A prompt is ``[system_t, user(article), user(question)]`` rendered with the offline
ChatML-style template, so an article's chunks start at a message anchor and chunk the same way
under every tenant's system prompt (they are hit at a shifted position).

Each tenant's FIRST batch is C requests issued at once (C threads, one reference engine each:
the within-batch race of the seed: every Lookup of the batch runs before its peers Store).
Tenants run one after another; every tenant's private scope starts empty, and tenants never
see each other's private chunks (docs/architecture.md, "Tenancy and security"), so without warm
start a first batch can only hit what its own peers Stored in time.

Arms per (T, C): ``cold`` (a fresh sidecar) and ``warm`` (the same fresh sidecar after the
operator's shared publication was imported into ``shared`` and warmed: the operator's manifest,
produced once by a sidecar that served the K articles into the shared scope, imported with
ImportManifest(shared) and replayed by the operator's engine with ``SidecarClient.warm_up``).
Reported: chunks hit (and tokens recovered) on the tenants' first batches, TTFT p50 of those
requests with the reference engine (random-weight Llama, CPU), and the warm-up time.
Goal: hits at every tenant count (the seed found none beyond 2 tenants).

    ./dev bench warm_start                 # T = 2, 4, 8; C = 4, 8 (about 2-4 minutes on 2 cores)
    ./dev bench warm_start --tenants 2 --concurrency 4 --articles 4   # a quick look
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.harness import machine, server_python, sidecar_process, write_results

OPERATOR = "operator"
ZIPF_S = 1.1


def build_model(args: argparse.Namespace):
    import torch

    from clients.transformers import FAST_ATTENTION, build_model, llama_config

    torch.set_num_threads(args.threads)
    cfg = llama_config(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 64,
                       num_kv_heads=max(1, args.hidden // 256), intermediate_size=3 * args.hidden)
    return build_model(cfg, seed=0, attn_implementation=FAST_ATTENTION)


class Prompts:
    def __init__(self, n_articles: int, seed: int) -> None:
        from workloads import TextPool
        from workloads.chat_template import ChatTemplate

        pool = TextPool.load()
        self.template = ChatTemplate()
        self.articles = [d for d in pool.documents if 1500 <= len(d) <= 3000][:n_articles]
        self.lines = pool.short_lines
        self.rng = np.random.default_rng(seed)
        w = 1.0 / np.arange(1, len(self.articles) + 1) ** ZIPF_S
        self.p = w / w.sum()

    def system(self, who: str) -> dict:
        return {"role": "system", "content": f"You are the research assistant of {who}. Cite the article. "
                                              f"Policy {abs(hash(who)) % 997}: answer briefly."}

    def operator(self, j: int) -> np.ndarray:
        return self.template.render([self.system(OPERATOR), {"role": "user", "content": self.articles[j]}],
                                    add_generation_prompt=False)

    def request(self, tenant: str) -> tuple[int, np.ndarray]:
        j = int(self.rng.choice(len(self.articles), p=self.p))
        q = self.lines[int(self.rng.integers(len(self.lines)))]
        msgs = [self.system(tenant), {"role": "user", "content": self.articles[j]},
                {"role": "user", "content": f"Question: {q}"}]
        return j, self.template.render(msgs)


def flags(prompts: Prompts, *extra: str) -> list[str]:
    anchors = ",".join(str(a) for a in prompts.template.anchor_token_ids)
    return ["--set", f"chunker.anchor_tokens=[{anchors}]", "--set", "store.cpu_bytes=1073741824",
            "--set", f"auth.shared_writers=[{OPERATOR}]", *extra]


def publish(args, model, weights_hash: str, prompts: Prompts, path: Path) -> dict:
    """The operator's long-running sidecar serves the K articles into ``shared``; its manifest
    producer writes ``path`` (complete once the sidecar has stopped)."""
    from clients.transformers import Engine
    from sidecar.client import SyncSidecarClient

    with sidecar_process(*flags(prompts, "--set", f"manifests.path={path}"), python=server_python()) as target:
        with SyncSidecarClient(target, tenant=OPERATOR) as c:
            eng = Engine(model, sidecar=c, weights_hash=weights_hash, namespace="warm-start")
            for j in range(len(prompts.articles)):
                eng.warm(prompts.operator(j), shared=True)
    lines = path.read_bytes().splitlines()
    return {"lines": len(lines), "bytes": path.stat().st_size}


def run_arm(args, model, weights_hash: str, prompts: Prompts, manifest: Path, tenants: int, conc: int,
            warm: bool) -> dict:
    from clients.transformers import Engine
    from sidecar.client import SyncSidecarClient

    out: dict = {"tenants": tenants, "concurrency": conc, "warm_start": warm}
    with sidecar_process(*flags(prompts), python=server_python()) as target:
        if warm:
            t0 = time.perf_counter()
            with SyncSidecarClient(target, tenant=OPERATOR, timeout_s=120) as op:
                imp = op.import_manifest(manifest.read_bytes(), shared=True)
                eng = Engine(model, sidecar=op, weights_hash=weights_hash, namespace="warm-start")
                done = op.warm_up(eng, shared=True)
            out["warmup"] = {"seconds": round(time.perf_counter() - t0, 3), "planned": imp.planned,
                             "sequences": done.sequences, "tokens": done.tokens, "chunks_stored": done.chunks_stored}
        records = []
        lock = threading.Lock()
        for t in range(tenants):
            name = f"tenant-{t}"
            batch = [prompts.request(name) for _ in range(conc)]
            clients = [SyncSidecarClient(target, tenant=name, timeout_s=120) for _ in range(conc)]
            engines = [Engine(model, sidecar=c, weights_hash=weights_hash, namespace="warm-start") for c in clients]
            barrier = threading.Barrier(conc)

            def one(i: int) -> None:
                barrier.wait()  # the whole batch arrives at once
                res = engines[i].prefill(batch[i][1])
                s = res.plan.summary
                with lock:
                    records.append({"tenant": name, "article": batch[i][0], "tokens": len(batch[i][1]),
                                    "chunks_hit": s.chunks_hit, "recovered_tokens": res.exact_tokens + res.shifted_tokens,
                                    "ttft_ms": res.timings.ttft_s * 1e3})

            with ThreadPoolExecutor(conc) as ex:
                list(ex.map(one, range(conc)))
            for c in clients:
                c.close()
    ttft = np.array([r["ttft_ms"] for r in records])
    out["first_batch"] = {
        "requests": len(records),
        "chunks_hit": sum(r["chunks_hit"] for r in records),
        "recovered_tokens": sum(r["recovered_tokens"] for r in records),
        "prompt_tokens": sum(r["tokens"] for r in records),
        "tenants_with_hits": len({r["tenant"] for r in records if r["chunks_hit"]}),
        "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 2),
        "ttft_p90_ms": round(float(np.percentile(ttft, 90)), 2),
    }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.warm_start", description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 8])
    p.add_argument("--articles", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="warm_start", help="results name under bench/results (default %(default)s)")
    args = p.parse_args(argv)

    from clients.transformers import weights_fingerprint

    t_start = time.perf_counter()
    model = build_model(args)
    weights_hash = weights_fingerprint(model)
    prompts = Prompts(args.articles, args.seed)
    arms = []
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "operator.jsonl"
        pub = publish(args, model, weights_hash, prompts, manifest)
        print(f"operator manifest: {pub['lines']} lines, {pub['bytes']} bytes ({len(prompts.articles)} articles)")
        print(f"{'tenants':>7} {'conc':>4} {'arm':>5} {'hits':>5} {'tenants hit':>11} {'recovered':>9} "
              f"{'TTFT p50 ms':>11} {'warm-up s':>9}")
        for tenants in args.tenants:
            for conc in args.concurrency:
                for warm in (False, True):
                    prompts.rng = np.random.default_rng([args.seed, tenants, conc])  # same requests in both arms
                    r = run_arm(args, model, weights_hash, prompts, manifest, tenants, conc, warm)
                    arms.append(r)
                    fb = r["first_batch"]
                    print(f"{tenants:>7} {conc:>4} {'warm' if warm else 'cold':>5} {fb['chunks_hit']:>5} "
                          f"{fb['tenants_with_hits']:>5}/{tenants:<5} {fb['recovered_tokens']:>9} "
                          f"{fb['ttft_p50_ms']:>11.1f} {r.get('warmup', {}).get('seconds', 0.0):>9.2f}", flush=True)
    warm_arms = [a for a in arms if a["warm_start"]]
    goal = {
        "hits_at_every_tenant_count": all(a["first_batch"]["chunks_hit"] > 0 for a in warm_arms),
        "every_tenant_hit_with_warm_start": all(a["first_batch"]["tenants_with_hits"] == a["tenants"] for a in warm_arms),
    }
    payload = {
        "benchmark": "warm_start",
        "description": __doc__.split("\n\n")[0],
        "config": {"tenants": args.tenants, "concurrency": args.concurrency, "articles": len(prompts.articles),
                   "zipf_s": ZIPF_S, "model": f"llama {args.layers}x{args.hidden} (random weights, fp32, CPU)",
                   "torch_threads": args.threads},
        "operator_manifest": pub,
        "arms": arms,
        "goal": goal,
        "machine": machine(),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    path = write_results(args.out, payload)
    print(f"goal: {goal}  ->  {path}  ({payload['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
