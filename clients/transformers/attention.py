"""Attention implementations for the reference engine (registered with transformers on import).

``kvs_sdpa`` (fast; the TTFT benchmark): causal attention for a query block that continues a
cache. transformers builds an explicit ``[q, T]`` mask whenever the cache is not empty, and SDPA
with an explicit mask cannot skip the masked half, so a prompt prefilled after a 16-token prefix
hit costs up to 2x the attention of the same prompt prefilled from scratch (a penalty a serving
engine's flash kernels with causal offsets do not have, and one that would make the exact-prefix
baseline look worse than it is). Here the block is split where the mask changes shape::

    keys  |<--------- cached prefix (T - q) --------->|<--- the block itself (q) --->|
    part 1: no mask (every query sees every prefix key)   part 2: causal (is_causal)
    out = (e^lse1 * out1 + e^lse2 * out2) / (e^lse1 + e^lse2)   (log-sum-exp merge, fp32)

On CPU both parts run the flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, which
also returns the log-sum-exp); elsewhere SDPA with a lower-right causal bias.

``kvs_invariant`` (the determinism gate and the fidelity harness): batch-invariant attention,
the same token gets bit-identical K, V and logits however the sequence was cut into forward
passes.

Why: the determinism gate (prefix reuse == full prefill, bit for bit) compares a cache built
in one forward pass with one built in several (an earlier request's prefill, then this
request's remainder). CPU BLAS picks its reduction blocking from the matrix sizes, so
``softmax(QK^T) V`` over 300 keys and over 1,200 keys (the extra ones masked) round
differently even though the masked terms are exact zeros. Here every size-dependent reduction
runs over fixed-size blocks of ``KEY_BLOCK`` keys, accumulated block after block in position
order::

    keys   |  block 0 (128)  |  block 1 (128)  |  block 2: j < T real, rest zero-padded |
    scores = Q K^T * scale                  (reduction over head_dim only: fixed)
    e      = exp(scores - rowmax)           (masked / padded keys: exactly 0)
    num    = sum_b  e[:, b] @ V[b]          (each a K=128 matmul; added in block order)
    den    = sum_b  sum(e[:, b])            (fixed-length sums; added in block order)
    out    = num / den

Masked blocks add exact zeros, so a query's result does not depend on how many keys follow it.
The linear layers are row-invariant on CPU once a forward has at least ``MIN_ROWS`` rows (BLAS
switches kernels below that); the engine pads shorter prefills (``Engine._forward``).

Both assume the engine's cache layout: cache index == position, the ``q`` queries are the last
``q`` cache entries, causal, no padding. They are registered to make transformers build no mask.
``kvs_invariant`` is slower than SDPA; the fidelity harness and the tests use it.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

KEY_BLOCK = 128
MIN_ROWS = 16
NAME = "kvs_invariant"
FAST_NAME = "kvs_sdpa"


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def invariant_attention_native(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, block: int = KEY_BLOCK
) -> torch.Tensor:
    """Causal attention ``[B, H, q, Dk] x [B, H, T, Dk] x [B, H, T, Dv] -> [B, H, q, Dv]`` (fp32 math).

    Query ``i`` sits at key index ``T - q + i`` and sees keys ``0 .. T - q + i``.
    """
    b, h, q, _ = query.shape
    t = key.shape[2]
    nb = -(-t // block)
    pad = nb * block - t
    dtype = query.dtype
    qf, kf, vf = query.float(), key.float(), value.float()
    if pad:
        kf = torch.nn.functional.pad(kf, (0, 0, 0, pad))
        vf = torch.nn.functional.pad(vf, (0, 0, 0, pad))
    scores = torch.matmul(qf, kf.transpose(2, 3)) * scaling  # [B, H, q, nb*block]
    qpos = torch.arange(t - q, t, device=query.device)[:, None]
    kpos = torch.arange(nb * block, device=query.device)[None, :]
    scores.masked_fill_(kpos > qpos, float("-inf"))
    e = torch.exp(scores - scores.amax(-1, keepdim=True)).view(b, h, q, nb, block)
    den = e.sum(-1).cumsum(-1)[..., -1:]  # [B, H, q, 1]; cumsum runs block after block
    num = torch.matmul(e.transpose(2, 3), vf.view(b, h, nb, block, -1))  # [B, H, nb, q, Dv]
    num = num.cumsum(2)[:, :, -1]
    return (num / den).to(dtype)


def _attention_interface(native):
    """Wrap ``native(query, key, value, scaling)`` (``[B, H, q, D]``, K/V heads repeated) in
    transformers' attention-interface signature, returning ``([B, q, H, Dv], None)``."""

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        groups = query.shape[1] // key.shape[1]
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        out = native(query, _repeat_kv(key, groups), _repeat_kv(value, groups), scaling)
        return out.transpose(1, 2).contiguous(), None

    attention.__name__ = native.__name__.removesuffix("_native")
    return attention


def offset_causal_attention_native(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Causal attention of the last ``q`` positions over ``T`` keys (``[B, H, q, D]``; K/V with
    H heads already repeated). Query ``i`` sees keys ``0 .. T - q + i``."""
    q, t = query.shape[2], key.shape[2]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if q == 1:
        return sdpa(query, key, value, scale=scaling)
    if q == t:
        return sdpa(query, key, value, is_causal=True, scale=scaling)
    if query.device.type != "cpu":
        from torch.nn.attention.bias import causal_lower_right

        return sdpa(query, key, value, attn_mask=causal_lower_right(q, t), scale=scaling)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    dk, dv = query.shape[-1], value.shape[-1]
    if dk != dv:  # the CPU flash kernel wants one head size (MLA: qk 64+, v smaller): zero-pad
        d = max(dk, dv)
        pad = torch.nn.functional.pad
        query, key, value = pad(query, (0, d - dk)), pad(key, (0, d - dk)), pad(value, (0, d - dv))
        return offset_causal_attention_native(query, key, value, scaling)[..., :dv]
    p = t - q
    out1, lse1 = flash(query, key[:, :, :p], value[:, :, :p], 0.0, False, scale=scaling)
    out2, lse2 = flash(query, key[:, :, p:], value[:, :, p:], 0.0, True, scale=scaling)
    m = torch.maximum(lse1, lse2)
    w1 = torch.exp(lse1 - m).unsqueeze(-1)
    w2 = torch.exp(lse2 - m).unsqueeze(-1)
    return ((out1.float() * w1 + out2.float() * w2) / (w1 + w2)).to(query.dtype)




invariant_attention = _attention_interface(invariant_attention_native)
offset_causal_attention = _attention_interface(offset_causal_attention_native)


def _no_mask(*args, **kwargs) -> None:
    return None


AttentionInterface.register(NAME, invariant_attention)
AttentionMaskInterface.register(NAME, _no_mask)
AttentionInterface.register(FAST_NAME, offset_causal_attention)
AttentionMaskInterface.register(FAST_NAME, _no_mask)
