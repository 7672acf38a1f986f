"""vLLM (CPU build) with ``clients.vllm.connector.SidecarConnector`` against a real sidecar.

Real engines, the real model (SmolLM2-135M-Instruct, bf16), real gRPC; every engine is a fresh
process (an empty local prefix cache), so a second engine is an engine restart. Engines:

* A (in-process engine core): the reference outputs and the Stores. P1 (stores its chunks),
  X under tenant "ref" (nothing to reuse there: vLLM's plain output for X), Y = another
  agent's header before X's body (stores the body at shifted positions).
* B (multiprocess engine core, the default vLLM mode): P1 again (exact-prefix reuse across the
  restart), then X: a new header before Y's body, served through the gap-fill plug-in
  (``--scheduler-cls clients.vllm.scheduler.SidecarScheduler``), and X2: the same header
  warmed in vLLM's own cache first (a shifted continuation claimable without a gap-fill).
* C: the connector pointed at a closed port (the sidecar is down): P1 still served, by prefill.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (the engine tests run in .venv-engines)")
transformers = pytest.importorskip("transformers")

from tests.real_engines.conftest import closed_port, run_engine  # noqa: E402

pytestmark = pytest.mark.timeout(1800)

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts(model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)

    def render(system: str, body: list[str], question: str) -> list[int]:
        msgs = [{"role": "system", "content": system}]
        msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": p} for i, p in enumerate(body)]
        msgs.append({"role": "user", "content": question})
        ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
        return [int(t) for t in ids]

    fixed = json.loads((Path(__file__).parent / "data" / "prompt_paragraphs.json").read_text())
    readme, fidelity = fixed["readme"], fixed["fidelity"]
    h1 = "You are the booking agent of the airline. Answer in one short sentence. " * 3
    h2 = ("You are the refunds agent. You check every claim against the policy, cite the rule you apply, "
          "and never promise a refund the policy does not allow. ") * 4
    h3 = "You are the triage agent; route each question to the right team and say which one. " * 5
    p1 = render("You are a helpful assistant.", fidelity, "Summarize the fidelity results in one sentence.")
    stub = [int(t) for t in tok.encode(" [older content removed] ", add_special_tokens=False)]
    starts = [i for i, t in enumerate(p1) if t == 1]  # <|im_start|>: message k is [starts[k], starts[k+1])

    def content(seq: list[int], k: int) -> tuple[int, int]:
        at = [i for i, t in enumerate(seq) if t == 1]
        return at[k] + 3, at[k + 1] - 2  # after "<|im_start|>role\n", before "<|im_end|>\n"

    s1, e1 = content(p1, 2)  # an early message: amortize (kept content reused)
    e1p = p1[:s1] + stub + p1[e1:]
    s2, e2 = content(e1p, 6)  # a later one: forget (nothing after it served from cache)
    e2p = e1p[:s2] + stub + e1p[e2:]
    assert len(starts) > 8
    return {
        "e1": e1p, "e2": e2p,
        "d1": [[s1, e1, stub, "amortize"]], "d2": [[s2, e2, stub, "forget"]], "forget_at": s2,
        "p1": render("You are a helpful assistant.", fidelity, "Summarize the fidelity results in one sentence."),
        "x": render(h1, readme, "What does the sidecar do with a shifted chunk?"),
        "y": render(h2, readme, "Which workloads were measured?"),
        "z": render(h3, readme, "What does the sidecar do with a shifted chunk?"),
        "w": render(h1, [], "Hello."),
        "h1": h1,
    }


def _spec(model_dir: str, target: str, requests: list[dict], **extra) -> dict:
    return {"model": model_dir, "sidecar": target, "gap_fill": True,
            "extra": {"tenant": "team-a", "store": "sync", **extra}, "requests": requests}


@pytest.fixture(scope="module")
def engine_a(model_dir, sidecar_target, prompts):
    reqs = [
        {"prompt_token_ids": prompts["p1"], "max_tokens": MAX_TOKENS},
        {"prompt_token_ids": prompts["x"], "max_tokens": MAX_TOKENS, "params": {"sidecar_tenant": "ref"}},
        {"prompt_token_ids": prompts["z"], "max_tokens": MAX_TOKENS, "params": {"sidecar_tenant": "ref2"}},
        {"prompt_token_ids": prompts["y"], "max_tokens": MAX_TOKENS},
        # 4: P1 again, from vLLM's own prefix cache (all but its last partial block)
        {"prompt_token_ids": prompts["p1"], "max_tokens": MAX_TOKENS},
    ]
    return run_engine(_spec(model_dir, sidecar_target, reqs))


@pytest.fixture(scope="module")
def engine_b(model_dir, sidecar_target, prompts, engine_a):
    reqs = [
        {"prompt_token_ids": prompts["p1"], "max_tokens": MAX_TOKENS},
        {"prompt_token_ids": prompts["z"], "max_tokens": MAX_TOKENS},
        {"prompt_token_ids": prompts["w"], "max_tokens": 4},
        {"prompt_token_ids": prompts["x"], "max_tokens": MAX_TOKENS},
        # 4..6: a session mirrored in the sidecar, edited by directives riding in kv_transfer_params
        {"prompt_token_ids": prompts["p1"], "max_tokens": 1, "params": {"sidecar_session": "open"}},
        {"prompt_token_ids": prompts["e1"], "max_tokens": 4,
         "params": {"sidecar_session": "@4", "sidecar_session_version": "@4", "sidecar_directives": prompts["d1"]}},
        {"prompt_token_ids": prompts["e2"], "max_tokens": 4,
         "params": {"sidecar_session": "@5", "sidecar_session_version": "@5", "sidecar_directives": prompts["d2"]}},
    ]
    return run_engine(_spec(model_dir, sidecar_target, reqs), multiprocess=True)


def _agree(a: list[int], b: list[int]) -> int:
    """Leading tokens two greedy outputs share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_exact_prefix_reuse_across_restart(engine_a, engine_b, prompts):
    """Engine A prefilled P1 and Stored it; a fresh engine B (new process, empty local cache)
    claims it from the sidecar and produces the bit-identical greedy output of A's own
    prefix-cache hit on P1 (A's request 4): the same cached rows, the same last partial block
    computed. (Against A's full prefill the output may differ after a few tokens: a CPU matmul
    over 20 rows need not round like the same rows inside a 2,900-row batch.)"""
    a, again, b = engine_a["results"][0], engine_a["results"][4], engine_b["results"][0]
    assert a["sidecar"]["claimed_tokens"] == 0 and a["sidecar"]["store_chunks"] > 0
    n = len(prompts["p1"])
    whole = (n - 1) // 32 * 32 - 32  # all of it but the last partial block
    assert again["sidecar"]["local_tokens"] >= whole and again["sidecar"]["claimed_tokens"] == 0, again["sidecar"]
    claimed = b["sidecar"]["claimed_tokens"]
    assert claimed >= whole and claimed + b["sidecar"]["local_tokens"] == again["sidecar"]["local_tokens"], b["sidecar"]
    assert b["token_ids"] == again["token_ids"]
    assert b["token_ids"][0] == a["token_ids"][0]
    assert b["ttft_s"] < a["ttft_s"]
    assert engine_b["multiprocess"] is True


