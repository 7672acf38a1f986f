"""KV-aware routing across a fleet: round-robin vs prefix-only affinity vs the sidecar's Score.

    ./dev bench routing            # ~13 minutes on 2 cores; --quick for a smoke run

The fleet: three replicas, each a reference engine (``clients.transformers.Engine``, its own
exact-prefix cache, Lookup -> Fetch -> prefill -> Store through its own sidecar), each sidecar a
``kv-sidecar serve`` process with ``routing.replica_id``, all on one Redis (shared registry; no
shared remote tier, so a replica serves only what it holds). Every arm of every setting starts
from a fresh fleet (new sidecar processes and key prefix, empty engine caches).

The traffic: the real agent traces (workloads/data/agent_traces: mini-SWE-agent and tau-bench),
one trajectory per agent, replayed call by call with the truncation policy applied (tool outputs
older than two turns cut to a head/tail stub, ``TruncateOldToolOutputs``) and a per-agent header
message first: the agent's name and session, and, with ``stamped`` headers, the time of the
request, which changes every call (as agent harnesses stamp their prompts); ``stable`` headers
are the same on every call of an agent, so an agent's previous prompt is an exact prefix of its
next one up to the first cut tool output. Twelve agents run concurrently; between two calls an
agent runs the tool its answer called (``--think-s``, 0.5-2 s), so their requests interleave on
the fleet.

The replay runs on a virtual clock, so that every arm gets the same traffic and a result does not
depend on how busy the machine is: calls are taken in the order of their arrival times, each one
is routed (the router's load window on the virtual clock), then served by the real engine and
sidecar of its replica, one request at a time; the Score arm waits until the scoring sidecar
sees the replica's new chunks (what its own sidecar scores) before the next call. A call's
time to first token is modelled from what it computed (``SERVICE``: 20 ms + 4,000 computed
tokens/s + 40,000 reused tokens/s) plus its wait behind earlier calls on the same replica; the
agent's next call arrives that long plus its tool time later. Routes and cached tokens are
therefore reproducible; the engine's own run time per request is measured and reported too.

Arms (the router picks a replica per request; the engines are the same in the first three):

    round_robin   replicas in turn
    prefix        prefix-only affinity, as Dynamo's KV router and llm-d's indexer score: the
                  longest exact-prefix match against what each engine's own prefix cache holds
                  (read after every request, evictions included: what its KV events would
                  report), among replicas within the load bound
    sidecar       the reference router (``sidecar.sdk.router.Router``): the sidecar fleet's Score
                  (position-independent: prefix, exact and shifted hits), same load bound
    prefix_apc    the peer deployment: prefix-only routing as above, engines with their own
                  exact-prefix cache only (vLLM APC behind Dynamo or llm-d), no sidecar

Both affinity arms run the reference router with the same load bound (``--load-slack``: a replica
at most that many requests above the least loaded one, counting the requests routed to each in
the last ``--load-window-s`` seconds) and fall back to the least loaded replica when no score
reaches ``--min-saved`` tokens; they differ only in the scores.

Settings: every header mode (``--headers``) at every per-replica cache size (``--caches``, for the
sidecar's CPU tier and for the engine's own prefix cache): ``all`` is 1024 MiB, where a replica
can hold every agent's history; a fraction is that share of the working set measured for the
header mode (the distinct blocks of every prompt: the agents' histories, the traces' shared
system prompts and tools), so at 1/2 and 1/8 a replica holds half and an eighth of it, the regime
of a GPU fleet's KV capacity under agent load, where a request lands decides what is still
cached. The peer-deployment arm runs at the first size of each header mode.

Measured per arm: fleet-wide prompt tokens served from cache (the engine's own prefix + the
sidecar's exact and shifted hits, as the engine loaded them), load balance (max / mean requests
per replica), TTFT p50 / p99 (modelled, above), and how often an agent's call went where its
previous call went. Goal: in every setting the Score arm serves at least the cached tokens of
prefix-only routing, at a balance within 10% of round-robin's.

Model: the random-weight Llama-shaped model of ``bench.ttft --model random`` (``--layers`` x
``--hidden``) with the offline hash tokenizer: real forward passes, sized for 2 cores.
Results: bench/results/routing.json and routing.png.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from bench.harness import bench_redis, machine, spawn_sidecar, stop_process, write_results
from workloads.traces import TruncateOldToolOutputs, load_trajectories

REPLICAS = ("r0", "r1", "r2")
ARMS = ("round_robin", "prefix", "sidecar", "prefix_apc")
#: arms whose engines use their own exact-prefix cache only (no sidecar): the peer deployment
APC_ONLY = ("prefix_apc",)
HEADERS = ("stamped", "stable")
#: the modelled time to first token of a call: fixed seconds + computed / reused tokens per second;
#: then the engine decodes the answer (the tool call) in ``answer_s``
SERVICE = {"fixed_s": 0.02, "prefill_tokens_per_s": 4000.0, "reused_tokens_per_s": 40000.0, "answer_s": 2.0}
#: the longest wait for the scoring sidecar to see a replica's new chunks as its own sidecar does
SETTLE_S = 0.5


# ----------------------------------------------------------------------------- workload


def agent_prompts(template, *, agents: int, turns: int, max_tokens: int, seed: int,
                  stamped: bool = True, first: int = 0) -> list[tuple[str, list[np.ndarray]]]:
    """Per agent (trace name, its prompts in call order): one trajectory each, alternating the
    two traces, the truncation policy applied, a per-agent header first: stamped with each
    call's time (``stamped``), or the same on every call of the agent. ``first``: the first
    trajectory of each trace taken (another offset replays other trajectories)."""
    policy = TruncateOldToolOutputs()
    rng = np.random.default_rng(seed)
    pools = {name: load_trajectories(name) for name in ("mini_swe", "tau_bench")}
    out = []
    for i in range(agents):
        name = ("mini_swe", "tau_bench")[i % 2]
        traj = pools[name][(first + i // 2) % len(pools[name])]
        session = uuid.UUID(int=int(rng.integers(0, 2**63))).hex[:12]
        clock = 9 * 3600 + int(rng.integers(0, 3600))
        prompts = []
        for t, messages in enumerate(traj.calls[:turns]):
            clock += int(rng.integers(20, 90))
            stamp = f"2026-11-27T{clock // 3600:02d}:{clock // 60 % 60:02d}:{clock % 60:02d}Z"
            text = f"Agent {name}-{i} (session {session})." + (f" Request {t + 1} at {stamp}." if stamped else "")
            header = {"role": "system", "content": text}
            msgs = [header, *policy.transform(messages, t)]
            tokens = template.render(msgs, traj.tools)
            if len(tokens) > max_tokens:
                break
            prompts.append(tokens)
        out.append((name, prompts))
    return out


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


def cache_mib(size: str, working_set_mib: float) -> int:
    """``all``: 1024 MiB; a fraction (``1/2``): that share of the working set, rounded up."""
    if size == "all":
        return 1024
    return max(1, math.ceil(float(Fraction(size)) * working_set_mib))


# ----------------------------------------------------------------------------- fleet


class PrefixScorer:
    """``Score`` as an exact-prefix router computes it, from what each engine's own prefix cache
    holds (read after each request, evictions included: what its KV events report)."""

    def __init__(self, engines: dict) -> None:
        self.engines = engines

    def score(self, tokens: np.ndarray, identity, candidates, **_guards):
        from sidecar.client import ReplicaScore, ScoreResult

        n = len(tokens)
        out = []
        for r in candidates:
            best = 0
            for e in self.engines[r].prefix_cache._entries.values():
                m = min(len(e.tokens), n)
                diff = np.flatnonzero(e.tokens[:m] != tokens[:m])
                best = max(best, int(diff[0]) if len(diff) else m)
            out.append(ReplicaScore(replica=r, prefix_tokens=best, prefill_tokens=n - best))
        return ScoreResult(total_tokens=n, absent=[], scores=out)


@dataclass
class Record:
    agent: int
    trace: str
    turn: int
    replica: str
    tokens: int
    prefix: int
    exact: int
    shifted: int
    predicted: int  # the router's score of the chosen replica (saved tokens)
    arrival_s: float  # virtual
    ttft_s: float  # modelled: wait behind earlier calls on the replica + SERVICE
    run_s: float  # measured: the engine's Lookup, Fetch, prefill and Store of this request
    route_s: float  # measured: the routing decision (Score and pick)
    fetch_misses: int

    @property
    def cached(self) -> int:
        return self.prefix + self.exact + self.shifted


def service_s(prefill: int, cached: int) -> float:
    return SERVICE["fixed_s"] + prefill / SERVICE["prefill_tokens_per_s"] + cached / SERVICE["reused_tokens_per_s"]


def replay(arm: str, model, weights_hash: str, template, agents, args, mib: int, latency: dict) -> tuple[list[Record], int]:
    """One arm on a fresh fleet; returns the records and how many calls the Score arm went on
    without the scoring sidecar seeing the previous call's chunks within ``SETTLE_S``."""
    from clients.transformers import EXACT_PREFIX, SIDECAR, Engine, PrefixCache
    from sidecar.client import Route, Router, RouterConfig, SyncSidecarClient

    records: list[Record] = []
    unsettled = 0
    with ExitStack() as stack:
        url = bench_redis(stack)
        key_prefix = f"route{uuid.uuid4().hex[:8]}"
        anchors = ",".join(str(a) for a in template.anchor_token_ids)

        def start(name: str):
            return spawn_sidecar(
                "--set", f"chunker.anchor_tokens=[{anchors}]", "--set", f"store.cpu_bytes={mib << 20}",
                "--set", f"shared_registry.redis_url={url}", "--set", f"shared_registry.key_prefix={key_prefix}",
                "--set", "shared_registry.publish_interval_s=0.005", "--set", f"routing.replica_id={name}",
                "--set", f"store.namespace={key_prefix}{name}", "--set", "max_prompt_tokens=262144")

        with ThreadPoolExecutor(len(REPLICAS)) as ex:  # a sidecar takes seconds to start
            started = [ex.submit(start, name) for name in REPLICAS]
        targets = {}
        for name, fut in zip(REPLICAS, started):
            proc, targets[name] = fut.result()
            stack.callback(stop_process, proc)
        clients = {r: stack.enter_context(SyncSidecarClient(t, tenant="fleet", timeout_s=10.0))
                   for r, t in targets.items()}
        engines = {r: Engine(model, sidecar=clients[r], namespace="routing", weights_hash=weights_hash,
                             reuse=EXACT_PREFIX if arm in APC_ONLY else SIDECAR,
                             prefix_cache=PrefixCache(capacity_bytes=mib << 20)) for r in REPLICAS}
        identity = engines[REPLICAS[0]].identity
        scorer = stack.enter_context(SyncSidecarClient(targets[REPLICAS[0]], tenant="fleet", timeout_s=2.0))
        now = [0.0]
        cfg = RouterConfig(load_slack=args.load_slack, load_window_s=args.load_window_s,
                           min_saved_tokens=args.min_saved)
        # both affinity arms run the reference router: the same load figures and rule, only the
        # scores differ (the sidecar fleet's Score, or the engines' exact-prefix match)
        router = Router(scorer if arm == "sidecar" else PrefixScorer(engines), list(REPLICAS), cfg,
                        clock=lambda: now[0])

        def seen(replica: str, tokens: np.ndarray) -> bool:
            """Wait until the scorer sees ``replica``'s copies of ``tokens`` as it sees them itself."""
            if replica == REPLICAS[0]:
                return True
            want = clients[replica].score(tokens, identity, [replica]).scores
            end = time.monotonic() + SETTLE_S
            while time.monotonic() < end:
                if scorer.score(tokens, identity, [replica]).scores == want:
                    return True
                time.sleep(0.002)
            return False

        rngs = [np.random.default_rng((args.seed, i)) for i in range(len(agents))]
        arrivals = [(float(rngs[i].uniform(0, args.think_s[0])), i, 0) for i, (_, p) in enumerate(agents) if p]
        heapq.heapify(arrivals)
        free = dict.fromkeys(REPLICAS, 0.0)
        turn = 0
        while arrivals:
            t, i, k = heapq.heappop(arrivals)
            now[0] = t
            trace, prompts = agents[i]
            tokens = prompts[k]
            t0 = time.perf_counter()
            if arm == "round_robin":
                route = Route(replica=REPLICAS[turn % len(REPLICAS)], saved_tokens=0)
                turn += 1
            else:
                with router.request(tokens, identity, session=str(i)) as route:  # counted in the window at t
                    pass
            t1 = time.perf_counter()
            res = engines[route.replica].prefill(tokens)
            t2 = time.perf_counter()
            if arm == "sidecar" and not seen(route.replica, tokens):
                unsettled += 1
            cached = res.prefix_tokens + res.exact_tokens + res.shifted_tokens
            begin = max(t, free[route.replica])
            free[route.replica] = begin + service_s(res.prefill_tokens, cached)
            ttft = free[route.replica] - t
            records.append(Record(
                agent=i, trace=trace, turn=k, replica=route.replica, tokens=len(tokens), prefix=res.prefix_tokens,
                exact=res.exact_tokens, shifted=res.shifted_tokens, predicted=route.saved_tokens, arrival_s=t,
                ttft_s=ttft, run_s=t2 - t1, route_s=t1 - t0, fetch_misses=res.fetch_misses))
            if k + 1 < len(prompts):  # the agent runs the tool its answer called, then calls again
                think = float(rngs[i].uniform(*args.think_s))
                heapq.heappush(arrivals, (t + ttft + SERVICE["answer_s"] + think, i, k + 1))
        if arm == "sidecar" and not latency:
            latency.update(idle_latency(scorer, identity, [p[-1] for _, p in agents if p]))
    return records, unsettled


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
        "run_p50_s": float(np.percentile([r.run_s for r in records], 50)),
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
                                  "cached_tokens": int(sum(r.cached for r in sub))}
    return out


