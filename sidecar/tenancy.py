"""Tenants from request headers (ARCHITECTURE.md, "Tenancy and security").

The tenant is the ``x-tenant-id`` header. With bearer tokens configured, a request must carry
``authorization: Bearer <token>`` and may only act as a tenant that token is mapped to
(missing/unknown token: UNAUTHENTICATED; tenant not allowed: PERMISSION_DENIED). Without auth
the header is taken as given (and the server listens on loopback only). The tenant id becomes
the scope of every chunk it stores; ``shared`` is reserved for the operator-granted scope.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from sidecar.config import AuthConfig
from sidecar.errors import InvalidArgument, PermissionDenied, Unauthenticated
from sidecar.identity import SHARED_SCOPE
from sidecar.wire import AUTH_HEADER, TENANT_HEADER

_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")


class Tenancy:
    def __init__(self, auth: AuthConfig, default_tenant: str) -> None:
        self._auth = auth
        self._default = default_tenant
        self._shared_writers = frozenset(auth.shared_writers)

    def resolve(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """Tenant for a request's invocation metadata; raises a typed error on refusal."""
        tenant = None
        token = None
        for key, value in metadata or ():
            if key == TENANT_HEADER:
                tenant = value if isinstance(value, str) else value.decode()
            elif key == AUTH_HEADER:
                token = value if isinstance(value, str) else value.decode()
        if self._auth.enabled:
            if not token or not token.startswith("Bearer "):
                raise Unauthenticated("authorization: a 'Bearer <token>' header is required")
            allowed = self._auth.tokens.get(token[len("Bearer ") :].strip())
            if allowed is None:
                raise Unauthenticated("authorization: unknown bearer token")
            if tenant is None:
                if len(allowed) != 1:
                    raise InvalidArgument(f"{TENANT_HEADER}: header required (token maps to {len(allowed)} tenants)")
                tenant = allowed[0]
            if tenant not in allowed:
                raise PermissionDenied(f"{TENANT_HEADER}: token may not act as tenant {tenant!r}")
        tenant = tenant or self._default
        if tenant == SHARED_SCOPE or not _TENANT_RE.match(tenant):
            raise InvalidArgument(f"{TENANT_HEADER}: invalid tenant id {tenant!r}")
        return tenant

    def may_write_shared(self, tenant: str) -> bool:
        return tenant in self._shared_writers

    def check_shared_write(self, tenant: str) -> None:
        if tenant not in self._shared_writers:
            raise PermissionDenied(f"shared: tenant {tenant!r} may not store into the shared scope")
