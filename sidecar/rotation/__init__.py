"""RoPE delta-rotation: re-position cached keys in closed form (docs/rotation.md).

    from sidecar.rotation import RopeSpec, rotate_keys, rotate_slots_
    spec = RopeSpec.from_hf_config(config)          # transformers 5.x PretrainedConfig
    out = rotate_keys(k, delta, spec)               # K(p) -> K(p + delta), new tensor
    rotate_slots_(pool, slot_ids, deltas, spec)     # in place, on a token-slot KV pool

``K(p) = s * R(p) k``; the key at ``p + delta`` is ``R(delta) K(p)``. The YaRN/LongRoPE scale
``s`` is already inside K and is never applied again. Angles are float64, cos/sin fp32, the
rotation fp32, and the result is rounded once to the storage dtype; non-rotary dims come back
bit-identical.

``rotate_payloads_(items, layout, spec)`` rotates the rotary parts of many chunk payloads
(``(payload, num_tokens, delta)``) in one kernel call: the Fetch path (``batch.py``).

Paths behind the one API: ``rotate_keys_native`` (pure torch, the reference), the fused CPU
kernel (numba; fp32/bf16/fp16) and a Triton kernel for CUDA tensors. All agree with the
reference (the CPU kernel bit for bit).

Store canonical copies and rotate from the canonical source position each time: chaining
rotations accumulates rounding (docs/rotation.md has the measured drift).
"""

from __future__ import annotations

from sidecar.rotation.angles import Delta
from sidecar.rotation.batch import PayloadRotation, rotate_payloads_
from sidecar.rotation.dispatch import rotate_keys, rotate_slots_
from sidecar.rotation.native import rotate_keys_native, rotate_slots_native_
from sidecar.rotation.spec import SUPPORTED_ROPE_TYPES, Pairing, RopeSpec, RotaryLayout

__all__ = [
    "SUPPORTED_ROPE_TYPES",
    "Delta",
    "Pairing",
    "PayloadRotation",
    "RopeSpec",
    "RotaryLayout",
    "rotate_keys",
    "rotate_keys_native",
    "rotate_payloads_",
    "rotate_slots_",
    "rotate_slots_native_",
]
