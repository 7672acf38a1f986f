"""The KV payload: one chunk's (or one span's) KV bytes for ``n`` tokens of a ``KVLayout``, as
the tiers store it and every engine client reads and writes it (one format, one decoder).

A payload is the chunk's KV at its source position, layer-major, each part contiguous over the
chunk's ``n`` tokens (``KVLayout`` docstring)::

    | layer 0: part 0 [n, *shape0] | part 1 [n, *shape1] | ... | layer 1: part 0 ... |
      ^ byte 0                                                  ^ layer_stride

For GQA / MHA (``KVLayout.gqa``: parts ``k`` and ``v``, both ``[H, D]`` of one dtype) that is
one ``[L, 2, n, H, D]`` tensor, which is how vLLM's connector, SGLang's radix cache and the
transformers engine all consume it (``stacked_view``, ``stacked_payload``); layouts whose parts
differ (MLA: ``c_kv [r]`` and ``k_pe [d]``) are read part by part (``decode_payload``).

``decode_payload`` returns views into the payload buffer (``torch.frombuffer`` / ``Tensor.view``,
no copy), so rotating ``rotary_parts()`` in place rewrites the payload the caller streams out.
A part whose byte offset is not a multiple of its element size (only possible when a 1-byte part
precedes a wider one with an odd element count) cannot be viewed; it is copied and flagged
``zero_copy=False``, and ``KVPayloadView.write_back()`` copies such parts back. Every view is
zero-copy over the caller's buffer: it lives as long as that buffer.
"""


from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sidecar.identity import KVLayout

TORCH_DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def payload_nbytes(layout: KVLayout, num_tokens: int) -> int:
    """Bytes of a chunk payload of ``num_tokens`` tokens under ``layout``."""
    if num_tokens <= 0:
        raise ValueError("num_tokens must be positive")
    return layout.bytes_per_token * num_tokens


def as_byte_tensor(payload: object, *, field: str = "payload") -> torch.Tensor:
    """A 1-D ``torch.uint8`` view of ``payload`` without copying.

    Accepts ``bytes``/``bytearray``/``memoryview``, a numpy array or a contiguous torch tensor of
    any dtype and device. A view of immutable ``bytes`` must not be written to.
    """
    if isinstance(payload, torch.Tensor):
        if not payload.is_contiguous():
            raise ValueError(f"{field} tensor must be contiguous")
        return payload.reshape(-1).view(torch.uint8)
    if isinstance(payload, np.ndarray):
        if not payload.flags.c_contiguous:
            raise ValueError(f"{field} array must be C-contiguous")
        return torch.from_numpy(payload.reshape(-1).view(np.uint8))
    if isinstance(payload, (bytes, bytearray, memoryview)):
        mv = memoryview(payload)
        if not mv.c_contiguous:
            raise ValueError(f"{field} buffer must be contiguous")
        if mv.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():
            # Read-only buffers (bytes) come back as tensors that must not be written; the store
            # only reads them.
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(mv.cast("B"), dtype=torch.uint8)
    raise TypeError(f"{field} must be bytes-like, a numpy array or a torch tensor, got {type(payload).__name__}")


@dataclass(frozen=True, slots=True)
class PartView:
    """One part of one layer: ``tensor`` is ``[num_tokens, *part.shape]`` of the part's dtype."""

    layer: int
    name: str
    rotary: bool
    tensor: torch.Tensor
    offset: int
    zero_copy: bool


