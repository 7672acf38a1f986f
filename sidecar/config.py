"""Typed configuration: defaults < config file < environment < command-line flags.

* File: YAML or JSON, given by ``--config PATH`` or ``KV_SIDECAR_CONFIG``. Nested sections
  mirror the dataclasses (``chunker:``, ``registry:``, ``auth:``, ``directives:``).
* Environment: ``KV_SIDECAR_<KEY>`` for top-level keys (``KV_SIDECAR_PORT=50052``) and
  ``KV_SIDECAR_<SECTION>__<KEY>`` for nested ones (``KV_SIDECAR_REGISTRY__CAPACITY_BYTES=1e9``).
  Values are parsed as YAML scalars/lists (``[1, 2]``, ``true``).
* Flags: ``kv-sidecar serve --port 50052 --set registry.capacity_entries=100000``.

``load_config`` is the only place that reads the environment; constructors never do.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from sidecar.auth.tls import TlsConfig
from sidecar.auth.tokens import parse_entry
from sidecar.claims.config import ClaimsConfig
from sidecar.directives import SessionConfig
from sidecar.limits import LimitsConfig
from sidecar.manifests.config import ManifestsConfig
from sidecar.registry.chunker import ChunkerConfig
from sidecar.registry.lookup_plan import AdmissionPolicy, RepairScope
from sidecar.registry.registry import RegistryConfig
from sidecar.registry.shared_keys import SharedRegistryConfig
from sidecar.routing.config import RoutingConfig
from sidecar.tiers import StoreConfig

ENV_PREFIX = "KV_SIDECAR_"
#: Variables under the prefix that are not settings: the config file, ./dev's environments, the
#: model cache of sidecar.models, the engine suite's server interpreter / binary.
NOT_SETTINGS = frozenset(
    ENV_PREFIX + k
    for k in ("CONFIG", "VENV", "ENGINE_VENV", "MODEL_CACHE", "SERVER_PYTHON", "BIN")  # ./dev, engine tests
)
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True, kw_only=True)
class AuthConfig:
    """Bearer tokens mapped to the tenants they may act as.

    ``tokens: {"sha256:<hex>": ["team-a", "team-b"]}``: keys are SHA-256 digests of the tokens
    (``kv-sidecar auth hash-token``) or, with a warning at startup, the tokens in clear
    (``sidecar.auth.tokens``). With no tokens configured, requests are not authenticated,
    ``x-tenant-id`` is taken as given, and the server binds to loopback only (unless client
    certificates name the tenant, ``tls.tenant_from_cert``). ``shared_writers`` may store into
    the ``shared`` scope (operator-granted). ``operators`` see the whole server in ``Stats``
    (every other tenant sees its own share only).
    """

    tokens: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    shared_writers: tuple[str, ...] = ()
    operators: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", {str(k): tuple(v) for k, v in dict(self.tokens).items()})
        object.__setattr__(self, "shared_writers", tuple(self.shared_writers))
        object.__setattr__(self, "operators", tuple(self.operators))
        for entry, tenants in self.tokens.items():
            parse_entry(entry)  # ValueError naming a malformed sha256: entry
            if not tenants or not all(isinstance(t, str) and t for t in tenants):
                raise ValueError("auth.tokens: every token must map to a non-empty list of tenant ids")

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)


_SESSION_DEFAULTS = SessionConfig()


@dataclass(frozen=True, kw_only=True)
class DirectivesConfig:
    """Span directives and Splice sessions (docs/architecture.md, "The edit path"; docs/splice.md).

    Limits are per tenant where they say so. ``refresh_after``: rotations a slot may go through
    before a plan proposes REFRESH instead of rotating it again (None: never). ``vocab_size``:
    token ids must be below it (None: any uint32). ``forget_tenants``: tenants whose edits are
    all planned as ``forget`` whatever mode they ask for (content must leave the cache).
    ``sweep_interval_s``: how often idle sessions and pending plans past their TTL are expired
    (every call also enforces the deadlines of what it touches).
    """

    max_sessions_per_tenant: int = _SESSION_DEFAULTS.max_sessions_per_tenant
    max_tokens_per_session: int = _SESSION_DEFAULTS.max_tokens_per_session
    max_directives: int = _SESSION_DEFAULTS.max_directives  # per Splice
    idle_ttl_s: float = _SESSION_DEFAULTS.idle_ttl_s
    plan_ttl_s: float = _SESSION_DEFAULTS.plan_ttl_s
    refresh_after: int | None = _SESSION_DEFAULTS.refresh_after
    vocab_size: int | None = _SESSION_DEFAULTS.vocab_size
    forget_tenants: tuple[str, ...] = ()
    sweep_interval_s: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "forget_tenants", tuple(self.forget_tenants))
        for name in ("max_sessions_per_tenant", "max_tokens_per_session", "max_directives"):
            if getattr(self, name) < 1:
                raise ValueError(f"directives.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("idle_ttl_s", "plan_ttl_s", "sweep_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"directives.{name} must be > 0, got {getattr(self, name)}")
        if self.refresh_after is not None and self.refresh_after < 0:
            raise ValueError(f"directives.refresh_after must be >= 0 or null, got {self.refresh_after}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"directives.vocab_size must be >= 1 or null, got {self.vocab_size}")
        for t in self.forget_tenants:
            if not isinstance(t, str) or not t:
                raise ValueError(f"directives.forget_tenants: tenant ids must be non-empty strings, got {t!r}")

    def session_config(self) -> SessionConfig:
        """The session table's share of these settings."""
        return SessionConfig(
            max_sessions_per_tenant=self.max_sessions_per_tenant,
            max_tokens_per_session=self.max_tokens_per_session,
            max_directives=self.max_directives,
            idle_ttl_s=self.idle_ttl_s,
            plan_ttl_s=self.plan_ttl_s,
            refresh_after=self.refresh_after,
            vocab_size=self.vocab_size,
        )


