"""``RopeSpec``: which dims of a cached key are rotary, how they pair, at which frequencies.

A spec describes keys exactly as they sit in a cache, so that ``K(p) -> K(p + delta)`` is one
rotation per pair (docs/architecture.md, "Rotation contract")::

    GQA/MHA key, partial rotary, LEADING        MLA key expanded per head, TRAILING
    |<-- rotary_dim -->|<-- pass-through -->|   |<-- qk_nope (pass) -->|<-- qk_rope -->|
    0             rotary_dim            key_dim 0                                key_dim

    pairing HALF (NEOX):        (r[j], r[j + rotary_dim/2])   rotated by inv_freq[j]
    pairing INTERLEAVED (GPT-J): (r[2j], r[2j + 1])           rotated by inv_freq[j]

``from_hf_config`` computes the fp32 frequency table the way transformers 5.x does: the scaled
types through transformers' own ``ROPE_INIT_FUNCTIONS``, ``default`` with the same torch
operations, in the same order, as each model's ``compute_default_rope_parameters``; so the table
is bit-identical to the model's ``inv_freq`` buffer (the tests check it for every supported
family). YaRN / LongRoPE attention scaling is
recorded in ``attention_scaling`` but is already inside every cached key and is never applied
again by a rotation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import Any

import torch

__all__ = ["Pairing", "RotaryLayout", "RopeSpec", "SUPPORTED_ROPE_TYPES"]


class Pairing(str, Enum):
    """How rotary dims pair up: ``HALF`` = NEOX / ``rotate_half``; ``INTERLEAVED`` = GPT-J."""

    HALF = "half"
    INTERLEAVED = "interleaved"

    @classmethod
    def from_neox_style(cls, is_neox_style: bool) -> Pairing:
        """vLLM / SGLang ``is_neox_style``: True -> ``HALF``, False -> ``INTERLEAVED`` (GPT-J)."""
        return cls.HALF if is_neox_style else cls.INTERLEAVED


class RotaryLayout(str, Enum):
    """Where the rotary slice sits in a key: the first or the last ``rotary_dim`` dims."""

    LEADING = "leading"
    TRAILING = "trailing"


#: rope_type values whose frequencies do not depend on the sequence length (closure holds).
#: ``longrope`` is accepted only when its short and long factors are equal.
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "longrope"})

# How transformers 5.x lays out the cached rotary part, per verified model_type. Families not
# listed are refused unless the caller states the pairing: a guessed pairing is silently wrong.
#   glm/glm4: rotate_half on (0::2, 1::2), partial, leading    cohere: repeat_interleave freqs
#   deepseek_v2: complex multiply of (2j, 2j+1)                deepseek_v3 / kimi_k2: interleave
#   on read, then cat(evens, odds) -> cached half-split       glm4_moe (GLM-4.5): rotate_half
_MODEL_PAIRING: dict[str, Pairing] = {
    "llama": Pairing.HALF,
    "mistral": Pairing.HALF,
    "mixtral": Pairing.HALF,
    "qwen2": Pairing.HALF,
    "qwen3": Pairing.HALF,
    "qwen3_moe": Pairing.HALF,
    "phi": Pairing.HALF,
    "phi3": Pairing.HALF,
    "gpt_neox": Pairing.HALF,
    "glm": Pairing.INTERLEAVED,
    "glm4": Pairing.INTERLEAVED,
    "glm4_moe": Pairing.HALF,
    "cohere": Pairing.INTERLEAVED,
    "gpt_oss": Pairing.HALF,
    "deepseek_v2": Pairing.INTERLEAVED,
    "deepseek_v3": Pairing.HALF,
    "kimi_k2": Pairing.HALF,
    "minicpm3": Pairing.HALF,
}

_FINGERPRINT_VERSION = "rope-spec-v1"


@dataclass(frozen=True, kw_only=True)
class RopeSpec:
    """The rotary part of one cached key tensor (all layers of a model share it).

    Fields:
      rotary_dim: number of rotary dims (even); ``len(inv_freq) == rotary_dim // 2``.
      key_dim: the key tensor's last dim (``head_dim`` for GQA/MHA, ``qk_rope_head_dim`` for an
        MLA ``k_pe``, ``qk_nope_head_dim + qk_rope_head_dim`` for an expanded MLA key,
        ``kv_lora_rank + qk_rope_head_dim`` for a vLLM/SGLang MLA cache row).
      layout: rotary dims LEADING (``[0, rotary_dim)``) or TRAILING (``[key_dim - rotary_dim,
        key_dim)``).
      pairing: ``Pairing.HALF`` or ``Pairing.INTERLEAVED``.
      inv_freq: the fp32 frequency table, radians per position, as the model computes it
        (stored as Python floats that are exactly fp32 values).
      attention_scaling: YaRN/LongRoPE cos/sin scale ``s``; informational, already in K.
      rope_type: informational label (``default``, ``yarn``, ...).

    Engine clients override what ``from_hf_config`` infers with its keyword arguments or with
    ``dataclasses.replace(spec, pairing=Pairing.HALF)``; the result is validated again.
    """

    rotary_dim: int
    key_dim: int
    layout: RotaryLayout
    pairing: Pairing
    inv_freq: tuple[float, ...]
    attention_scaling: float = 1.0
    rope_type: str = "default"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", RotaryLayout(self.layout))
        object.__setattr__(self, "pairing", Pairing(self.pairing))
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be positive and even, got {self.rotary_dim}")
        if not self.rotary_dim <= self.key_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} exceeds key_dim {self.key_dim}")
        freqs = tuple(float(x) for x in self.inv_freq)
        if len(freqs) != self.rotary_dim // 2:
            raise ValueError(f"inv_freq has {len(freqs)} entries, rotary_dim {self.rotary_dim} needs {self.rotary_dim // 2}")
        if not all(math.isfinite(f) for f in freqs):
            raise ValueError("inv_freq must be finite")
        # The table is an fp32 table; storing the exact fp32 values keeps the fingerprint and
        # every path on the same numbers.
        as32 = tuple(struct.unpack("<f", struct.pack("<f", f))[0] for f in freqs)
        object.__setattr__(self, "inv_freq", as32)
        if not math.isfinite(self.attention_scaling) or self.attention_scaling <= 0:
            raise ValueError(f"attention_scaling must be positive, got {self.attention_scaling}")

    # ------------------------------------------------------------------ geometry

    @property
    def half(self) -> int:
        """Number of rotary pairs (``rotary_dim // 2``)."""
        return self.rotary_dim // 2

    @property
    def rotary_offset(self) -> int:
        """Index of the first rotary dim in the key."""
        return 0 if self.layout is RotaryLayout.LEADING else self.key_dim - self.rotary_dim

    @cached_property
    def inv_freq_tensor(self) -> torch.Tensor:
        """``inv_freq`` as a CPU fp32 tensor ``[rotary_dim // 2]`` (do not modify)."""
        return torch.tensor(self.inv_freq, dtype=torch.float32)

    @cached_property
    def fingerprint(self) -> str:
        """Stable identity of the rotation: geometry, pairing, exact fp32 table, scaling.

        Same string in every process and on every host that computes the same fp32 table; it
        goes into ``CacheIdentity``. ``rope_type`` is a label and is not part of it.
        """
        payload = {
            "v": _FINGERPRINT_VERSION,
            "rotary_dim": self.rotary_dim,
            "key_dim": self.key_dim,
            "rotary_offset": self.rotary_offset,
            "pairing": self.pairing.value,
            "inv_freq": struct.pack(f"<{len(self.inv_freq)}f", *self.inv_freq).hex(),
            "attention_scaling": struct.pack("<d", float(self.attention_scaling)).hex(),
        }
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
        return f"{_FINGERPRINT_VERSION}:{digest[:32]}"

    def with_key(self, *, key_dim: int, layout: RotaryLayout | str | None = None) -> RopeSpec:
        """The same rotation described for another key tensor (e.g. an expanded MLA key)."""
        return dataclasses.replace(self, key_dim=key_dim, layout=self.layout if layout is None else layout)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_hf_config(
        cls,
        config: Any,
        *,
        pairing: Pairing | str | None = None,
        layout: RotaryLayout | str | None = None,
        key_dim: int | None = None,
        layer_type: str | None = None,
    ) -> RopeSpec:
        """Describe the keys the way transformers 5.x caches them for ``config``.

        Args:
          config: a ``PretrainedConfig`` (multimodal configs use their text config).
          pairing: override the pairing (engines state their own: vLLM ``is_neox_style`` ->
            ``"half"``). Required for a ``model_type`` whose layout is not verified here.
          layout / key_dim: describe another key tensor. Defaults: GQA/MHA -> LEADING,
            ``key_dim = head_dim``; MLA -> TRAILING, ``key_dim = qk_rope_head_dim`` (the
            ``k_pe`` transformers caches); pass ``key_dim=qk_nope_head_dim + qk_rope_head_dim``
            for the expanded key or ``kv_lora_rank + qk_rope_head_dim`` for an engine's MLA row.
          layer_type: for configs with per-layer-type rope parameters, which one.

        Raises:
          ValueError: length-dependent frequencies (``dynamic``, ``longrope`` with different
            short/long factors), an unknown rope_type, or an unverified model_type without an
            explicit ``pairing``.
        """
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        model_type = getattr(text, "model_type", "") or ""
        params = _rope_parameters(text, layer_type)
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if "dynamic" in rope_type:
            raise ValueError(
                f"rope_type {rope_type!r}: frequencies change with the sequence length, so a cached key "
                "cannot be re-positioned by a fixed rotation (closure fails)"
            )
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {sorted(SUPPORTED_ROPE_TYPES)})")
        if rope_type == "longrope":
            short, long = params.get("short_factor"), params.get("long_factor")
            if short is None or long is None or [float(x) for x in short] != [float(x) for x in long]:
                raise ValueError(
                    "rope_type 'longrope' with different short and long factors: frequencies depend on the "
                    "sequence length (closure fails)"
                )

        if pairing is None:
            family = _MODEL_PAIRING.get(model_type)
            if family is None:
                raise ValueError(
                    f"model_type {model_type!r}: cached-key pairing is not verified for this family; "
                    "pass pairing='half' or pairing='interleaved' explicitly"
                )
            pairing = family

        is_mla = getattr(text, "qk_rope_head_dim", None) is not None and getattr(text, "kv_lora_rank", None) is not None
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        inv_freq, attention_scaling = _inv_freq_table(text, params, rope_type, head_dim, layer_type)
        rotary_dim = 2 * int(inv_freq.numel())
        if is_mla:
            if rotary_dim != int(text.qk_rope_head_dim):
                raise ValueError(
                    f"MLA config computes {rotary_dim} rotary dims but qk_rope_head_dim is {text.qk_rope_head_dim}"
                )
            default_layout, default_key_dim = RotaryLayout.TRAILING, int(text.qk_rope_head_dim)
        else:
            default_layout, default_key_dim = RotaryLayout.LEADING, int(head_dim)
        return cls(
            rotary_dim=rotary_dim,
            key_dim=default_key_dim if key_dim is None else int(key_dim),
            layout=default_layout if layout is None else layout,
            pairing=pairing,
            inv_freq=tuple(inv_freq.tolist()),
            attention_scaling=float(attention_scaling),
            rope_type=rope_type,
        )


