"""End to end: the real engine loop against a real sidecar over gRPC, GQA and MLA models.

Lookup -> Fetch (rotated) -> assemble -> prefill with position_ids -> Store -> decode, checked
against full prefill of the same prompt on the same model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clients.transformers import CACHE_OFF, Engine, ReusePolicy, Rotation, Sampling
from clients.transformers.fidelity import ARMS, evaluate
from sidecar.registry.lookup_plan import Fidelity, SegmentKind
from tests.rotation.bounds import assert_within, model_bound

NO_STORE = ReusePolicy(store=False)
FULL = ReusePolicy(prefix_cache=False, sidecar=False, store=False)


def agent_pair(p):
    """Two agents: own header, then the same body at a shifted position (agent_meta in small)."""
    system = p.msg(100)
    body = p.join(p.msg(150), p.msg(200), p.msg(120))
    query = p.msg(40)
    a = p.join(system, p.msg(60), body, query)
    b = p.join(system, p.msg(95), body, query)
    return a, b


def assert_cache_equal(x, y, n: int) -> None:
    for i, (lx, ly) in enumerate(zip(x.layers, y.layers)):
        assert torch.equal(lx.keys[:, :, :n], ly.keys[:, :, :n]), f"layer {i} keys differ"
        assert torch.equal(lx.values[:, :, :n], ly.values[:, :, :n]), f"layer {i} values differ"


def test_shifted_hits_land_at_target_positions(make_engine, prompts):
    """Layer-0 KV of every shifted hit equals the model's own KV at the target positions:
    rotary part within fp32 rotation round-off (the bound of tests/rotation: the model's own
    fp32 angles are off by half an ulp at both positions), the rest bit for bit."""
    engine = make_engine()
    a, b = agent_pair(prompts)
    engine.prefill(a)
    reused = engine.prefill(b, reuse=NO_STORE)
    full = engine.prefill(b, reuse=FULL)
    hits = [s for s in reused.steps if s.kind == "hit" and s.fetched.delta != 0]
    assert sum(s.end - s.start for s in hits) >= 400, "the shifted body should come back as chunk hits"
    assert all(s.fetched.rotated for s in hits)
    assert reused.shifted_tokens >= 400
    ad = engine.adapter
    rotary = next(i for i, p in enumerate(ad.layout.parts) if p.rotary)
    for s in hits:
        for j, part in enumerate(ad.layout.parts):
            got = ad.part_view(reused.cache, 0, j, s.start, s.end)
            want = ad.part_view(full.cache, 0, j, s.start, s.end)
            if j == rotary:
                # [n, (H,) D] -> [1, H, n, D], the layout the bound helpers take
                g = got.transpose(0, 1)[None] if got.dim() == 3 else got[None, None]
                w = want.transpose(0, 1)[None] if want.dim() == 3 else want[None, None]
                src = s.fetched.source_pos + s.offset + torch.arange(s.end - s.start)
                dst = s.start + torch.arange(s.end - s.start)
                bound = model_bound(w, src[None], dst[None], ad.rope, ad.rope.inv_freq_tensor)
                assert_within(g, w, bound, f"layer-0 {part.name} of hit [{s.start}, {s.end})")
            else:
                assert torch.equal(got, want), f"non-rotary part {part.name} must be reused bit for bit"
    # Without rotation the same keys are measurably off (the check above is not vacuous).
    naive = engine.prefill(b, reuse=ReusePolicy(rotation=Rotation.NONE, store=False))
    s = max(hits, key=lambda s: abs(s.fetched.delta))
    err = (ad.rotary_keys(naive.cache, 0, s.start, s.end) - ad.rotary_keys(full.cache, 0, s.start, s.end)).abs().max()
    assert err > 1e-3


def test_prefix_reuse_is_bit_identical_to_full_prefill(make_engine, prompts):
    """The determinism gate: the engine's own prefix cache and the sidecar's EXACT hits both
    reproduce full prefill exactly (logits, every layer's KV, teacher-forced decode)."""
    engine = make_engine()
    turn1 = prompts.join(prompts.msg(100), prompts.msg(150), prompts.msg(60))
    turn2 = prompts.join(turn1, prompts.msg(80), prompts.msg(30))  # append-only next turn
    engine.prefill(turn1)
    full = engine.prefill(turn2, reuse=FULL)

    own = engine.prefill(turn2, reuse=ReusePolicy(prefix_cache=True, sidecar=False, store=False))
    assert own.prefix_tokens == (len(turn1) // 16) * 16
    assert torch.equal(own.logits, full.logits)
    assert_cache_equal(own.cache, full.cache, len(turn2))

    # A second engine with an empty own cache gets the prefix from the sidecar as EXACT hits.
    other = make_engine()
    via_sidecar = other.prefill(turn2, reuse=ReusePolicy(admission="exact", store=False))
    assert via_sidecar.prefix_tokens == 0
    assert via_sidecar.exact_tokens >= len(turn1) - 64
    assert all(s.fidelity is Fidelity.EXACT for s in via_sidecar.steps if s.kind == "hit")
    assert torch.equal(via_sidecar.logits, full.logits)
    assert_cache_equal(via_sidecar.cache, full.cache, len(turn2))

    forced = engine.generate(turn2, max_new_tokens=8, reuse=FULL).tokens
    ref = engine.score(turn2, forced, reuse=FULL).logprobs
    assert torch.equal(engine.score(turn2, forced, reuse=ReusePolicy(sidecar=False, store=False)).logprobs, ref)
    assert torch.equal(other.score(turn2, forced, reuse=ReusePolicy(admission="exact", store=False)).logprobs, ref)


def test_naive_reuse_without_rotation_is_worse(make_engine, prompts):
    """Rotated position-independent reuse is close to full prefill; the same KV without
    rotation is measurably further away (the control)."""
    engine = make_engine()
    a, b = agent_pair(prompts)
    arms = {k: ARMS[k] for k in ("full_prefill", "exact_prefix", "sidecar", "naive_no_rotation")}
    rows = {r.arm: r for r in evaluate(engine, [a], b, new_tokens=8, arms=arms)}
    assert rows["full_prefill"].bit_identical and rows["exact_prefix"].bit_identical
    assert rows["sidecar"].shifted_tokens >= 400
    assert 0 < rows["sidecar"].mean_kl
    assert rows["naive_no_rotation"].mean_kl > 3 * rows["sidecar"].mean_kl


def test_client_side_rotation_matches_server_side(make_engine, prompts):
    engine = make_engine()
    a, b = agent_pair(prompts)
    engine.prefill(a)
    server = engine.prefill(b, reuse=NO_STORE)
    client = engine.prefill(b, reuse=ReusePolicy(rotation=Rotation.CLIENT, store=False))
    assert client.timings.rotate_s > 0
    assert torch.equal(server.logits, client.logits)
    assert_cache_equal(server.cache, client.cache, len(b))


def test_own_prefix_cache_and_engine_prefix_len(make_engine, prompts):
    engine = make_engine()
    a = prompts.join(prompts.msg(100), prompts.msg(123))
    first = engine.prefill(a)
    assert first.prefix_tokens == 0 and first.plan.summary.prefix_tokens == 0
    assert engine.prefix_cache.lookups == 1 and len(engine.prefix_cache) == 1
    # The same prompt again: whole blocks, capped so the last token is computed.
    again = engine.prefill(a, reuse=NO_STORE)
    assert again.prefix_tokens == ((len(a) - 1) // 16) * 16
    assert again.plan.summary.prefix_tokens == again.prefix_tokens
    assert again.plan.segments[0].kind is SegmentKind.ENGINE_PREFIX
    assert again.prefill_tokens + again.recovered_tokens == len(a)
    # A prompt diverging at 150 reuses 144 tokens of the own cache.
    b = a.copy()
    b[150] = (int(b[150]) + 1) % 1000
    diverged = engine.prefill(b, reuse=ReusePolicy(sidecar=False, store=False))
    assert diverged.prefix_tokens == 144
    # An append-only extension replaces the shorter entry.
    engine.prefill(prompts.join(a, prompts.msg(20)))
    assert len(engine.prefix_cache) == 1


def test_store_registers_computed_chunks_only(make_engine, prompts):
    engine = make_engine()
    a, b = agent_pair(prompts)
    first = engine.prefill(a)
    assert first.stored_chunks == len(first.plan.chunk_bounds) - 1
    second = engine.prefill(b)
    # Shifted (approximate) chunks are not stored again; the new header's chunks are.
    shifted = {s.start for s in second.steps if s.kind == "hit" and s.fidelity is Fidelity.APPROXIMATE}
    assert shifted and 0 < second.stored_chunks < len(second.plan.chunk_bounds) - 1
    plan = engine.sidecar.lookup(b, identity=engine.identity, engine_prefix_len=0)
    assert plan.summary.prefill_tokens < 100


def test_recompute_tokens_and_window_guard_shape_the_plan(make_engine, prompts):
    engine = make_engine()
    a, b = agent_pair(prompts)
    engine.prefill(a)
    k8 = engine.prefill(b, reuse=ReusePolicy(recompute_tokens=8, store=False))
    hits = [s for s in k8.plan.hits() if s.fidelity is Fidelity.APPROXIMATE]
    # boundary repair: the first 8 tokens of every hit segment (not of every chunk in it)
    firsts = {int(a) for a, _ in k8.plan.hit_segments()}
    assert hits and all(s.chunk_offset >= 8 for s in hits if s.start in firsts)
    plain = engine.prefill(b, reuse=ReusePolicy(recompute_tokens=0, store=False))
    assert k8.shifted_tokens < plain.shifted_tokens
    w = engine.prefill(b, reuse=ReusePolicy(left_context_window=32, store=False))
    assert w.shifted_tokens < plain.shifted_tokens  # the chunk right after the new header is refused
    for r in (k8, w):
        assert r.prefill_tokens + r.recovered_tokens == len(b)


def test_sampling_is_seeded_and_greedy_is_argmax(make_engine, prompts):
    engine = make_engine()
    a = prompts.join(prompts.msg(100), prompts.msg(50))
    s = Sampling(temperature=1.0, top_k=50, top_p=0.95, seed=11)
    x = engine.generate(a, max_new_tokens=12, sampling=s, reuse=FULL).tokens
    y = engine.generate(a, max_new_tokens=12, sampling=s, reuse=FULL).tokens
    z = engine.generate(a, max_new_tokens=12, sampling=Sampling(temperature=1.0, top_k=50, top_p=0.95, seed=12),
                        reuse=FULL).tokens
    assert x == y and x != z
    greedy = engine.generate(a, max_new_tokens=6, reuse=FULL).tokens
    logp = engine.score(a, greedy, reuse=FULL).logprobs
    assert logp.argmax(-1).tolist() == greedy
    # Greedy decoding after sidecar reuse of its own prefix reproduces the same tokens.
    engine.prefill(a)
    assert engine.generate(a, max_new_tokens=6, reuse=NO_STORE).tokens == greedy


def test_engine_without_sidecar(model, prompts):
    engine = Engine(model)
    a = prompts.join(prompts.msg(64), prompts.msg(64))
    out = engine.generate(a, max_new_tokens=4)
    assert len(out.tokens) == 4 and out.prompt.plan is None
    again = engine.prefill(a)
    assert again.prefix_tokens == 128
    assert torch.equal(again.logits, engine.prefill(a, reuse=CACHE_OFF).logits)


@pytest.mark.parametrize("bad", [[], [[1, 2]], [-1, 3]])
def test_bad_tokens_are_refused(model, bad):
    with pytest.raises(ValueError, match="tokens"):
        Engine(model).prefill(np.asarray(bad))
