"""How a transformers model's cache maps onto the sidecar's ``KVLayout`` payloads.

transformers 5.x keeps, per layer, two tensors ``layer.keys`` / ``layer.values`` shaped
``[B, heads, T, dim]``. What they hold depends on the attention::

    GQA / MHA (Llama, Qwen, Mistral...)   keys = K  [B, H_kv, T, head_dim]   rotary dims LEADING
                                          values = V [B, H_kv, T, head_dim]
        -> KVLayout parts  k (H_kv, head_dim) rotary | v (H_kv, head_dim)

    MLA (DeepSeek-V2/V3, MiniCPM3)         keys = c_kv  [B, 1, T, kv_lora_rank]   (normalised latent)
                                          values = k_pe [B, 1, T, qk_rope_head_dim] (rotated)
        -> KVLayout parts  c_kv (kv_lora_rank,) | k_pe (qk_rope_head_dim,) rotary
           (the same parts vLLM/SGLang cache, so payloads are engine-neutral)

    MLA, older transformers (expanded)     keys = [B, H, T, nope + rope] (rope TRAILING), values [B, H, T, v_dim]
        -> parts k (H, nope + rope) rotary | v (H, v_dim)

``KVAdapter.from_model`` probes the model with one token to see which case it is (never
guesses from the config alone) and refuses caches it cannot describe (sliding-window layers,
linear-attention layers). A payload is ``KVLayout`` order, layer-major::

    | layer 0: part 0 [n, *shape0] | part 1 [n, *shape1] | layer 1: ... |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from clients.transformers.cache import SequenceCache
from sidecar.identity import KVLayout, KVPart
from sidecar.rotation import RopeSpec, RotaryLayout, rotate_keys
from sidecar.sdk.kit import TORCH_DTYPES, KVPayloadView, decode_payload, encode_payload, is_stacked, stacked_view

_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


@dataclass(frozen=True, slots=True)
class PartSlot:
    """Where one ``KVPart`` lives in a cache layer: ``slot`` is ``keys`` or ``values``;
    ``squeeze`` when the cache carries a singleton head axis the part does not have."""

    name: str
    slot: str
    squeeze: bool


class KVAdapter:
    """Moves token ranges between a ``SequenceCache`` and sidecar payloads for one model."""

    def __init__(
        self,
        layout: KVLayout,
        rope: RopeSpec,
        slots: tuple[PartSlot, ...],
        kind: str,
        *,
        key_shape: tuple[int, int],
        value_shape: tuple[int, int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layout = layout
        self.rope = rope
        self.slots = slots
        self.kind = kind  # "gqa" | "mla" | "mla_expanded"
        self.key_shape = key_shape  # (heads, dim) of a cache layer's keys
        self.value_shape = value_shape
        self.dtype = dtype
        self.device = device
        self._rotary = tuple(p.rotary for p in layout.parts)
        # Every part the same shape and dtype, none squeezed (GQA / MHA): a payload is then one
        # [layers * parts, n, heads, dim] tensor, written with one copy (``new_cache``, ``writer``).
        self._uniform = is_stacked(layout) and not any(s.squeeze for s in slots)

    def new_cache(self, capacity: int) -> SequenceCache:
        """An empty ``SequenceCache`` for this model with ``capacity`` positions preallocated."""
        cache = SequenceCache(self.layout.num_layers, capacity)
        if self._uniform and [s.slot for s in self.slots] == ["keys", "values"]:
            # One allocation for every layer's K and V, in payload order (layer-major, then part):
            # a fetched payload [layers * parts, n, heads, dim] then lands with one copy (``writer``).
            heads, dim = self.key_shape
            slab = torch.empty((2 * len(cache.layers), 1, heads, max(capacity, 16), dim), dtype=self.dtype,
                               device=self.device)
            for i, layer in enumerate(cache.layers):
                layer.adopt(slab[2 * i], slab[2 * i + 1])
            cache.slab = slab
            return cache
        for layer in cache.layers:
            layer.allocate(self.key_shape, self.value_shape, self.dtype, self.device)
        return cache

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_model(cls, model: Any, *, rope: RopeSpec | None = None) -> "KVAdapter":
        """Describe ``model``'s cache. ``rope`` overrides ``RopeSpec.from_hf_config`` (e.g. for a
        family whose pairing is not verified there).

        Raises ValueError for caches this engine cannot serve (sliding-window or
        linear-attention layers, a cache layout it does not recognise).
        """
        config = model.config.get_text_config(decoder=True)
        num_layers = int(config.num_hidden_layers)
        types = set(getattr(config, "layer_types", None) or ())
        if types - {"full_attention"} or (
            getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False
        ):
            raise ValueError(
                f"model_type {getattr(config, 'model_type', '?')!r} uses sliding-window or non-attention layers "
                f"({sorted(types) or 'sliding_window'}): the reference engine serves full-attention models only"
            )
        device = next(model.parameters()).device
        cache = SequenceCache(num_layers, 1)
        with torch.inference_mode():
            model(torch.zeros((1, 1), dtype=torch.long, device=device), past_key_values=cache, use_cache=True,
                  position_ids=torch.zeros((1, 1), dtype=torch.long, device=device))
        for i, layer in enumerate(cache.layers):
            if layer.length != 1:
                raise ValueError(f"layer {i} did not cache the probe token (sliding window / linear attention?)")
        k, v = cache.layers[0].keys, cache.layers[0].values
        dtype = _DTYPE_NAMES.get(k.dtype)
        if dtype is None:
            raise ValueError(f"cache dtype {k.dtype} has no KVLayout name")
        spec = rope or RopeSpec.from_hf_config(config)
        is_mla = getattr(config, "kv_lora_rank", None) is not None and getattr(config, "qk_rope_head_dim", None) is not None
        if is_mla and k.shape[1] == 1 and k.shape[-1] == config.kv_lora_rank and v.shape[-1] == config.qk_rope_head_dim:
            layout = KVLayout(num_layers=num_layers, parts=(
                KVPart(name="c_kv", shape=(int(config.kv_lora_rank),), dtype=dtype),
                KVPart(name="k_pe", shape=(int(config.qk_rope_head_dim),), dtype=dtype, rotary=True),
            ))
            slots = (PartSlot("c_kv", "keys", True), PartSlot("k_pe", "values", True))
            kind = "mla"
            if rope is None:
                spec = spec.with_key(key_dim=int(config.qk_rope_head_dim), layout=RotaryLayout.TRAILING)
        elif is_mla and k.shape[-1] == config.qk_nope_head_dim + config.qk_rope_head_dim:
            layout = KVLayout(num_layers=num_layers, parts=(
                KVPart(name="k", shape=(int(k.shape[1]), int(k.shape[-1])), dtype=dtype, rotary=True),
                KVPart(name="v", shape=(int(v.shape[1]), int(v.shape[-1])), dtype=dtype),
            ))
            slots = (PartSlot("k", "keys", False), PartSlot("v", "values", False))
            kind = "mla_expanded"
            if rope is None:
                spec = spec.with_key(key_dim=int(k.shape[-1]), layout=RotaryLayout.TRAILING)
        elif not is_mla and k.shape[-1] == spec.key_dim:
            layout = KVLayout(num_layers=num_layers, parts=(
                KVPart(name="k", shape=(int(k.shape[1]), int(k.shape[-1])), dtype=dtype, rotary=True),
                KVPart(name="v", shape=(int(v.shape[1]), int(v.shape[-1])), dtype=dtype),
            ))
            slots = (PartSlot("k", "keys", False), PartSlot("v", "values", False))
            kind = "gqa"
        else:
            raise ValueError(
                f"unrecognised cache layout: keys {tuple(k.shape)}, values {tuple(v.shape)} for model_type "
                f"{getattr(config, 'model_type', '?')!r}"
            )
        for layer in cache.layers[1:]:
            if layer.keys.shape[1:] != k.shape[1:] or layer.values.shape[1:] != v.shape[1:]:
                raise ValueError("layers cache differently shaped KV (per-layer head counts are not supported)")
        return cls(
            layout, spec, slots, kind, key_shape=(int(k.shape[1]), int(k.shape[-1])),
            value_shape=(int(v.shape[1]), int(v.shape[-1])), dtype=k.dtype, device=k.device,
        )

    # ------------------------------------------------------------------ views

    def part_view(self, cache: SequenceCache, layer: int, part: int, start: int, end: int) -> torch.Tensor:
        """Tokens ``[start, end)`` of one part as ``[n, *part.shape]`` (a strided view, no copy)."""
        s = self.slots[part]
        lay = cache.layers[layer]
        t = lay._kbuf if s.slot == "keys" else lay._vbuf
        t = t[0, :, start:end]  # [heads, n, dim]
        return t[0] if s.squeeze else t.transpose(0, 1)

    def rotary_keys(self, cache: SequenceCache, layer: int, start: int, end: int) -> torch.Tensor:
        """The rotary part of ``layer`` for tokens ``[start, end)`` (``[n, ...]`` view)."""
        return self.part_view(cache, layer, self._rotary.index(True), start, end)

    # ------------------------------------------------------------------ payloads

    def payload(self, cache: SequenceCache, start: int, end: int) -> torch.Tensor:
        """Encode tokens ``[start, end)`` of ``cache`` as one payload (1-D uint8, CPU)."""
        layers = []
        for i in range(self.layout.num_layers):
            layers.append({p.name: self.part_view(cache, i, j, start, end).cpu()
                           for j, p in enumerate(self.layout.parts)})
        return encode_payload(layers, self.layout)

    def decode(self, data: bytes, num_tokens: int) -> KVPayloadView:
        return decode_payload(data, self.layout, num_tokens)

    def write(self, cache: SequenceCache, view: KVPayloadView, offset: int, start: int, end: int) -> None:
        """Copy payload tokens ``[offset, offset + end - start)`` into cache positions
        ``[start, end)`` (already allocated by ``SequenceCache.extend``), every layer and part."""
        n = end - start
        per_layer = len(self.layout.parts)
        for i, pv in enumerate(view.parts):
            self.part_view(cache, pv.layer, i % per_layer, start, end).copy_(pv.tensor[offset : offset + n])

    def writer(self, cache: SequenceCache) -> "Callable[[Any, int, int, int, int], None]":
        """``write`` for raw payload bytes into ``cache``: ``fn(data, num_tokens, offset, start,
        end)``. For uniform layouts (GQA / MHA) the payload is viewed as one tensor and copied
        with one call into the cache's ``slab`` (every layer's K and V in one allocation, as
        ``new_cache`` makes them), else with one call per layer and part into destination views
        made once here (the cache must not regrow while the writer is used: the engine sizes it
        up front); other layouts decode and ``write``."""
        if not self._uniform:
            return lambda data, num_tokens, offset, start, end: self.write(
                cache, self.decode(data, num_tokens), offset, start, end)
        dst = []
        for lay in cache.layers:
            for s in self.slots:
                buf = lay._kbuf if s.slot == "keys" else lay._vbuf
                dst.append(buf[0].transpose(0, 1))  # [capacity, heads, dim]
        first = cache.layers[0]._kbuf
        layout = self.layout
        count = len(dst)
        slab = cache.slab

        def write(data: Any, num_tokens: int, offset: int, start: int, end: int) -> None:
            if cache.layers[0]._kbuf is not first:
                raise RuntimeError("the cache was reallocated after its writer was made")
            src = stacked_view(data, layout, num_tokens).flatten(0, 1)  # [layers * parts, n, heads, dim]
            n = end - start
            if slab is not None:  # [count, n, H, D] -> [count, 1, H, n, D]
                slab.narrow(3, start, n).copy_(src.narrow(1, offset, n).unsqueeze(1).transpose(2, 3))
                return
            for j in range(count):
                dst[j].narrow(0, start, n).copy_(src[j].narrow(0, offset, n))

        return write

    def rotate_(self, view: KVPayloadView, delta: int) -> None:
        """Rotate every rotary part of a writable payload view by ``delta`` in place (what the
        sidecar does on Fetch; the engine's client-side path for raw fetches)."""
        if delta:
            for pv in view.rotary_parts():
                rotate_keys(pv.tensor, delta, self.rope, out=pv.tensor)
            view.write_back()
