"""The KV payload as engine clients read and write it: the one decoder every client uses.

A payload is one chunk's (or one span's) KV for ``n`` tokens, laid out by its ``KVLayout``:
layer-major, each part contiguous over the ``n`` tokens::

    | layer 0: part 0 [n, *shape0] | part 1 [n, *shape1] | layer 1: part 0 ... | ... |
      ^ byte 0

For GQA / MHA (``KVLayout.gqa``: parts ``k`` and ``v``, both ``[H, D]`` of one dtype) that is
one ``[L, 2, n, H, D]`` tensor, which is how vLLM's connector, SGLang's radix cache and the
transformers engine all consume it (``stacked_view``); layouts whose parts differ (MLA:
``c_kv [r]`` and ``k_pe [d]``) are read part by part (``decode_payload``).

The byte layout is the tiers' codec (``sidecar.tiers.codec``, what the server stores and
rotates); this module re-exports it and adds the client-side views over it, so the layout is
defined once. It imports torch, numpy and ``sidecar.identity`` only: nothing of the server.
Every view here is zero-copy over the caller's buffer: a view of a ``FetchedKV.data`` lives as
long as that buffer (``FetchedKV``: copy what you keep).
"""

from __future__ import annotations

import torch

from sidecar.identity import KVLayout
from sidecar.tiers.codec import (
    TORCH_DTYPES,
    KVPayloadView,
    PartView,
    as_byte_tensor,
    decode_payload,
    encode_payload,
    payload_nbytes,
)


def is_stacked(layout: KVLayout) -> bool:
    """True when every part has the same shape and dtype (GQA / MHA), so a payload is one
    ``[layers, parts, n, *shape]`` tensor (``stacked_view``)."""
    first = layout.parts[0]
    return all(p.shape == first.shape and p.dtype == first.dtype for p in layout.parts)


def stacked_view(data: object, layout: KVLayout, num_tokens: int) -> torch.Tensor:
    """``data`` (bytes-like, numpy array or tensor) as ``[num_layers, num_parts, num_tokens,
    *part.shape]`` of the parts' dtype, without a copy: ``[L, 2, n, H, D]`` for ``KVLayout.gqa``
    (K then V per layer).

    Raises ``ValueError`` when the parts differ in shape or dtype (use ``decode_payload``) or
    the buffer is not ``payload_nbytes(layout, num_tokens)`` bytes.
    """
    if not is_stacked(layout):
        raise ValueError("kv_layout parts differ in shape or dtype: read the payload with decode_payload")
    buf = as_byte_tensor(data)
    expected = payload_nbytes(layout, num_tokens)
    if buf.numel() != expected:
        raise ValueError(f"payload is {buf.numel()} bytes but kv_layout x num_tokens ({num_tokens}) needs {expected}")
    part = layout.parts[0]
    return buf.view(TORCH_DTYPES[part.dtype]).view(layout.num_layers, len(layout.parts), num_tokens, *part.shape)


def stacked_payload(rows: torch.Tensor) -> memoryview:
    """The inverse of ``stacked_view``: ``[L, P, n, *shape]`` rows (any dtype, CPU) as payload
    bytes (one copy if ``rows`` is not contiguous, none otherwise)."""
    t = rows.contiguous()
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


__all__ = [
    "TORCH_DTYPES",
    "KVPayloadView",
    "PartView",
    "as_byte_tensor",
    "decode_payload",
    "encode_payload",
    "is_stacked",
    "payload_nbytes",
    "stacked_payload",
    "stacked_view",
]
