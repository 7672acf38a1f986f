"""llm-d's ``indexer.v1.IndexerService/GetPodScores`` over raw gRPC, and bad routing input.

llm-d sends prompt text and a model name; the sidecar tokenizes with ``routing.models.<name>``'s
local ``tokenizer.json`` and finds the identity the model's engines store under in their
heartbeats. The tokenizer here is a small word-level one written to ``tmp_path`` with the
``tokenizers`` library (instant, nothing downloaded); its words ``<m1>``.. ``<m3>`` are the
chunker anchors of the test fleet, as a chat template's special tokens would be.
"""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from sidecar.api.kv import identity_to_wire
from sidecar.api.routing import score_request
from sidecar.api.service import IndexerStub, Stub
from sidecar.client import SyncSidecarClient
from sidecar.v1 import llmd_indexer_pb2 as ipb
from sidecar.v1 import sidecar_pb2 as pb
from tests.conftest import ANCHORS
from tests.routing.conftest import IDENT, FleetProcs, store_kv, wait_until

WORDS = 5000
MAX_PROMPT_TOKENS = 4096
#: llm-d's score unit when the identity names no block size (IDENT.block_size is 0)
LLMD_BLOCK = 16
#: raw gRPC as llm-d sends it: no x-tenant-id header, so the sidecar's default tenant
DEFAULT_TENANT = "default"


def write_tokenizer(directory) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, WORDS)}}
    vocab.update({f"m{i}": ANCHORS[i] for i in range(1, 4)})  # message starts: chunker anchors
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))


def chat(rng, sizes=(300, 250, 280)) -> str:
    """Prompt text: messages, each an anchor word and ordinary words."""
    return " ".join(f"m{1 + i % 3} " + " ".join(f"w{x}" for x in rng.integers(1, WORDS, n))
                    for i, n in enumerate(sizes))


def tokens_of(text: str, directory) -> np.ndarray:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    return np.asarray(ids, dtype=np.uint32)


@pytest.fixture
def llmd_fleet(fleet: FleetProcs, tmp_path):
    """r0 and r1 serving llm-d model "m" (engines store under model_id "tiny", IDENT's)."""
    tok = tmp_path / "tokenizer"
    write_tokenizer(tok)
    models = json.dumps({"m": {"tokenizer": str(tok), "model_id": "tiny"}})
    fleet.start_all(("r0", "r1"), **{"routing.models": models, "max_prompt_tokens": MAX_PROMPT_TOKENS})
    return fleet, tok


def pod_scores(target: str, prompt: str, pods=(), model: str = "m") -> list[tuple[str, float]]:
    with grpc.insecure_channel(target) as ch:
        resp = IndexerStub(ch).GetPodScores(
            ipb.GetPodScoresRequest(prompt=prompt, model_name=model, pod_identifiers=list(pods)), timeout=10)
    return [(s.pod, s.score) for s in resp.scores]