@dataclass(frozen=True, kw_only=True)
class WireConfig:
    """Bounds on every request message, checked as it is decoded (``sidecar.api.kv.RequestLimits``):
    a request past one is refused with INVALID_ARGUMENT naming the field and the limit, before
    any handler runs. Token and payload bytes have their own limits (``max_prompt_tokens``,
    Store's layout x tokens sizes); Fetch items ``max_fetch_items``."""

    #: UTF-8 bytes of any string field (identity fields, session / plan / claim / request ids, ...)
    max_string_bytes: int = 4096
    #: entries of any repeated field (chunk hash lists, directives, Fetch items, layout parts, ...)
    max_repeated: int = 65_536

    def __post_init__(self) -> None:
        if self.max_string_bytes <= 0 or self.max_repeated <= 0:
            raise ValueError("wire.max_string_bytes and wire.max_repeated must be positive")


#: ``default_recompute_tokens`` out of the box (docs/fidelity.md: the real-model sweep).
DEFAULT_RECOMPUTE_TOKENS = 4


@dataclass(frozen=True, kw_only=True)
class SidecarConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9464  # 0 picks a free port, -1 disables the metrics endpoint
    grace_period_s: float = 5.0
    max_prompt_tokens: int = 262_144
    max_message_bytes: int = 64 << 20
    default_tenant: str = "default"
    default_policy: AdmissionPolicy = AdmissionPolicy.POSITION_INDEPENDENT
    # Guards applied to position_independent Lookups that do not set their own. The default k
    # was chosen on a trained model: the largest reuse that keeps greedy answers equal to full
    # prefill on >= 99% of question prompts (docs/fidelity.md).
    default_left_context_window: int = 0
    default_recompute_tokens: int = DEFAULT_RECOMPUTE_TOKENS
    #: where repair goes inside a segment continuing one stored sequence (``RepairScope``):
    #: ``chunk`` (every stored chunk's start) keeps the fidelity the default k was chosen with
    default_repair_scope: RepairScope = RepairScope.CHUNK
    log_level: str = "INFO"
    chunker: ChunkerConfig = field(default_factory=ChunkerConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    directives: DirectivesConfig = field(default_factory=DirectivesConfig)
    shared_registry: SharedRegistryConfig = field(default_factory=SharedRegistryConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    manifests: ManifestsConfig = field(default_factory=ManifestsConfig)
    claims: ClaimsConfig = field(default_factory=ClaimsConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    max_fetch_items: int = 4096
    #: payload bytes one Fetch may answer (every item counted, duplicates too); more is refused
    #: whole, before anything is read (RESOURCE_EXHAUSTED naming ``max_fetch_bytes``)
    max_fetch_bytes: int = 1 << 30
    fetch_part_bytes: int = 4 << 20
    #: write Fetch / FetchSession payloads into the shared-memory buffer a client on this host
    #: names (sidecar/shm; docs/operations.md, "Shared-memory Fetch"); false: always inline
    fetch_shared_memory: bool = True
    #: the shared pool (``store.cpu_shared``): how long a Fetch lease pins its chunks when its
    #: engine does not release it (at most half of ``store.io_timeout_s``, the longest an Evict
    #: or Delete waits for readers: ``lease_ttl_s``), how long a Store reservation stays open,
    #: and how many leases at once
    pool_lease_ttl_s: float = 2.0
    pool_reservation_ttl_s: float = 30.0
    pool_max_leases: int = 4096

    @property
    def lease_ttl_s(self) -> float:
        """The lease TTL in force: ``pool_lease_ttl_s``, within half of ``store.io_timeout_s``."""
        return min(self.pool_lease_ttl_s, self.store.io_timeout_s / 2)
    #: gRPC server processes sharing ``port`` (SO_REUSEPORT), each with its own event loop, local
    #: registry and tiers; more than one needs the shared registry and the remote tier, through
    #: which the workers find and Fetch each other's chunks (docs/operations.md, "Workers").
    workers: int = 1
    #: set by the supervisor on each worker process it starts (-1: not a worker)
    worker_index: int = -1

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} out of range")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port {self.metrics_port} out of range")
        if self.max_prompt_tokens <= 0:
            raise ValueError("max_prompt_tokens must be positive")
        if self.grace_period_s < 0:
            raise ValueError("grace_period_s must be >= 0")
        if self.max_fetch_bytes <= 0:
            raise ValueError("max_fetch_bytes must be positive")
        object.__setattr__(self, "default_policy", AdmissionPolicy(self.default_policy))
        if self.default_repair_scope not in {s.value for s in RepairScope}:
            raise ValueError(f"default_repair_scope must be one of {[s.value for s in RepairScope]}, "
                             f"got {self.default_repair_scope!r}")
        object.__setattr__(self, "default_repair_scope", RepairScope(self.default_repair_scope))
        if not 0 <= self.default_left_context_window <= self.registry.left_context_tokens:
            raise ValueError(
                f"default_left_context_window must be in [0, registry.left_context_tokens={self.registry.left_context_tokens}]"
            )
        if not 0 <= self.default_recompute_tokens <= self.chunker.max_size:
            raise ValueError(f"default_recompute_tokens must be in [0, chunker.max_size={self.chunker.max_size}]")
        if self.pool_lease_ttl_s <= 0:
            raise ValueError("pool_lease_ttl_s must be positive")
        if self.pool_reservation_ttl_s <= 0:
            raise ValueError("pool_reservation_ttl_s must be positive")
        if self.pool_max_leases < 1:
            raise ValueError("pool_max_leases must be >= 1")
        self.limits.check(store=self.store, forget_tenants=self.directives.forget_tenants)
        self._check_workers()

    def _check_workers(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if not -1 <= self.worker_index < self.workers:
            raise ValueError(f"worker_index must be in [-1, workers={self.workers}), got {self.worker_index}")
        if self.workers == 1:
            return
        if not self.shared_registry.enabled:
            raise ValueError(f"workers: {self.workers} workers need shared_registry.redis_url (each worker has its "
                             "own registry; they find each other's chunks through the shared registry)")
        if not (self.store.remote_url and self.store.remote_bytes > 0 and self.shared_registry.publish_payloads):
            raise ValueError(f"workers: {self.workers} workers need store.remote_url and store.remote_bytes > 0 with "
                             "shared_registry.publish_payloads (workers Fetch each other's KV from the remote tier)")

    @property
    def authenticated(self) -> bool:
        """Calls are authenticated: bearer tokens, or client certificates that name the tenant."""
        return self.auth.enabled or self.tls.authenticates

    @property
    def bind_host(self) -> str:
        """Where the gRPC port binds: loopback only unless authentication is configured."""
        if not self.authenticated and self.host not in LOOPBACK_HOSTS:
            return "127.0.0.1"
        return self.host


# ------------------------------------------------------------------------------- loading


def _coerce(tp: Any, value: Any) -> Any:
    """Convert a parsed YAML/JSON/env value to the annotated field type."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"expected a mapping for {tp.__name__}, got {value!r}")
        return build(tp, value)
    origin = get_origin(tp)
    if origin is tuple:
        args = get_args(tp)
        inner = args[0] if args else Any
        return tuple(_coerce(inner, v) for v in (value or ()))
    if origin in (dict, Mapping) or tp is Mapping:
        args = get_args(tp)
        inner = args[1] if len(args) == 2 else Any
        return {k: _coerce(inner, v) for k, v in dict(value or {}).items()}
    if tp is bool:
        if isinstance(value, str):
            return value.strip().lower() in ("1", "true", "yes", "on")
        return bool(value)
    if tp is int:
        return int(float(value)) if isinstance(value, str) else int(value)
    if tp is float:
        return float(value)
    if tp is str:
        return str(value)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return tp(value)
    if tp is Any:
        return value
    if get_origin(tp) is not None and type(None) in get_args(tp):  # Optional[X]
        inner = [a for a in get_args(tp) if a is not type(None)][0]
        return None if value is None else _coerce(inner, value)
    return value


def build(cls: type, values: Mapping[str, Any]) -> Any:
    """Instantiate dataclass ``cls`` from a nested mapping, rejecting unknown keys."""
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = set(values) - set(fields)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} setting(s): {sorted(unknown)}")
    kwargs = {}
    for k, v in values.items():
        try:
            kwargs[k] = _coerce(hints[k], v)
        except (TypeError, ValueError, OverflowError) as e:
            # Only ValueError leaves, naming the field (tests/fuzz: a null `chunker.mask_bits`
            # raised TypeError from int()).
            raise ValueError(f"{k}: {e}") from None
    try:
        return cls(**kwargs)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"{cls.__name__}: {e}") from None


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for i, p in enumerate(parts[:-1]):
        node = node.setdefault(p, {})
        if not isinstance(node, dict):  # e.g. {"chunker": 0, "chunker.min_size": 8}
            raise ValueError(f"{'.'.join(parts[:i + 1])}: expected a section (mapping), got {node!r}")
    node[parts[-1]] = value


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX) or key in NOT_SETTINGS:
            continue
        dotted = key[len(ENV_PREFIX) :].lower().replace("__", ".")
        _set_dotted(tree, dotted, yaml.safe_load(raw))
    return tree


def read_file(path: str | Path) -> dict[str, Any]:
    text = Path(path).read_text()
    data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(f"config file {path} must hold a mapping at the top level")
    return dict(data)


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> SidecarConfig:
    """Resolve the configuration with precedence defaults < file < env < ``overrides``.

    ``overrides`` maps dotted keys (``"registry.capacity_entries"``) to values (flags).
    """
    env = os.environ if env is None else env
    tree: dict[str, Any] = {}
    path = path or env.get(ENV_PREFIX + "CONFIG")
    if path:
        tree = _merge(tree, read_file(path))
    tree = _merge(tree, _env_overrides(env))
    flag_tree: dict[str, Any] = {}
    for dotted, value in (overrides or {}).items():
        _set_dotted(flag_tree, dotted, value)
    tree = _merge(tree, flag_tree)
    return build(SidecarConfig, tree)


def to_dict(config: SidecarConfig) -> dict[str, Any]:
    """Plain nested dict of the effective configuration (``kv-sidecar config``)."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v) if f.init}
        if isinstance(v, Enum):
            return v.value
        if isinstance(v, tuple):
            return [conv(x) for x in v]
        if isinstance(v, Mapping):
            return {k: conv(x) for k, x in v.items()}
        return v

    return conv(config)
