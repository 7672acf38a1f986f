"""The engine-client kit: what every engine integration needs around the SDK's client.

Pure client-side helpers (no server imports, no engine imports), shared by the vLLM connector
(``clients/vllm``), the SGLang backends (``clients/sglang``) and the transformers reference
engine (``clients/transformers``):

* **fail-soft link** (``link``): ``FailSoftLink(connect, default_tenant=, retry_after_s=,
  target=, role=)`` keeps one client per tenant; ``call(what, tenant, fn)`` returns ``fn``'s
  answer or ``None`` on any error, logs an outage once and skips the sidecar for
  ``retry_after_s``; ``errors`` counts failures per call name.
* **plan -> loadable runs** (``runs``): ``load_run(plan, local=, n=, block_size=, ...)`` ->
  ``LoadRun`` (the run of hits contiguous with the engine's own prefix hit, as ``LoadItem``s:
  chunk, rows, target positions; ``gap_start`` / ``gap_end`` where the next hits resume);
  ``load_item(segment)`` for one CHUNK_HIT; ``store_chunks(plan, n=, approximate=, served=)``:
  the chunks to Store after the prefill; ``served_ranges(plan)``.
* **payload views** (``sidecar.payload``, re-exported): ``stacked_view(data, layout, n)``
  -> ``[L, P, n, *shape]`` (GQA: ``[L, 2, n, H, D]``), ``stacked_payload(rows)`` (the
  inverse), ``decode_payload`` / ``encode_payload`` (per part, any layout), ``as_byte_tensor``.
"""

from sidecar.payload import (
    TORCH_DTYPES,
    KVPayloadView,
    as_byte_tensor,
    decode_payload,
    encode_payload,
    is_stacked,
    payload_nbytes,
    stacked_payload,
    stacked_view,
)
from sidecar.sdk.kit.link import FailSoftLink
from sidecar.sdk.kit.runs import LoadItem, LoadRun, load_item, load_run, served_ranges, store_chunks

__all__ = [
    "TORCH_DTYPES",
    "FailSoftLink",
    "KVPayloadView",
    "LoadItem",
    "LoadRun",
    "as_byte_tensor",
    "decode_payload",
    "encode_payload",
    "is_stacked",
    "load_item",
    "load_run",
    "payload_nbytes",
    "served_ranges",
    "stacked_payload",
    "stacked_view",
    "store_chunks",
]