def test_get_pod_scores(llmd_fleet, clients, rng):
    fleet, tok = llmd_fleet
    t = fleet.targets
    text = chat(rng)
    tokens = tokens_of(text, tok)
    assert len(tokens) == 833 and {ANCHORS[1], ANCHORS[2], ANCHORS[3]} <= set(tokens.tolist())
    # no engine of the model stored anything yet: every live pod scores 0, an unknown one is left out
    for via in ("r0", "r1"):
        assert pod_scores(t[via], text, ["r0", "r1", "r9"]) == [("r0", 0.0), ("r1", 0.0)]

    engine = clients(t["r0"], DEFAULT_TENANT)  # r0's engine, as llm-d's calls carry no tenant
    store_kv(engine, tokens, seed=1)
    want = [("r0", len(tokens) / LLMD_BLOCK), ("r1", 0.0)]
    # r1 learns the identity from r0's heartbeat, r0's residency from Redis
    wait_until(lambda: pod_scores(t["r1"], text, ["r0", "r1", "r9"]) == want, "r0's chunks scored by r1")
    assert pod_scores(t["r0"], text, ["r0", "r1", "r9"]) == want
    assert pod_scores(t["r1"], text, ["r1", "r0"]) == want[::-1]  # the request's order
    # the SDK's Score of the same tokens says the same
    res = clients(t["r1"], DEFAULT_TENANT).score(tokens, IDENT, ["r0", "r1"])
    assert [(s.replica, s.saved_tokens / LLMD_BLOCK) for s in res.scores] == want
    # no pods named: the live ones
    for via in ("r0", "r1"):
        assert sorted(pod_scores(t[via], text)) == want
    # half the prompt, then other words: the shared part scores
    head = text[: len(text) // 2] + " " + chat(rng, (100,))
    got = dict(pod_scores(t["r1"], head, ["r0", "r1"]))
    assert 0 < got["r0"] < len(tokens) / LLMD_BLOCK and got["r1"] == 0.0
    # another tenant's engine's KV is not the default tenant's
    other = chat(rng)
    store_kv(clients(t["r1"], "alice"), tokens_of(other, tok), seed=2)
    assert pod_scores(t["r0"], other, ["r0", "r1"]) == [("r0", 0.0), ("r1", 0.0)]


# --------------------------------------------------------------------------------- bad input


def test_bad_routing_input_changes_nothing(llmd_fleet, clients, rng, redis_client):
    """Every bad GetPodScores / Score gets a clear status naming the field, and changes neither
    the sidecar's registry and tier counters nor the Redis keyspace."""
    fleet, tok = llmd_fleet
    t = fleet.targets
    text = chat(rng)
    tokens = tokens_of(text, tok)
    engine = clients(t["r0"], DEFAULT_TENANT)
    n = store_kv(engine, tokens, seed=3)
    wait_until(lambda: pod_scores(t["r1"], text, ["r0", "r1"])[0][1] > 0, "r0's chunks scored by r1")
    wait_until(lambda: sum(redis_client.hlen(k) for k in redis_client.keys(f"{fleet.prefix}:*:r:*")) == n,
               "the residency published")

    def state():
        keys = sorted(redis_client.keys(f"{fleet.prefix}:*"))
        per = []
        for r in ("r0", "r1"):
            for tenant in (DEFAULT_TENANT, "alice"):
                with SyncSidecarClient(t[r], tenant=tenant) as c:
                    st = c.stats()
                per.append((st.registry, st.tiers, st.lookups, st.lookup_tokens, st.prefill_tokens))
        return keys, per

    ok = tokens.astype("<u4").tobytes()
    ident = identity_to_wire(IDENT)
    long_id = "x" * 201

    def P(**kw) -> ipb.GetPodScoresRequest:  # a good request but for ``kw``
        return ipb.GetPodScoresRequest(**{"prompt": text, "model_name": "m", **kw})

    def S(lookup: pb.LookupRequest | None = None, **kw) -> pb.ScoreRequest:
        return pb.ScoreRequest(lookup=lookup if lookup is not None else pb.LookupRequest(tokens=ok, identity=ident), **kw)

    many = [f"p{i}" for i in range(5000)]
    pods_cases = [
        (P(model_name="nope"), grpc.StatusCode.NOT_FOUND, "model_name", "not configured"),
        (P(model_name=""), grpc.StatusCode.NOT_FOUND, "model_name", "not configured"),
        (P(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt", "empty"),
        (P(prompt="   "), grpc.StatusCode.INVALID_ARGUMENT, "prompt", "no tokens"),
        (P(prompt=chat(rng, (MAX_PROMPT_TOKENS,))), grpc.StatusCode.INVALID_ARGUMENT, "prompt", "max_prompt_tokens"),
        (P(prompt="w1 " * (64 * MAX_PROMPT_TOKENS)), grpc.StatusCode.INVALID_ARGUMENT, "prompt", "max_prompt_tokens"),
        (P(pod_identifiers=many), grpc.StatusCode.INVALID_ARGUMENT, "pod_identifiers", "routing.max_candidates"),
        (P(pod_identifiers=["r0", "r0"]), grpc.StatusCode.INVALID_ARGUMENT, "pod_identifiers[1]", "twice"),
        (P(pod_identifiers=["r0", ""]), grpc.StatusCode.INVALID_ARGUMENT, "pod_identifiers[1]", "empty"),
        (P(pod_identifiers=[long_id]), grpc.StatusCode.INVALID_ARGUMENT, "pod_identifiers[0]", "longer than"),
    ]
    score_cases = [
        (pb.ScoreRequest(candidates=["r0"]), grpc.StatusCode.INVALID_ARGUMENT, "lookup", "required"),
        (S(candidates=many), grpc.StatusCode.INVALID_ARGUMENT, "candidates", "routing.max_candidates"),
        (S(candidates=["r0", "r1", "r0"]), grpc.StatusCode.INVALID_ARGUMENT, "candidates[2]", "twice"),
        (S(candidates=[""]), grpc.StatusCode.INVALID_ARGUMENT, "candidates[0]", "empty"),
        (S(candidates=[long_id]), grpc.StatusCode.INVALID_ARGUMENT, "candidates[0]", "longer than"),
        (S(pb.LookupRequest(tokens=ok[:-1], identity=ident)), grpc.StatusCode.INVALID_ARGUMENT, "tokens", "multiple of 4"),
        (S(pb.LookupRequest(tokens=b"", identity=ident)), grpc.StatusCode.INVALID_ARGUMENT, "tokens", "empty"),
        (S(pb.LookupRequest(tokens=b"\0" * 4 * (MAX_PROMPT_TOKENS + 1), identity=ident)),
         grpc.StatusCode.INVALID_ARGUMENT, "tokens", "max_prompt_tokens"),
        (S(pb.LookupRequest(tokens=ok)), grpc.StatusCode.INVALID_ARGUMENT, "identity.model_id", "required"),
        (S(pb.LookupRequest(tokens=ok, identity=ident, policy=7)), grpc.StatusCode.INVALID_ARGUMENT, "policy", "unknown"),
        (S(pb.LookupRequest(tokens=ok, identity=ident, recompute_tokens=100_000)), grpc.StatusCode.INVALID_ARGUMENT,
         "recompute_tokens", "exceeds"),
    ]
    before = state()
    opts = [("grpc.max_send_message_length", 64 << 20)]
    for via in ("r0", "r1"):
        with grpc.insecure_channel(t[via], options=opts) as ch:
            for stub, cases in ((IndexerStub(ch).GetPodScores, pods_cases), (Stub(ch).Score, score_cases)):
                for req, code, field, words in cases:
                    with pytest.raises(grpc.RpcError) as ei:
                        stub(req, timeout=10)
                    what = (via, field, words, ei.value.code(), ei.value.details())
                    assert ei.value.code() is code, what
                    assert ei.value.details().startswith(field), what
                    assert words in ei.value.details(), what
        assert state() == before, via
    # still serving, with the same answers
    assert pod_scores(t["r1"], text, ["r0", "r1"]) == [("r0", len(tokens) / LLMD_BLOCK), ("r1", 0.0)]
    with grpc.insecure_channel(t["r1"]) as ch:
        res = Stub(ch).Score(score_request(tokens, IDENT, ["r0", "r1"]), timeout=10,
                             metadata=[("x-tenant-id", DEFAULT_TENANT)])
    assert [(s.replica, s.saved_tokens) for s in res.scores] == [("r0", len(tokens)), ("r1", 0)]
