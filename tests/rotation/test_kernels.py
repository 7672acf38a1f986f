"""Fused CPU kernel vs the torch reference over a bounded grid of layouts; the public API's contract.

The fused kernel must be bit-identical to ``rotate_keys_native``: same fp32 cos/sin, same
expression order, no FMA contraction, same round-to-nearest-even.
"""

from __future__ import annotations

import itertools

import numba
import pytest
import torch

from sidecar.rotation import Pairing, cpu, rotate_keys, rotate_keys_native, rotate_slots_, rotate_slots_native_
from tests.rotation.grid import DTYPES, GEOMETRIES, assert_bits_equal, bits, make_spec


def deltas(shape: tuple[int, ...], gen: torch.Generator) -> list:
    b, h, t = shape[:3]
    return [
        7,
        -100000,
        torch.tensor(123456),
        torch.randint(-100000, 100000, (b, 1, t), generator=gen),  # per token
        torch.randint(-5, 5, (b, h, t), generator=gen),  # per element, many repeats
        torch.randint(-3, 3, (t,), generator=gen),  # broadcast from the right
    ]


@pytest.mark.parametrize("pairing", list(Pairing))
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"{g[0]}of{g[1]}-{g[2]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_is_bit_identical_to_native(dtype, geometry, pairing):
    spec = make_spec(*geometry, pairing)
    gen = torch.Generator().manual_seed(0)
    k = (torch.randn(2, 3, 17, spec.key_dim, generator=gen) * 4).to(dtype)
    for delta in deltas(k.shape, gen):
        assert_bits_equal(cpu.rotate_keys_cpu(k, delta, spec), rotate_keys_native(k, delta, spec))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_input_and_output_buffers(dtype):
    spec = make_spec(64, 128, "leading", Pairing.INTERLEAVED)
    base = torch.randn(2, 17, 3, 128).to(dtype)
    k = base.transpose(1, 2)  # [2, 3, 17, 128], not contiguous
    expected = rotate_keys_native(k, 99, spec)
    assert_bits_equal(rotate_keys(k, 99, spec), expected)
    buf = torch.empty(k.shape, dtype=dtype)
    assert rotate_keys(k, 99, spec, out=buf) is buf
    assert_bits_equal(buf, expected)
    kc = k.contiguous()
    assert rotate_keys(kc, 99, spec, out=kc) is kc  # in place
    assert_bits_equal(kc, expected)