def _rope_parameters(config: Any, layer_type: str | None) -> dict[str, Any]:
    if hasattr(config, "standardize_rope_params"):
        config.standardize_rope_params()
    params = getattr(config, "rope_parameters", None)
    if params is None:
        raise ValueError(f"config of model_type {getattr(config, 'model_type', '?')!r} has no rope_parameters")
    nested = {k: v for k, v in params.items() if isinstance(v, dict)}
    if nested:
        if layer_type is None:
            raise ValueError(f"rope_parameters are per layer type {sorted(nested)}; pass layer_type=")
        if layer_type not in nested:
            raise ValueError(f"layer_type {layer_type!r} not in rope_parameters {sorted(nested)}")
        return dict(nested[layer_type])
    if layer_type is not None:
        raise ValueError("layer_type given but rope_parameters are not per layer type")
    return dict(params)


def _inv_freq_table(
    config: Any, params: dict[str, Any], rope_type: str, head_dim: int, layer_type: str | None
) -> tuple[torch.Tensor, float]:
    """fp32 inverse frequencies and attention scaling, exactly as the model computes them.

    ``default`` mirrors each model's ``compute_default_rope_parameters`` (op for op, so the
    table is bit-identical to the model's ``inv_freq`` buffer). The scaled types (``linear``,
    ``llama3``, ``yarn``, ``longrope``) call transformers' own ``ROPE_INIT_FUNCTIONS`` with the
    config the model's rotary embedding is built from, so they are bit-identical by
    construction (``longrope`` is only reached with equal short/long factors, where the
    length argument does not matter).
    """
    base = params["rope_theta"]
    partial_rotary_factor = params.get("partial_rotary_factor", 1.0)
    dim = int(head_dim * partial_rotary_factor)
    if dim <= 0 or dim % 2:
        raise ValueError(f"rotary dim {dim} (head_dim {head_dim} x partial_rotary_factor {partial_rotary_factor}) must be even")
    if rope_type == "default":
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim)), 1.0
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    try:
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
    except KeyError as exc:
        raise ValueError(f"rope_type {rope_type!r}: rope_parameters lack {exc.args[0]!r}") from exc
    inv_freq = inv_freq.to(torch.float32)
    if inv_freq.numel() != dim // 2:
        raise ValueError(f"rope_type {rope_type!r}: {inv_freq.numel()} frequencies for rotary dim {dim} (needs {dim // 2})")
    return inv_freq, float(attention_scaling)
