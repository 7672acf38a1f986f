"""KV-aware routing across a fleet: round-robin vs prefix-only affinity vs the sidecar's score.

    ./dev bench routing            # ~15 minutes on 2 cores; --quick for a smoke run

The fleet: three replicas, each a reference engine (``clients.transformers.Engine``, its own
exact-prefix cache, Lookup -> Fetch -> prefill -> Store through its own sidecar) served by one
worker thread, each sidecar a ``kv-sidecar serve`` process with ``routing.replica_id``, all on
one Redis (shared registry; no shared remote tier, so a replica serves only what it holds).
Every arm starts from a fresh fleet (new sidecar processes and key prefix, empty engine caches).

The traffic: the real agent traces (bench/data/agent_traces: mini-SWE-agent and tau-bench),
one trajectory per agent, replayed call by call with the truncation policy applied (tool outputs
older than two turns cut to a head/tail stub, ``TruncateOldToolOutputs``) and a per-agent header
message first: the agent's name and session, and the time of the request, which changes every
call (as agent harnesses stamp their prompts). Twelve agents run concurrently; between two calls
an agent runs the tool its answer called (``--think-s``, 0.5-2 s), so their requests interleave
on the fleet.

Arms (the router picks a replica per request; the engines are the same in the first three):

    round_robin   replicas in turn
    prefix        prefix-only affinity, as Dynamo's KV router and llm-d's indexer score: the
                  longest exact-prefix block match (16-token blocks) against what each engine's
                  own prefix cache holds (read after every request, evictions included: what its
                  KV events would report), among replicas within the load bound
    sidecar       the reference router (``sidecar.sdk.router.Router``): the sidecar fleet's Score
                  (position-independent: engine prefix, exact and shifted hits), same load bound
    prefix_apc    the peer deployment: prefix-only routing as above, engines with their own
                  exact-prefix cache only (vLLM APC behind Dynamo or llm-d), no sidecar

Both affinity arms run the reference router with the same load bound (``--load-slack``: a replica
at most that many requests above the least loaded one, counting the requests routed to each in
the last ``--load-window-s`` seconds) and fall back to the least loaded replica when no score
reaches ``--min-saved`` tokens; they differ only in the scores.

The arms run once per cache size (``--caches``, MiB per replica, for the sidecar's CPU tier and
for the engine's own prefix cache; this model's KV is 2 KiB a token): at 1024 MiB every replica
can hold every agent's history; the fleet's working set (the distinct blocks of every prompt:
the agents' histories, the traces' shared system prompts and tools) is about 130 MiB, so at 64,
32 and 16 MiB a replica holds a half, a quarter and an eighth of it: the regime of a GPU
fleet's KV capacity under agent load, where a request lands decides what is still cached (the
run prints and records the working set it measured). The peer-deployment arm runs at the first
size only.

Measured per arm: fleet-wide prompt tokens served from cache (the engine's own prefix + the
sidecar's exact and shifted hits, as the engine loaded them), TTFT p50 / p99 (from the routing
decision to the first token: routing, queueing, Lookup, Fetch, prefill), and load balance (max /
mean requests per replica). Goal: the sidecar arm serves >= 1.3x the cached tokens of prefix-only routing on
the edited histories at a balance within 10% of round-robin's.

Model: the random-weight Llama-shaped model of ``bench.ttft --model random`` (``--layers`` x
``--hidden``) with the offline hash tokenizer: real forward passes, sized for 2 cores.
Results: bench/results/routing.json and routing.png.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np

from bench.harness import bench_redis, machine, sidecar_process, write_results
from bench.workloads.traces import TruncateOldToolOutputs, load_trajectories

REPLICAS = ("r0", "r1", "r2")
ARMS = ("round_robin", "prefix", "sidecar", "prefix_apc")
#: arms whose engines use their own exact-prefix cache only (no sidecar): the peer deployment
APC_ONLY = ("prefix_apc",)
BLOCK = 16


# ----------------------------------------------------------------------------- workload


def agent_prompts(template, *, agents: int, turns: int, max_tokens: int, seed: int) -> list[tuple[str, list[np.ndarray]]]:
    """Per agent (trace name, its prompts in call order): one trajectory each, alternating the
    two traces, the truncation policy applied, a per-agent header stamped with each call's time."""
    policy = TruncateOldToolOutputs()
    rng = np.random.default_rng(seed)
    pools = {name: load_trajectories(name) for name in ("mini_swe", "tau_bench")}
    out = []
    for i in range(agents):
        name = ("mini_swe", "tau_bench")[i % 2]
        traj = pools[name][(i // 2) % len(pools[name])]
        session = uuid.UUID(int=int(rng.integers(0, 2**63))).hex[:12]
        clock = 9 * 3600 + int(rng.integers(0, 3600))
        prompts = []
        for t, messages in enumerate(traj.calls[:turns]):
            clock += int(rng.integers(20, 90))
            stamp = f"2026-11-27T{clock // 3600:02d}:{clock // 60 % 60:02d}:{clock % 60:02d}Z"
            header = {"role": "system", "content": f"Agent {name}-{i} (session {session}). Request {t + 1} at {stamp}."}
            msgs = [header, *policy.transform(messages, t)]
            tokens = template.render(msgs, traj.tools)
            if len(tokens) > max_tokens:
                break
            prompts.append(tokens)
        out.append((name, prompts))
    return out


# ----------------------------------------------------------------------------- fleet


class Replica:
    """One engine behind a queue, served by one thread; after each request the prompts its own
    prefix cache holds go to ``index`` (what the engine's KV events would report)."""

    def __init__(self, name: str, engine, index: PrefixIndex) -> None:
        self.name = name
        self.engine = engine
        self.index = index
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._serve, name=f"engine-{name}", daemon=True)
        self.thread.start()

    def submit(self, tokens: np.ndarray) -> Future:
        fut: Future = Future()
        self.jobs.put((tokens, fut))
        return fut

    def _serve(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            tokens, fut = job
            try:
                t0 = time.perf_counter()
                res = self.engine.prefill(tokens)
                self.index.update(self.name, self.engine.prefix_cache)
                fut.set_result((t0, res))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting agent
                fut.set_exception(exc)

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(60)


class PrefixIndex:
    """What each engine's own prefix cache holds (its entries, evictions included, read after each
    request): the exact-prefix block match Dynamo's and llm-d's routers compute from engine KV
    events."""

    def __init__(self) -> None:
        self.seqs: dict[str, list[np.ndarray]] = {r: [] for r in REPLICAS}
        self.lock = threading.Lock()

    def update(self, replica: str, cache) -> None:
        seqs = [e.tokens for e in list(cache._entries.values())]
        with self.lock:
            self.seqs[replica] = seqs

    def match(self, tokens: np.ndarray) -> dict[str, int]:
        with self.lock:
            seqs = {r: list(s) for r, s in self.seqs.items()}
        out = {}
        for r, ss in seqs.items():
            best = 0
            for s in ss:
                m = min(len(s), len(tokens))
                diff = np.flatnonzero(s[:m] != tokens[:m])
                best = max(best, int(diff[0]) if len(diff) else m)
            out[r] = min(best, len(tokens) - 1) // BLOCK * BLOCK
        return out


class PrefixScorer:
    """``Score`` as an exact-prefix router computes it, from ``PrefixIndex`` (for ``Router``)."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    def score(self, tokens: np.ndarray, identity, candidates, **_guards):
        from sidecar.client import ReplicaScore, ScoreResult

        m = self.index.match(tokens)
        n = len(tokens)
        return ScoreResult(total_tokens=n, absent=[], scores=[
            ReplicaScore(replica=r, prefix_tokens=m[r], prefill_tokens=n - m[r]) for r in candidates])


@dataclass
class Record:
    arm: str
    agent: int
    trace: str
    turn: int
    replica: str
    tokens: int
    prefix: int
    exact: int
    shifted: int
    prefill: int
    predicted: int  # the router's score of the chosen replica (saved tokens)
    ttft_s: float
    route_s: float
    queue_s: float
    fetch_misses: int

    @property
    def cached(self) -> int:
        return self.prefix + self.exact + self.shifted


def run_arm(arm: str, model, weights_hash: str, template, agents, args, cache_mib: int, latency: dict) -> list[Record]:
    from clients.transformers import EXACT_PREFIX, SIDECAR, Engine, PrefixCache
    from sidecar.client import SyncSidecarClient
    from sidecar.client import Route, Router, RouterConfig

    records: list[Record] = []
    with ExitStack() as stack:
        url = bench_redis(stack)
        key_prefix = f"route{uuid.uuid4().hex[:8]}"
        anchors = ",".join(str(a) for a in template.anchor_token_ids)
        replicas: dict[str, Replica] = {}
        index = PrefixIndex()
        scorer = None
        for name in REPLICAS:
            target = stack.enter_context(sidecar_process(
                "--set", f"chunker.anchor_tokens=[{anchors}]", "--set", f"store.cpu_bytes={cache_mib << 20}",
                "--set", f"shared_registry.redis_url={url}", "--set", f"shared_registry.key_prefix={key_prefix}",
                "--set", "shared_registry.publish_interval_s=0.01", "--set", f"routing.replica_id={name}",
                "--set", f"store.namespace={key_prefix}{name}", "--set", "max_prompt_tokens=262144",
            ))
            client = stack.enter_context(SyncSidecarClient(target, tenant="fleet"))
            engine = Engine(model, sidecar=client, namespace="routing", weights_hash=weights_hash,
                            reuse=EXACT_PREFIX if arm in APC_ONLY else SIDECAR,
                            prefix_cache=PrefixCache(capacity_bytes=cache_mib << 20))
            replicas[name] = Replica(name, engine, index)
            stack.callback(replicas[name].stop)
            if scorer is None:
                scorer = stack.enter_context(SyncSidecarClient(target, tenant="fleet", timeout_s=2.0))
        identity = replicas[REPLICAS[0]].engine.identity
        cfg = RouterConfig(load_slack=args.load_slack, load_window_s=args.load_window_s,
                           min_saved_tokens=args.min_saved)
        # both affinity arms run the reference router: the same load figures and rule, only the
        # scores differ (the sidecar fleet's Score, or the engines' exact-prefix block match)
        router = Router(scorer if arm == "sidecar" else PrefixScorer(index), list(REPLICAS), cfg)
        turn = iter(range(1 << 30))

        def agent(i: int, trace: str, prompts: list[np.ndarray]) -> None:
            think = np.random.default_rng((args.seed, i))
            for t, tokens in enumerate(prompts):
                if t:  # the agent runs the tool its previous answer called
                    time.sleep(think.uniform(*args.think_s))
                t_start = time.perf_counter()
                if arm == "round_robin":
                    ctx = contextlib.nullcontext(Route(replica=REPLICAS[next(turn) % len(REPLICAS)], saved_tokens=0))
                else:
                    ctx = router.request(tokens, identity)
                with ctx as route:
                    t_routed = time.perf_counter()
                    t0, res = replicas[route.replica].submit(tokens).result()
                records.append(Record(
                    arm=arm, agent=i, trace=trace, turn=t, replica=route.replica, tokens=len(tokens),
                    prefix=res.prefix_tokens, exact=res.exact_tokens, shifted=res.shifted_tokens,
                    prefill=res.prefill_tokens, predicted=route.saved_tokens,
                    ttft_s=t0 + res.timings.ttft_s - t_start, route_s=t_routed - t_start, queue_s=t0 - t_routed,
                    fetch_misses=res.fetch_misses,
                ))

        threads = [threading.Thread(target=agent, args=(i, trace, prompts), name=f"agent-{i}", daemon=True)
                   for i, (trace, prompts) in enumerate(agents)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if arm == "sidecar" and not latency:
            latency.update(idle_latency(scorer, identity, [p[-1] for _, p in agents if p]))
    return records


def idle_latency(client, identity, prompts: list[np.ndarray], reps: int = 60) -> dict:
    """Score (3 candidates) / Lookup / Ping round trips on the idle fleet, from one client,
    over the agents' last prompts (ms)."""
    def timed(fn) -> list[float]:
        out = []
        for _ in range(reps):
            for p in prompts:
                t0 = time.perf_counter()
                fn(p)
                out.append((time.perf_counter() - t0) * 1e3)
        return out

    timed(lambda p: client.score(p, identity, list(REPLICAS)))  # warm
    score = timed(lambda p: client.score(p, identity, list(REPLICAS)))
    lookup = timed(lambda p: client.lookup(p, identity=identity, dry_run=True))
    ping = timed(lambda p: client.ping())
    q = lambda xs, p: round(float(np.percentile(xs, p)), 3)  # noqa: E731
    return {"score_p50_ms": q(score, 50), "score_p99_ms": q(score, 99), "lookup_dry_run_p50_ms": q(lookup, 50),
            "ping_p50_ms": q(ping, 50), "prompt_tokens_mean": int(np.mean([len(p) for p in prompts])),
            "candidates": len(REPLICAS)}


# ----------------------------------------------------------------------------- report


def working_set_tokens(agents, template) -> int:
    """Distinct blocks over every prompt of every agent, in tokens: what the fleet must hold to
    serve every call from cache once (blocks start at the template's block openers: messages,
    the tool schemas, each tool call and result)."""
    openers = np.asarray(template.anchor_token_ids, dtype=np.uint32)
    seen: set[bytes] = set()
    total = 0
    for _, prompts in agents:
        for p in prompts:
            cuts = [*np.flatnonzero(np.isin(p, openers)).tolist(), len(p)]
            for a, b in zip(cuts, cuts[1:]):
                block = p[a:b].tobytes()
                if block not in seen:
                    seen.add(block)
                    total += b - a
    return total


def summarize(records: list[Record]) -> dict:
    ttft = np.array([r.ttft_s for r in records])
    per = {name: sum(1 for r in records if r.replica == name) for name in REPLICAS}
    counts = np.array(list(per.values()), dtype=float)
    out = {
        "requests": len(records),
        "prompt_tokens": int(sum(r.tokens for r in records)),
        "cached_tokens": int(sum(r.cached for r in records)),
        "prefix_tokens": int(sum(r.prefix for r in records)),
        "exact_tokens": int(sum(r.exact for r in records)),
        "shifted_tokens": int(sum(r.shifted for r in records)),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "route_p50_ms": float(np.percentile([r.route_s for r in records], 50) * 1e3),
        "requests_per_replica": per,
        "load_balance": float(counts.max() / counts.mean()),
        "fetch_misses": int(sum(r.fetch_misses for r in records)),
        # what the router's score promised for the replicas it chose, against what they served
        "predicted_tokens": int(sum(r.predicted for r in records)),
    }
    out["cached_fraction"] = out["cached_tokens"] / max(1, out["prompt_tokens"])
    # how often an agent's call went where its previous call went, and each agent's route
    by_agent: dict[int, list[Record]] = {}
    for r in sorted(records, key=lambda r: (r.agent, r.turn)):
        by_agent.setdefault(r.agent, []).append(r)
    follow = [b.replica == a.replica for rs in by_agent.values() for a, b in zip(rs, rs[1:])]
    out["same_replica_as_previous_call"] = float(np.mean(follow)) if follow else 0.0
    out["routes"] = {str(a): "".join(r.replica[-1] for r in rs) for a, rs in by_agent.items()}
    out["by_trace"] = {}
    for trace in sorted({r.trace for r in records}):
        sub = [r for r in records if r.trace == trace]
        out["by_trace"][trace] = {"prompt_tokens": int(sum(r.tokens for r in sub)),
                                  "cached_tokens": int(sum(r.cached for r in sub)),
                                  "ttft_p50_s": float(np.percentile([r.ttft_s for r in sub], 50))}
    return out


def goals_of(summary: dict) -> dict:
    """The sidecar arm against prefix-only routing (same engines, and the peer deployment), over
    all agents and over the edited histories (mini-SWE: the truncation policy moves content on
    most calls), and its balance against round-robin's."""
    out: dict = {}
    side = summary.get("sidecar")
    if side is None:
        return out
    for base in ("prefix", "prefix_apc"):
        if base in summary:
            out[f"cached_vs_{base}"] = round(side["cached_tokens"] / max(1, summary[base]["cached_tokens"]), 3)
            for trace, t in side["by_trace"].items():
                b = summary[base]["by_trace"].get(trace, {}).get("cached_tokens", 0)
                out[f"cached_vs_{base}[{trace}]"] = round(t["cached_tokens"] / max(1, b), 3)
    if "round_robin" in summary:
        out["balance_vs_round_robin"] = round(side["load_balance"] / summary["round_robin"]["load_balance"], 3)
    out["goal"] = "cached >= 1.3x prefix-only routing on edited histories, balance <= 1.10x round-robin's"
    return out


def plot(configs: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"round_robin": "#999", "prefix": "#69c", "sidecar": "#d62", "prefix_apc": "#ccc"}
    fig, grid = plt.subplots(len(configs), 3, figsize=(12, 3.4 * len(configs)), squeeze=False)
    for axes, (name, conf) in zip(grid, configs.items()):
        summary = conf["arms"]
        arms = [a for a in ARMS if a in summary]
        traces = sorted(summary[arms[0]]["by_trace"])
        bottom = np.zeros(len(arms))
        for j, trace in enumerate(traces):
            vals = np.array([summary[a]["by_trace"][trace]["cached_tokens"] / 1e3 for a in arms])
            axes[0].bar(arms, vals, bottom=bottom, color=[colors.get(a, "#888") for a in arms],
                        hatch="//" if j else None, edgecolor="white")
            bottom += vals
        axes[0].set_title(f"{name}: tokens from cache (K; hatched: {', '.join(traces[1:])})", fontsize=9)
        x = np.arange(len(arms))
        axes[1].bar(x - 0.2, [summary[a]["ttft_p50_s"] for a in arms], 0.4, label="p50")
        axes[1].bar(x + 0.2, [summary[a]["ttft_p99_s"] for a in arms], 0.4, label="p99")
        axes[1].set_xticks(x, arms)
        axes[1].set_title(f"{name}: TTFT (s)", fontsize=9)
        axes[1].legend(fontsize=8)
        axes[2].bar(arms, [summary[a]["load_balance"] for a in arms], color="#888")
        axes[2].set_ylim(1.0, max(1.3, max(summary[a]["load_balance"] for a in arms) + 0.05))
        axes[2].set_title(f"{name}: load balance (max / mean requests)", fontsize=9)
        for ax in axes:
            ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("3 replicas, 12 agents replaying real traces (truncation policy, a header stamped per call)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=12)
    ap.add_argument("--turns", type=int, default=12, help="calls per agent (at most)")
    ap.add_argument("--max-tokens", type=int, default=6144, help="an agent stops before a longer prompt")
    ap.add_argument("--think-s", default="0.5,2.0", help="tool time between an agent's calls: uniform LO,HI seconds")
    ap.add_argument("--caches", default="1024,64,32,16",
                    help="MIB,... one run of the arms per size: each replica's cache (the sidecar's CPU tier and "
                         "the engine's own prefix cache, MiB each); the peer-deployment arm runs at the first only")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (shared by the three engines)")
    ap.add_argument("--load-slack", type=int, default=2)
    ap.add_argument("--load-window-s", type=float, default=10.0,
                    help="the routers' load: requests routed to a replica in the last N seconds (0: in flight)")
    ap.add_argument("--min-saved", type=int, default=64)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="4 agents x 4 calls (smoke run; results not written)")
    args = ap.parse_args()
    if args.quick:
        args.agents, args.turns = 4, 4
    args.think_s = tuple(float(x) for x in args.think_s.split(","))
    caches = [(f"{int(c)}MiB", int(c)) for c in args.caches.split(",")]
    args.device = "cpu"
    import torch

    from bench.ttft import load_bench_model
    from clients.transformers.models import weights_fingerprint

    setup = load_bench_model("random", args)
    torch.set_num_threads(args.threads)
    model, template = setup.model, setup.template
    wh = weights_fingerprint(model)
    agents = agent_prompts(template, agents=args.agents, turns=args.turns, max_tokens=args.max_tokens, seed=args.seed)
    n_req = sum(len(p) for _, p in agents)
    ws = working_set_tokens(agents, template)
    kv_per_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * (
        model.config.hidden_size // model.config.num_attention_heads) * 4
    working_set = {"tokens": ws, "mib": round(ws * kv_per_token / (1 << 20), 1), "kv_bytes_per_token": kv_per_token}
    print(f"{len(agents)} agents, {n_req} requests, {sum(len(t) for _, p in agents for t in p)} prompt tokens per arm; "
          f"working set {ws} tokens ({working_set['mib']} MiB of KV)")
    configs, latency = {}, {}
    for k, (name, mib) in enumerate(caches):
        summary = {}
        for arm in args.arms.split(","):
            if arm in APC_ONLY and k:
                continue
            t0 = time.perf_counter()
            recs = run_arm(arm, model, wh, template, agents, args, mib, latency)
            summary[arm] = {**summarize(recs), "wall_s": round(time.perf_counter() - t0, 1)}
            report(f"{name}/{arm}", summary[arm])
        configs[name] = {"cache_mib": mib, "arms": summary, "goals": goals_of(summary)}
        for k, v in configs[name]["goals"].items():
            print(f"  {name} {k}: {v}")
    if latency:
        print(f"idle fleet: {latency}")
    if args.quick:
        return
    settings = {k: v for k, v in vars(args).items() if k not in ("quick", "device")}
    doc = {"machine": machine(), "model": setup.meta, "settings": settings,
           "agents": [{"trace": t, "requests": len(p)} for t, p in agents], "working_set": working_set,
           "configs": configs,
           "idle_latency": latency}
    path = write_results("routing", doc)
    plot(configs, path.with_suffix(".png"))
    print(f"wrote {path}")


def report(label: str, s: dict) -> None:
    print(f"{label:20s} cached {s['cached_tokens']:7d} ({s['cached_fraction']:.0%})  TTFT p50 {s['ttft_p50_s']:.2f} s "
          f"p99 {s['ttft_p99_s']:.2f} s  balance {s['load_balance']:.2f} {s['requests_per_replica']}  "
          f"route p50 {s['route_p50_ms']:.1f} ms  same replica {s['same_replica_as_previous_call']:.0%}  "
          f"wall {s['wall_s']} s", flush=True)
    for trace, t in s["by_trace"].items():
        print(f"{'':20s}   {trace}: cached {t['cached_tokens']} of {t['prompt_tokens']} "
              f"({t['cached_tokens'] / max(1, t['prompt_tokens']):.0%}), TTFT p50 {t['ttft_p50_s']:.2f} s", flush=True)


if __name__ == "__main__":
    main()
