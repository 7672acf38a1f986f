"""RoPE delta-rotation: re-position cached keys in closed form (ARCHITECTURE.md, "Rotation contract").

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

import torch

from sidecar.rotation.angles import Delta
from sidecar.rotation.batch import PayloadRotation, rotate_payloads_
from sidecar.rotation.cpu import rotate_keys_cpu, rotate_slots_cpu_
from sidecar.rotation.cuda import rotate_keys_cuda, rotate_slots_cuda_
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


def rotate_keys(k: torch.Tensor, delta: Delta, spec: RopeSpec, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Re-position cached keys: ``K(p) -> K(p + delta)``.

    Args:
      k: ``[..., key_dim]`` keys as cached (e.g. ``[B, H, T, head_dim]``, an MLA ``k_pe``
        ``[B, 1, T, qk_rope_head_dim]``, or an expanded MLA key ``[B, H, T, nope + rope]``);
        any floating dtype, CPU or CUDA. ``k.shape[-1]`` must equal ``spec.key_dim``.
      delta: target minus source position: an int, a 0-d integer tensor, or an integer tensor
        broadcastable over ``k.shape[:-1]`` (e.g. ``[B, 1, T]`` per token).
      spec: the keys' ``RopeSpec``.
      out: optional contiguous buffer shaped and typed like ``k`` (reused to avoid allocation),
        or ``k`` itself to rotate in place.
    Returns:
      A contiguous tensor shaped and typed like ``k`` (``out`` when given). Pure apart from
      ``out``: ``k`` is not modified unless it is passed as ``out``.
    Raises:
      ValueError / TypeError: shape, dtype or delta mistakes.
    """
    if k.device.type == "cuda":
        return rotate_keys_cuda(k, delta, spec, out=out)
    if k.device.type == "cpu":
        return rotate_keys_cpu(k, delta, spec, out=out)
    result = rotate_keys_native(k, delta, spec)
    return result if out is None else out.copy_(result)


def rotate_slots_(
    pool: torch.Tensor, slot_ids: torch.Tensor, deltas: Delta, spec: RopeSpec, *, check: bool = True
) -> torch.Tensor:
    """Rotate the keys held in ``pool[slot_ids[i]]`` by ``deltas[i]``, in place.

    Pool layout (token-slot view, slot axis first)::

        pool [num_slots, H, key_dim]      SGLang-style token pool (block size 1)
        pool [num_slots, key_dim]         one key per slot (e.g. an MLA k_pe pool)
        paged NHD [num_blocks, block_size, H, D]  ->  pass pool.flatten(0, 1)
                                          (slot = block * block_size + offset)

    Args:
      pool: the key pool; the last dim must be ``spec.key_dim``. Values (and MLA latents) are
        never touched: pass only the key tensor.
      slot_ids: 1-D integer tensor ``[n]`` of distinct slots to rotate.
      deltas: an int for all slots, or an integer tensor ``[n]`` (one per slot).
      check: reject duplicate slot ids (a sort) and, on CUDA, out-of-range ids (a device sync).
        CPU always range-checks. Pass False only for ids from a planner that guarantees both.
    Returns:
      ``pool``. Slots not listed and non-rotary dims are left bit-identical. Not idempotent:
      each call rotates again.
    """
    if pool.device.type == "cuda":
        return rotate_slots_cuda_(pool, slot_ids, deltas, spec, check=check)
    if pool.device.type == "cpu":
        return rotate_slots_cpu_(pool, slot_ids, deltas, spec, check=check)
    return rotate_slots_native_(pool, slot_ids, deltas, spec)