@dataclass(frozen=True, slots=True)
class KVPayloadView:
    """Typed views over one payload buffer (see the module docstring for the layout)."""

    layout: KVLayout
    num_tokens: int
    buffer: torch.Tensor
    parts: tuple[PartView, ...]

    def part(self, layer: int, name: str) -> torch.Tensor:
        per_layer = len(self.layout.parts)
        for i, p in enumerate(self.layout.parts):
            if p.name == name:
                return self.parts[layer * per_layer + i].tensor
        raise KeyError(f"kv_layout has no part {name!r}")

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        per_layer = len(self.layout.parts)
        return {v.name: v.tensor for v in self.parts[layer * per_layer : (layer + 1) * per_layer]}

    def rotary_parts(self) -> tuple[PartView, ...]:
        """The parts that delta rotation re-positions (``KVPart.rotary``), layer-major."""
        return tuple(v for v in self.parts if v.rotary)

    def write_back(self) -> None:
        """Copy parts that could not be viewed in place back into ``buffer`` (no-op otherwise)."""
        for v in self.parts:
            if not v.zero_copy:
                n = v.tensor.numel() * v.tensor.element_size()
                self.buffer[v.offset : v.offset + n].copy_(v.tensor.reshape(-1).view(torch.uint8))


def decode_payload(payload: object, layout: KVLayout, num_tokens: int) -> KVPayloadView:
    """Views of every layer/part of ``payload`` (bytes-like or uint8 tensor, any device).

    Raises ``ValueError`` when the payload size does not match ``layout`` and ``num_tokens``.
    """
    buf = as_byte_tensor(payload)
    expected = payload_nbytes(layout, num_tokens)
    if buf.numel() != expected:
        raise ValueError(f"payload is {buf.numel()} bytes but kv_layout x num_tokens ({num_tokens}) needs {expected}")
    views: list[PartView] = []
    offset = 0
    for layer in range(layout.num_layers):
        for part in layout.parts:
            dtype = TORCH_DTYPES[part.dtype]
            nbytes = part.bytes_per_token * num_tokens
            raw = buf[offset : offset + nbytes]
            shape = (num_tokens, *part.shape)
            itemsize = dtype.itemsize
            if (raw.storage_offset() * 1) % itemsize == 0 and raw.data_ptr() % itemsize == 0:
                tensor = raw.view(dtype).view(shape)
                zero_copy = True
            else:
                tensor = raw.clone().view(dtype).view(shape)
                zero_copy = False
            views.append(PartView(layer, part.name, part.rotary, tensor, offset, zero_copy))
            offset += nbytes
    return KVPayloadView(layout=layout, num_tokens=num_tokens, buffer=buf, parts=tuple(views))


def rotary_views(payload: object, layout: KVLayout, num_tokens: int) -> tuple[PartView, ...]:
    """Shortcut for ``decode_payload(...).rotary_parts()``: the views the Fetch path rotates."""
    return decode_payload(payload, layout, num_tokens).rotary_parts()


def encode_payload(
    layers: Sequence[Mapping[str, torch.Tensor]],
    layout: KVLayout,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pack per-layer part tensors into one payload (one copy per part).

    ``layers[i][name]`` must be ``[n, *part.shape]`` of the part's dtype, the same ``n`` for all.
    Returns ``out`` (a 1-D uint8 tensor of ``payload_nbytes(layout, n)``) or a new CPU tensor.
    """
    if len(layers) != layout.num_layers:
        raise ValueError(f"layers has {len(layers)} entries, kv_layout.num_layers is {layout.num_layers}")
    first = layers[0].get(layout.parts[0].name)
    if first is None or first.dim() < 1:
        raise ValueError(f"layers[0] lacks part {layout.parts[0].name!r}")
    num_tokens = int(first.shape[0])
    total = payload_nbytes(layout, num_tokens)
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=first.device)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != total:
        raise ValueError(f"out must be a 1-D uint8 tensor of {total} bytes")
    view = decode_payload(out, layout, num_tokens)
    for v in view.parts:
        src = layers[v.layer].get(v.name)
        if src is None:
            raise ValueError(f"layers[{v.layer}] lacks part {v.name!r}")
        if tuple(src.shape) != tuple(v.tensor.shape) or src.dtype != v.tensor.dtype:
            raise ValueError(
                f"layers[{v.layer}][{v.name!r}] is {tuple(src.shape)} {src.dtype}, "
                f"kv_layout needs {tuple(v.tensor.shape)} {v.tensor.dtype}"
            )
        v.tensor.copy_(src)
    view.write_back()
    return out


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
