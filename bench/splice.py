"""Splice benchmark: planning time, and the three-arm message-edit benchmark.

    ./dev bench splice                    # everything (~12 minutes on 2 cores)
    ./dev bench splice --only planning    # planning time only (~1 minute)
    ./dev bench splice --only sweep       # the 16K-token edit-position sweep (random weights)
    ./dev bench splice --only workloads   # edit_replay and the truncated traces (SmolLM2)

**Planning.** A 32K-token session, block sizes 1 and 16, 1 and 8 amortize directives (each
replaces 300 tokens with 37, so every shift is misaligned for B = 16 and the plan copies the
downstream tokens; the worst case). Server-side phases timed in process, as the sidecar runs
them: decode the request's directives, plan (``plan_splice``, which includes the invariant
check), encode the ``OpPlan``; and the Splice round trip to a sidecar in its own process
against an empty RPC (Ping) in the same run, with the server's own ``kv_sidecar_splice_seconds``
mean. Goal: <= 1 ms server side for 8 directives.

**Three arms** (the seed's message-edit benchmark, on the reference engine), per request::

    cache_off     full prefill of the edited prompt
    exact_prefix  the engine's own exact-prefix cache (16-token blocks, like vLLM APC / radix):
                  everything after the first changed token is prefilled again
    splice        the engine session edited in place over gRPC: Splice -> apply the plan
                  (prefill the new tokens, rotate and reindex the kept ones) -> CommitSplice

The directives come from the Policy SDK (``sidecar.sdk.policy.diff_directives``: both message
lists rendered with the model's chat template and diffed at message boundaries). TTFT is the
request start to the first-token logits (splice: the Splice RPC, applying the plan and the
commit included). Cache hit: prompt tokens not prefilled; the oracle keeps every token that is
not inside an edit (the directives' replacements are the only new tokens).

* **Sweep** (``--sweep-model``, default the random-weight 4x512 Llama, because SmolLM2 stops at
  8192 positions): a real mini-SWE-agent history of ~16K tokens; one message near 5%, 50% or
  90% of the prompt is edited (a tool output cut to the truncation policy's head/tail stub, or
  an appended sentence) and a new user message is appended. Goals: splice TTFT <= 0.25x
  exact-prefix when the edit sits in the first 10%; never more than 5% slower anywhere.
* **Workloads** on SmolLM2-135M-Instruct (real weights, its own template):
  ``edit_replay`` (the seed's build-edit-replay: a tau-bench conversation is built call by call,
  then one of its first two user messages is edited and the whole conversation is replayed)
  and the real traces with the reference truncation policy applied
  (``sidecar.sdk.policy.TruncateOldToolOutputs``; each call's history is the policy's output).
  Reported: cache hit per arm and the oracle, TTFT p50/p99 per arm, and the fidelity of
  amortize against the full prefill (cache_off) of the same prompt: KL of the next-token
  distribution, argmax agreement, and answer agreement (the greedy answer of ``--answer-tokens``
  tokens, scored by forced decoding: every step's argmax must match). Goal: splice hit >= 95%
  of the oracle.

Writes bench/results/splice.json (and splice.png).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from bench.harness import machine, pct, sidecar_process, time_calls, write_results

ARMS = ("cache_off", "exact_prefix", "splice")
GOAL_PLAN_MS = 1.0
GOAL_EARLY_RATIO = 0.25
GOAL_SLOWDOWN = 1.05
GOAL_ORACLE_FRACTION = 0.95
PLAN_TOKENS = 32_768


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------


def plan_directives(n: int, count: int, rng: np.random.Generator):
    from sidecar.directives import Directive

    starts = np.linspace(n // 16, n - n // 16, count).astype(int)
    return [Directive(start=int(s), end=int(s) + 300, replacement=rng.integers(0, 49_000, 37).astype(np.uint32))
            for s in starts]


class SpliceMeter:
    """The server's ``kv_sidecar_splice_seconds`` histogram (sum, count) from /metrics."""

    _RE = re.compile(r"^kv_sidecar_splice_seconds_(sum|count) (\S+)$", re.M)

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"

    def read(self) -> tuple[float, float]:
        with urllib.request.urlopen(self.url, timeout=5) as r:
            got = dict(self._RE.findall(r.read().decode()))
        return float(got.get("sum", 0.0)), float(got.get("count", 0.0))


