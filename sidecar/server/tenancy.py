"""Tenants from request headers and client certificates (docs/security.md).

The tenant of a call comes from one of, in this order:

1. a verified client certificate, when ``tls.tenant_from_cert`` is set (mTLS): the tenant is
   the certificate's CN / SAN; an ``x-tenant-id`` header naming anyone else is
   PERMISSION_DENIED; bearer tokens are not consulted;
2. bearer tokens, when ``auth.tokens`` is set: a request must carry ``authorization: Bearer
   <token>`` (missing/unknown: UNAUTHENTICATED) and may act only as a tenant its token maps
   to (``x-tenant-id``; PERMISSION_DENIED otherwise; optional when the token maps to one
   tenant). Entries are stored as ``sha256:<hex>`` digests or plaintext
   (``sidecar.auth.tokens``);
3. otherwise the ``x-tenant-id`` header as given (the server then listens on loopback only),
   or ``default_tenant``.

The tenant id becomes the scope of every chunk it stores, set server-side: no request field
can name another scope. ``shared`` is reserved for the operator-granted scope.

``resolve`` takes the call's ``ServicerContext`` (it reads the invocation metadata and, for
mTLS, the peer's auth context). Passing bare metadata still works for header and token
tenancy; with ``tenant_from_cert`` configured it is refused (INTERNAL), so a handler that
forgets the context cannot bypass the certificate. Cost: one pass over the metadata and, with
tokens, one SHA-256 and one dict probe.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from sidecar.api.kv import AUTH_HEADER, TENANT_HEADER
from sidecar.auth.tls import TenantSource, TlsConfig, cert_tenant
from sidecar.auth.tokens import TokenTable
from sidecar.config import AuthConfig
from sidecar.errors import Internal, InvalidArgument, PermissionDenied, Unauthenticated
from sidecar.identity import SHARED_SCOPE

logger = logging.getLogger(__name__)

_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")
_BEARER = "Bearer "

Metadata = Iterable[tuple[str, str | bytes]]


class Tenancy:
    def __init__(self, auth: AuthConfig, default_tenant: str, tls: TlsConfig | None = None) -> None:
        self._auth = auth
        self._tokens = TokenTable(auth.tokens) if auth.tokens else None
        self._default = default_tenant
        self._shared_writers = frozenset(auth.shared_writers)
        tls = tls or TlsConfig()
        self._cert_source = tls.tenant_from_cert
        self._uri_prefix = tls.tenant_uri_prefix

    @property
    def authenticated(self) -> bool:
        """Calls are authenticated (bearer tokens or tenant-naming client certificates)."""
        return self._tokens is not None or self._cert_source is not TenantSource.NONE

    def startup_warnings(self) -> list[str]:
        """What the server should log when it starts (plaintext token entries)."""
        out = []
        if self._tokens is not None and self._tokens.plaintext_entries:
            out.append(
                f"auth.tokens holds {self._tokens.plaintext_entries} plaintext token(s): store "
                "sha256:<hex> digests instead (`kv-sidecar auth hash-token`), so the config file is no credential"
            )
        return out

    def resolve(self, call: object) -> str:
        """Tenant of a call (a ``grpc.aio.ServicerContext``, or its invocation metadata);
        raises a typed error on refusal and changes nothing."""
        invocation_metadata = getattr(call, "invocation_metadata", None)
        metadata: Metadata | None = invocation_metadata() if invocation_metadata is not None else call  # type: ignore[assignment]
        tenant = None
        token = None
        for key, value in metadata or ():
            if key == TENANT_HEADER:
                tenant = value if isinstance(value, str) else value.decode()
            elif key == AUTH_HEADER:
                token = value if isinstance(value, str) else value.decode()
        if self._cert_source is not TenantSource.NONE:
            if invocation_metadata is None:
                raise Internal("tenancy: resolve() needs the call context when tls.tenant_from_cert is set (a servicer bug)")
            tenant = self._from_cert(call, tenant)
        elif self._tokens is not None:
            if not token or not token.startswith(_BEARER):
                raise Unauthenticated("authorization: a 'Bearer <token>' header is required")
            allowed = self._tokens.allowed(token[len(_BEARER) :].strip())
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

    def _from_cert(self, context: object, header: str | None) -> str:
        auth_context = context.auth_context() if hasattr(context, "auth_context") else {}
        names = cert_tenant(auth_context, self._cert_source, self._uri_prefix)
        what = f"client certificate ({self._cert_source.value})"
        if not names:
            raise Unauthenticated(f"tls.tenant_from_cert: the {what} names no tenant")
        if len(names) > 1:
            raise PermissionDenied(f"tls.tenant_from_cert: the {what} names {len(names)} tenants; it must name one")
        tenant = names[0]
        if tenant == SHARED_SCOPE or not _TENANT_RE.match(tenant):
            raise PermissionDenied(f"tls.tenant_from_cert: the {what} names an invalid tenant id {tenant!r}")
        if header is not None and header != tenant:
            raise PermissionDenied(f"{TENANT_HEADER}: the client certificate may not act as tenant {header!r}")
        return tenant

    def may_write_shared(self, tenant: str) -> bool:
        return tenant in self._shared_writers

    def check_shared_write(self, tenant: str) -> None:
        if tenant not in self._shared_writers:
            raise PermissionDenied(f"shared: tenant {tenant!r} may not store into the shared scope")
