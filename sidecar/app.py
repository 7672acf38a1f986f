"""The composition root: ``build(config) -> Sidecar`` wires the parts in their constructors;
``SidecarServer`` serves them over gRPC; ``create_server`` and ``ServerThread`` start one.

    config ─┬─> Metrics (edge) ─────────────────────────────────────────────┐
            ├─> ChunkIndex(chunker, InMemoryRegistry) ── SharedRegistry?     │
            ├─> DataPlane(index, TieredStore) <── ClaimLedger ─┐             │
            ├─> SpliceService(SessionTable, resolver=dataplane) │            │
            ├─> ClaimsService(ledger) ──────────────────────────┘            │
            ├─> ManifestService(index, dataplane)                            │
            └─> Edge(Tenancy, TenantLimiter, IdentityCache) ─> KVHandlers, SessionHandlers,
                                                               ClaimHandlers, ManifestHandlers
                                                               -> grpc.aio server (from the
                                                               service descriptor)

Also served: gRPC health checking (``grpc.health.v1.Health``; NOT_SERVING during shutdown, and
``sidecar.v1.KVSidecar.registry`` for the shared registry), server reflection (grpcurl works
without the proto) and Prometheus on ``metrics_port``. Background tasks expire idle sessions,
pending Splice plans and claims.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import threading
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sidecar import __version__
from sidecar.api.kv import RequestLimits
from sidecar.api.service import INDEXER_METHODS, INDEXER_SERVICE_NAME, SERVICE_NAME
from sidecar.auth.tls import server_credentials
from sidecar.claims import ClaimLedger
from sidecar.claims.service import ClaimsService
from sidecar.config import LOOPBACK_HOSTS, SidecarConfig
from sidecar.dataplane import DataPlane
from sidecar.directives import SessionTable
from sidecar.directives.service import SpliceService
from sidecar.limits import TenantLimiter
from sidecar.manifests.service import ManifestService
from sidecar.registry.chunk_index import ChunkIndex
from sidecar.registry.chunker import warmup
from sidecar.registry.lookup_kernel import warmup as compiled_warmup
from sidecar.registry.registry import InMemoryRegistry
from sidecar.registry.shared import SharedRegistry
from sidecar.routing.fleet import Fleet
from sidecar.routing.models import ModelCatalog
from sidecar.server.claims import ClaimHandlers
from sidecar.server.edge import Edge
from sidecar.server.kv import KVHandlers
from sidecar.server.manifests import ManifestHandlers
from sidecar.server.metrics import Metrics
from sidecar.server.pool import PoolHandlers
from sidecar.server.pool import run_reaper as run_pool_reaper
from sidecar.server.routing import RoutingHandlers
from sidecar.server.service import add_service
from sidecar.server.splice import SessionHandlers
from sidecar.server.tenancy import Tenancy
from sidecar.tiers import RemoteEndpoint, Tier, TieredStore

logger = logging.getLogger("sidecar.server")

REGISTRY_HEALTH_NAME = f"{SERVICE_NAME}.registry"
#: how long a stop waits for the rotation kernels' warm-up still running (it takes seconds)
_WARMUP_JOIN_S = 60.0

__all__ = [
    "REGISTRY_HEALTH_NAME", "SERVICE_NAME", "ServerThread", "Sidecar", "SidecarServer", "build", "create_server",
    "new_event_loop",
]


def _shared_registry(config: SidecarConfig) -> SharedRegistry | None:
    """The shared (Redis) registry in front of which the local one is a near cache, or None."""
    sr = config.shared_registry
    if not sr.enabled:
        return None
    store = config.store
    shared_tier = ""
    if store.remote_url and store.remote_bytes > 0:
        ep = RemoteEndpoint.parse(store.remote_url)
        shared_tier = f"{ep.host}:{ep.port}/{store.namespace}"
    return SharedRegistry(sr, sidecar_id=sr.sidecar_id, shared_tier=shared_tier)


def _warm_rotation() -> None:
    from sidecar.rotation.batch import warmup as rotation_warmup

    t0 = time.perf_counter()
    try:
        calls = rotation_warmup()
    except Exception:  # noqa: BLE001 - a warm-up failure only moves the cost to the first Fetch
        logger.warning("rotation kernel warm-up failed; the first rotated Fetch compiles them", exc_info=True)
        return
    logger.info("rotation kernels ready in %.2f s (%d kernel calls)", time.perf_counter() - t0, calls)


@dataclass(frozen=True, kw_only=True)
class Sidecar:
    """The parts of one sidecar, wired (``build``). ``handlers`` serve the KVSidecar service:
    every RPC the proto declares is one of their methods (``sidecar.server.service.bind``)."""

    config: SidecarConfig
    metrics: Metrics
    index: ChunkIndex
    dataplane: DataPlane
    shared_registry: SharedRegistry | None
    sessions: SpliceService
    claims: ClaimsService
    manifests: ManifestService
    edge: Edge
    kv: KVHandlers
    fleet: Fleet
    handlers: tuple[object, ...]


def build(config: SidecarConfig, *, session_table: SessionTable | None = None) -> Sidecar:
    """Every part of a sidecar, each given what it needs in its constructor. Starts nothing:
    no port, no thread, no task (``SidecarServer.start`` does).

    ``session_table`` replaces the session table built from ``config.directives`` (tests); its
    ``config`` then rules the session limits and TTLs."""
    metrics = Metrics(__version__)
    shared = _shared_registry(config)
    index = ChunkIndex(config.chunker, InMemoryRegistry(config.registry), shared=shared)
    # limits.max_bytes* become the tier store's tenant quotas
    store = TieredStore(config.limits.store_config(config.store))
    ledger = ClaimLedger(config.claims, index.registry, store)
    dataplane = DataPlane(
        index, store, claims=ledger,
        publish_remote=shared is not None and config.shared_registry.publish_payloads and bool(shared.shared_tier),
        on_registry_eviction=lambda reason: metrics.evictions.labels(reason).inc(),
        pool_lease_ttl_s=config.lease_ttl_s, pool_reservation_ttl_s=config.pool_reservation_ttl_s,
        pool_max_leases=config.pool_max_leases,
    )
    # The table's own per-tenant cap is the largest any tenant may have; the edge enforces
    # each tenant's limits.max_sessions before the table is asked.
    directives = dataclasses.replace(
        config.directives,
        max_sessions_per_tenant=config.limits.session_ceiling(config.directives.max_sessions_per_tenant),
    )
    sessions = SpliceService(
        directives.session_config(), table=session_table, resolver=dataplane.held.resolve,
        forget_tenants=directives.forget_tenants, sweep_interval_s=directives.sweep_interval_s,
    )
    claims = ClaimsService(config.claims, index, ledger, sessions)
    tenancy = Tenancy(config.auth, config.default_tenant, config.tls)
    limits = TenantLimiter(
        config.limits,
        # directives.max_sessions_per_tenant, or an injected table's own (smaller) limit
        default_sessions=min(config.directives.max_sessions_per_tenant, sessions.table.config.max_sessions_per_tenant),
        forget_tenants=config.directives.forget_tenants,
    )
    edge = Edge(tenancy, limits, metrics, shared_memory=config.fetch_shared_memory)
    manifests = ManifestService(config.manifests, index, dataplane, config.max_prompt_tokens)
    kv = KVHandlers(edge, config, index, dataplane, ledger)
    fleet = Fleet(config.routing, index, shared)
    kv.on_stored = fleet.saw_identity
    handlers = (
        kv,
        SessionHandlers(edge, config, sessions, dataplane),
        ClaimHandlers(edge, config, claims),
        ManifestHandlers(edge, manifests),
        RoutingHandlers(edge, config, kv, fleet, ModelCatalog(config.routing.models)),
        PoolHandlers(edge, kv, dataplane),
    )
    metrics.watch_registry(index.registry)
    metrics.watch_dataplane(dataplane)
    metrics.watch_sessions(sessions.table)
    metrics.watch_claims(ledger, store)
    metrics.watch_fleet(fleet)
    if shared is not None:
        metrics.watch_shared_registry(shared)
    return Sidecar(config=config, metrics=metrics, index=index, dataplane=dataplane, shared_registry=shared,
                   sessions=sessions, claims=claims, manifests=manifests, edge=edge, kv=kv, fleet=fleet,
                   handlers=handlers)


class SidecarServer:
    """A sidecar (``build(config)``) served over gRPC, with health and the metrics endpoint.
    Start with ``await start()``, stop with ``await stop()``. The parts are attributes
    (``index``, ``dataplane``, ``sessions``, ``claims``, ``manifests``, ``metrics``, ``edge``).

    ``session_table``: see ``build``.
    """

    def __init__(self, config: SidecarConfig, *, session_table: SessionTable | None = None) -> None:
        parts = build(config, session_table=session_table)
        self.parts = parts
        self.config = config
        self.metrics = parts.metrics
        self.index = parts.index
        self.dataplane = parts.dataplane
        self.shared_registry = parts.shared_registry
        self.sessions = parts.sessions
        self.claims = parts.claims
        self.manifests = parts.manifests
        self.edge = parts.edge
        self.kv = parts.kv
        self.fleet = parts.fleet
        opts = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            # Off, so a second sidecar on a taken port fails to bind instead of silently taking
            # half the connections; on for the workers of one supervisor, which share the port.
            ("grpc.so_reuseport", int(config.worker_index >= 0)),
        ]
        self.grpc = grpc.aio.server(options=opts)
        limits = RequestLimits(config.wire.max_string_bytes, config.wire.max_repeated)
        add_service(self.grpc, self.edge, parts.handlers, limits)
        add_service(self.grpc, self.edge, parts.handlers, limits, INDEXER_METHODS, INDEXER_SERVICE_NAME)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, INDEXER_SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME),
            self.grpc,
        )
        self.port = 0
        self.metrics_port = -1
        self._stopped = False
        self._sweeper: asyncio.Task | None = None
        self._rotation_warmup: threading.Thread | None = None
        self._claim_sweeper: asyncio.Task | None = None
        self._pool_reaper: asyncio.Task | None = None

    async def start(self) -> int:
        cfg = self.config
        host = cfg.bind_host
        if host != cfg.host:
            logger.warning("no authentication configured: binding %s instead of %s (loopback only)", host, cfg.host)
        elif not cfg.authenticated:
            logger.info("no authentication configured: serving on loopback only")
        for warning in self.edge.tenancy.startup_warnings():
            logger.warning("%s", warning)
        if cfg.tls.enabled:
            self.port = self.grpc.add_secure_port(f"{host}:{cfg.port}", server_credentials(cfg.tls))
        else:
            if cfg.authenticated and host not in LOOPBACK_HOSTS:
                if not cfg.tls.allow_insecure:
                    raise ValueError(
                        f"tls: refusing to serve authenticated calls on {host} without TLS (bearer tokens would "
                        "cross the network in clear): set tls.cert_file and tls.key_file, or tls.allow_insecure: "
                        "true on a private network"
                    )
                logger.warning(
                    "INSECURE: serving bearer-token calls on %s:%d WITHOUT TLS (tls.allow_insecure is set): "
                    "anyone on this network can read the tokens", host, cfg.port,
                )
            self.port = self.grpc.add_insecure_port(f"{host}:{cfg.port}")
        if self.port == 0:
            raise OSError(f"could not bind gRPC port {host}:{cfg.port}")
        warmup(cfg.chunker)
        if cfg.registry.compiled_lookup:
            compiled_warmup(cfg.chunker)
        self.dataplane.recover()  # logs what it rebuilt
        await self.manifests.import_startup()  # warm start before the first request (logs what it did)
        await self.grpc.start()
        self._sweeper = asyncio.get_running_loop().create_task(self.sessions.run_sweeper(), name="session-expiry")
        self._claim_sweeper = asyncio.get_running_loop().create_task(self.claims.run_sweeper(), name="claim-expiry")
        self._pool_reaper = asyncio.get_running_loop().create_task(
            run_pool_reaper(self.dataplane, self.config.lease_ttl_s / 4), name="pool-lease-expiry")
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        # The rotation kernels are compiled (or loaded from numba's cache) behind the serving
        # port: Lookups do not need them and a restart should not wait for them, but the first
        # rotated Fetch should not pay them either (it waits for this thread if it comes first).
        self._rotation_warmup = threading.Thread(target=_warm_rotation, name="kv-sidecar-rotation-warmup", daemon=True)
        self._rotation_warmup.start()
        if self.shared_registry is not None:
            await self._start_shared_registry()
        if cfg.metrics_port >= 0:
            self.metrics_port = self.metrics.serve_http(cfg.metrics_host, cfg.metrics_port)
        logger.info("kv-sidecar %s serving %s on %s:%d", __version__, SERVICE_NAME, host, self.port)
        return self.port

    async def _start_shared_registry(self) -> None:
        shared = self.shared_registry
        assert shared is not None
        if not shared.sidecar_id:
            shared.sidecar_id = f"{socket.gethostname()}:{self.port}"
            if self.config.worker_index >= 0:
                shared.sidecar_id += f"/w{self.config.worker_index}"
        loop = asyncio.get_running_loop()

        def on_health(up: bool) -> None:  # any thread
            if not loop.is_closed():
                loop.call_soon_threadsafe(lambda: loop.create_task(self._set_registry_health(up)))
                if up:  # Redis may have come back without its data: publish the residency again
                    loop.call_soon_threadsafe(self.fleet.republish)

        if self.fleet.residency is not None:
            self.fleet.residency.on_lost = lambda: loop.call_soon_threadsafe(self.fleet.republish)
        up = await asyncio.to_thread(shared.start, on_health)
        await self._set_registry_health(up)
        logger.info("shared registry %s (sidecar id %s, shared tier %s)", "up" if up else "DOWN: degraded",
                    shared.sidecar_id, shared.shared_tier or "none")

    async def _set_registry_health(self, up: bool) -> None:
        if self._stopped and up:
            return
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        result = self.health.set(REGISTRY_HEALTH_NAME, status)
        if asyncio.iscoroutine(result):
            await result

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            result = self.health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting calls, let in-flight calls finish for ``grace`` seconds. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        grace_s = self.config.grace_period_s if grace is None else grace
        began = time.monotonic()
        await self.grpc.stop(grace_s)
        await self.kv.drain()  # Stores committed by calls that are gone finish first
        for task in (self._sweeper, self._claim_sweeper, self._pool_reaper):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.dataplane.pool.close()  # leases released, reservations aborted
        await asyncio.to_thread(self.manifests.close)  # writes what the producer still buffers
        if self.shared_registry is not None:
            await self._set_registry_health(False)
            await asyncio.to_thread(self.shared_registry.close, self.config.shared_registry.timeout_s * 10)
        # what only memory holds goes to disk within what is left of the grace period (at least
        # a second: the calls were stopped first), so a restart starts warm
        budget = max(1.0, grace_s - (time.monotonic() - began))
        moved, left = await asyncio.to_thread(self.dataplane.store.spill, budget)
        if moved or left:
            log = logger.warning if left else logger.info
            log("shutdown: %d chunks moved from memory to the disk tier, %d left in memory (lost)%s", moved, left,
                "" if Tier.DISK in self.dataplane.store.tiers else ": no disk tier configured")
        await asyncio.to_thread(self.dataplane.close)
        self.metrics.close()
        warming = self._rotation_warmup
        if warming is not None and warming.is_alive():
            # A process that exits while numba's parallel workers run a warm-up kernel aborts
            # ("terminate called without an active exception"): let the warm-up finish first.
            await asyncio.to_thread(warming.join, _WARMUP_JOIN_S)
        logger.info("kv-sidecar stopped")

    async def wait_for_termination(self) -> None:
        await self.grpc.wait_for_termination()


async def create_server(config: SidecarConfig) -> tuple[SidecarServer, int]:
    """Build and start a sidecar; returns it and the bound gRPC port (config.port 0 = any)."""
    server = SidecarServer(config)
    port = await server.start()
    return server, port


class ServerThread:
    """A sidecar on its own event loop in a daemon thread, for synchronous callers.

    ``with ServerThread(config) as st: SyncSidecarClient(st.target)``.
    """

    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.server: SidecarServer | None = None
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "ServerThread":
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                self.server, self.port = loop.run_until_complete(create_server(self.config))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="kv-sidecar", daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            raise errors[0]
        return self

    def stop(self, grace: float = 0.5) -> None:
        if self._loop is None or self.server is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._loop)
        fut.result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join()
        self.server = None

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop when uvloop is installed, else asyncio's default."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; kept for embedding
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
