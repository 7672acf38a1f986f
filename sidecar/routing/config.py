"""The ``routing`` settings (docs/routing.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

#: longest replica id (bytes of its Redis key and of every residency field)
MAX_REPLICA_ID = 200


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """One model llm-d's ``GetPodScores`` may name (``routing.models.<model_name>``).

    ``tokenizer``: a local directory holding the model's ``tokenizer.json`` (Hugging Face
    ``tokenizers`` format; never downloaded). ``model_id``: the ``CacheIdentity.model_id`` its
    engines store KV under (default: the model name). ``namespace``: their identity namespace.
    ``add_special_tokens``: tokenize prompts with the tokenizer's special tokens (BOS), as the
    engine does for a completion prompt of this model."""

    tokenizer: str
    model_id: str = ""
    namespace: str = ""
    add_special_tokens: bool = False

    def __post_init__(self) -> None:
        if not self.tokenizer:
            raise ValueError("tokenizer: a local directory with the model's tokenizer.json is required")
        if not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer: no tokenizer.json in {self.tokenizer!r} (the tokenizer is never downloaded)")


@dataclass(frozen=True, kw_only=True)
class RoutingConfig:
    """``replica_id``: the engine or pod this sidecar serves, as a router names it (llm-d's pod
    identifier, a Dynamo worker id). Set, the sidecar publishes a heartbeat and which chunks it
    holds (needs ``shared_registry.redis_url``); empty, it publishes nothing and ``Score`` knows
    only the replicas that do. ``heartbeat_ttl_s``: a replica that stops heartbeating leaves the
    scores this long after its last beat (it beats every third of it). ``max_candidates``: the
    most replicas one ``Score`` may name. ``models``: llm-d's model names ``GetPodScores`` serves."""

    replica_id: str = ""
    heartbeat_ttl_s: float = 10.0
    max_candidates: int = 256
    models: dict[str, ModelConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rid = self.replica_id
        if len(rid.encode()) > MAX_REPLICA_ID or any(c in rid for c in "{}@ \t\n\x00"):
            raise ValueError(f"routing.replica_id must be at most {MAX_REPLICA_ID} bytes without braces, '@' "
                             f"or spaces, got {rid!r}")
        if not self.heartbeat_ttl_s >= 1.0:
            raise ValueError(f"routing.heartbeat_ttl_s must be >= 1 (seconds), got {self.heartbeat_ttl_s}")
        if not 1 <= self.max_candidates <= 4096:
            raise ValueError(f"routing.max_candidates must be in [1, 4096], got {self.max_candidates}")
        for name in self.models:
            if not name:
                raise ValueError("routing.models: a model name must not be empty")
