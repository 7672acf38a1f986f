"""Batched payload rotation (``rotate_payloads_``): one kernel call over every chunk
and layer, bit-identical to rotating each rotary part on its own with ``rotate_keys``."""

from __future__ import annotations

import pytest
import torch

from sidecar.identity import KVLayout, KVPart
from sidecar.payload import decode_payload
from sidecar.rotation import Pairing, rotate_keys, rotate_keys_native, rotate_payloads_
from tests.rotation.grid import DTYPES, make_spec

# (num_tokens, delta): mixed signs, zero, large, a one-token chunk.
CHUNKS = [(17, 5), (32, -300), (1, 0), (40, 123456), (9, -1), (64, 0), (3, 77)]


def layouts(dtype: str):
    """GQA keys (partial rotary, leading) and an MLA layout (k_pe after the latent)."""
    return {
        "gqa": (KVLayout.gqa(num_layers=3, num_kv_heads=2, head_dim=64, dtype=dtype), (32, 64, "leading")),
        "mla": (KVLayout.mla(num_layers=4, kv_lora_rank=32, qk_rope_head_dim=64, dtype=dtype), (64, 64, "trailing")),
    }


def random_payload(layout: KVLayout, n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    values = torch.randn(n * layout.bytes_per_token // dtype.itemsize, generator=gen) * 3
    return values.to(dtype).view(torch.uint8).clone()


def per_part(payload: torch.Tensor, layout: KVLayout, n: int, delta: int, spec, rotate=rotate_keys) -> torch.Tensor:
    """The unbatched path: each rotary part of each layer on its own."""
    out = payload.clone()
    view = decode_payload(out, layout, n)
    for part in view.rotary_parts():
        if delta:
            part.tensor.copy_(rotate(part.tensor, delta, spec))
    view.write_back()
    return out


@pytest.mark.parametrize("parallel", [None, True, False], ids=["auto", "parallel", "serial"])
@pytest.mark.parametrize("pairing", list(Pairing))
@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batched_is_bit_identical_to_the_per_chunk_path(dtype, kind, pairing, parallel):
    layout, geometry = layouts(str(dtype).removeprefix("torch."))[kind]
    spec = make_spec(*geometry, pairing)
    gen = torch.Generator().manual_seed(1)
    payloads = [random_payload(layout, n, dtype, gen) for n, _ in CHUNKS]
    expected = [per_part(p, layout, n, d, spec) for p, (n, d) in zip(payloads, CHUNKS)]
    reference = [per_part(p, layout, n, d, spec, rotate_keys_native) for p, (n, d) in zip(payloads, CHUNKS)]
    items = [(p.clone(), n, d) for p, (n, d) in zip(payloads, CHUNKS)]
    done = rotate_payloads_(items, layout, spec, parallel=parallel)
    for (got, n, d), want, ref, orig in zip(items, expected, reference, payloads):
        assert torch.equal(got, want), (n, d)
        assert torch.equal(got, ref), (n, d)
        if d == 0:
            assert torch.equal(got, orig)
    # One fused call for all chunks and layers; the byte count covers the moved chunks' rotary parts.
    assert (done.kernel_calls, done.fallback_calls) == (1, 0)
    rotary = sum(p.bytes_per_token for p in layout.parts if p.rotary) * layout.num_layers
    assert done.rotated_bytes == rotary * sum(n for n, d in CHUNKS if d)


def test_non_rotary_parts_and_pass_through_dims_are_untouched():
    layout, _ = layouts("bfloat16")["gqa"]
    spec = make_spec(32, 64, "leading", Pairing.HALF)
    gen = torch.Generator().manual_seed(2)
    p = random_payload(layout, 50, torch.bfloat16, gen)
    before = decode_payload(p.clone(), layout, 50)
    rotate_payloads_([(p, 50, 999)], layout, spec)
    after = decode_payload(p, layout, 50)
    for layer in range(layout.num_layers):
        assert torch.equal(after.part(layer, "v"), before.part(layer, "v"))
        assert torch.equal(after.part(layer, "k")[..., 32:], before.part(layer, "k")[..., 32:])
        assert not torch.equal(after.part(layer, "k")[..., :32], before.part(layer, "k")[..., :32])


def test_a_coalesced_run_of_chunks_is_one_item():
    """Several consecutive chunks stored as one payload rotate like the chunks one by one."""
    layout, geometry = layouts("bfloat16")["mla"]
    spec = make_spec(*geometry, Pairing.INTERLEAVED)
    gen = torch.Generator().manual_seed(3)
    parts = [random_payload(layout, n, torch.bfloat16, gen) for n in (40, 24, 64)]
    # A run's payload is layer-major over all its tokens: re-pack the three chunks as one.
    views = [decode_payload(p, layout, n) for p, n in zip(parts, (40, 24, 64))]
    run = torch.cat([torch.cat([v.parts[i].tensor.reshape(-1).view(torch.uint8) for v in views])
                     for i in range(len(views[0].parts))])
    rotate_payloads_([(run, 128, -77)], layout, spec)
    one_by_one = [per_part(p, layout, n, -77, spec) for p, n in zip(parts, (40, 24, 64))]
    views = [decode_payload(p, layout, n) for p, n in zip(one_by_one, (40, 24, 64))]
    want = torch.cat([torch.cat([v.parts[i].tensor.reshape(-1).view(torch.uint8) for v in views])
                      for i in range(len(views[0].parts))])
    assert torch.equal(run, want)


def test_misaligned_and_unfused_parts_fall_back_with_the_same_result():
    """A 1-byte part before a bf16 key leaves the key at an odd offset for odd chunk lengths;
    an fp8 key has no fused kernel: both go part by part, same bits as the per-chunk path."""
    spec = make_spec(64, 64, "trailing", Pairing.HALF)
    odd = KVLayout(num_layers=2, parts=(KVPart(name="scale", shape=(1,), dtype="int8"),
                                        KVPart(name="k_pe", shape=(64,), dtype="bfloat16", rotary=True)))
    gen = torch.Generator().manual_seed(4)
    p = torch.randint(0, 255, (odd.bytes_per_token * 7,), generator=gen, dtype=torch.uint8)
    finite = decode_payload(p, odd, 7)
    for part in finite.rotary_parts():
        part.tensor.copy_(torch.randn(part.tensor.shape, generator=gen).to(torch.bfloat16))
    finite.write_back()
    want = per_part(p, odd, 7, 300, spec)
    done = rotate_payloads_([(p, 7, 300)], odd, spec)
    assert torch.equal(p, want) and done.fallback_calls == 2 and done.kernel_calls == 0


@pytest.mark.parametrize("pairing", list(Pairing))
def test_bf16_keys_two_bytes_off_a_word_boundary(pairing, monkeypatch):
    """A 2-byte part before a bf16 k_pe puts the key 2 bytes past a 4-byte boundary in chunks
    of an odd length: HALF pairing then rotates element by element (one fused call for all
    chunks), INTERLEAVED part by part; all-even chunk lengths keep the word path. Same bits
    as the per-chunk path either way."""
    from sidecar.rotation import cpu

    spec = make_spec(64, 64, "trailing", pairing)
    layout = KVLayout(num_layers=3, parts=(KVPart(name="scale", shape=(1,), dtype="bfloat16"),
                                           KVPart(name="k_pe", shape=(1, 64), dtype="bfloat16", rotary=True)))
    modes = []
    real_mode = cpu._mode
    monkeypatch.setattr(cpu, "_mode", lambda *a: modes.append(real_mode(*a)) or modes[-1])
    gen = torch.Generator().manual_seed(7)
    for chunks in ([(8, 300), (6, -5)], [(8, 300), (7, -5), (1, 12)]):
        payloads = [random_payload(layout, n, torch.bfloat16, gen) for n, _ in chunks]
        want = [per_part(p, layout, n, d, spec) for p, (n, d) in zip(payloads, chunks)]
        modes.clear()
        done = rotate_payloads_([(p, n, d) for p, (n, d) in zip(payloads, chunks)], layout, spec)
        assert all(torch.equal(p, w) for p, w in zip(payloads, want))
        odd = any(n % 2 for n, _ in chunks)
        if pairing is Pairing.INTERLEAVED and odd:
            assert (done.kernel_calls, done.fallback_calls) == (0, 3 * len(chunks))
        else:
            assert (done.kernel_calls, done.fallback_calls) == (1, 0)
            assert modes == [cpu._INTERLEAVED if pairing is Pairing.INTERLEAVED else cpu._HALF if odd else cpu._HALF_WORDS]


def test_zero_deltas_and_empty_batches_do_nothing():
    layout, geometry = layouts("float32")["gqa"]
    spec = make_spec(*geometry, Pairing.HALF)
    p = random_payload(layout, 8, torch.float32, torch.Generator().manual_seed(5))
    keep = p.clone()
    assert rotate_payloads_([(p, 8, 0)], layout, spec).rotated_bytes == 0
    assert rotate_payloads_([], layout, spec).kernel_calls == 0
    assert torch.equal(p, keep)


def test_bad_items_are_refused_before_anything_is_written():
    layout, geometry = layouts("bfloat16")["gqa"]
    spec = make_spec(*geometry, Pairing.HALF)
    gen = torch.Generator().manual_seed(6)
    good = random_payload(layout, 8, torch.bfloat16, gen)
    keep = good.clone()
    short = random_payload(layout, 8, torch.bfloat16, gen)[:-2]
    with pytest.raises(ValueError, match=r"items\[1\]\.payload has"):
        rotate_payloads_([(good, 8, 5), (short, 8, 5)], layout, spec)
    with pytest.raises(ValueError, match="share memory"):
        rotate_payloads_([(good, 8, 5), (good, 8, 6)], layout, spec)
    with pytest.raises(TypeError, match=r"items\[0\]\.delta"):
        rotate_payloads_([(good, 8, 5.0)], layout, spec)
    with pytest.raises(TypeError, match=r"items\[0\]\.payload"):
        rotate_payloads_([(good.view(torch.bfloat16), 8, 5)], layout, spec)
    wrong_dim = make_spec(32, 128, "leading", Pairing.HALF)
    with pytest.raises(ValueError, match="rope.key_dim"):
        rotate_payloads_([(good, 8, 5)], layout, wrong_dim)
    assert torch.equal(good, keep)


def test_warmup_compiles_every_fetch_kernel_variant():
    # The server runs this right after it starts serving, so that the first rotated Fetch does not
    # compile (or load) the kernels itself: every dtype, pairing, rotary placement, serial and
    # parallel goes through the fused kernel, none through the per-part fallback.
    from sidecar.rotation import cpu
    from sidecar.rotation.batch import warmup

    assert warmup() == 3 * 2 * 2 * 2
    assert cpu._disabled == set()
    assert cpu._rotate_segments_serial.signatures and cpu._rotate_segments_parallel.signatures
