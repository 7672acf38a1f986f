"""The models llm-d's ``GetPodScores`` may name: each one's tokenizer, and its cache identity.

llm-d sends prompt text and a model name, not tokens and a ``CacheIdentity``. The tokenizer is
loaded once, at startup, from the local directory ``routing.models.<name>.tokenizer`` (its
``tokenizer.json``, Hugging Face ``tokenizers``; nothing is downloaded). The identity is the one
the model's engines store KV under, as their sidecars' heartbeats name it (``Residency``): the
newest with the configured ``model_id`` and ``namespace`` whose shard is rank 0 of stage 0 (the
shard a tensor- or pipeline-parallel engine plans with).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from sidecar.errors import InvalidArgument, NotFound
from sidecar.identity import CacheIdentity
from sidecar.routing.config import ModelConfig

_LEAD_SHARD = re.compile(r"^(tp0of\d+|pp0of\d+|tp0of\d+\.pp0of\d+)$")


class ModelCatalog:
    """Tokenizers and identity rules of ``routing.models`` (loaded at construction)."""

    def __init__(self, models: dict[str, ModelConfig]) -> None:
        from tokenizers import Tokenizer

        self.models = dict(models)
        self._tokenizers = {name: Tokenizer.from_file(str(Path(m.tokenizer) / "tokenizer.json"))
                            for name, m in self.models.items()}

    def config(self, model_name: str) -> ModelConfig:
        m = self.models.get(model_name)
        if m is None:
            known = sorted(self.models) or "none"
            raise NotFound(f"model_name: {model_name!r} is not configured in routing.models (configured: {known})")
        return m

    def tokenize(self, model_name: str, prompt: str, max_tokens: int) -> np.ndarray:
        """The prompt's token ids (uint32); INVALID_ARGUMENT for an empty or too long prompt."""
        m = self.config(model_name)
        if not prompt:
            raise InvalidArgument("prompt: empty")
        if len(prompt) > 64 * max_tokens:
            raise InvalidArgument(f"prompt: {len(prompt)} characters is past any prompt of max_prompt_tokens {max_tokens}")
        ids = self._tokenizers[model_name].encode(prompt, add_special_tokens=m.add_special_tokens).ids
        if len(ids) > max_tokens:
            raise InvalidArgument(f"prompt: {len(ids)} tokens exceeds max_prompt_tokens {max_tokens}")
        if not ids:
            raise InvalidArgument("prompt: no tokens")
        return np.asarray(ids, dtype=np.uint32)

    def identity(self, model_name: str, seen: Iterable[CacheIdentity]) -> CacheIdentity | None:
        """The identity engines of ``model_name`` store under, among ``seen`` (newest first), or
        None when no engine of it has stored anything yet."""
        m = self.config(model_name)
        model_id = m.model_id or model_name
        for ident in seen:
            if ident.model_id == model_id and ident.namespace == m.namespace and (
                not ident.shard or _LEAD_SHARD.match(ident.shard)
            ):
                return ident
        return None
