"""TLS and mTLS for the gRPC port, and tenants taken from client certificates.

``tls:`` in the configuration (docs/operations.md, "TLS and mTLS")::

    tls:
      cert_file: /etc/kv-sidecar/server.crt     # PEM chain; with key_file turns TLS on
      key_file: /etc/kv-sidecar/server.key
      client_ca_file: /etc/kv-sidecar/clients-ca.crt   # verify client certificates (mTLS)
      require_client_cert: true                  # refuse clients without a certificate
      tenant_from_cert: cn                       # cn | san_uri | san_dns: the tenant is the cert's
      tenant_uri_prefix: "spiffe://corp/tenant/" # san_uri only: strip this prefix (others ignored)

With ``tenant_from_cert`` the client certificate *is* the authentication: the tenant is read
from the verified certificate (``grpc.aio.ServicerContext.auth_context()``), bearer tokens are
not consulted, and an ``x-tenant-id`` header naming another tenant is PERMISSION_DENIED.

``allow_insecure``: with authentication configured and a non-loopback ``host`` the server
refuses to start without TLS (bearer tokens would cross the network in clear) unless this is
set; it then logs a warning at startup. Files are read when the server starts, not when the
configuration is loaded (``kv-sidecar config`` works on a machine without the keys).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import grpc


class TenantSource(str, Enum):
    """Where ``tenant_from_cert`` reads the tenant in a verified client certificate."""

    NONE = ""
    CN = "cn"  # subject common name
    SAN_URI = "san_uri"  # a URI subject alternative name (SPIFFE ids), minus tenant_uri_prefix
    SAN_DNS = "san_dns"  # a DNS subject alternative name

    @property
    def auth_property(self) -> str:
        """The gRPC auth-context property holding this value (gRPC core's names)."""
        return _PROPERTIES[self]


_PROPERTIES = {
    TenantSource.NONE: "",
    TenantSource.CN: "x509_common_name",
    TenantSource.SAN_URI: "peer_uri",
    TenantSource.SAN_DNS: "peer_dns",
}


@dataclass(frozen=True, kw_only=True)
class TlsConfig:
    """The gRPC port's transport security (see the module docstring)."""

    cert_file: str | None = None
    key_file: str | None = None
    client_ca_file: str | None = None
    require_client_cert: bool = False
    tenant_from_cert: TenantSource = TenantSource.NONE
    tenant_uri_prefix: str = ""
    allow_insecure: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenant_from_cert", TenantSource(self.tenant_from_cert or ""))
        for name in ("cert_file", "key_file", "client_ca_file"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"tls.{name} must be a path string, got {value!r}")
            if value == "":
                object.__setattr__(self, name, None)
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("tls.cert_file and tls.key_file must be set together")
        if self.client_ca_file and not self.cert_file:
            raise ValueError("tls.client_ca_file needs tls.cert_file and tls.key_file (mTLS runs over TLS)")
        if self.require_client_cert and not self.client_ca_file:
            raise ValueError("tls.require_client_cert needs tls.client_ca_file (the CA that signs client certificates)")
        if self.tenant_from_cert is not TenantSource.NONE and not self.require_client_cert:
            raise ValueError(
                f"tls.tenant_from_cert: {self.tenant_from_cert.value!r} needs tls.require_client_cert: true "
                "(every call must then present a verified certificate)"
            )
        if self.tenant_uri_prefix and self.tenant_from_cert is not TenantSource.SAN_URI:
            raise ValueError("tls.tenant_uri_prefix applies to tls.tenant_from_cert: san_uri only")

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    @property
    def authenticates(self) -> bool:
        """Client certificates name the tenant: a form of authentication."""
        return self.tenant_from_cert is not TenantSource.NONE


def _read(path: str, field: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"tls.{field}: cannot read {path!r}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"tls.{field}: {path!r} is not a PEM file")
    return data


def server_credentials(config: TlsConfig) -> grpc.ServerCredentials:
    """``grpc.ssl_server_credentials`` for ``config`` (which must be ``enabled``)."""
    if not config.enabled:
        raise ValueError("tls: cert_file and key_file are required for TLS")
    pair = (_read(config.key_file, "key_file"), _read(config.cert_file, "cert_file"))
    roots = _read(config.client_ca_file, "client_ca_file") if config.client_ca_file else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=roots, require_client_auth=config.require_client_cert
    )


def channel_credentials(
    root_ca: str | bytes | None = None, client_cert: str | bytes | None = None, client_key: str | bytes | None = None
) -> grpc.ChannelCredentials:
    """``grpc.ssl_channel_credentials`` from PEM bytes or file paths. ``root_ca`` None uses
    the system roots; ``client_cert`` and ``client_key`` go together (mTLS)."""
    if (client_cert is None) != (client_key is None):
        raise ValueError("tls: client_cert and client_key must be given together")

    def load(value: str | bytes | None, field: str) -> bytes | None:
        if value is None or isinstance(value, bytes):
            return value
        try:
            return Path(value).read_bytes()
        except OSError as exc:
            raise ValueError(f"{field}: cannot read {value!r}: {exc.strerror or exc}") from None

    return grpc.ssl_channel_credentials(
        load(root_ca, "root_ca"), load(client_key, "client_key"), load(client_cert, "client_cert")
    )


def cert_tenant(auth_context: Mapping[str, Sequence[bytes]], source: TenantSource, uri_prefix: str = "") -> list[str]:
    """The tenant names a verified peer certificate carries under ``source`` (usually one).

    ``auth_context`` is ``ServicerContext.auth_context()``: gRPC fills it only from a
    certificate that chained to ``client_ca_file``."""
    values = [v.decode() if isinstance(v, bytes) else str(v) for v in auth_context.get(source.auth_property, ())]
    if source is TenantSource.SAN_URI and uri_prefix:
        values = [v[len(uri_prefix) :] for v in values if v.startswith(uri_prefix) and len(v) > len(uri_prefix)]
    return list(dict.fromkeys(values))
