"""The engine's parts on their own: cache, own prefix cache, KV adapter, schedule, sampling,
fidelity math, batch invariance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from clients.transformers import (
    FAST_ATTENTION,
    INVARIANT_ATTENTION,
    KVAdapter,
    PrefixCache,
    ReusePolicy,
    Sampling,
    SequenceCache,
    build_model,
)
from clients.transformers.attention import invariant_attention_native, offset_causal_attention_native
from clients.transformers.engine import Engine, _schedule, _select
from clients.transformers.fidelity import compare, kl_per_token
from sidecar.client import FetchedKV
from sidecar.registry.lookup_plan import Fidelity, Segment, SegmentKind
from tests.clients.transformers.conftest import MODEL_CONFIGS, get_model

# ------------------------------------------------------------------------------ SequenceCache


def _kv(n: int, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.full((1, 2, n, 4), fill)
    return k, k + 0.5


def test_sequence_cache_grows_in_place_and_truncates():
    cache = SequenceCache(2, capacity=4)
    layer = cache.layers[0]
    keys, _ = layer.update(*_kv(3, 1.0))
    assert keys.shape == (1, 2, 3, 4) and cache.get_seq_length(1) == 0  # layer 1 untouched
    cache.layers[1].update(*_kv(3, 1.0))
    assert cache.length == 3 and cache.get_seq_length() == 3
    buf = layer._kbuf
    layer.update(*_kv(1, 2.0))
    assert layer._kbuf is buf, "within capacity: no reallocation"
    layer.update(*_kv(5, 3.0))  # past capacity: grows, keeps what it had
    assert layer.length == 9 and layer.keys.shape[2] == 9
    assert layer.keys[0, 0, :, 0].tolist() == [1.0] * 3 + [2.0] + [3.0] * 5
    layer.truncate(4)
    assert layer.keys.shape[2] == 4 and layer.get_seq_length() == 4
    with pytest.raises(ValueError):
        layer.truncate(5)


def test_sequence_cache_extend_gives_writable_slots():
    cache = SequenceCache(1, capacity=8)
    cache.layers[0].allocate((2, 4), (2, 4), torch.float32, torch.device("cpu"))
    start = cache.extend(3)
    assert start == 0 and cache.length == 3
    cache.layers[0]._kbuf[:, :, :3] = 7.0
    assert torch.all(cache.layers[0].keys == 7.0)


# ------------------------------------------------------------------------------ PrefixCache


def _filled_cache(n: int) -> SequenceCache:
    cache = SequenceCache(1, capacity=n)
    cache.layers[0].update(*_kv(n, 1.0))
    return cache


def test_prefix_cache_whole_blocks_capped_before_last_token():
    pc = PrefixCache(block_size=16)
    a = np.arange(100, dtype=np.uint32)
    assert pc.match(a) == (None, 0)
    pc.insert(a, _filled_cache(100))
    entry, hit = pc.match(a)
    assert entry is not None and hit == 96  # (100 - 1) // 16 * 16
    b = a.copy()
    b[40] += 1000
    assert pc.match(b)[1] == 32
    assert pc.match(a[:17])[1] == 16
    assert pc.match(a[:16])[1] == 0  # the last token is always computed
    assert pc.match(np.arange(5, 50, dtype=np.uint32))[1] == 0


def test_prefix_cache_drops_subsumed_entries_and_evicts_lru():
    one = _filled_cache(64)
    per_entry = one.layers[0]._kbuf.numel() * 4 * 2
    pc = PrefixCache(block_size=16, capacity_bytes=2 * per_entry)
    a = np.arange(64, dtype=np.uint32)
    pc.insert(a[:32], _filled_cache(64))
    pc.insert(a, one)  # extends the first: replaces it
    assert len(pc) == 1
    pc.insert(a + 1000, _filled_cache(64))
    pc.match(a)  # a is now most recently used
    pc.insert(a + 2000, _filled_cache(64))  # over capacity: evicts a + 1000
    assert len(pc) == 2 and pc.nbytes == 2 * per_entry
    assert pc.match(a + 1000)[1] == 0 and pc.match(a)[1] == 48


# ------------------------------------------------------------------------------ KVAdapter


@pytest.mark.parametrize("kind, parts", [("gqa", ("k", "v")), ("mla", ("c_kv", "k_pe"))])
def test_adapter_layout_and_payload_round_trip(kind, parts):
    model = get_model(kind)
    ad = KVAdapter.from_model(model)
    assert tuple(p.name for p in ad.layout.parts) == parts
    assert [p.rotary for p in ad.layout.parts] == ([True, False] if kind == "gqa" else [False, True])
    cfg = model.config
    if kind == "mla":
        assert ad.rope.key_dim == cfg.qk_rope_head_dim and ad.rope.pairing.value == "interleaved"
    else:
        assert ad.rope.key_dim == cfg.hidden_size // cfg.num_attention_heads and ad.rope.pairing.value == "half"
    src = ad.new_cache(64)
    with torch.inference_mode():
        model(torch.arange(40)[None], past_key_values=src, use_cache=True)
    payload = ad.payload(src, 10, 30)
    assert payload.numel() == 20 * ad.layout.bytes_per_token
    dst = ad.new_cache(64)
    dst.extend(25)
    ad.write(dst, ad.decode(payload.numpy().tobytes(), 20), 5, 20, 25)  # tokens 15..19 -> positions 20..24
    for ls, ld in zip(src.layers, dst.layers):
        assert torch.equal(ld.keys[:, :, 20:25], ls.keys[:, :, 15:20])
        assert torch.equal(ld.values[:, :, 20:25], ls.values[:, :, 15:20])
    # the engine's writer (GQA: one copy into the cache's slab, or one per layer and part into a
    # cache allocated layer by layer; MLA: decode + write) from read-only bytes and from a
    # writable buffer puts the same rows in the same places
    assert ad._uniform == (kind == "gqa")
    assert (ad.new_cache(64).slab is not None) == (kind == "gqa")

    def per_layer_cache():
        cache = SequenceCache(ad.layout.num_layers, 64)
        for layer in cache.layers:
            layer.allocate(ad.key_shape, ad.value_shape, ad.dtype, ad.device)
        return cache

    for data in (payload.numpy().tobytes(), memoryview(bytearray(payload.numpy().tobytes()))):
        for other in (ad.new_cache(64), per_layer_cache()):
            other.extend(25)
            ad.writer(other)(data, 20, 5, 20, 25)
            for lo, ld in zip(other.layers, dst.layers):
                assert torch.equal(lo.keys[:, :, 20:25], ld.keys[:, :, 20:25])
                assert torch.equal(lo.values[:, :, 20:25], ld.values[:, :, 20:25])
    if kind == "gqa":  # its destination views were made up front: a reallocated cache is refused
        grown = ad.new_cache(8)
        write = ad.writer(grown)
        grown.extend(25)  # past its capacity: the buffers are reallocated
        with pytest.raises(RuntimeError, match="reallocated"):
            write(payload.numpy().tobytes(), 20, 5, 20, 25)


def test_adapter_refuses_sliding_window_models():
    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, sliding_window=16)
    with pytest.raises(ValueError, match="sliding-window"):
        KVAdapter.from_model(build_model(cfg))


# ------------------------------------------------------------------------------ schedule


def _hit(s, e, off=0, fid=Fidelity.APPROXIMATE, delta=0):
    return Segment(SegmentKind.CHUNK_HIT, s, e, 1, off, s - delta, delta, fid)


def test_schedule_prefills_misses_and_the_last_token():
    # one fetched result per hit segment (span): [40, 60) and [60, 80) differ in delta
    segs = [Segment(SegmentKind.ENGINE_PREFIX, 0, 32), Segment(SegmentKind.PREFILL, 32, 40), _hit(40, 60),
            _hit(60, 80, delta=5), Segment(SegmentKind.PREFILL, 80, 90), _hit(90, 100)]
    fetched = [FetchedKV(0, 1, True), FetchedKV(1, 1, False), FetchedKV(2, 1, True)]
    steps = [(s.kind, s.start, s.end) for s in _schedule(segs, fetched, 100)]
    assert steps == [("prefill", 32, 40), ("hit", 40, 60), ("prefill", 60, 90), ("hit", 90, 99), ("prefill", 99, 100)]
    # rows of one span (contiguous, one delta) share its result and become one step
    joined = _schedule([_hit(40, 60), _hit(60, 70, fid=Fidelity.APPROXIMATE)], [FetchedKV(0, 1, True)], 100)
    assert [(s.kind, s.start, s.end, s.offset) for s in joined][0] == ("hit", 40, 70, 0)
    one = _schedule([_hit(40, 41)], [FetchedKV(0, 1, True)], 41)
    assert [(s.kind, s.start, s.end) for s in one] == [("prefill", 40, 41)]


# ------------------------------------------------------------------------------ sampling


def test_sampling_limits():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    g = torch.Generator().manual_seed(0)
    assert _select(logits, Sampling(), g) == 1
    assert all(_select(logits, Sampling(temperature=5.0, top_k=1), g) == 1 for _ in range(20))
    assert {_select(logits, Sampling(temperature=5.0, top_k=2), g) for _ in range(200)} == {1, 3}
    assert all(_select(logits, Sampling(temperature=1.0, top_p=0.01), g) == 1 for _ in range(20))
    with pytest.raises(ValueError):
        Sampling(temperature=-1.0)


# ------------------------------------------------------------------------------ fidelity math


def test_kl_and_divergence():
    ref = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0]]), -1)
    same = compare(ref, ref.clone(), [0, 1, 2])
    assert same["bit_identical"] and same["first_divergence"] is None and same["kl"].max() == 0
    other = ref.clone()
    other[1] = torch.log_softmax(torch.tensor([2.0, 0.0, 0.0]), -1)
    m = compare(ref, other, [0, 1, 2])
    assert m["first_divergence"] == 1 and not m["bit_identical"]
    assert m["kl"][0] == 0 and m["kl"][1] > 0.5
    assert torch.allclose(kl_per_token(ref, ref), torch.zeros(3, dtype=torch.float64))


# ------------------------------------------------------------------------------ batch invariance


def test_invariant_attention_ignores_trailing_masked_keys():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 8)
    whole = invariant_attention_native(q, k, v, 0.25)
    head = invariant_attention_native(q[:, :, :37], k[:, :, :37], v[:, :, :37], 0.25)
    assert torch.equal(whole[:, :, :37], head)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    torch.testing.assert_close(whole, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_split_prefill_is_bit_identical(kind):
    """However a prompt is cut into forward passes, the deterministic engine gives the same bits."""
    engine = Engine(get_model(kind))
    tokens = np.random.default_rng(3).integers(0, 5000, 700).astype(np.uint32)
    full = engine._prefill(tokens, engine.reuse, 0)
    for cuts in ([5, 6, 400], [64, 333, 650, 699], [1, 2, 3, 17]):
        cache = engine.adapter.new_cache(800)
        bounds = [0, *cuts, len(tokens)]
        for a, b in zip(bounds, bounds[1:]):
            logits = engine._forward(cache, tokens[a:b], a, want_logits=b == len(tokens))
        assert torch.equal(logits, full.logits)
        for x, y in zip(cache.layers, full.cache.layers):
            assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


def test_model_builders_are_seeded():
    a = build_model(transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1), seed=5,
                    attn_implementation=INVARIANT_ATTENTION)
    b = build_model(a.config, seed=5)
    c = build_model(a.config, seed=6)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.config._attn_implementation == INVARIANT_ATTENTION and b.config._attn_implementation == FAST_ATTENTION


# ------------------------------------------------------------------------------ fast attention


@pytest.mark.parametrize("q, t, dk, dv", [(300, 316, 32, 32), (37, 400, 32, 32), (1, 50, 32, 32), (64, 64, 32, 32),
                                          (50, 300, 48, 32)])
def test_offset_causal_attention_matches_masked_sdpa(q, t, dk, dv):
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 4, q, dk), torch.randn(1, 4, t, dk), torch.randn(1, 4, t, dv)
    mask = torch.ones(q, t, dtype=torch.bool).tril(t - q)
    ref = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=dk**-0.5)
    torch.testing.assert_close(offset_causal_attention_native(query, key, value, dk**-0.5), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_fast_attention_engine_matches_the_plain_model(kind):
    """The benchmark's attention: prefix reuse and split prefill stay within float round-off of
    transformers' own SDPA forward of the whole prompt."""
    fast = build_model(MODEL_CONFIGS[kind](), seed=1)
    plain = build_model(MODEL_CONFIGS[kind](), seed=1, attn_implementation="sdpa")
    engine = Engine(fast)
    tokens = np.random.default_rng(4).integers(0, 5000, 600).astype(np.uint32)
    with torch.inference_mode():
        want = plain(torch.as_tensor(tokens.astype(np.int64))[None]).logits[0, -1]
    engine.prefill(tokens[:400])
    reused = engine.prefill(tokens, reuse=ReusePolicy(sidecar=False, store=False))
    assert reused.prefix_tokens == 400
    torch.testing.assert_close(reused.logits, want, rtol=1e-4, atol=1e-4)