def goals_of(summary: dict) -> dict:
    """The Score arm against prefix-only routing (same engines, and the peer deployment), over
    all agents and per trace (mini-SWE: the truncation policy moves content on most calls), and
    its balance against round-robin's."""
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
    out["met"] = bool(out.get("cached_vs_prefix", 1.0) >= 1.0 and out.get("balance_vs_round_robin", 1.0) <= 1.10)
    return out


def plot(configs: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"round_robin": "#999", "prefix": "#69c", "sidecar": "#d62", "prefix_apc": "#ccc"}
    headers = [h for h in HEADERS if any(c["headers"] == h for c in configs.values())]
    fig, axes = plt.subplots(1, len(headers) + 1, figsize=(4.2 * (len(headers) + 1), 3.6), squeeze=False)
    axes = axes[0]
    for ax, h in zip(axes, headers):
        confs = [(c["size"], c) for c in configs.values() if c["headers"] == h]
        arms = [a for a in ARMS if a in confs[0][1]["arms"]]
        w = 0.8 / len(arms)
        for j, a in enumerate(arms):
            xs = [x for x, (_, c) in enumerate(confs) if a in c["arms"]]
            ax.bar([x + (j - (len(arms) - 1) / 2) * w for x in xs],
                   [confs[x][1]["arms"][a]["cached_fraction"] * 100 for x in xs], w, label=a, color=colors[a])
        ax.set_xticks(range(len(confs)), [f"{s}\n{c['cache_mib']} MiB" for s, c in confs], fontsize=8)
        ax.set_title(f"{h} headers: % of prompt tokens from cache", fontsize=9)
        ax.legend(fontsize=7)
    ax = axes[-1]
    names = list(configs)
    ax.bar(range(len(names)), [configs[n]["goals"].get("cached_vs_prefix", 0) for n in names], color="#d62")
    ax.axhline(1.0, color="#333", lw=0.8)
    ax.set_xticks(range(len(names)), [n.replace(" ", "\n", 1) for n in names], fontsize=7)
    ax.set_ylim(0.9, max(1.3, max(configs[n]["goals"].get("cached_vs_prefix", 0) for n in names) + 0.05))
    ax.set_title("cached tokens, Score / prefix-only", fontsize=9)
    fig.suptitle("3 replicas, 12 agents replaying real traces (truncation policy)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=12)
    ap.add_argument("--turns", type=int, default=12, help="calls per agent (at most)")
    ap.add_argument("--max-tokens", type=int, default=6144, help="an agent stops before a longer prompt")
    ap.add_argument("--think-s", default="0.5,2.0", help="tool time between an agent's calls: uniform LO,HI seconds")
    ap.add_argument("--headers", default=",".join(HEADERS), help="header modes: stamped (per call), stable")
    ap.add_argument("--caches", default="all,1/2,1/4,1/8",
                    help="per-replica cache sizes: all (1024 MiB) or a fraction of the header mode's working set; "
                         "the sidecar's CPU tier and the engine's own prefix cache each; the peer-deployment arm "
                         "runs at the first")
    ap.add_argument("--first", type=int, default=0, help="the first trajectory of each trace (another set of agents)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (requests run one at a time)")
    ap.add_argument("--load-slack", type=int, default=2)
    ap.add_argument("--load-window-s", type=float, default=10.0,
                    help="the routers' load: requests routed to a replica in the last N (virtual) seconds")
    ap.add_argument("--min-saved", type=int, default=64)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="results file (default bench/results/routing.json)")
    ap.add_argument("--quick", action="store_true", help="4 agents x 4 calls (smoke run; results not written)")
    args = ap.parse_args()
    if args.quick:
        args.agents, args.turns = 4, 4
    args.think_s = tuple(float(x) for x in args.think_s.split(","))
    args.device = "cpu"
    import torch

    from bench.ttft import load_bench_model
    from clients.transformers.models import weights_fingerprint

    setup = load_bench_model("random", args)
    torch.set_num_threads(args.threads)
    model, template = setup.model, setup.template
    wh = weights_fingerprint(model)
    kv_per_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * (
        model.config.hidden_size // model.config.num_attention_heads) * 4
    t_run = time.perf_counter()
    configs, latency, workloads = {}, {}, {}
    for headers in args.headers.split(","):
        agents = agent_prompts(template, agents=args.agents, turns=args.turns, max_tokens=args.max_tokens,
                               seed=args.seed, stamped=headers == "stamped", first=args.first)
        ws = working_set_tokens(agents, template)
        ws_mib = ws * kv_per_token / (1 << 20)
        workloads[headers] = {"agents": [{"trace": t, "requests": len(p)} for t, p in agents],
                              "prompt_tokens": sum(len(t) for _, p in agents for t in p),
                              "working_set": {"tokens": ws, "mib": round(ws_mib, 1)}}
        print(f"{headers} headers: {len(agents)} agents, {sum(len(p) for _, p in agents)} requests, "
              f"{workloads[headers]['prompt_tokens']} prompt tokens per arm; working set {ws} tokens "
              f"({ws_mib:.1f} MiB of KV)", flush=True)
        for k, size in enumerate(args.caches.split(",")):
            mib = cache_mib(size, ws_mib)
            name = f"{headers} {size}"
            summary = {}
            for arm in args.arms.split(","):
                if arm in APC_ONLY and k:
                    continue
                t0 = time.perf_counter()
                recs, unsettled = replay(arm, model, wh, template, agents, args, mib, latency)
                summary[arm] = {**summarize(recs), "wall_s": round(time.perf_counter() - t0, 1)}
                if arm == "sidecar":
                    summary[arm]["unsettled"] = unsettled
                report(f"{name}/{arm}", summary[arm])
            configs[name] = {"headers": headers, "size": size, "cache_mib": mib, "arms": summary,
                             "goals": goals_of(summary)}
            print(f"  {name} ({mib} MiB): {configs[name]['goals']}", flush=True)
    print(f"idle fleet: {latency}\nrun time {time.perf_counter() - t_run:.0f} s")
    if args.quick:
        return
    settings = {k: v for k, v in vars(args).items() if k not in ("quick", "device", "out")}
    doc = {"machine": machine(), "model": setup.meta, "settings": settings, "service_model": SERVICE,
           "kv_bytes_per_token": kv_per_token, "workloads": workloads, "configs": configs,
           "idle_latency": latency, "run_s": round(time.perf_counter() - t_run)}
    if args.out:
        path = Path(args.out)
        path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    else:
        path = write_results("routing", doc)
    plot(configs, path.with_suffix(".png"))
    print(f"wrote {path}")


def report(label: str, s: dict) -> None:
    print(f"{label:22s} cached {s['cached_tokens']:7d} ({s['cached_fraction']:.1%})  TTFT p50 {s['ttft_p50_s']:.2f} s "
          f"p99 {s['ttft_p99_s']:.2f} s  balance {s['load_balance']:.2f} {s['requests_per_replica']}  "
          f"run p50 {s['run_p50_s'] * 1e3:.0f} ms  route p50 {s['route_p50_ms']:.1f} ms  "
          f"same replica {s['same_replica_as_previous_call']:.0%}  wall {s['wall_s']} s"
          + (f"  unsettled {s['unsettled']}" if "unsettled" in s else ""), flush=True)
    for trace, t in s["by_trace"].items():
        print(f"{'':22s}   {trace}: cached {t['cached_tokens']} of {t['prompt_tokens']} "
              f"({t['cached_tokens'] / max(1, t['prompt_tokens']):.1%})", flush=True)


if __name__ == "__main__":
    main()
