"""The typed public wrappers: one call, routed by the tensor's device to the fused CPU kernel,
the CUDA (Triton) kernel, or the pure-torch reference (any other device)."""

from __future__ import annotations

import torch

from sidecar.rotation.angles import Delta
from sidecar.rotation.cpu import rotate_keys_cpu, rotate_slots_cpu_
from sidecar.rotation.cuda import rotate_keys_cuda, rotate_slots_cuda_
from sidecar.rotation.native import rotate_keys_native, rotate_slots_native_
from sidecar.rotation.spec import RopeSpec

__all__ = ["rotate_keys", "rotate_slots_"]


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