def planning(args: argparse.Namespace) -> dict:
    from sidecar.api.splice import directives_from_wire, directives_to_wire, op_plan_to_wire
    from sidecar.client import SyncSidecarClient
    from sidecar.directives import SessionId, SessionMirror, plan_splice

    rng = np.random.default_rng(0)
    n = PLAN_TOKENS
    tokens = rng.integers(0, 49_000, n).astype(np.uint32)
    reps = args.plan_reps
    rows = []
    port = free_port()
    print(f"planning: {n}-token session, {reps} repetitions per cell", file=sys.stderr)
    with sidecar_process("--metrics-port", str(port)) as target, \
            SyncSidecarClient(target, tenant="bench") as client:
        meter = SpliceMeter(port)
        for b in (1, 16):
            mirror = SessionMirror.open(session_id=SessionId("bench"), tenant="bench", block_size=b, tokens=tokens)
            session = client.open_session(tokens, block_size=b)
            for count in (1, 8):
                ds = plan_directives(n, count, rng)
                wire = directives_to_wire(ds)
                decode = time_calls(lambda: directives_from_wire(wire, max_directives=256), reps, warmup=5)
                plan = plan_splice(mirror, ds)
                planned = time_calls(lambda: plan_splice(mirror, ds), reps, warmup=5)
                encode = time_calls(lambda: op_plan_to_wire(plan, 30.0), reps, warmup=5)
                size = op_plan_to_wire(plan, 30.0).ByteSize()

                def rpc() -> None:
                    p = client.splice(session.session_id, 0, ds)
                    client.abort_splice(p.plan_id)

                rpc()
                s0, c0 = meter.read()
                rtt = np.empty(reps)
                for i in range(reps):
                    t0 = time.perf_counter()
                    p = client.splice(session.session_id, 0, ds)
                    rtt[i] = time.perf_counter() - t0
                    client.abort_splice(p.plan_id)
                s1, c1 = meter.read()
                ping = time_calls(client.ping, reps, warmup=20)
                server_ms = (pct(decode, 50) + pct(planned, 50) + pct(encode, 50)) * 1e3
                row = {
                    "block_size": b, "directives": count, "tokens": n, "plan_bytes": size,
                    "slots_moved": plan.summary.slots_moved, "slots_rotated": plan.summary.slots_rotated,
                    "decode_ms": pct(decode, 50) * 1e3, "plan_ms": pct(planned, 50) * 1e3,
                    "encode_ms": pct(encode, 50) * 1e3, "server_ms": server_ms,
                    "server_histogram_mean_ms": (s1 - s0) / max(1.0, c1 - c0) * 1e3,
                    "splice_rtt_p50_ms": pct(rtt, 50) * 1e3, "splice_rtt_p99_ms": pct(rtt, 99) * 1e3,
                    "ping_p50_ms": pct(ping, 50) * 1e3,
                }
                row["rtt_over_ping"] = row["splice_rtt_p50_ms"] / row["ping_p50_ms"]
                rows.append(row)
                print(f"  B={b:<2} {count} directive(s): server {server_ms:.3f} ms (decode {row['decode_ms']:.3f}, "
                      f"plan+check {row['plan_ms']:.3f}, encode {row['encode_ms']:.3f}; histogram "
                      f"{row['server_histogram_mean_ms']:.3f}); RTT p50 {row['splice_rtt_p50_ms']:.3f} ms = "
                      f"{row['rtt_over_ping']:.1f}x Ping ({row['ping_p50_ms']:.3f} ms); plan {size / 1e6:.2f} MB",
                      file=sys.stderr, flush=True)
            client.close_session(session.session_id)
    worst = max(r["server_ms"] for r in rows if r["directives"] == 8)
    return {"rows": rows, "goal_ms": GOAL_PLAN_MS, "worst_8_directives_server_ms": worst, "met": worst <= GOAL_PLAN_MS}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Three arms
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Record:
    workload: str
    request: int
    tokens: int
    edit_at: float  # first edited position / prompt length
    ttft_ms: dict
    hit: dict  # arm -> fraction of prompt tokens not prefilled; "oracle" too
    prefilled: dict
    splice_ms: dict  # the splice arm's phases: grow, move, rotate, prefill, the rest (RPCs, checks, last token)
    fidelity: dict | None = None


