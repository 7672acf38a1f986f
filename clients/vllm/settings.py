"""Connector settings (``kv_connector_extra_config``) and the cache identity of a vLLM engine.

Both connector roles (scheduler and worker, separate processes by default) compute the same
identity from the ``VllmConfig`` alone, so they agree without talking to each other:

* ``model_id``: the served model name (or the extra config's ``model_id``);
* ``weights_hash``: xxh64 over each weights file's name, size, safetensors header and three
  1 MiB samples of its data (start, middle, end): cheap for any model size, different for
  different weights of one architecture;
* ``tokenizer_hash``: xxh64 of the tokenizer files;
* ``kv_layout``: ``KVLayout.gqa(layers, kv heads, head size, cache dtype)`` fingerprint;
* ``rope_fingerprint``: ``RopeSpec.from_hf_config(hf_config, pairing=is_neox_style)``, vLLM's
  pairing read from its model config (``vllm_is_neox_style``: False for MLA models) unless
  ``rope_is_neox_style`` is set;
* ``block_size``: vLLM's block size.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sidecar.rotation import RopeSpec
    from sidecar.sdk.kit import FailSoftLink

import xxhash

from clients.vllm.refusals import Refused
from sidecar.identity import CacheIdentity, KVLayout

# sidecar.rotation is imported lazily (engine_shape): it loads numba/llvmlite, and vLLM 0.32's
# worker start-up scans every module in sys.modules for Triton kernels and crashes on
# llvmlite's ``_lib_fn_wrapper`` objects (AttributeError in triton_utils/dispatcher.py). The
# connector class is imported by vLLM's config validation before the workers start, so this
# module must not pull numba in at import time.

log = logging.getLogger("clients.vllm")

#: Per-request ``kv_transfer_params`` keys (span directives: ``directives.py``): the tenant
#: header for this request's calls, and the flag on the connector's own gap-fill sub-requests.
PARAM_TENANT = "sidecar_tenant"
PARAM_GAP_FILL = "sidecar_gap_fill"

_SAMPLE = 1 << 20
_TORCH_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}


@dataclass(frozen=True, kw_only=True)
class Settings:
    """``kv_connector_extra_config`` keys (all optional except ``sidecar``).

    sidecar: "host:port" of the sidecar. tenant: default tenant (``x-tenant-id``); a request's
    ``kv_transfer_params["sidecar_tenant"]`` overrides it. token: bearer token. timeout_s: per
    RPC. min_hit_tokens: load nothing shorter. policy / recompute_tokens /
    left_context_window: the Lookup's admission (None: the sidecar's defaults).
    bridge_recompute: serve the recompute guard's few tokens from the chunk instead of ending
    the loadable run there (``sidecar.sdk.kit.runs``). store: "async" (default; Store on a background thread
    after the prefill step), "sync", or "off". gap_fill / max_gap_fills / min_gap_run:
    the gap-fill sub-requests (``gap_fill.py``). retry_after_s: after a
    failed call, skip the sidecar this long (requests are prefilled meanwhile).
    tls / root_ca / client_cert / client_key: TLS to the sidecar (PEM file paths; a client
    certificate for mTLS; docs/operations.md, "TLS and mTLS").
    admission / admit_min_tokens / admit_retry_s / admit_max_wait_s / engine_id: resident-claim
    arbitration (``admit_gate.py``): report the pool and ask ``AdmitActive`` before a prefill of
    at least ``admit_min_tokens``; hold deferred or refused requests, re-asking at most every
    ``admit_retry_s``, at most ``admit_max_wait_s``.
    rotate: who re-positions shifted keys: "sidecar" (on its CPU, before answering), "engine"
    (the worker fetches raw rows and rotates them on the cache's device with the project's
    kernels), or "auto" (default: "engine" for a cache on a GPU or when the shared pool serves
    the rows, else "sidecar").
    shared_pool: on the sidecar's host, move KV through its shared pool (default: True; GQA /
    MHA caches; not with ``rotate = "sidecar"``): leased Fetches rotated by the worker straight
    from the pool, Stores copied into reserved slots (docs/operations.md, "The shared pool");
    elsewhere, Fetch and Store.
    """

    target: str
    tenant: str = "default"
    token: str | None = None
    timeout_s: float = 5.0
    min_hit_tokens: int = 0  # 0: one block
    policy: str = "position_independent"
    recompute_tokens: int | None = None
    left_context_window: int | None = None
    bridge_recompute: bool = True
    store: str = "async"
    gap_fill: bool = True
    max_gap_fills: int = 4
    min_gap_run: int = 256
    retry_after_s: float = 5.0
    model_id: str = ""
    namespace: str = ""
    rope_is_neox_style: bool | None = None
    tls: bool = False
    root_ca: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    admission: bool = False
    admit_min_tokens: int = 2048
    admit_retry_s: float = 0.05
    admit_max_wait_s: float = 30.0
    engine_id: str = ""
    rotate: str = "auto"
    shared_pool: bool = True

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "Settings":
        extra = dict(extra or {})
        if "sidecar" not in extra:
            raise ValueError('kv_connector_extra_config: "sidecar" ("host:port") is required')
        kw: dict[str, Any] = {"target": str(extra.pop("sidecar"))}
        fields = cls.__dataclass_fields__
        for k, v in extra.items():
            if k in fields and k != "target":
                kw[k] = v
            else:
                log.warning("kv_connector_extra_config: unknown key %r ignored", k)
        s = cls(**kw)
        if s.store not in ("async", "sync", "off"):
            raise ValueError('kv_connector_extra_config "store": one of "async", "sync", "off"')
        if s.rotate not in ("auto", "sidecar", "engine"):
            raise ValueError('kv_connector_extra_config "rotate": one of "auto", "sidecar", "engine"')
        return s


def sidecar_link(settings: Settings, role: str) -> "FailSoftLink":
    """The fail-soft link of one connector role (``"scheduler"`` / ``"worker"``): a client per
    tenant with these settings, one attempt per call (a failed call is a prefill, not a retry)."""
    from sidecar.client import RetryPolicy, SyncSidecarClient
    from sidecar.sdk.kit import FailSoftLink

    s = settings

    def connect(tenant: str | None) -> SyncSidecarClient:
        return SyncSidecarClient(s.target, tenant=tenant, token=s.token, timeout_s=s.timeout_s,
                                 retry=RetryPolicy(attempts=1), tls=s.tls, root_ca=s.root_ca,
                                 client_cert=s.client_cert, client_key=s.client_key)

    return FailSoftLink(connect, default_tenant=s.tenant, retry_after_s=s.retry_after_s, target=s.target, role=role,
                        log=log)


def _file_digest(path: Path, h: "xxhash.xxh64") -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\x1f{size}\x1f".encode())
    with path.open("rb") as f:
        if path.suffix == ".safetensors":
            n = int.from_bytes(f.read(8), "little")
            if 0 < n < 100 << 20:
                h.update(f.read(n))
        for off in (0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)):
            f.seek(off)
            h.update(f.read(_SAMPLE))


def weights_hash(model_dir: str) -> str:
    """Digest of the weights files of a local model directory ("" if not a directory)."""
    p = Path(model_dir)
    if not p.is_dir():
        return ""
    files = sorted([*p.glob("*.safetensors"), *p.glob("*.bin"), *p.glob("*.gguf")])
    h = xxhash.xxh64()
    for f in files:
        _file_digest(f, h)
    return h.hexdigest() if files else ""


def tokenizer_hash(tokenizer_dir: str) -> str:
    p = Path(tokenizer_dir)
    if not p.is_dir():
        return ""
    h = xxhash.xxh64()
    found = False
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json"):
        f = p / name
        if f.is_file():
            h.update(name.encode() + b"\x1f" + f.read_bytes())
            found = True
    return h.hexdigest() if found else ""


def kv_layout(num_layers: int, num_kv_heads: int, head_size: int, dtype: str, mla_rope_dim: int = 0) -> KVLayout:
    """The payload layout of vLLM's cache rows: GQA / MHA ``[K | V]``, or with ``mla_rope_dim``
    an MLA latent row of ``head_size`` (``c_kv`` then the rope part ``k_pe``)."""
    if mla_rope_dim:
        return KVLayout.mla(num_layers=num_layers, kv_lora_rank=head_size - mla_rope_dim,
                            qk_rope_head_dim=mla_rope_dim, dtype=dtype)
    return KVLayout.gqa(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_size, dtype=dtype)


def shard_name(rank: int, size: int, stage: int = 0, stages: int = 1) -> str:
    """``CacheIdentity.shard`` of tensor-parallel rank ``rank`` of ``size`` in pipeline stage
    ``stage`` of ``stages``: "tp1of2", "pp0of2", "tp1of2.pp0of2"; "" without either."""
    return ".".join(([f"tp{rank}of{size}"] if size > 1 else []) + ([f"pp{stage}of{stages}"] if stages > 1 else []))


@dataclass(frozen=True)
class EngineShape:
    """One engine process's view of the model's KV: under tensor parallelism ``num_kv_heads`` are
    this rank's heads, under pipeline parallelism ``num_layers`` this stage's layers, and
    ``identity`` names the shard (rank 0 of stage 0, the scheduler side's plan identity, until
    the worker knows where it sits: ``for_rank``)."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str  # KVLayout dtype name
    layout: KVLayout
    rope: "RopeSpec"
    identity: CacheIdentity
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    #: MLA: one latent row per token (``head_size`` = kv_lora_rank + ``rope_dim``, rope last),
    #: the same on every tensor-parallel rank
    mla: bool = False
    rope_dim: int = 0
    #: the scheduler side's identity (rank 0 of stage 0), kept by ``for_rank``
    planned: CacheIdentity | None = None
    #: the model's KV heads over all ranks (0: ``num_kv_heads x tp_size``); when tensor
    #: parallelism exceeds them vLLM replicates heads, and chunks serve only their own cut
    total_kv_heads: int = 0

    @property
    def model_kv_heads(self) -> int:
        return self.total_kv_heads or self.num_kv_heads * self.tp_size

    def for_rank(self, rank: int, stage: int = 0, num_layers: int | None = None) -> "EngineShape":
        """This shape as tensor-parallel rank ``rank`` of pipeline stage ``stage`` holds it
        (``num_layers``: the stage's layers, as many KV caches as vLLM registered): its own
        shard's layout and identity."""
        if not (0 <= rank < self.tp_size and 0 <= stage < self.pp_size):
            raise ValueError(f"tensor-parallel rank {rank} of {self.tp_size}, pipeline stage {stage} of {self.pp_size}")
        n = self.num_layers if num_layers is None else num_layers
        layout = self.layout_of(n)
        # An MLA latent is not split by tensor parallelism: every rank holds (and reads) one shard.
        identity = replace(self.identity, kv_layout=layout.fingerprint(),
                           shard=shard_name(0, 1, stage, self.pp_size) if self.mla
                           else shard_name(rank, self.tp_size, stage, self.pp_size))
        return replace(self, num_layers=n, layout=layout, identity=identity, tp_rank=rank, pp_rank=stage,
                       planned=self.planned or self.identity)

    def layout_of(self, num_layers: int) -> KVLayout:
        return kv_layout(num_layers, self.num_kv_heads, self.head_size, self.dtype, self.rope_dim if self.mla else 0)

    @property
    def stores(self) -> bool:
        """Whether this worker Stores: every shard once (an MLA latent only from TP rank 0)."""
        return not (self.mla and self.tp_rank)

    @property
    def plan_identity(self) -> CacheIdentity | None:
        """The identity the scheduler side plans under, when this shard's differs: the shard
        fetches the plan's chunks as its own (``Fetch`` with ``plan_identity``)."""
        planned = self.planned
        return None if planned is None or planned == self.identity else planned


