"""CUDA path (Triton) against the reference. Skipped without CUDA.

Without a GPU the Triton kernels can still be exercised in Triton's CPU interpreter:

    TRITON_INTERPRET=1 PYTHONPATH=<dir with triton> python -m pytest tests/rotation/test_cuda.py

(the interpreter truncates fp32 -> bf16 instead of rounding to nearest even, so bf16 is
compared within one bf16 ulp there; on a GPU every dtype must match bit for bit).
"""

from __future__ import annotations

import os

import pytest
import torch

from sidecar.rotation import Pairing, cuda, rotate_keys, rotate_keys_native, rotate_slots_, rotate_slots_native_
from tests.rotation.grid import DTYPES, GEOMETRIES, make_spec

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and cuda.TRITON_AVAILABLE
if torch.cuda.is_available():
    DEVICE = "cuda"
elif INTERPRET:
    DEVICE = "cpu"
else:
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1 with triton installed)", allow_module_level=True)

pytestmark = pytest.mark.cuda
ROTATE = rotate_keys if DEVICE == "cuda" else cuda.rotate_keys_cuda
ROTATE_SLOTS = rotate_slots_ if DEVICE == "cuda" else cuda.rotate_slots_cuda_


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if INTERPRET and actual.dtype == torch.bfloat16:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=0)
    else:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("pairing", list(Pairing))
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"{g[0]}of{g[1]}-{g[2]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_path_matches_the_reference(dtype, geometry, pairing):
    spec = make_spec(*geometry, pairing)
    gen = torch.Generator().manual_seed(0)
    k = (torch.randn(2, 3, 17, spec.key_dim, generator=gen) * 4).to(dtype).to(DEVICE)
    for delta in (7, -100000, torch.randint(-100000, 100000, (2, 1, 17), generator=gen).to(DEVICE)):
        assert_matches(ROTATE(k, delta, spec), rotate_keys_native(k, delta, spec))
    kc = k.clone()
    ROTATE(kc, 5, spec, out=kc)
    assert_matches(kc, rotate_keys_native(k, 5, spec))


@pytest.mark.parametrize("pairing", list(Pairing))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_rotate_slots_matches_the_reference(dtype, pairing):
    spec = make_spec(64, 192, "trailing", pairing)
    pool = torch.randn(6, 16, 2, 192).to(dtype).to(DEVICE)
    ids = torch.tensor([0, 17, 95, 40], device=DEVICE)
    for d in (torch.tensor([1, 2, 3, -4], device=DEVICE), 99):
        fast, ref = pool.clone(), pool.clone()
        ROTATE_SLOTS(fast.flatten(0, 1), ids, d, spec)
        rotate_slots_native_(ref.flatten(0, 1), ids, d, spec)
        assert_matches(fast, ref)