class Arms:
    """The three arms over one model and one sidecar: engines, the splice session, the state
    (what each arm's cache holds) carried from request to request of a workload."""

    def __init__(self, model, client, *, answer_tokens: int, fidelity: bool, stop_tokens: Sequence[int] = (),
                 exact_store: bool = True) -> None:
        from clients.transformers import CACHE_OFF, EXACT_PREFIX, Engine, PrefixCache, ReusePolicy

        self.model, self.client = model, client
        self.off = Engine(model, reuse=replace(CACHE_OFF, store=False))
        # exact_store=False: the measured request leaves the prefix cache as it was (repeats).
        self.exact = Engine(model, reuse=replace(EXACT_PREFIX, store=exact_store),
                            prefix_cache=PrefixCache(capacity_bytes=4 << 30))
        self.splicer = Engine(model, reuse=ReusePolicy(prefix_cache=False, sidecar=False, store=False))
        self.answer_tokens, self.fidelity, self.stop = answer_tokens, fidelity, tuple(stop_tokens)
        self.session = None
        self._base = None  # (tokens, PrefillResult) of the last conversation start

    def start(self, tokens: np.ndarray) -> None:
        """A new conversation: both caching arms hold ``tokens`` (untimed)."""
        from clients.transformers import EXACT_PREFIX
        from clients.transformers.splice import SpliceSession

        self.close()
        self.exact.prefill(tokens, reuse=EXACT_PREFIX)
        if self._base is None or not np.array_equal(self._base[0], tokens):
            self._base = (tokens, self.splicer.prefill(tokens))
        # shared=True: the session edits a copy, so the next start can reuse the prefill.
        # 4096 spare positions, as an engine preallocates its pool: edits that grow the session
        # do not reallocate the cache (SpliceTimings.grow_s reports it when they do).
        self.session = SpliceSession.from_prefill(self.splicer, self._base[1], shared=True, reserve=4096,
                                                  sidecar=self.client)

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    def request(self, label: str, i: int, directives, new_ids: np.ndarray) -> Record:
        n = len(new_ids)
        out: dict = {}
        order = ARMS[i % 3:] + ARMS[: i % 3]
        for arm in order:
            t0 = time.perf_counter()
            if arm == "cache_off":
                r = self.off.prefill(new_ids, reserve=self.answer_tokens + 1)
                out[arm] = (time.perf_counter() - t0, n, r)
            elif arm == "exact_prefix":
                r = self.exact.prefill(new_ids)
                out[arm] = (time.perf_counter() - t0, r.prefill_tokens, r)
            else:
                res = self.session.splice(directives)
                logits = res.logits if res.logits is not None else self.session.next_logits()
                out[arm] = (time.perf_counter() - t0, res.prefilled + res.refreshed, logits)
                t = res.timings
                phases = {"grow": t.grow_s, "move": t.move_s, "rotate": t.rotate_s, "prefill": t.prefill_s}
                phases = {k: v * 1e3 for k, v in phases.items()}
                phases["rpc_and_checks"] = out[arm][0] * 1e3 - sum(phases.values())
                if res.fell_back:
                    print(f"  {label} #{i}: splice fell back: {res.fell_back}", file=sys.stderr)
        assert np.array_equal(self.session.tokens, new_ids), "the spliced session differs from the prompt"
        replaced = sum(len(d.replacement) for d in directives)
        first = min(d.start for d in directives) if directives else n
        rec = Record(
            workload=label, request=i, tokens=n, edit_at=first / max(1, n),
            ttft_ms={a: out[a][0] * 1e3 for a in ARMS},
            hit={**{a: 1 - out[a][1] / n for a in ARMS}, "oracle": 1 - replaced / n},
            prefilled={a: int(out[a][1]) for a in ARMS}, splice_ms=phases,
        )
        if self.fidelity:
            rec.fidelity = self._fidelity(out["cache_off"][2], out["splice"][2])
        print(f"  {label} #{i}: {n} tok, edit at {rec.edit_at:.0%}  " + "  ".join(
            f"{a} {rec.ttft_ms[a]:8.0f} ms ({100 * rec.hit[a]:5.1f}%)" for a in ARMS)
            + f"  oracle {100 * rec.hit['oracle']:5.1f}%"
            + (f"  KL {rec.fidelity['kl_first']:.2e} argmax {rec.fidelity['argmax_first']} "
               f"answer {rec.fidelity['answer_match']}" if rec.fidelity else ""), file=sys.stderr, flush=True)
        return rec

    def _fidelity(self, full, splice_logits) -> dict:
        """Amortize vs the full prefill: next-token KL / argmax, and the full prefill's greedy
        answer scored on a copy of the spliced cache by forced decoding."""
        import torch

        from clients.transformers.fidelity import answer_length, compare
        from clients.transformers.splice import clone_cache

        eng, a = self.off, self.answer_tokens
        ref_logp, answer = [torch.log_softmax(full.logits.float(), -1)], []
        cache, pos = full.cache, len(full.tokens)
        for step in range(a):
            tok = int(ref_logp[-1].argmax())
            answer.append(tok)
            if step == a - 1 or tok in self.stop:
                break
            ref_logp.append(torch.log_softmax(eng._decode(cache, tok, pos + step).float(), -1))
        sess = self.session
        copy = clone_cache(self.splicer, sess.cache, reserve=a + 1)
        logp = [torch.log_softmax(splice_logits.float(), -1)]
        for step, tok in enumerate(answer[:-1]):
            logp.append(torch.log_softmax(self.splicer._decode(copy, tok, pos + step).float(), -1))
        m = compare(torch.stack(ref_logp), torch.stack(logp), answer)
        k = answer_length(answer, self.stop)
        return {
            "kl_first": float(m["kl"][0]), "kl_mean": float(np.mean(m["kl"][:k])),
            "argmax_first": bool(m["agree"][0]), "argmax_rate": float(np.mean(m["agree"][:k])),
            "answer_match": bool(m["agree"][:k].all()), "answer_tokens": k,
        }


