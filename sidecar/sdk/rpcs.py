"""The SDK's RPC table: every call of ``SidecarClient`` and ``SyncSidecarClient``, defined once.

Each entry of ``KVSidecarRpcs`` is an ``Rpc``: the service method it calls, the request builder
(from ``sidecar.api``; its signature is the client method's signature), the response converter
(to a typed result: ``sidecar.sdk.results`` or a domain type), whether a transient failure may
be retried, and how the call streams. Both clients inherit the table and run each entry with
their own transport, like redis-py's ``commands/core.py`` under its sync and asyncio clients::

    Rpc entry ──> client method ──> _invoke(rpc, ...)    build, send, retry, convert
                                    (sync.py: grpc channel; aio.py: grpc.aio, returns awaitables)
              └─ Kind.WATCH ──────> _watch(rpc, ...)     an iterator of converted answers

Adding an RPC to the SDK: one entry here, plus its request builder (and, for a new answer, its
converter) in ``sidecar.api`` / ``sidecar.sdk.results``. Calls that are not one RPC
(``warm_up``) are written in each client.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from operator import attrgetter
from types import MethodType
from typing import Any

from sidecar.api.claims import (
    admit_active_request,
    claim_request,
    demote_claim_request,
    get_claim_request,
    release_claim_request,
    report_pool_request,
    watch_events_request,
)
from sidecar.api.kv import (
    delete_request,
    evict_request,
    lookup_plan_from_wire,
    lookup_request,
    ping_request,
    stats_request,
)
from sidecar.api.manifests import (
    export_manifest_request,
    import_manifest_request,
    manifest_lines_from_wire,
    warm_up_plan_from_wire,
    warm_up_plan_request,
)
from sidecar.api.pool import (
    abort_store_request,
    commit_store_request,
    lease_fetch_request,
    map_pool_request,
    release_lease_request,
    reserve_store_request,
)
from sidecar.api.routing import score_request, score_result_from_wire
from sidecar.api.splice import (
    abort_splice_request,
    append_session_request,
    close_session_request,
    commit_splice_request,
    get_session_request,
    op_plan_from_wire,
    open_session_request,
    session_from_wire,
    splice_request,
)
from sidecar.api.store_frames import store_frames
from sidecar.sdk.fetch import fetch_call, fetch_session_call
from sidecar.sdk.results import (
    AdmitActiveResult,
    ClaimDecision,
    ClaimInfo,
    ImportResult,
    ReportPoolResult,
    SidecarStats,
    StoreResult,
    WatchedEvent,
)


class Kind(enum.Enum):
    """How an RPC travels, which decides what its request builder returns and how it is sent."""

    UNARY = "unary"  # one request message, one answer
    CLIENT_STREAM = "client_stream"  # the builder returns the messages (or wire frames) to stream (Store)
    SERVER_STREAM = "server_stream"  # the answers are collected, then converted as one list
    FRAMES = "frames"  # Fetch frames decoded in place and assembled (sidecar.sdk.fetch.FrameCall)
    WATCH = "watch"  # an open stream the caller iterates: no deadline, never retried


def _nothing(_msg: Any) -> None:
    return None


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True, eq=False)
class Rpc:
    """One SDK call: ``method`` of the ``KVSidecar`` service, built by ``request`` (its
    signature is the call's), answered through ``result``. ``idempotent``: a transient failure
    (UNAVAILABLE) is retried with backoff; False for calls that change state each time (a
    retried Claim or Splice would meet its own first attempt). As a class attribute it is a
    method of the client class (a descriptor): ``client.lookup(...)`` runs
    ``client._invoke(Rpc("Lookup", ...), ...)``."""

    method: str
    request: Callable[..., Any]
    result: Callable[[Any], Any] = _same
    _: KW_ONLY
    idempotent: bool  # required: every entry says whether a retry is safe
    kind: Kind = Kind.UNARY
    doc: str = ""
    name: str = field(default="", init=False)
    _method: Callable[..., Any] = field(default=_nothing, init=False, repr=False)

    def __set_name__(self, owner: type, name: str) -> None:
        rpc = self
        if self.kind is Kind.WATCH:
            def method(client, /, *args, **kwargs):
                return client._watch(rpc, *args, **kwargs)
            retry = "a stream the caller iterates: no deadline, not retried"
        else:
            def method(client, /, *args, **kwargs):
                return client._invoke(rpc, *args, **kwargs)
            retry = ("idempotent: retried when the failure is transient" if self.idempotent
                     else "not retried: each call changes state")
        method.__name__ = name
        method.__qualname__ = f"{owner.__qualname__}.{name}"
        method.__doc__ = f"{inspect.cleandoc(self.doc or self.request.__doc__ or '')}\n\n``{self.method}`` RPC, {retry}."
        sig = inspect.signature(self.request)
        try:
            returns = inspect.signature(self.result).return_annotation
        except (TypeError, ValueError):  # attrgetter and friends have no signature
            returns = inspect.Signature.empty
        method.__signature__ = sig.replace(  # type: ignore[attr-defined]
            parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY), *sig.parameters.values()],
            return_annotation=returns,
        )
        method.rpc = self  # type: ignore[attr-defined]
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "_method", method)

    def __get__(self, client: Any, owner: type | None = None) -> Any:
        if client is None:  # on the class: the plain function, as for any method
            return self._method
        return MethodType(self._method, client)


class KVSidecarRpcs:
    """The table: the ``KVSidecar`` RPCs the clients offer, by API area. Each entry is a method
    of both clients (``SidecarClient``: returns an awaitable, ``watch_events`` an async
    iterator). Errors arrive as the typed errors of ``sidecar.errors``; a call refused because
    of claims raises ``ResourceExhausted`` with ``blocking_claim_ids`` and ``capacity_proof``."""

    # ------------------------------------------------------------------------- KV data
    lookup = Rpc("Lookup", lookup_request, lookup_plan_from_wire, idempotent=True, doc="""
        Plan which parts of ``tokens`` the engine can skip (``LookupPlan``). ``dry_run`` changes
        nothing; otherwise the hits it returns have their recency refreshed (still safe to
        retry). ``policy`` / ``left_context_window`` / ``recompute_tokens`` / ``repair_scope``:
        None = the server's defaults.""")
    store = Rpc("Store", store_frames, StoreResult.from_wire, idempotent=True, kind=Kind.CLIENT_STREAM, doc="""
        Register the chunks of ``tokens`` (the whole sequence from position 0) starting at or
        after ``register_from``; with ``layout`` and ``payloads`` ({chunk start: KV bytes at
        that chunk's positions, ``KVLayout`` order}) also store their KV. Chunk starts come
        from ``LookupPlan.chunk_bounds`` or a previous ``StoreResult.chunk_bounds``. Each chunk
        becomes visible only once its payload is complete and verified. ``part_bytes``: payload
        bytes per stream message (each part is copied once, into its message, as the stream is
        sent: a payload must not change until the call returns).""")
    fetch = Rpc("Fetch", fetch_call, idempotent=True, kind=Kind.FRAMES)
    evict = Rpc("Evict", evict_request, attrgetter("evicted"), idempotent=False, doc="""
        Operators: drop the copies of ``chunk_hashes`` from ``tier`` ("": each one's top tier,
        a demotion). Returns how many copies went. Each call demotes one tier, so a retry would
        demote twice.""")
    delete = Rpc("Delete", delete_request, attrgetter("deleted"), idempotent=True, doc="""
        Operators: delete ``chunk_hashes`` from every tier; returns how many were deleted.""")
    stats = Rpc("Stats", stats_request, SidecarStats.from_wire, idempotent=True, doc="""
        Counters since the sidecar started (``SidecarStats``).""")
    ping = Rpc("Ping", ping_request, _nothing, idempotent=True, doc="""
        An empty round trip (the latency baseline); raises when the sidecar is unreachable.""")

    score = Rpc("Score", score_request, score_result_from_wire, idempotent=True, doc="""
        KV-aware routing (docs/routing.md): per candidate replica id (empty: every live one), what
        it could serve of ``tokens`` from cache, planned like a Lookup with the same guards
        (``ScoreResult``: a ``ReplicaScore`` per live candidate in ``candidates``' order, and the
        ``absent`` ones). Changes nothing.""")

    # ------------------------------------------------------------------- the shared pool
    # sidecar.sdk.pool.PoolClient runs these; docs/operations.md, "The shared pool".
    map_pool = Rpc("MapPool", map_pool_request, idempotent=True, doc="""
        The sidecar's shared pool (``PoolInfo``: name, size, lease TTL); an empty name when it
        has none or this client is not on its host.""")
    lease_fetch = Rpc("LeaseFetch", lease_fetch_request, idempotent=False, doc="""
        Where the hits of ``items`` are in the shared pool, pinned under one lease
        (``LeaseFetchResponse``). Not retried: a retry would take a second lease.""")
    release_lease = Rpc("ReleaseLease", release_lease_request, attrgetter("chunks"), idempotent=False, doc="""
        End a lease; returns how many chunks it pinned.""")
    reserve_store = Rpc("ReserveStore", reserve_store_request, idempotent=False, doc="""
        Slots in the shared pool for the chunks of a Store (``ReserveStoreResponse``).""")
    commit_store = Rpc("CommitStore", commit_store_request, StoreResult.from_wire, idempotent=False, doc="""
        Store what the reservation's slots hold (``StoreResult``): ``chunks`` slots written,
        ``payload_bytes`` in all (checked against the reservation).""")
    abort_store = Rpc("AbortStore", abort_store_request, attrgetter("slots"), idempotent=False, doc="""
        Drop a reservation unwritten; returns how many slots it freed.""")

    # ----------------------------------------------------------------------- manifests
    import_manifest = Rpc("ImportManifest", import_manifest_request, ImportResult.from_wire, idempotent=True, doc="""
        Import manifest JSONL ``lines`` (whole lines; split big manifests into several calls)
        into this tenant's scope, or the shared scope with ``shared`` (operator permission).
        Entries already served count as ``present``, so a repeat is harmless.""")
    warm_up_plan = Rpc("GetWarmUpPlan", warm_up_plan_request, warm_up_plan_from_wire, idempotent=True, doc="""
        Token sequences (uint32) still to prefill and Store for ``identity``.""")
    export_manifest = Rpc("ExportManifest", export_manifest_request, manifest_lines_from_wire, idempotent=True,
                          kind=Kind.SERVER_STREAM, doc="""
        This tenant's chunks registered under ``identity`` (and the shared scope's with
        ``include_shared``) as manifest JSONL.""")

    # -------------------------------------------------------------------------- claims
    # docs/claims.md. Claim / Release / Demote / AdmitActive change state: not retried.
    claim = Rpc("Claim", claim_request, ClaimDecision.from_wire, idempotent=False, doc="""
        Submit a claim (``ClaimDecision``): ``chunk_hashes`` (ordered), ``tokens`` or
        ``session_id`` names the object; ``mode`` a ``ProtectionMode`` or its value
        (``"hard_protected"``, ...); ``predicate_min_tokens``, ``duration_s``,
        ``footprint_blocks``, ``shared`` as in the proto.""")
    release_claim = Rpc("ReleaseClaim", release_claim_request, ClaimInfo.from_wire, idempotent=False, doc="""
        End the claim (state ``released``); returns it as it ended.""")
    demote_claim = Rpc("DemoteClaim", demote_claim_request, ClaimInfo.from_wire, idempotent=False, doc="""
        Relax the claim to no obligation (state ``demoted``), recording ``reason``.""")
    get_claim = Rpc("GetClaim", get_claim_request, ClaimInfo.from_wire, idempotent=True, doc="""
        The claim now (``ClaimInfo``); NotFound for an unknown id or another tenant's.""")
    report_pool = Rpc("ReportPool", report_pool_request, ReportPoolResult.from_wire, idempotent=True, doc="""
        An engine reports its KV pool: ``usable_blocks`` of ``block_size`` tokens, of which
        ``free_blocks`` are not held by running requests; ``hard_protection``: it can exclude
        claimed blocks from its victims. A later report replaces this one.""")
    admit_active = Rpc("AdmitActive", admit_active_request, AdmitActiveResult.from_wire, idempotent=False, doc="""
        Ask before running request ``request_id`` that holds ``active_live_blocks`` at its
        peak (``AdmitActiveResult``): admitted (demotable claims may be relaxed for it),
        deferred, or refused with the blocking claims and the capacity proof.""")
    watch_events = Rpc("WatchEvents", watch_events_request, WatchedEvent.from_wire, idempotent=False,
                       kind=Kind.WATCH, doc="""
        An iterator of ``WatchedEvent`` from ``since_seq`` (0: the oldest retained); with
        ``follow`` it streams new events until the caller stops iterating (no deadline).""")

    # --------------------------------------------------------------- sessions / Splice
    # docs/splice.md. None is retried (a retried Splice would meet its own pending plan),
    # GetSession included; fetch_session (a read) is.
    open_session = Rpc("OpenSession", open_session_request, session_from_wire, idempotent=False, doc="""
        Mirror an engine session holding ``tokens`` at positions ``0..n-1`` in a pool of
        ``block_size``-token blocks (1 for token pools). Returns version 0 and the block table
        (the session's block ids, which the engine binds to its own blocks). ``held``: the
        sidecar also holds the session's KV (chunks Stored under ``identity``, required then)
        and serves it with ``fetch_session``.""")
    append_session = Rpc("AppendSession", append_session_request, session_from_wire, idempotent=False, doc="""
        The engine computed ``tokens`` after the session's end. The version is unchanged.""")
    get_session = Rpc("GetSession", get_session_request, session_from_wire, idempotent=False, doc="""
        The session now, with its pending plan's id (``pending_plan_id``) if any.""")
    close_session = Rpc("CloseSession", close_session_request, _nothing, idempotent=False, doc="""
        Forget the session (a pending plan is aborted). NotFound if already gone.""")
    splice = Rpc("Splice", splice_request, op_plan_from_wire, idempotent=False, doc="""
        Plan ``directives`` against the session at ``expected_version``. The answer is a
        ``sidecar.directives.OpPlan`` (numpy arrays): apply its ops in order, then
        ``commit_splice(plan.plan_id)``, or ``abort_splice``. The plan is pending (no other
        Splice or append on the session) until then, or until the server's plan TTL passes.""")
    commit_splice = Rpc("CommitSplice", commit_splice_request, session_from_wire, idempotent=False, doc="""
        The engine applied the plan: the session takes its layout and next version.""")
    abort_splice = Rpc("AbortSplice", abort_splice_request, session_from_wire, idempotent=False, doc="""
        Drop the pending plan; returns the session as it was before the Splice.""")
    fetch_session = Rpc("FetchSession", fetch_session_call, idempotent=True, kind=Kind.FRAMES)


#: The table by client method name.
RPCS: dict[str, Rpc] = {name: v for name, v in vars(KVSidecarRpcs).items() if isinstance(v, Rpc)}
