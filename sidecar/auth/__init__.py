"""Who may call the sidecar and how much: bearer tokens stored hashed (``tokens``), TLS and
mTLS with tenants taken from client certificates (``tls``), and per-tenant limits
(``limits``). ``sidecar.tenancy.Tenancy`` is the entry point the server uses; this package
holds the pieces it is built from and never imports the server or the client.
"""

from sidecar.auth.limits import LimitsConfig, TenantLimits, TenantLimiter
from sidecar.auth.tls import TenantSource, TlsConfig
from sidecar.auth.tokens import TokenTable, generate_token, hash_token

__all__ = [
    "LimitsConfig",
    "TenantLimiter",
    "TenantLimits",
    "TenantSource",
    "TlsConfig",
    "TokenTable",
    "generate_token",
    "hash_token",
]
