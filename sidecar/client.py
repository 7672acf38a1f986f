"""Client SDK, the public path: ``SidecarClient`` (asyncio) and ``SyncSidecarClient`` (blocking).

The clients live in ``sidecar.sdk`` (one RPC table run by both; see ``sidecar.sdk.rpcs`` for
every call and its contract); this module re-exports them with their results and the Policy
SDK.

Example::

    async with SidecarClient("127.0.0.1:50051", tenant="team-a") as client:
        ident = CacheIdentity(model_id="llama-3.1-8b")
        plan = await client.lookup(tokens, identity=ident, engine_prefix_len=512)
        await client.store(tokens, identity=ident)

Span directives (docs/splice.md)::

        session = await client.open_session(tokens, block_size=16)
        plan = await client.splice(session.session_id, session.version, [(120, 180, stub, "amortize")])
        ...  # apply plan.ops in order to the engine's cache
        session = await client.commit_splice(plan.plan_id)   # or abort_splice(plan.plan_id)

Held sessions (the sidecar holds the KV; docs/splice.md "Sessions the sidecar holds")::

        await client.store(tokens, identity=ident, layout=layout, payloads=chunks)
        session = await client.open_session(tokens, block_size=1, identity=ident, held=True)
        ...  # Splice / apply / commit; Store the chunks that hold new tokens
        runs = await client.fetch_session(session.session_id, layout=layout, rope=spec)

None of the session calls is retried (none is idempotent: a retried Splice would meet its own
pending plan), except ``fetch_session`` (a read).
"""

from sidecar.api.splice import SessionState
from sidecar.directives import Directive, OpPlan, PlanId, SessionId
from sidecar.errors import SidecarError
from sidecar.routing.score import ReplicaScore, ScoreResult
from sidecar.sdk import (
    AdmitActiveResult,
    ClaimDecision,
    ClaimInfo,
    FetchedKV,
    FetchedRun,
    ImportResult,
    RegistryCounters,
    ReportPoolResult,
    RetryPolicy,
    SidecarClient,
    SidecarStats,
    StoreResult,
    SyncSidecarClient,
    TierCounters,
    WarmUpEngine,
    WarmUpResult,
    WatchedEvent,
)
from sidecar.sdk.policy import (  # the Policy SDK: message-list rewrites -> directives
    EditPolicy,
    MessageDiff,
    Policy,
    Renderer,
    TemplateNotIncremental,
    TokenizerRenderer,
    TruncateOldToolOutputs,
    diff_directives,
    edit_turn,
)
from sidecar.sdk.router import Route, Router, RouterConfig  # the reference router (docs/routing.md)

__all__ = [
    "AdmitActiveResult",
    "ClaimDecision",
    "ClaimInfo",
    "Directive",
    "EditPolicy",
    "FetchedKV",
    "FetchedRun",
    "ImportResult",
    "MessageDiff",
    "OpPlan",
    "PlanId",
    "Policy",
    "RegistryCounters",
    "Renderer",
    "ReplicaScore",
    "ReportPoolResult",
    "RetryPolicy",
    "Route",
    "Router",
    "RouterConfig",
    "ScoreResult",
    "SessionId",
    "SessionState",
    "SidecarClient",
    "SidecarError",
    "SidecarStats",
    "StoreResult",
    "SyncSidecarClient",
    "TemplateNotIncremental",
    "TierCounters",
    "TokenizerRenderer",
    "TruncateOldToolOutputs",
    "WarmUpEngine",
    "WarmUpResult",
    "WatchedEvent",
    "diff_directives",
    "edit_turn",
]
