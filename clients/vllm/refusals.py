"""What the connector refuses, and what a refusal does: vLLM serves alone, one log line says why.

The connector serves an engine only when it can move that engine's KV correctly. When it cannot
(a quantized cache, a cache layout it does not know, keys rotated with another pairing than the
identity says, a model whose shape or RoPE it cannot describe), the code that finds out raises
``Refused``, whose message starts with the setting or shape refused and says why. The connector
(``connector.py``) catches it in the two places refusals happen and disables itself; nothing
else does::

    where                          who checks                      what
    construction (both roles,      settings.engine_shape           kv cache dtype, model dtype,
      the VllmConfig alone)                                        the model's RoPE, MLA shape
    register_kv_caches (each       worker_side.register_kv_caches  layer count, cache layout
      worker, its caches and         (layouts.UnsupportedLayout    (layouts.PagedSpec), the
      its model's rotary             is a Refused)                 rotary embeddings' pairing
      embeddings)

A disabled connector behaves like no connector: the scheduler side answers 0 external tokens
and plans no job, the worker side loads and stores nothing, no sidecar call is made, and vLLM
serves every request alone. A worker's refusal reaches the scheduler side through vLLM's
connector handshake (``get_handshake_metadata`` -> ``set_xfer_handshake_metadata_pp_aware``,
after the workers register their caches and before the first request), so both sides stop.

One WARNING line per refusal, from the scheduler side (one per engine): a construction refusal
is found by both roles, a worker's by each refusing rank; the workers log theirs at INFO.
Settings that are malformed (``Settings.from_extra``: a missing ``sidecar``, an unknown
``store`` mode) are not refusals: they raise, like any other bad configuration.
"""

from __future__ import annotations

__all__ = ["Refused"]


class Refused(ValueError):
    """The connector cannot serve this engine; the message names the setting or shape refused,
    then why (``"kv cache dtype 'fp8_e4m3': ..."``)."""

