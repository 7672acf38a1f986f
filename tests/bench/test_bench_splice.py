"""The Splice benchmark's machinery on a tiny random-weight model and a real sidecar: the three
arms serve the same edited prompt, the splice arm reuses exactly what the oracle allows, and the
in-process planning timings run."""

from __future__ import annotations

import numpy as np
import pytest

from bench import splice as sb
from clients.transformers import INVARIANT_ATTENTION, build_model, llama_config
from sidecar.app import ServerThread
from sidecar.client import SyncSidecarClient
from tests.conftest import make_config
from workloads.chat_template import ChatTemplate


@pytest.fixture(scope="module")
def client():
    with ServerThread(make_config()) as st, SyncSidecarClient(st.target, tenant="bench-test") as c:
        yield c


@pytest.fixture(scope="module")
def model():
    cfg = llama_config(vocab_size=ChatTemplate().tokenizer.vocab_size, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1)
    return build_model(cfg, seed=3, attn_implementation=INVARIANT_ATTENTION)


def history() -> list[dict]:
    words = "the build failed because a module was missing from the path and the test runner".split()
    out = [{"role": "system", "content": "You are a careful software agent."}]
    for i in range(6):
        out.append({"role": "user" if i == 0 else "tool", "content": " ".join(words[(i + j) % len(words)]
                                                                              for j in range(60 + 7 * i))})
        out.append({"role": "assistant", "content": f"Step {i}: I will look at file {i}.py next."})
    return out


def test_three_arms_on_an_edited_history(model, client):
    template = ChatTemplate()
    old = history()
    edited, kind = sb.edit_near(old, template, None, 0.2, "Also: check the lock file.")
    new = [*edited, {"role": "user", "content": "Now run the tests again."}]
    d = sb.diff(old, new, template, None)
    assert d.directives and kind.startswith(("truncate", "insert"))
    arms = sb.Arms(model, client, answer_tokens=3, fidelity=True, exact_store=False)
    try:
        arms.start(d.old_ids)
        rec = arms.request("t", 0, d.directives, d.new_ids)
        assert np.array_equal(arms.session.tokens, d.new_ids)
        # splice prefills exactly the directives' replacements: the oracle
        assert rec.prefilled["splice"] == sum(len(x.replacement) for x in d.directives)
        assert rec.hit["splice"] == pytest.approx(rec.hit["oracle"])
        assert rec.hit["exact_prefix"] < rec.hit["splice"] and rec.hit["cache_off"] == 0
        assert rec.prefilled["cache_off"] == len(d.new_ids)
        f = rec.fidelity
        assert f["answer_tokens"] >= 1 and np.isfinite(f["kl_first"]) and f["kl_first"] >= 0
        # repeated from the same start, the exact arm sees the same cache state (exact_store=False)
        arms.start(d.old_ids)
        again = arms.request("t", 1, d.directives, d.new_ids)
        assert again.prefilled == rec.prefilled
    finally:
        arms.close()
    s = sb.summarize([rec, again])["t"]
    assert s["requests"] == 2 and s["splice_hit_over_oracle"] == pytest.approx(1.0)
    assert "t" in sb.format_table({"t": s})
