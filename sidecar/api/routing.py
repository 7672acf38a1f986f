"""Wire conversions of the routing RPCs: ``Score`` (KVSidecar) and llm-d's ``GetPodScores``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sidecar.api.kv import lookup_request
from sidecar.errors import InvalidArgument
from sidecar.identity import CacheIdentity
from sidecar.registry.lookup_plan import AdmissionPolicy, RepairScope
from sidecar.routing.config import MAX_REPLICA_ID
from sidecar.routing.score import ReplicaScore, ScoreResult
from sidecar.v1 import llmd_indexer_pb2 as ipb
from sidecar.v1 import sidecar_pb2 as pb

ScoreRequest = pb.ScoreRequest
GetPodScoresRequest = ipb.GetPodScoresRequest


def score_request(
    tokens: np.ndarray | Sequence[int] | bytes,
    identity: CacheIdentity,
    candidates: Sequence[str] = (),
    policy: AdmissionPolicy | str | None = None,
    left_context_window: int | None = None,
    recompute_tokens: int | None = None,
    repair_scope: RepairScope | str | None = None,
) -> pb.ScoreRequest:
    """A ``ScoreRequest``: the prompt and guards as ``lookup_request`` builds them, and the
    replica ids to score (empty: every live replica)."""
    lookup = lookup_request(tokens, identity, policy=policy, left_context_window=left_context_window,
                            recompute_tokens=recompute_tokens, repair_scope=repair_scope)
    return pb.ScoreRequest(lookup=lookup, candidates=list(candidates))


def candidates_from_wire(values: Sequence[str], limit: int, field: str = "candidates") -> list[str]:
    """Validated replica ids (INVALID_ARGUMENT naming ``field``): at most ``limit``, each once,
    non-empty, at most ``MAX_REPLICA_ID`` bytes."""
    if len(values) > limit:
        raise InvalidArgument(f"{field}: {len(values)} replicas exceed routing.max_candidates {limit}")
    seen: set[str] = set()
    for i, c in enumerate(values):
        if not c:
            raise InvalidArgument(f"{field}[{i}]: empty replica id")
        if len(c.encode()) > MAX_REPLICA_ID:
            raise InvalidArgument(f"{field}[{i}]: longer than {MAX_REPLICA_ID} bytes")
        if c in seen:
            raise InvalidArgument(f"{field}[{i}]: {c!r} named twice")
        seen.add(c)
    return list(values)


def score_result_to_wire(res: ScoreResult) -> pb.ScoreResponse:
    return pb.ScoreResponse(
        total_tokens=res.total_tokens,
        scores=[pb.ReplicaScore(replica=s.replica, prefix_tokens=s.prefix_tokens, exact_tokens=s.exact_tokens,
                                shifted_tokens=s.shifted_tokens, prefill_tokens=s.prefill_tokens,
                                saved_tokens=s.saved_tokens, chunks_hit=s.chunks_hit, tier_tokens=s.tier_tokens)
                for s in res.scores],
        absent=res.absent,
    )


def score_result_from_wire(msg: pb.ScoreResponse) -> ScoreResult:
    return ScoreResult(
        total_tokens=msg.total_tokens,
        scores=[ReplicaScore(replica=s.replica, prefix_tokens=s.prefix_tokens, exact_tokens=s.exact_tokens,
                             shifted_tokens=s.shifted_tokens, prefill_tokens=s.prefill_tokens,
                             chunks_hit=s.chunks_hit, tier_tokens=dict(s.tier_tokens))
                for s in msg.scores],
        absent=list(msg.absent),
    )


def pod_scores_request(prompt: str, model_name: str, pod_identifiers: Sequence[str] = ()) -> ipb.GetPodScoresRequest:
    """llm-d's ``GetPodScoresRequest``."""
    return ipb.GetPodScoresRequest(prompt=prompt, model_name=model_name, pod_identifiers=list(pod_identifiers))


def pod_scores_to_wire(scores: Sequence[tuple[str, float]]) -> ipb.GetPodScoresResponse:
    return ipb.GetPodScoresResponse(scores=[ipb.PodScore(pod=p, score=s) for p, s in scores])


def pod_scores_from_wire(msg: ipb.GetPodScoresResponse) -> dict[str, float]:
    return {s.pod: s.score for s in msg.scores}