def test_shifted_chunks_after_new_header_gap_fill(engine_a, engine_b, prompts):
    """Z = a third agent's header before the body that Y Stored at other positions. vLLM's own
    cache has nothing of Z; the gap-fill plug-in prefills the header (a sub-request), after which
    the shifted body is contiguous and claimed. Fidelity: the sidecar's default admission
    (position-independent, the k=4 recompute tokens served from the chunk when bridged) is an
    approximation, so the answer is compared with vLLM's plain output on Z, not required equal:
    we assert the first generated token agrees and report the shared length."""
    ref = engine_a["results"][2]
    z = engine_b["results"][1]
    assert ref["sidecar"]["claimed_tokens"] == 0
    info = z["sidecar"]
    assert info["gap_fills"] >= 1, info
    assert info["claimed_tokens"] >= 0.5 * len(prompts["z"]), info
    print(f"\nZ: {len(prompts['z'])} tokens, planned {info['planned_tokens']}, claimed {info['claimed_tokens']}, "
          f"local {info['local_tokens']}; answers share {_agree(z['token_ids'], ref['token_ids'])}/{MAX_TOKENS} tokens")
    assert z["token_ids"][0] == ref["token_ids"][0]
    # vLLM's own metrics: Z is one request of len(Z) queried tokens (the sub-request's lookup is
    # not counted), and the gap the sub-request computed (at least one whole block) is not
    # reported as a local prefix-cache hit of Z although Z then found it in vLLM's cache.
    m = z["vllm_metrics"]
    print(f"Z in vLLM's metrics: {m}")
    assert m["prefix_cache_queries"] == len(prompts["z"]), m
    assert m["prefix_cache_hits"] <= info["local_tokens"] - 32, (m, info)