def test_out_must_not_alias_k_partially():
    spec = make_spec(64, 64, "leading", Pairing.HALF)
    k = torch.randn(8, 64)
    with pytest.raises(ValueError, match="shares storage"):
        rotate_keys(k[:4], 1, spec, out=k[4:])
    with pytest.raises(ValueError, match="match"):
        rotate_keys(k, 1, spec, out=torch.empty(8, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("pairing", list(Pairing))
def test_pass_through_bits_survive_nan_payloads_denormals_and_signed_zero(pairing):
    spec = make_spec(32, 80, "leading", pairing)
    k = torch.randn(4, 80)
    specials = torch.tensor([0x7FC00001, 0x7F800001, 0xFFC12345, 0x00000001, 0x80000000, 0x7F800000], dtype=torch.int64)
    raw = bits(k)
    raw[:, 32:38] = specials.to(torch.int32)  # NaN payloads, denormal, -0.0, +inf
    out = rotate_keys(k, 12345, spec)
    assert_bits_equal(out[:, 32:], k[:, 32:])
    for dtype in (torch.bfloat16, torch.float16):
        kb = torch.randn(4, 80).to(dtype)
        rb = bits(kb)
        rb[:, 40:44] = torch.tensor([0x7FC1, 0x7F81, -1, 0x0001], dtype=torch.int16)
        assert_bits_equal(rotate_keys(kb, -777, spec)[:, 32:], kb[:, 32:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_and_extreme_rotary_values_round_like_torch(dtype):
    spec = make_spec(8, 8, "leading", Pairing.HALF)
    k = torch.tensor([[float("nan"), float("inf"), -float("inf"), 65504.0, 3e38, 1e-40, -0.0, 1.0]]).to(dtype)
    fused, ref = cpu.rotate_keys_cpu(k, 3, spec), rotate_keys_native(k, 3, spec)
    # NaN stays NaN (the payload is not part of the contract: torch's own bf16 cast gives 0xFFFF
    # on its vector path and 0x7FC0 on its scalar path); every other value matches bit for bit.
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(fused), nan)
    assert_bits_equal(fused[~nan], ref[~nan])


def test_zero_delta_is_the_identity_in_fp32():
    spec = make_spec(128, 128, "leading", Pairing.HALF)
    k = torch.randn(3, 5, 128)
    assert_bits_equal(rotate_keys(k, 0, spec), k)


def test_other_dtypes_use_the_reference():
    spec = make_spec(64, 64, "leading", Pairing.HALF)
    k = torch.randn(5, 64, dtype=torch.float64)
    assert not cpu.supports(k)
    assert_bits_equal(rotate_keys(k, 5, spec), rotate_keys_native(k, 5, spec))


def test_results_do_not_depend_on_the_thread_count():
    spec = make_spec(128, 128, "leading", Pairing.HALF)
    k = torch.randn(64, 8, 128).to(torch.bfloat16)
    d = torch.randint(-1000, 1000, (64, 1))
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = rotate_keys(k, d, spec)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        many = rotate_keys(k, d, spec)
    finally:
        numba.set_num_threads(before)
    assert_bits_equal(one, many)


def test_bad_arguments_are_caller_errors():
    spec = make_spec(64, 128, "leading", Pairing.HALF)
    k = torch.randn(2, 3, 128)
    with pytest.raises(ValueError, match="key_dim"):
        rotate_keys(torch.randn(2, 3, 64), 1, spec)
    with pytest.raises(TypeError, match="integer"):
        rotate_keys(k, torch.tensor(1.0), spec)
    with pytest.raises(TypeError):
        rotate_keys(k, 1.5, spec)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        rotate_keys(k, True, spec)
    with pytest.raises(ValueError, match="broadcast"):
        rotate_keys(k, torch.zeros(4, dtype=torch.int64), spec)
    with pytest.raises(ValueError, match="broadcast"):
        rotate_keys(k, torch.zeros(5, 2, 3, dtype=torch.int64), spec)
    with pytest.raises(TypeError, match="floating"):
        rotate_keys(torch.zeros(2, 128, dtype=torch.int32), 1, spec)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_place_rotation_with_per_token_and_per_chunk_deltas(dtype):
    """In place, one array is source and destination (the vectorized in-place path); same bits
    as out of place and as the reference, scalar and per-row deltas, both pairings."""
    gen = torch.Generator().manual_seed(11)
    for pairing in Pairing:
        spec = make_spec(64, 64, "trailing", pairing)
        k = (torch.randn(300, 1, 64, generator=gen) * 3).to(dtype)
        for delta in (9999, torch.randint(-5000, 5000, (300, 1), generator=gen),
                      torch.randint(-50, 50, (3, 1), generator=gen).repeat_interleave(100, dim=0)):
            want = rotate_keys_native(k, delta, spec)
            kc = k.clone()
            assert rotate_keys(kc, delta, spec, out=kc) is kc
            assert_bits_equal(kc, want)


def test_bf16_half_pairing_takes_the_word_path_only_where_it_applies():
    """bf16 HALF pairing reads two pairs per 32-bit word when the rotary slice, the rows and
    the buffers allow it (``_HALF_WORDS``) and element by element otherwise (odd pair count,
    odd rotary offset, a buffer starting at an odd element); every case matches the
    reference bit for bit."""
    k_pe = make_spec(64, 64, "trailing", Pairing.HALF)
    assert cpu._mode(k_pe, torch.bfloat16, True) == cpu._HALF_WORDS
    assert cpu._mode(k_pe, torch.bfloat16, False) == cpu._HALF
    assert cpu._mode(k_pe, torch.float32, True) == cpu._HALF
    assert cpu._mode(make_spec(64, 64, "trailing", Pairing.INTERLEAVED), torch.bfloat16, True) == cpu._INTERLEAVED
    gen = torch.Generator().manual_seed(12)
    cases = [
        (k_pe, 0),  # word path
        (make_spec(22, 64, "leading", Pairing.HALF), 0),  # 11 pairs: odd half
        (make_spec(64, 65, "trailing", Pairing.HALF), 0),  # rotary offset 1, odd key_dim
        (k_pe, 1),  # the buffer starts 2 bytes past a 4-byte boundary
        (make_spec(32, 96, "trailing", Pairing.HALF), 0),  # offset 64, pass-through copied
    ]
    for spec, skip in cases:
        base = (torch.randn(33 * spec.key_dim + 1, generator=gen) * 5).to(torch.bfloat16)
        k = base[skip : skip + 33 * spec.key_dim].view(33, spec.key_dim)
        for delta in (-31337, torch.randint(-9000, 9000, (33,), generator=gen)):
            want = rotate_keys_native(k, delta, spec)
            assert_bits_equal(cpu.rotate_keys_cpu(k, delta, spec), want)
            kc = base.clone()[skip : skip + 33 * spec.key_dim].view(33, spec.key_dim)
            cpu.rotate_keys_cpu(kc, delta, spec, out=kc)
            assert_bits_equal(kc, want)


def test_composition_closure():
    """One rotation by a + b equals two rotations, within fp32 rounding (closure)."""
    spec = make_spec(128, 128, "leading", Pairing.HALF)
    k = torch.randn(4, 8, 128)
    two = rotate_keys(rotate_keys(k, 40000, spec), -12345, spec)
    one = rotate_keys(k, 40000 - 12345, spec)
    torch.testing.assert_close(two, one, rtol=0, atol=2e-6 * float(k.abs().max()))


# ------------------------------------------------------------------ rotate_slots_


@pytest.mark.parametrize("pairing", list(Pairing))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotate_slots_matches_native_on_a_token_pool(dtype, pairing):
    spec = make_spec(64, 128, "leading", pairing)
    pool = torch.randn(50, 4, 128).to(dtype)
    ids = torch.tensor([7, 0, 49, 13, 21])
    per_slot = torch.tensor([5, -100000, 3, 5, 77777])
    for d in (per_slot, 31, torch.tensor(-9)):
        fused, ref = pool.clone(), pool.clone()
        assert rotate_slots_(fused, ids, d, spec) is fused
        rotate_slots_native_(ref, ids, d, spec)
        assert_bits_equal(fused, ref)
        untouched = torch.ones(50, dtype=torch.bool)
        untouched[ids] = False
        assert_bits_equal(fused[untouched], pool[untouched])
        # Same as rotating the gathered keys.
        expected = rotate_keys_native(pool[ids], d if isinstance(d, int) or d.dim() == 0 else d.view(-1, 1), spec)
        assert_bits_equal(fused[ids], expected)


@pytest.mark.parametrize("pairing", list(Pairing))
def test_rotate_slots_on_a_paged_nhd_pool_and_a_single_key_pool(pairing):
    spec = make_spec(64, 192, "trailing", pairing)
    paged = torch.randn(6, 16, 2, 192).to(torch.bfloat16)  # [num_blocks, block_size, H, D]
    ids = torch.tensor([0, 17, 95, 40])  # slot = block * 16 + offset
    d = torch.tensor([1, 2, 3, -4])
    ref = paged.clone()
    rotate_slots_(paged.flatten(0, 1), ids, d, spec)  # a view: rotates `paged` in place
    rotate_slots_native_(ref.flatten(0, 1), ids, d, spec)
    assert_bits_equal(paged, ref)

    kpe = make_spec(64, 64, "trailing", pairing)
    pool = torch.randn(100, 64)  # MLA k_pe pool: one key per slot
    ref = pool.clone()
    rotate_slots_(pool, ids[:3], d[:3], kpe)
    rotate_slots_native_(ref, ids[:3], d[:3], kpe)
    assert_bits_equal(pool, ref)


def test_rotate_slots_on_strided_and_non_collapsible_pools():
    spec = make_spec(32, 64, "leading", Pairing.INTERLEAVED)
    big = torch.randn(20, 3, 80)
    strided = big[:, :, 8:72]  # slot/head strides with padding, last dim contiguous
    ref = strided.clone()
    ids, d = torch.tensor([2, 5, 19]), torch.tensor([3, -3, 1000])
    rotate_slots_(strided, ids, d, spec)
    rotate_slots_native_(ref, ids, d, spec)
    assert_bits_equal(strided, ref)
    hnd = torch.randn(20, 4, 2, 64).permute(0, 2, 1, 3)  # middle dims not collapsible
    ref = hnd.clone()
    rotate_slots_(hnd, ids, d, spec)
    rotate_slots_native_(ref, ids, d, spec)
    assert_bits_equal(hnd, ref)


def test_rotate_slots_rejects_bad_slot_ids_and_changes_nothing():
    spec = make_spec(64, 64, "leading", Pairing.HALF)
    pool = torch.randn(10, 2, 64)
    before = pool.clone()
    for ids, err in ((torch.tensor([1, 1]), "duplicates"), (torch.tensor([10]), "out of range"), (torch.tensor([-1]), "out of range")):
        with pytest.raises(ValueError, match=err):
            rotate_slots_(pool, ids, 3, spec)
    with pytest.raises(TypeError):
        rotate_slots_(pool, torch.tensor([1.0]), 3, spec)
    with pytest.raises(ValueError, match="broadcast"):
        rotate_slots_(pool, torch.tensor([1, 2]), torch.tensor([1, 2, 3]), spec)
    with pytest.raises(ValueError, match="out of range"):
        rotate_slots_(pool, torch.tensor([12]), 3, spec, check=False)  # CPU always range-checks
    assert_bits_equal(pool, before)
    assert rotate_slots_(pool, torch.tensor([], dtype=torch.int64), 3, spec) is pool
    assert_bits_equal(pool, before)


def test_the_grid_exercises_the_fused_kernel_not_the_fallback(monkeypatch):
    def no_fallback(*args, **kwargs):
        raise AssertionError("fused path fell back to the reference")

    monkeypatch.setattr(cpu, "_fallback", no_fallback)
    monkeypatch.setattr(cpu, "rotate_slots_native_", no_fallback)
    for dtype, pairing, geometry in itertools.product(DTYPES, Pairing, GEOMETRIES):
        spec = make_spec(*geometry, pairing)
        cpu.rotate_keys_cpu(torch.randn(3, 2, spec.key_dim).to(dtype), torch.tensor([1, -2, 3]).view(3, 1), spec)
        cpu.rotate_slots_cpu_(torch.randn(6, 2, spec.key_dim).to(dtype), torch.tensor([4, 1]), torch.tensor([5, 6]), spec)
