"""Cache identity and KV layout: what must match before two caches may share KV.

Every chunk key is salted with the ``CacheIdentity`` (docs/architecture.md, "Cache identity"), so
KV never crosses models, adapters, tokenizers, KV layouts, RoPE variants, block sizes or
namespaces. The salt is a 64-bit xxh64 of a canonical encoding of the identity; the scope
(tenant or ``shared``) is mixed in separately by ``scope_seed`` because one Lookup searches two
scopes under one identity.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import NewType

import xxhash

#: Salt for one (identity, scope) pair; used as the xxh64 seed of every chunk fingerprint.
ScopeSeed = NewType("ScopeSeed", int)

SHARED_SCOPE = "shared"

_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True, kw_only=True)
class KVPart:
    """One named tensor of a layer's KV, described per token.

    ``shape`` excludes the token axis: a GQA key is ``(num_kv_heads, head_dim)``, an MLA latent
    ``c_kv`` is ``(kv_lora_rank,)`` and its rotary ``k_pe`` is ``(qk_rope_head_dim,)``.
    ``rotary`` marks parts whose leading/trailing rotary dims are re-positioned by delta
    rotation on Fetch (the ``RopeSpec`` of the identity says which dims).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    rotary: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("kv_layout.parts.name must be non-empty")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"kv_layout.parts.dtype {self.dtype!r} is not one of {sorted(_DTYPE_BYTES)}")
        if not self.shape or any(int(d) <= 0 for d in self.shape):
            raise ValueError(f"kv_layout.parts.shape {self.shape!r} must be non-empty and positive")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def bytes_per_token(self) -> int:
        n = _DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, kw_only=True)
class KVLayout:
    """A chunk's KV: ``num_layers`` layers, each holding the same named ``parts``.

    Stored payload order (per chunk of ``n`` tokens)::

        layer 0: part 0 [n, *shape0] | part 1 [n, *shape1] | ...
        layer 1: part 0 ...
    """

    num_layers: int
    parts: tuple[KVPart, ...]
    _fingerprint: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_layers <= 0:
            raise ValueError("kv_layout.num_layers must be positive")
        if not self.parts:
            raise ValueError("kv_layout.parts must be non-empty")
        names = [p.name for p in self.parts]
        if len(set(names)) != len(names):
            raise ValueError(f"kv_layout.parts names must be unique, got {names}")
        object.__setattr__(self, "parts", tuple(self.parts))
        canon = {"num_layers": self.num_layers, "parts": [asdict(p) for p in self.parts]}
        object.__setattr__(self, "_fingerprint", xxhash.xxh64_hexdigest(json.dumps(canon, sort_keys=True).encode()))

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * sum(p.bytes_per_token for p in self.parts)

    def fingerprint(self) -> str:
        """Stable across processes and hosts (computed once)."""
        return self._fingerprint

    @classmethod
    def gqa(cls, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str = "bfloat16") -> "KVLayout":
        """GQA/MHA as transformers and vLLM cache it: K (rotary dims leading) and V."""
        return cls(
            num_layers=num_layers,
            parts=(
                KVPart(name="k", shape=(num_kv_heads, head_dim), dtype=dtype, rotary=True),
                KVPart(name="v", shape=(num_kv_heads, head_dim), dtype=dtype),
            ),
        )

    @classmethod
    def mla(cls, *, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype: str = "bfloat16") -> "KVLayout":
        """MLA as vLLM/SGLang cache it: the latent ``c_kv`` and the rotary ``k_pe``."""
        return cls(
            num_layers=num_layers,
            parts=(
                KVPart(name="c_kv", shape=(kv_lora_rank,), dtype=dtype),
                KVPart(name="k_pe", shape=(qk_rope_head_dim,), dtype=dtype, rotary=True),
            ),
        )


@dataclass(frozen=True, kw_only=True)
class CacheIdentity:
    """Everything that must be equal for cached KV to be reusable.

    ``kv_layout`` and ``rope_fingerprint`` are opaque strings on the wire (the engine client
    computes them from ``KVLayout.fingerprint()`` and ``RopeSpec.fingerprint``); the sidecar only
    compares them. ``model_id`` is required; everything else defaults to empty.
    """

    model_id: str
    weights_hash: str = ""
    tokenizer_hash: str = ""
    kv_layout: str = ""
    rope_fingerprint: str = ""
    block_size: int = 0
    namespace: str = ""
    #: the part of the model's KV this identity's engine process holds ("tp1of2", "pp0of2",
    #: "tp1of2.pp0of2"), or ""
    shard: str = ""
    _salt: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("identity.model_id is required")
        if self.block_size < 0:
            raise ValueError("identity.block_size must be >= 0")
        canon = "\x1f".join(
            (
                self.model_id,
                self.weights_hash,
                self.tokenizer_hash,
                self.kv_layout,
                self.rope_fingerprint,
                str(self.block_size),
                self.namespace,
                *((self.shard,) if self.shard else ()),  # unsharded identities keep their salts
            )
        )
        object.__setattr__(self, "_salt", xxhash.xxh64_intdigest(canon.encode()))

    @property
    def salt(self) -> int:
        """64-bit salt over every identity field (stable across processes and hosts)."""
        return self._salt

    @property
    def fingerprint(self) -> str:
        return f"{self._salt:016x}"

    def scope_seed(self, scope: str) -> ScopeSeed:
        """xxh64 seed for chunks of ``scope`` under this identity."""
        return ScopeSeed(xxhash.xxh64_intdigest(scope.encode(), seed=self._salt))