def test_shifted_continuation_after_local_prefix(engine_a, engine_b, prompts):
    """X's header was warmed in B's own cache (W); the body after it was Stored by Y at other
    positions: the claim runs from vLLM's local hit through shifted chunks without a gap."""
    ref = engine_a["results"][1]
    x = engine_b["results"][3]
    info = x["sidecar"]
    assert info["local_tokens"] > 0, info
    assert info["claimed_tokens"] >= 0.5 * len(prompts["x"]), info
    print(f"\nX: {len(prompts['x'])} tokens, local {info['local_tokens']}, claimed {info['claimed_tokens']}; "
          f"answers share {_agree(x['token_ids'], ref['token_ids'])}/{MAX_TOKENS} tokens")
    assert x["token_ids"][0] == ref["token_ids"][0]


def test_sidecar_down_requests_still_served(model_dir, engine_a, prompts):
    """The connector pointed at a closed port: the request completes by prefill with vLLM's
    plain output, the failure is counted (and logged once), nothing raises."""
    out = run_engine(_spec(model_dir, closed_port(), [
        {"prompt_token_ids": prompts["p1"], "max_tokens": MAX_TOKENS},
        {"prompt_token_ids": prompts["w"], "max_tokens": 4},
    ], timeout_s=1.0))
    r = out["results"][0]
    assert r["token_ids"] == engine_a["results"][0]["token_ids"]
    assert r["sidecar"]["claimed_tokens"] == 0 and r["sidecar"]["plan_ok"] is False
    sched = out["scheduler_stats"]
    assert sched.get("error:lookup", 0) >= 1, sched
    assert out["log"].count("prefilling, retrying") == 1  # logged once per outage, not per request


def test_directives_become_splice_calls(engine_b, prompts):
    """kv_transfer_params carry a session and span directives: the connector opens the session,
    Splices + Commits each edit (the sidecar's mirror follows the conversation), reuses the kept
    content of an ``amortize`` edit through Lookup + gap-fill, and serves nothing at or after a
    ``forget`` edit from any cache."""
    opened, am, fg = engine_b["results"][4:7]
    s0 = opened["sidecar"]["session"]
    assert s0["id"] and s0["version"] == 0 and s0["length"] == len(prompts["p1"])
    s1 = am["sidecar"]["session"]
    assert s1["id"] == s0["id"] and s1["version"] == 1 and s1["length"] == len(prompts["e1"]), s1
    assert s1["plan_tokens_kept"] > 0.8 * len(prompts["p1"]), s1
    info = am["sidecar"]
    assert info["reused_tokens"] > 0.8 * len(prompts["e1"]), info  # prefix (local) + kept content after the edit
    s2 = fg["sidecar"]["session"]
    assert s2["version"] == 2 and s2["forget_from"] == prompts["forget_at"], s2
    info = fg["sidecar"]
    assert info["local_tokens"] + info["claimed_tokens"] <= prompts["forget_at"], info
    assert info["gap_fills"] == 0, info


def test_admission_holds_a_request_a_hard_claim_blocks(model_dir, prompts):
    """Resident claims on vLLM (clients/vllm/admit_gate.py): a hard claim larger than vLLM's pool
    makes the sidecar refuse the request's active blocks; the connector holds the request
    (vLLM's "ask again") and re-asks until ``admit_max_wait_s``, then serves it, because vLLM has
    no connector API to reject a request. The answer names the blocking claim and carries the
    capacity proof's reason; the output is vLLM's plain output."""
    from sidecar.client import SyncSidecarClient
    from sidecar.identity import CacheIdentity
    from sidecar.process import server_python, sidecar_process

    with sidecar_process("--set", "chunker.anchor_tokens=[1]", python=server_python()) as target:
        ident = CacheIdentity(model_id="resident-pool", kv_layout="any", rope_fingerprint="any")
        with SyncSidecarClient(target, tenant="team-a") as c:
            d = c.claim("system-prompt", identity=ident, mode="hard_protected", tokens=prompts["w"],
                        footprint_blocks=1_000_000, duration_s=600)
            assert d.claim.claim_id == "system-prompt" and d.claim.state == "accepted", d
        held = dict(admission=True, admit_min_tokens=256, admit_max_wait_s=2.0, admit_retry_s=0.2)
        out = run_engine(_spec(model_dir, target, [{"prompt_token_ids": prompts["p1"], "max_tokens": MAX_TOKENS}],
                               **held))
        with SyncSidecarClient(target, tenant="team-a") as c:
            assert c.release_claim("system-prompt").state == "released"
        after = run_engine(_spec(model_dir, target, [{"prompt_token_ids": prompts["x"], "max_tokens": 4}], **held))
    adm = after["results"][0]["sidecar"]["admission"]
    assert adm["decision"] == "admitted" and adm["waited_s"] == 0 and not adm["blocking_claim_ids"], adm
    r = out["results"][0]
    adm = r["sidecar"]["admission"]
    assert adm["decision"] == "refused" and adm["overridden"] is True, adm
    assert "system-prompt" in adm["blocking_claim_ids"], adm
    assert adm["waited_s"] >= 2.0 and "infeasible" in adm["reason"], adm
    sched = out["scheduler_stats"]
    assert sched["admission_refused"] >= 2 and sched["admission_overridden"] == 1, sched
    assert r["ttft_s"] >= 2.0  # held while refused


