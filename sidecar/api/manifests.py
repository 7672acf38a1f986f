"""Warm-start manifests on the wire: import outcomes and warm-up plans -> messages (docs/manifests.md)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sidecar.api.kv import identity_to_wire
from sidecar.identity import CacheIdentity
from sidecar.manifests import ImportResult, Outcome
from sidecar.v1 import sidecar_pb2 as pb

__all__ = ["import_result_to_wire", "warm_up_plan_to_wire"]


def import_result_to_wire(res: ImportResult, warmup_pending: int) -> pb.ImportManifestResponse:
    o = res.outcomes
    return pb.ImportManifestResponse(
        lines=res.lines, prefetched=o[Outcome.PREFETCHED], planned=o[Outcome.PLANNED], present=o[Outcome.PRESENT],
        malformed=o[Outcome.MALFORMED], refused=o[Outcome.REFUSED], warmup_pending=warmup_pending,
    )


def warm_up_plan_to_wire(sequences: list[bytes], pending_chunks: int) -> pb.WarmUpPlan:
    """``sequences``: packed little-endian uint32 token sequences, each to prefill once and Store."""
    return pb.WarmUpPlan(sequences=sequences, tokens=sum(len(q) for q in sequences) // 4, pending_chunks=pending_chunks)


# ===================================================================================
# Client side (the SDK's): request builders and the answers that are plain values.
# ===================================================================================

__all__ += ["export_manifest_request", "import_manifest_request", "manifest_lines_from_wire",
            "warm_up_plan_from_wire", "warm_up_plan_request"]


def import_manifest_request(lines: bytes, *, shared: bool = False, prefetch: bool = True) -> pb.ImportManifestRequest:
    """Whole JSONL lines, into the caller's scope or the shared one; ``prefetch`` False leaves
    KV a shared tier holds where it is (the entries are planned instead)."""
    return pb.ImportManifestRequest(lines=bytes(lines), shared=shared, no_prefetch=not prefetch)


def warm_up_plan_request(identity: CacheIdentity, *, shared: bool = False, max_sequences: int = 0) -> pb.WarmUpPlanRequest:
    return pb.WarmUpPlanRequest(identity=identity_to_wire(identity), shared=shared, max_sequences=max_sequences)


def warm_up_plan_from_wire(msg: pb.WarmUpPlan) -> list[np.ndarray]:
    """The plan's token sequences as read-only uint32 views of the received bytes."""
    return [np.frombuffer(q, dtype="<u4") for q in msg.sequences]


def export_manifest_request(identity: CacheIdentity, *, include_shared: bool = False) -> pb.ExportManifestRequest:
    return pb.ExportManifestRequest(identity=identity_to_wire(identity), include_shared=include_shared)


def manifest_lines_from_wire(msgs: Sequence[pb.ExportManifestResponse]) -> bytes:
    """An ExportManifest stream's messages joined: the manifest's JSONL."""
    return b"".join(m.lines for m in msgs)


# The messages of this area's RPCs, for the server's handlers (which import no stubs).
ExportManifestRequest = pb.ExportManifestRequest
ExportManifestResponse = pb.ExportManifestResponse
ImportManifestRequest = pb.ImportManifestRequest
ImportManifestResponse = pb.ImportManifestResponse
WarmUpPlan = pb.WarmUpPlan
WarmUpPlanRequest = pb.WarmUpPlanRequest
