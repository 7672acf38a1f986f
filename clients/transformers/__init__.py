"""Reference engine on Hugging Face transformers.

    from clients.transformers import Engine, ReusePolicy, Sampling, build_model, llama_config
    model = build_model(llama_config(num_layers=4, hidden_size=512))
    with SyncSidecarClient("127.0.0.1:50051") as sidecar:
        engine = Engine(model, sidecar=sidecar)
        out = engine.generate(prompt_ids, max_new_tokens=32)

Modules: ``engine`` (the request loop), ``options`` (its options and results), ``kv`` (cache <-> payloads), ``cache`` (in-place
growing cache), ``prefix_cache`` (the engine's own exact-prefix cache), ``attention``
(the engine's attention implementations: fast, and batch-invariant for the determinism gate), ``models`` (configs, random or real
weights), ``fidelity`` (teacher-forced output-consistency metrics).

Deprecated: ``clients.transformers.pretrained`` moved to ``sidecar.models``; the old path (the
attribute, and importing the module) still gives ``sidecar.models``, with a
``DeprecationWarning``, for one release.
"""

import importlib
import warnings

from clients.transformers.cache import SequenceCache
from clients.transformers.engine import Engine
from clients.transformers.kv import KVAdapter
from clients.transformers.models import (
    FAST_ATTENTION,
    INVARIANT_ATTENTION,
    build_model,
    deepseek_v2_config,
    default_device,
    llama_config,
    load_model,
    weights_fingerprint,
)
from clients.transformers.options import (
    CACHE_OFF,
    EXACT_PREFIX,
    SIDECAR,
    ActiveAdmission,
    ActiveRefused,
    Generation,
    PrefillResult,
    ReusePolicy,
    Rotation,
    Sampling,
    Scored,
    Timings,
)
from clients.transformers.prefix_cache import PrefixCache
from clients.transformers.splice import (
    PlanNotApplicable,
    SpliceResult,
    SpliceSession,
    SpliceTimings,
    clone_cache,
    splice_cache,
)
from sidecar.models import STANDARD_MODEL, hf_directory, load_tokenizer
from sidecar.registry.anchors import anchor_token_ids

__all__ = [
    "CACHE_OFF",
    "EXACT_PREFIX",
    "FAST_ATTENTION",
    "INVARIANT_ATTENTION",
    "SIDECAR",
    "STANDARD_MODEL",
    "ActiveAdmission",
    "ActiveRefused",
    "Engine",
    "Generation",
    "KVAdapter",
    "PlanNotApplicable",
    "PrefillResult",
    "PrefixCache",
    "ReusePolicy",
    "Rotation",
    "Sampling",
    "Scored",
    "SequenceCache",
    "SpliceResult",
    "SpliceSession",
    "SpliceTimings",
    "Timings",
    "anchor_token_ids",
    "build_model",
    "clone_cache",
    "deepseek_v2_config",
    "default_device",
    "hf_directory",
    "llama_config",
    "load_model",
    "load_tokenizer",
    "splice_cache",
    "weights_fingerprint",
]

#: old public name -> the module it moved to (each removed one release after its move)
_MOVED = {"pretrained": "sidecar.models"}


def __getattr__(name: str) -> object:
    new = _MOVED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.{name} is deprecated: use {new}", DeprecationWarning, stacklevel=2)
    return importlib.import_module(new)
