"""Recovery benchmark: how much of each prompt a cache would serve, per arm.

Observer mode: every arm sees the same requests in arrival order, counts for each request how
many of its tokens would be served from cache given everything it saw before, then registers
the request. Nothing is evicted (unbounded caches), no KV moves; what is measured is the
structure of the traffic against each cache's matching rule::

    exact16     vLLM automatic prefix caching: prefix-chained hashes of full 16-token blocks;
                hit = longest run of leading blocks seen in any earlier request
    lmcache256  LMCache's ChunkedTokenDatabase (its own code, chunk_size 256, default config:
                save_unfull_chunk=False): prefix-chained 256-token chunk keys; hit = longest
                run of leading keys seen before
                (both engines compute the last prompt token anyway: hits are capped at whole
                blocks of the first n - 1 tokens)
    sidecar     the real KV Sidecar over gRPC loopback: Lookup(dry_run, engine_prefix_len =
                the exact16 hit) then Store per request; recovered = prefix + exact + shifted
    oracle      token i is recovered when some 64-token window of the request that covers i
                (tokens[j:j+64], j <= i < j+64) occurred anywhere in an earlier request, or
                when i lies in the exact16 hit; an upper bound for chunk reuse at >= 64-token
                granularity (the sidecar can exceed it only on shorter anchored repeats)

Goals: sidecar >= 95% of the oracle on every synthetic workload; sidecar >= exact16
on every request of every workload. Percentages are token-weighted over the workload.

Run: ``python -m bench.recovery`` (or ``./dev bench recovery``); ``--quick`` for a smoke run,
``--traces N`` / ``--traces all`` for the trace subset, ``--mask-compare`` to re-run the sidecar
on every workload with the chunker's boundary mask on the low hash bits instead of the high ones.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench.recovery_arms import (
    EXACT_BLOCK,
    LMCACHE_CHUNK,
    MIN_FETCH_TOKENS,
    ORACLE_WINDOW,
    LMCacheArm,
    PolyHasher,
    SidecarArm,
    SidecarCounts,
    exact_prefix_hits,
    oracle_hits,
)
from workloads import TextPool, TruncateOldToolOutputs, Workload, default_suite, trace_workload
from workloads.chat_template import ANCHOR_TOKENS, ChatTemplate
from workloads.synthetic import AGENT_META_HEADERS, DEFAULT_REQUESTS

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "recovery.json"
GOAL_ORACLE_FRACTION = 0.95
TRACE_NAMES = ("tau_bench", "mini_swe")
#: ``--quick`` replays this many trajectories per trace file; the default run replays all of them.
QUICK_TRACE_LIMITS = {"tau_bench": 8, "mini_swe": 3}



@dataclass(frozen=True, kw_only=True)
class MaskComparison:
    """The sidecar re-run with the boundary mask on the low hash bits (``--mask-compare``)."""

    sidecar_low: int  # recovered tokens, mask on the low bits
    mean_chunk_high: float  # tokens per chunk, mask on the high bits (the default)
    mean_chunk_low: float


@dataclass(frozen=True, kw_only=True)
class WorkloadResult:
    """Aggregates of one workload (token counts; percentages are derived)."""

    workload: str
    name: str
    variant: str
    synthetic: bool
    description: str
    requests: int
    tokens: int
    recovered: dict[str, int]
    sidecar_breakdown: dict[str, int]
    sidecar_below_exact16_requests: int
    sidecar_evictions: int
    sidecar_verify_failures: int
    #: hit segments: per request (mean), median length, and the shortest; Fetch items (hit rows)
    sidecar_segments: dict[str, float]
    seconds: dict[str, float]
    mask_compare: MaskComparison | None = None

    def pct(self, arm: str) -> float:
        return 100.0 * self.recovered[arm] / self.tokens

    @property
    def sidecar_over_oracle(self) -> float:
        return self.recovered["sidecar"] / self.recovered["oracle"] if self.recovered["oracle"] else 1.0

    @property
    def above_exact_pct(self) -> float:
        return 100.0 * (self.recovered["sidecar"] - self.recovered["exact16"]) / self.tokens

    @property
    def goal_oracle(self) -> bool | None:
        """Sidecar >= 95% of the oracle; applies to synthetic workloads only."""
        return self.sidecar_over_oracle >= GOAL_ORACLE_FRACTION if self.synthetic else None

    @property
    def goal_exact(self) -> bool:
        return self.sidecar_below_exact16_requests == 0 and self.recovered["sidecar"] >= self.recovered["exact16"]

    @property
    def passed(self) -> bool:
        return self.goal_exact and self.goal_oracle is not False

    def to_json(self) -> dict:
        d = asdict(self)
        d["pct"] = {arm: round(self.pct(arm), 3) for arm in self.recovered}
        d["sidecar_over_oracle"] = round(self.sidecar_over_oracle, 4)
        d["sidecar_above_exact16_pct"] = round(self.above_exact_pct, 3)
        d["goal_sidecar_ge_95pct_oracle"] = self.goal_oracle
        d["goal_sidecar_ge_exact16"] = self.goal_exact
        d["seconds"] = {k: round(v, 3) for k, v in self.seconds.items()}
        if self.mask_compare is not None:
            mc = self.mask_compare
            d["mask_compare"] = {
                "sidecar_pct_high": round(self.pct("sidecar"), 3),
                "sidecar_pct_low": round(100.0 * mc.sidecar_low / self.tokens, 3),
                "mean_chunk_tokens_high": round(mc.mean_chunk_high, 1),
                "mean_chunk_tokens_low": round(mc.mean_chunk_low, 1),
            }
        return d


def segment_stats(sc: SidecarCounts) -> dict[str, float]:
    """Hit segments per request, their median and shortest length; Fetch items (one span per
    hit segment) and plan rows (one per chunk piece), and how many are below ``MIN_FETCH_TOKENS``."""
    seg, rows = sc.segment_tokens, sc.hit_rows
    return {
        "per_request": round(float(sc.segments.mean()), 2) if len(sc.segments) else 0.0,
        "median_tokens": float(np.median(seg)) if len(seg) else 0.0,
        "min_tokens": int(seg.min()) if len(seg) else 0,
        "below_min": int((seg < MIN_FETCH_TOKENS).sum()),
        # span Fetch items (FetchItem.num_tokens, plan.fetch_spans): one per hit segment
        "fetch_items": int(len(seg)),
        "fetch_items_below_min": int((seg < MIN_FETCH_TOKENS).sum()),
        # the plan's CHUNK_HIT rows (one per chunk piece): what per-chunk Fetch items would be
        "chunk_rows": int(len(rows)),
        "chunk_rows_below_min": int((rows < MIN_FETCH_TOKENS).sum()),
        "median_chunk_row_tokens": float(np.median(rows)) if len(rows) else 0.0,
    }


@dataclass
class Bench:
    """The arms, built once and reused for every workload."""

    template: ChatTemplate
    sidecar: SidecarArm
    sidecar_low: SidecarArm | None = None
    hasher: PolyHasher = field(default_factory=PolyHasher)
    lmcache: LMCacheArm = field(default_factory=LMCacheArm)

    def evaluate(self, w: Workload, *, compare_mask: bool = False) -> WorkloadResult:
        reqs = w.requests
        secs: dict[str, float] = {}
        t = time.perf_counter()
        exact = exact_prefix_hits(reqs, self.hasher)
        secs["exact16"] = time.perf_counter() - t
        t = time.perf_counter()
        lm = self.lmcache.hits(reqs)
        secs["lmcache256"] = time.perf_counter() - t
        t = time.perf_counter()
        sc = self.sidecar.run(reqs, exact)
        secs["sidecar"] = time.perf_counter() - t
        t = time.perf_counter()
        orc = oracle_hits(reqs, self.hasher, exact)
        secs["oracle"] = time.perf_counter() - t
        mask = None
        if compare_mask and self.sidecar_low is not None:
            t = time.perf_counter()
            mask = MaskComparison(
                sidecar_low=int(self.sidecar_low.run(reqs, exact).recovered.sum()),
                mean_chunk_high=self.sidecar.mean_chunk_tokens(reqs),
                mean_chunk_low=self.sidecar_low.mean_chunk_tokens(reqs),
            )
            secs["mask_compare"] = time.perf_counter() - t
        rec = sc.recovered
        return WorkloadResult(
            workload=w.label,
            name=w.name,
            variant=w.variant,
            synthetic=w.synthetic,
            description=w.description,
            requests=len(reqs),
            tokens=w.total_tokens,
            recovered={
                "exact16": int(exact.sum()),
                "lmcache256": int(lm.sum()),
                "sidecar": int(rec.sum()),
                "oracle": int(orc.sum()),
            },
            sidecar_breakdown={
                "prefix": int(sc.prefix.sum()),
                "exact": int(sc.exact.sum()),
                "shifted": int(sc.shifted.sum()),
            },
            sidecar_below_exact16_requests=int((rec < exact).sum()),
            sidecar_evictions=sc.evictions,
            sidecar_verify_failures=sc.verify_failures,
            sidecar_segments=segment_stats(sc),
            seconds=secs,
            mask_compare=mask,
        )


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

_COLS = (
    ("workload", 32, "<"),
    ("reqs", 5, ">"),
    ("tokens", 10, ">"),
    ("exact16", 8, ">"),
    ("lmc256", 7, ">"),
    ("sidecar", 8, ">"),
    ("oracle", 7, ">"),
    ("sc/orc", 7, ">"),
    ("sc-ex16", 8, ">"),
    ("shifted", 8, ">"),
    ("segs/rq", 7, ">"),
    ("medseg", 6, ">"),
    ("goal", 5, "<"),
)


def format_table(results: Sequence[WorkloadResult]) -> str:
    """The results table: percentages of prompt tokens recovered, token-weighted."""
    head = " ".join(f"{name:{al}{w}}" for name, w, al in _COLS)
    lines = [head, "-" * len(head)]
    for r in results:
        goal = "PASS" if r.passed else "FAIL"
        if r.goal_oracle is None and r.passed:
            goal = "pass*"
        cells = (
            r.workload,
            r.requests,
            r.tokens,
            f"{r.pct('exact16'):.1f}%",
            f"{r.pct('lmcache256'):.1f}%",
            f"{r.pct('sidecar'):.1f}%",
            f"{r.pct('oracle'):.1f}%",
            f"{r.sidecar_over_oracle:.3f}",
            f"{r.above_exact_pct:+.1f}pp",
            f"{100.0 * r.sidecar_breakdown['shifted'] / r.tokens:.1f}%",
            f"{r.sidecar_segments['per_request']:.1f}",
            f"{r.sidecar_segments['median_tokens']:.0f}",
            goal,
        )
        lines.append(" ".join(f"{str(c):{al}{w}}" for c, (_, w, al) in zip(cells, _COLS)))
    lines.append(
        "sc/orc = sidecar / oracle recovered tokens; sc-ex16 = sidecar minus exact16 (points of prompt"
        " tokens); shifted = sidecar hits with a different left context; segs/rq, medseg = hit segments"
        " (coalesced chunk hits) per request and their median length in tokens; goal: synthetic needs"
        f" sc/orc >= {GOAL_ORACLE_FRACTION} and sidecar >= exact16 on every request; traces (pass*)"
        " only the latter."
    )
    return "\n".join(lines)


def format_mask_table(results: Sequence[WorkloadResult]) -> str:
    """Sidecar recovery and mean chunk length with the boundary mask on high vs low hash bits."""
    rows = [r for r in results if r.mask_compare is not None]
    if not rows:
        return ""
    head = f"{'workload':32} {'oracle':>7} {'high':>7} {'low':>7} {'low-high':>9} {'chunk high':>10} {'chunk low':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        mc = r.mask_compare
        assert mc is not None
        hi = r.pct("sidecar")
        lo = 100.0 * mc.sidecar_low / r.tokens
        lines.append(
            f"{r.workload:32} {r.pct('oracle'):6.1f}% {hi:6.1f}% {lo:6.1f}% {lo - hi:+7.2f}pp"
            f" {mc.mean_chunk_high:10.1f} {mc.mean_chunk_low:9.1f}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _parse_traces(value: str) -> str | int:
    if value == "all":
        return value
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError("--traces takes a count >= 0 or 'all'")
    return n


def trace_limit(name: str, traces: str | int | None, quick: bool) -> int | None:
    """Trajectories to replay from trace ``name`` (None = all of them; ``traces`` None = not given)."""
    if traces is None:
        return QUICK_TRACE_LIMITS[name] if quick else None
    return None if traces == "all" else int(traces)


def _limit_label(limit: int | None) -> int | str:
    return "all" if limit is None else limit


def build_workloads(args: argparse.Namespace, template: ChatTemplate) -> list[Workload]:
    pool = TextPool.load(args.traces_dir)
    out: list[Workload] = []
    if not args.no_synthetic:
        headers = (50, 1000) if args.quick else AGENT_META_HEADERS
        out += default_suite(pool, template, n_requests=args.requests, seed=args.seed, headers=headers)
    if args.traces != 0:
        policy = TruncateOldToolOutputs()
        for name in TRACE_NAMES:
            limit = trace_limit(name, args.traces, args.quick)
            out.append(trace_workload(name, template, limit=limit, traces_dir=args.traces_dir))
            out.append(trace_workload(name, template, limit=limit, policy=policy, traces_dir=args.traces_dir))
    return out


BEFORE_LABEL = "before hit segments (commit 4a610a9, same settings): per-chunk plans, boundary repair per chunk, no hit extension"


def baseline(path: Path) -> dict | None:
    """The figures to compare with: the ``before`` block of an earlier results file, or (a file
    written before hit segments) its sidecar figures, kept under ``before`` in the new file."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if "before" in old:
        return old["before"]
    return {
        "label": BEFORE_LABEL,
        "results": {
            r["workload"]: {"sidecar_pct": r["pct"]["sidecar"], "sidecar_over_oracle": r["sidecar_over_oracle"],
                            "sidecar_breakdown": r["sidecar_breakdown"]}
            for r in old.get("results", [])
        },
    }