def test_connector_over_mtls_acts_as_the_certificate_tenant(model_dir, prompts, tmp_path):
    """The connector with ``tls`` + a client certificate against a sidecar that requires mTLS and
    takes the tenant from the certificate's CN: the Lookup and the Store go through, and the
    chunks land in the certificate's tenant (visible to that tenant, not to another)."""
    from sidecar.process import server_python, sidecar_process
    from tests.tenancy.certs import CA

    ca = CA(tmp_path)
    server, engine = ca.server(), ca.issue("engine", cn="team-cert", client=True)
    other = ca.issue("other", cn="team-other", client=True)
    tls = ["--set", f"tls.cert_file={server.cert}", "--set", f"tls.key_file={server.key}",
           "--set", f"tls.client_ca_file={ca.cert_file}", "--set", "tls.require_client_cert=true",
           "--set", "tls.tenant_from_cert=cn"]
    with sidecar_process("--set", "chunker.anchor_tokens=[1]", *tls, python=server_python()) as target:
        out = run_engine(_spec(model_dir, target, [{"prompt_token_ids": prompts["p1"], "max_tokens": 4}],
                               tenant="", root_ca=str(ca.cert_file), client_cert=str(engine.cert),
                               client_key=str(engine.key)))
        info = out["results"][0]["sidecar"]
        assert info["plan_ok"] and info["store_chunks"] > 0, (
            info, out["scheduler_stats"], [ln for ln in out["log"].splitlines() if "sidecar" in ln][-5:])
        assert not any(k.startswith("error:") for k in out["scheduler_stats"]), out["scheduler_stats"]
        # a fresh engine with the same certificate reuses what the first stored; another tenant's does not
        spec = [{"prompt_token_ids": prompts["p1"], "max_tokens": 4}]
        again = run_engine(_spec(model_dir, target, spec, tenant="", root_ca=str(ca.cert_file),
                                 client_cert=str(engine.cert), client_key=str(engine.key)))
        foreign = run_engine(_spec(model_dir, target, spec, tenant="", root_ca=str(ca.cert_file),
                                   client_cert=str(other.cert), client_key=str(other.key)))
    assert again["results"][0]["sidecar"]["claimed_tokens"] > 0.8 * len(prompts["p1"])
    assert again["results"][0]["token_ids"] == out["results"][0]["token_ids"]
    assert foreign["results"][0]["sidecar"]["claimed_tokens"] == 0
    assert foreign["results"][0]["sidecar"]["plan_ok"] is True  # answered, with nothing of team-cert's


def test_a_rope_pairing_the_model_does_not_use_is_refused_and_vllm_serves_alone(model_dir, sidecar_target, engine_a,
                                                                                prompts):
    """``rope_is_neox_style: false`` on SmolLM2 (whose rotary embeddings are NEOX): the worker
    finds the mismatch when it registers its caches, before any load, and tells the scheduler
    side through vLLM's connector handshake; the engine then serves like vLLM without the
    connector: P1's plain output (engine A's first request), no Lookup, no Fetch, no Store
    although the sidecar holds P1's chunks, one WARNING line naming the setting."""
    out = run_engine(_spec(model_dir, sidecar_target, [
        {"prompt_token_ids": prompts["p1"], "max_tokens": MAX_TOKENS},
        {"prompt_token_ids": prompts["w"], "max_tokens": 4},
    ], rope_is_neox_style=False))
    r = out["results"][0]
    assert r["token_ids"] == engine_a["results"][0]["token_ids"]
    assert all(x["sidecar"] is None and x["vllm_metrics"]["external_prefix_cache_hits"] == 0 for x in out["results"])
    assert out["scheduler_stats"] == {"disabled": 1} and out["worker_stats"] == {"disabled": 1}
    lines = [ln for ln in out["log"].splitlines() if "sidecar connector disabled" in ln]
    assert len(lines) == 1 and "(scheduler): worker pp0/tp0: rope pairing" in lines[0], lines
    assert "is_neox_style=True, the identity assumes False" in lines[0]