def kv_dtype_name(vllm_config: Any) -> str:
    """The ``KVLayout`` dtype of the engine's cache; ``Refused`` for a quantized cache or a
    model dtype the sidecar's payloads do not carry."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        raise Refused(f"kv cache dtype {cache_dtype!r} (--kv-cache-dtype): the sidecar stores unquantized rows; "
                      "only 'auto' (the model dtype) is served")
    name = _TORCH_DTYPES.get(str(vllm_config.model_config.dtype))
    if name is None:
        raise Refused(f"model dtype {vllm_config.model_config.dtype} (--dtype): only bfloat16 / float16 / float32 "
                      "caches are served")
    return name


def vllm_is_neox_style(model_config: Any) -> bool | None:
    """The ``is_neox_style`` vLLM rotates this model's cached keys with, from its ``ModelConfig``
    (None: not known from the configuration).

    vLLM's own model classes build their rotary embedding with ``get_rope(...,
    is_neox_style=...)``, default True. Every attention vLLM runs with DeepSeek's latent cache
    (``ModelConfig.use_mla``: DeepSeek-V2 / V3 / V3.2, Kimi K2, ... in vllm/model_executor/
    models/deepseek_v2.py and the other MLA models) passes ``is_neox_style=False`` for ``k_pe``,
    whatever the HF config's ``rope_interleave`` says (that flag steers transformers' own code,
    which re-orders the dims before caching). On vLLM's Transformers backend the model's HF code
    rotates the keys, so the pairing is the HF family's (None here: ``RopeSpec.from_hf_config``
    reads its table of verified families)."""
    if not getattr(model_config, "use_mla", False):
        return True
    backend = getattr(model_config, "using_transformers_backend", None)
    if callable(backend) and backend():
        return None
    return False


#: rope_type names vLLM's DeepSeek models write into the HF config in place when they build the
#: model (vllm/model_executor/models/deepseek_v2.py): both are the config's YaRN frequencies
_VLLM_ROPE_RENAMES = {"deepseek_yarn": "yarn", "deepseek_llama_scaling": "yarn"}


def _as_published(hf_config: Any) -> Any:
    """``hf_config`` with the model files' rope_type: vLLM's DeepSeek code renames ``yarn`` in
    place while building the model, so a process that loaded the model (a worker, or the
    scheduler of a one-process engine) would otherwise see another RoPE than one that did not."""
    text = hf_config.get_text_config(decoder=True) if hasattr(hf_config, "get_text_config") else hf_config
    params = getattr(text, "rope_parameters", None)
    if not isinstance(params, dict) or params.get("rope_type") not in _VLLM_ROPE_RENAMES:
        return hf_config
    import copy

    published = copy.deepcopy(hf_config)
    published_text = (published.get_text_config(decoder=True) if hasattr(published, "get_text_config")
                      else published)
    published_text.rope_parameters = {**params, "rope_type": _VLLM_ROPE_RENAMES[params["rope_type"]]}
    return published


def engine_shape(vllm_config: Any, settings: Settings) -> EngineShape:
    """The engine's KV shape and cache identity from its ``VllmConfig``; ``Refused`` (the
    setting, then why) for an engine the connector cannot serve (``refusals.py``)."""
    from sidecar.rotation import Pairing, RopeSpec

    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
    mla = bool(mc.use_mla)
    # The plan identity is stage 0's in every process (a worker's own stage is set by for_rank).
    from vllm.distributed.utils import get_pp_indices

    first, last = get_pp_indices(mc.get_total_num_hidden_layers(), 0, pp)
    num_layers = last - first
    head = mc.get_head_size()  # MLA: kv_lora_rank + qk_rope_head_dim, the latent row
    kv_heads = 1 if mla else mc.get_num_kv_heads(pc)  # this rank's heads (replicated when TP exceeds them)
    rope_dim = int(getattr(mc.hf_config, "qk_rope_head_dim", 0) or 0) if mla else 0
    if mla and not 0 < rope_dim < head:
        raise Refused(f"MLA model shape: qk_rope_head_dim {rope_dim} is not inside the latent row of {head}")
    block = vllm_config.cache_config.block_size
    dtype = kv_dtype_name(vllm_config)
    neox = vllm_is_neox_style(mc) if settings.rope_is_neox_style is None else bool(settings.rope_is_neox_style)
    try:  # MLA: k_pe's RopeSpec
        rope = RopeSpec.from_hf_config(_as_published(mc.hf_config),
                                       pairing=None if neox is None else Pairing.from_neox_style(neox))
    except ValueError as exc:  # a RoPE no fixed rotation re-positions, or an unverified pairing
        raise Refused(f"the model's RoPE ({getattr(mc.hf_config, 'model_type', '?')}): {exc}") from None
    layout = kv_layout(num_layers, kv_heads, head, dtype, rope_dim)
    served = mc.served_model_name
    if isinstance(served, (list, tuple)):
        served = served[0]
    model_id = settings.model_id or str(served or mc.model)
    identity = CacheIdentity(
        model_id=model_id,
        weights_hash=weights_hash(mc.model),
        tokenizer_hash=tokenizer_hash(mc.tokenizer or mc.model),
        kv_layout=layout.fingerprint(),
        rope_fingerprint=rope.fingerprint,
        block_size=block,
        namespace=settings.namespace,
        shard=shard_name(0, 1 if mla else tp, 0, pp),
    )
    return EngineShape(num_layers, kv_heads, head, block, dtype, layout, rope, identity, tp_size=tp, pp_size=pp,
                       mla=mla, rope_dim=rope_dim, total_kv_heads=1 if mla else int(mc.get_total_num_kv_heads()))


def describe(shape: EngineShape) -> str:
    i = shape.identity
    return json.dumps({"model_id": i.model_id, "weights": i.weights_hash, "tokenizer": i.tokenizer_hash,
                       "layers": shape.num_layers, "kv_heads": shape.num_kv_heads, "head": shape.head_size,
                       "block": shape.block_size, "dtype": shape.dtype, "pairing": shape.rope.pairing.value,
                       "tp": shape.tp_size, "pp": shape.pp_size, "mla": shape.mla, "identity": i.fingerprint})


def env_flag(name: str, default: bool = False) -> bool:
    v = os.environ.get(name)
    return default if v is None else v.strip().lower() in ("1", "true", "yes", "on")


#: vLLM releases the connector is built and tested against: 0.32 (the CPU backend, in the engine
#: suite) and 0.33 (the GPU backends' standard KV layout; docs/vllm.md says what ran where).
SUPPORTED_VLLM = ("0.32.", "0.33.")


def vllm_version_note(version: str) -> str | None:
    """One line to log when ``version`` is not a supported vLLM release, else None."""
    if version.startswith(SUPPORTED_VLLM):
        return None
    return (f"vLLM {version} is not a release this connector supports (0.32 on CPU, 0.33 on GPU): its KV "
            "connector API or cache layout may differ; run a supported release or expect the connector to "
            "disable itself")