def seed_settings(args: argparse.Namespace) -> dict:
    """The registry's seed settings the command line overrides."""
    out = {"seed_interval": args.seed_interval, "seed_min_tokens": args.seed_min_tokens}
    return {k: v for k, v in out.items() if v is not None}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.recovery", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 24 requests, headers 50/1000, 8 + 3 trajectories")
    p.add_argument("--requests", type=int, default=None, help=f"requests per synthetic workload ({DEFAULT_REQUESTS})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--traces",
        type=_parse_traces,
        default=None,
        help="trajectories per trace file: a count, 0 = no traces, 'all' (default; --quick: 8 tau-bench, 3 mini-swe)",
    )
    p.add_argument("--no-synthetic", action="store_true", help="only the traces")
    p.add_argument("--mask-compare", action="store_true", help="also run the sidecar with mask_position=low")
    p.add_argument("--traces-dir", type=Path, default=None, help="folder with the *.jsonl.gz traces")
    p.add_argument("--seed-interval", type=int, default=None, help="registry.seed_interval (0: no seeds)")
    p.add_argument("--seed-min-tokens", type=int, default=None, help="registry.seed_min_tokens")
    p.add_argument("--out", type=Path, default=RESULTS_PATH, help="where to write the JSON results")
    args = p.parse_args(argv)
    if args.requests is None:
        args.requests = 24 if args.quick else DEFAULT_REQUESTS

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # LMCache reads these when its modules are first imported (by LMCacheArm): no telemetry,
    # no INFO chatter on the benchmark's output.
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    t0 = time.perf_counter()
    template = ChatTemplate()
    workloads = build_workloads(args, template)
    t_build = time.perf_counter() - t0
    bench = Bench(
        template=template,
        sidecar=SidecarArm(template.anchor_token_ids, mask_position="high", **seed_settings(args)),
        sidecar_low=SidecarArm(template.anchor_token_ids, mask_position="low") if args.mask_compare else None,
    )
    results = []
    for w in workloads:
        r = bench.evaluate(w, compare_mask=args.mask_compare)
        results.append(r)
        print(f"  {w.label}: {r.requests} requests, {r.tokens} tokens, sidecar {r.pct('sidecar'):.1f}% "
              f"oracle {r.pct('oracle'):.1f}% ({sum(r.seconds.values()):.1f}s)", file=sys.stderr, flush=True)
    total = time.perf_counter() - t0

    print(format_table(results))
    mask = format_mask_table(results)
    if mask:
        print("\nChunker boundary mask on high vs low hash bits: sidecar recovered (% of prompt tokens), mean chunk:")
        print(mask)
    failed = [r.workload for r in results if not r.passed]
    print(
        f"\ngoals: {'all met' if not failed else 'NOT met on ' + ', '.join(failed)}; tokenizer collisions"
        f" {template.tokenizer.collisions}; workloads built in {t_build:.1f}s, total {total:.1f}s"
    )

    before = baseline(args.out)
    try:
        kept = {k: v for k, v in json.loads(args.out.read_text()).items() if k.startswith("before_")}
    except (OSError, ValueError):
        kept = {}
    for key, block in (("before", before), *kept.items()):
        if not block or not isinstance(block.get("results"), dict):
            continue
        print(f"\n{key} ({block.get('label', block.get('note', ''))}) -> now: sidecar % of prompt tokens, sidecar / oracle")
        for r in results:
            b = block["results"].get(r.workload)
            if b:
                print(f"  {r.workload:32} {b['sidecar_pct']:6.2f}% -> {r.pct('sidecar'):6.2f}%"
                      f" ({r.pct('sidecar') - b['sidecar_pct']:+.2f}pp)  {b['sidecar_over_oracle']:.4f} ->"
                      f" {r.sidecar_over_oracle:.4f}")

    doc = {
        "benchmark": "recovery, observer mode",
        "arms": {
            "exact16": f"prefix-chained {EXACT_BLOCK}-token blocks (vLLM APC)",
            "lmcache256": f"lmcache.v1.token_database.ChunkedTokenDatabase chunk_size={LMCACHE_CHUNK}, "
            f"save_unfull_chunk={bench.lmcache.config.save_unfull_chunk}",
            "sidecar": "KV Sidecar over gRPC loopback, Lookup(dry_run, engine_prefix_len=exact16 hit) + Store",
            "oracle": f"tokens covered by a {ORACLE_WINDOW}-token window seen in an earlier request, union exact16",
        },
        "chunker": {
            "mask_bits": bench.sidecar.chunker.mask_bits,
            "mask_position": bench.sidecar.chunker.mask_position.value,
            "min_size": bench.sidecar.chunker.min_size,
            "max_size": bench.sidecar.chunker.max_size,
            "anchors": list(ANCHOR_TOKENS),
        },
        "args": {
            "quick": args.quick,
            "requests": args.requests,
            "seed": args.seed,
            "trajectories": {n: _limit_label(trace_limit(n, args.traces, args.quick)) for n in TRACE_NAMES},
            "mask_compare": args.mask_compare,
        },
        "registry": {"seed_interval": bench.sidecar.config.registry.seed_interval,
                     "seed_min_tokens": bench.sidecar.config.registry.seed_min_tokens},
        "goal_oracle_fraction": GOAL_ORACLE_FRACTION,
        "goals_met": not failed,
        "failed": failed,
        "tokenizer_collisions": template.tokenizer.collisions,
        "runtime_s": round(total, 1),
        "host": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "results": [r.to_json() for r in results],
    }
    if before:
        doc["before"] = before
    doc.update(kept)  # other earlier figures the file keeps (before_committed_file, before_seeds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