def diff(old_msgs, new_msgs, template, tools, mode_for=None):
    from sidecar.sdk.policy import diff_directives

    return diff_directives(old_msgs, new_msgs, template, tools=tools, mode_for=mode_for)


# ---------------------------------------------------------------------------------------------
# Sweep: the edit position in a ~16K-token prompt
# ---------------------------------------------------------------------------------------------


def long_history(pool, template, target: int):
    """The first call of a real mini-swe trajectory whose rendering reaches ``target`` tokens."""
    for traj in sorted(pool.swe, key=lambda t: -len(t.calls)):
        for msgs in traj.calls:
            if len(template.render(msgs, traj.tools)) >= target:
                return list(msgs), traj.tools
    raise ValueError(f"no trajectory reaches {target} tokens")


def edit_near(msgs, template, tools, frac: float, extra: str):
    """Edit the message whose start is nearest ``frac`` of the prompt: a tool output long enough
    to truncate is cut to the policy's stub, anything else gets ``extra`` inserted in its middle."""
    from sidecar.sdk.policy import TruncateOldToolOutputs, render_blocks

    pol = TruncateOldToolOutputs()
    starts = render_blocks(template, msgs, tools).starts
    n = len(template.render(msgs, tools))
    order = np.argsort(np.abs(starts[1:] / n - frac)) + 1  # never the system message
    for k in order:
        m = msgs[k]
        text = m.get("content")
        if not isinstance(text, str) or not text:
            continue
        if m.get("role") == "tool" and len(text) > 4 * (pol.head + pol.tail):
            new = {**m, "content": text[: pol.head] + pol.joiner + text[-pol.tail :]}
            kind = "truncate tool output"
        else:
            cut = text.rfind(" ", 0, len(text) // 2) + 1
            new = {**m, "content": f"{text[:cut]}{extra} {text[cut:]}"}
            kind = f"insert into {m.get('role')}"
        return [*msgs[:k], new, *msgs[k + 1 :]], kind
    raise ValueError("no editable message")


def sweep(args: argparse.Namespace, setup, client) -> list[Record]:
    from workloads import TextPool

    pool = TextPool.load()
    msgs, tools = long_history(pool, setup.template, args.sweep_tokens)
    arms = Arms(setup.model, client, answer_tokens=args.answer_tokens, fidelity=False, exact_store=False)
    out = []
    try:
        for i, frac in enumerate(args.sweep_at):
            edited, kind = edit_near(msgs, setup.template, tools, frac, "Also: " + pool.user_queries[i])
            new = [*edited, {"role": "user", "content": pool.user_queries[i + 1]}]
            d = diff(msgs, new, setup.template, tools)
            for rep in range(args.sweep_repeats):
                arms.start(d.old_ids)
                rec = arms.request(f"sweep[{frac:.0%}]", i * args.sweep_repeats + rep, d.directives, d.new_ids)
                rec.fidelity = {"edit": kind}
                out.append(rec)
    finally:
        arms.close()
    return out


# ---------------------------------------------------------------------------------------------
# Workloads on the real model
# ---------------------------------------------------------------------------------------------


def edit_replay_requests(pool, template, args):
    """(label, conversation index, old messages, new messages, tools): one build -> edit ->
    replay per conversation (the seed's pattern; workloads.edit_replay's edit)."""
    from workloads.synthetic import _pick_trajectories

    rng = np.random.default_rng([args.seed, 5])
    out = []
    for c, t in enumerate(_pick_trajectories(pool.tau, args.replay_conversations, min_calls=args.replay_calls,
                                             rng=rng)):
        calls = t.calls[: args.replay_calls]
        built = list(calls[-1])
        users = [i for i, m in enumerate(built) if m.get("role") == "user"][:2]
        target = users[int(rng.integers(len(users)))]
        extra = pool.user_queries[int(rng.integers(len(pool.user_queries)))]
        edited = [dict(m) for m in built]
        edited[target]["content"] = f"{edited[target]['content']} Also: {extra}"
        out.append(("edit_replay", c, built, edited, t.tools))
    return out


def trace_requests(pool, name: str, first: int, calls: int):
    """Consecutive calls of a trace's first trajectory, each history as the truncation policy
    leaves it: (label, call, previous history, this history, tools)."""
    from sidecar.sdk.policy import TruncateOldToolOutputs

    pol = TruncateOldToolOutputs()
    t = (pool.swe if name == "mini_swe" else pool.tau)[0]
    out = []
    for i in range(first, min(len(t.calls), first + calls + 1)):
        out.append((f"trace:{name}[truncated]", i, pol.transform(t.calls[i - 1], i - 1), pol.transform(t.calls[i], i),
                    t.tools))
    return out


def workloads(args: argparse.Namespace, setup, client) -> list[Record]:
    from workloads import TextPool

    pool = TextPool.load()
    tok = setup.tokenizer
    stop = [tok.convert_tokens_to_ids("<|im_end|>")] if tok is not None else []
    arms = Arms(setup.model, client, answer_tokens=args.answer_tokens, fidelity=True, stop_tokens=stop)
    limit = setup.meta.get("max_positions") or 1 << 30
    reqs = edit_replay_requests(pool, setup.template, args)
    reqs += trace_requests(pool, "mini_swe", args.swe_first, args.trace_calls)
    reqs += trace_requests(pool, "tau_bench", args.tau_first, args.trace_calls)
    out: list[Record] = []
    held = None  # (label, messages) the arms hold
    try:
        for label, i, old, new, tools in reqs:
            d = diff(old, new, setup.template, tools)
            if len(d.new_ids) + args.answer_tokens + 1 >= limit:
                print(f"  {label} #{i}: {len(d.new_ids)} tokens exceed the model's {limit} positions; stop",
                      file=sys.stderr)
                held = None
                continue
            if held != (label, old):
                arms.start(d.old_ids)  # a new conversation (the build phase is not timed)
            out.append(arms.request(label, i, d.directives, d.new_ids))
            held = (label, new)
    finally:
        arms.close()
    return out


# ---------------------------------------------------------------------------------------------
# Statistics, report
# ---------------------------------------------------------------------------------------------


def summarize(records: Sequence[Record]) -> dict:
    by: dict[str, list[Record]] = {}
    for r in records:
        by.setdefault(r.workload, []).append(r)
    out = {}
    for label, rs in by.items():
        total = sum(r.tokens for r in rs)
        s = {
            "requests": len(rs), "mean_tokens": total / len(rs),
            "mean_edit_at": float(np.mean([r.edit_at for r in rs])),
            "ttft_p50_ms": {a: pct(np.array([r.ttft_ms[a] for r in rs]), 50) for a in ARMS},
            "ttft_p99_ms": {a: pct(np.array([r.ttft_ms[a] for r in rs]), 99) for a in ARMS},
            "hit_pct": {a: 100 * sum(r.hit[a] * r.tokens for r in rs) / total for a in (*ARMS, "oracle")},
            "splice_over_exact": float(np.median([r.ttft_ms["splice"] / r.ttft_ms["exact_prefix"] for r in rs])),
        }
        s["splice_phases_ms_mean"] = {k: float(np.mean([r.splice_ms[k] for r in rs])) for k in rs[0].splice_ms}
        s["splice_hit_over_oracle"] = s["hit_pct"]["splice"] / max(1e-9, s["hit_pct"]["oracle"])
        fid = [r.fidelity for r in rs if r.fidelity and "kl_first" in r.fidelity]
        if fid:
            s["fidelity"] = {
                "kl_first_median": float(np.median([f["kl_first"] for f in fid])),
                "kl_first_max": float(np.max([f["kl_first"] for f in fid])),
                "argmax_first_pct": 100 * float(np.mean([f["argmax_first"] for f in fid])),
                "argmax_rate_pct": 100 * float(np.mean([f["argmax_rate"] for f in fid])),
                "answer_match_pct": 100 * float(np.mean([f["answer_match"] for f in fid])),
            }
        out[label] = s
    return out


def format_table(summary: dict) -> str:
    lines = [f"{'workload':<28} {'req':>3} {'tokens':>6} {'edit@':>5} | {'TTFT p50 ms: off':>16} {'exact':>8} "
             f"{'splice':>8} {'s/e':>5} | {'hit %: exact':>12} {'splice':>6} {'oracle':>6} | {'KL p50':>8} "
             f"{'argmax':>6} {'answer':>6}"]
    for label, s in summary.items():
        t, h, f = s["ttft_p50_ms"], s["hit_pct"], s.get("fidelity")
        fid = (f"{f['kl_first_median']:>8.1e} {f['argmax_first_pct']:>5.0f}% {f['answer_match_pct']:>5.0f}%" if f
               else f"{'':>8} {'':>6} {'':>6}")
        lines.append(f"{label:<28} {s['requests']:>3} {s['mean_tokens']:>6.0f} {s['mean_edit_at']:>5.0%} | "
                     f"{t['cache_off']:>16.0f} {t['exact_prefix']:>8.0f} {t['splice']:>8.0f} "
                     f"{s['splice_over_exact']:>5.2f} | {h['exact_prefix']:>12.1f} {h['splice']:>6.1f} "
                     f"{h['oracle']:>6.1f} | {fid}")
    return "\n".join(lines)


def goals(sweep_summary: dict, work_summary: dict) -> dict:
    out = {}
    early = [s for s in sweep_summary.values() if s["mean_edit_at"] <= 0.10]
    if early:
        worst = max(s["splice_over_exact"] for s in early)
        out["early_edit_ratio"] = {"value": worst, "goal": GOAL_EARLY_RATIO, "met": worst <= GOAL_EARLY_RATIO}
    both = {**sweep_summary, **work_summary}
    if both:
        worst = max(s["splice_over_exact"] for s in both.values())
        out["never_slower"] = {"value": worst, "goal": GOAL_SLOWDOWN, "met": worst <= GOAL_SLOWDOWN}
        low = min(s["splice_hit_over_oracle"] for s in both.values())
        out["hit_vs_oracle"] = {"value": low, "goal": GOAL_ORACLE_FRACTION, "met": low >= GOAL_ORACLE_FRACTION}
    return out


def plot(summary: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = list(summary)
    x = np.arange(len(labels))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for k, arm in enumerate(ARMS):
        ax1.bar(x + (k - 1) * 0.27, [summary[w]["ttft_p50_ms"][arm] for w in labels], 0.27, label=arm)
        ax2.bar(x + (k - 1.5) * 0.2, [summary[w]["hit_pct"][arm] for w in labels], 0.2, label=arm)
    ax2.bar(x + 1.5 * 0.2, [summary[w]["hit_pct"]["oracle"] for w in labels], 0.2, label="oracle", color="grey")
    ax1.set_ylabel("TTFT p50 (ms, log)")
    ax1.set_yscale("log")
    ax2.set_ylabel("cache hit (% of prompt tokens)")
    for ax in (ax1, ax2):
        ax.set_xticks(x, labels, rotation=20, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle("Splice vs exact-prefix vs cache-off (reference engine, 2 CPU cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.splice", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("planning", "sweep", "workloads"), action="append")
    p.add_argument("--plan-reps", type=int, default=200)
    p.add_argument("--sweep-model", choices=("random", "smollm2"), default="random")
    p.add_argument("--sweep-tokens", type=int, default=16_000)
    p.add_argument("--sweep-at", type=lambda s: [float(x) for x in s.split(",")], default=[0.05, 0.5, 0.9])
    p.add_argument("--sweep-repeats", type=int, default=2)
    p.add_argument("--replay-conversations", type=int, default=4)
    p.add_argument("--replay-calls", type=int, default=10)
    p.add_argument("--trace-calls", type=int, default=5)
    p.add_argument("--swe-first", type=int, default=10)
    p.add_argument("--tau-first", type=int, default=6)
    p.add_argument("--answer-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--layers", type=int, default=4, help="--sweep-model random: layers")
    p.add_argument("--hidden", type=int, default=512, help="--sweep-model random: hidden size")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="splice")
    args = p.parse_args(argv)
    parts = args.only or ["planning", "sweep", "workloads"]
    result: dict = {"machine": machine(), "args": {k: v for k, v in vars(args).items()}}
    if "planning" in parts:
        result["planning"] = planning(args)
    sweep_s, work_s = {}, {}
    if "sweep" in parts or "workloads" in parts:
        from bench.ttft import load_bench_model, sidecar_flags
        from sidecar.client import SyncSidecarClient

        for part, model in (("sweep", args.sweep_model), ("workloads", "smollm2")):
            if part not in parts:
                continue
            setup = load_bench_model(model, args)
            if model == "random":
                setup.model.config.max_position_embeddings = max(32_768, 2 * args.sweep_tokens)
            flags = sidecar_flags(setup.template, 1 << 28, -1)
            with sidecar_process(*flags) as target, SyncSidecarClient(target, tenant="bench") as client:
                print(f"{part}: {setup.title}", file=sys.stderr, flush=True)
                records = (sweep if part == "sweep" else workloads)(args, setup, client)
            summary = summarize(records)
            (sweep_s if part == "sweep" else work_s).update(summary)
            result[part] = {"model": setup.meta, "summary": summary, "records": [asdict(r) for r in records]}
    if sweep_s or work_s:
        table = format_table({**sweep_s, **work_s})
        print(table)
        result["goals"] = goals(sweep_s, work_s)
        png = plot({**sweep_s, **work_s}, Path(__file__).resolve().parent / "results" / f"{args.out}.png")
        if png:
            print(f"plot: {png}")
    if "planning" in result:
        pl = result["planning"]
        print(f"planning: 8 directives on {PLAN_TOKENS} tokens: {pl['worst_8_directives_server_ms']:.3f} ms server "
              f"side (goal <= {GOAL_PLAN_MS} ms: {'met' if pl['met'] else 'MISSED'})")
    for name, g in result.get("goals", {}).items():
        print(f"goal {name}: {g['value']:.3f} (goal {g['goal']}): {'met' if g['met'] else 'MISSED'}")
    print(f"results: {write_results(args.out, json.loads(json.dumps(result, default=float)))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
