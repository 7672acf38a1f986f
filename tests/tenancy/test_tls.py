"""TLS and mTLS on the gRPC port, tenants from client certificates (real sidecar, loopback)."""

from __future__ import annotations

import numpy as np
import pytest

from sidecar.app import ServerThread, create_server
from sidecar.auth.tls import TlsConfig
from sidecar.auth.tokens import hash_token
from sidecar.client import SidecarClient, SyncSidecarClient
from sidecar.config import AuthConfig
from sidecar.errors import PermissionDenied, SidecarError, Unavailable
from tests.conftest import make_config
from tests.tenancy.certs import CA

TOKEN = "tls-token-0123456789abcdefghij"
TOKENS = np.arange(5000, 5300, dtype=np.uint32)
NO_RETRY = dict(timeout_s=5.0)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = CA(d)
    other = CA(d, name="other CA")
    return {
        "ca": ca,
        "server": ca.server(),
        "team-a": ca.issue("client-a", cn="team-a", uris=("spiffe://corp/tenant/team-a",), client=True),
        "team-b": ca.issue("client-b", cn="team-b", uris=("spiffe://corp/tenant/team-b",), client=True),
        "rogue": other.issue("rogue", cn="team-a", client=True),  # right CN, wrong CA
        "other_ca": other,
    }


async def serve(pki, **tls):
    srv = pki["server"]
    cfg = make_config(tls=TlsConfig(cert_file=str(srv.cert), key_file=str(srv.key), **tls),
                      auth=AuthConfig(tokens={hash_token(TOKEN): ["team-a"]}))
    server, port = await create_server(cfg)
    return server, f"127.0.0.1:{port}"


async def test_tls_client_with_the_ca_works_without_it_fails(pki, identity):
    server, target = await serve(pki)
    try:
        async with SidecarClient(target, token=TOKEN, root_ca=str(pki["ca"].cert_file), **NO_RETRY) as c:
            assert (await c.store(TOKENS, identity=identity)).chunks_registered > 0
        async with SidecarClient(target, token=TOKEN, root_ca=pki["other_ca"].cert_file.read_bytes(),
                                 **NO_RETRY) as wrong_ca:
            with pytest.raises(Unavailable):
                await wrong_ca.lookup(TOKENS, identity=identity)
        async with SidecarClient(target, token=TOKEN, **NO_RETRY) as plaintext:
            with pytest.raises(SidecarError):
                await plaintext.lookup(TOKENS, identity=identity)
    finally:
        await server.stop(0.1)


def test_sync_client_over_tls(pki, identity):
    srv = pki["server"]
    cfg = make_config(tls=TlsConfig(cert_file=str(srv.cert), key_file=str(srv.key)),
                      auth=AuthConfig(tokens={hash_token(TOKEN): ["team-a"]}))
    with ServerThread(cfg) as st, SyncSidecarClient(st.target, token=TOKEN, root_ca=str(pki["ca"].cert_file)) as c:
        assert c.lookup(TOKENS, identity=identity).summary.total_tokens == len(TOKENS)


async def test_mtls_tenant_from_cert_cn(pki, identity):
    server, target = await serve(pki, client_ca_file=str(pki["ca"].cert_file), require_client_cert=True,
                                 tenant_from_cert="cn")
    ca = str(pki["ca"].cert_file)
    a_cert, b_cert = pki["team-a"], pki["team-b"]
    try:
        async with SidecarClient(target, root_ca=ca, client_cert=str(a_cert.cert), client_key=str(a_cert.key)) as a:
            await a.store(TOKENS, identity=identity)  # no token, no header: the certificate says team-a
            assert (await a.lookup(TOKENS, identity=identity, dry_run=True)).summary.chunks_hit > 0
        async with SidecarClient(target, root_ca=ca, client_cert=b_cert.cert.read_bytes(),
                                 client_key=b_cert.key.read_bytes()) as b:
            assert (await b.lookup(TOKENS, identity=identity, dry_run=True)).summary.chunks_hit == 0
        # A header naming another tenant is refused, even with a token valid for that tenant.
        async with SidecarClient(target, root_ca=ca, client_cert=str(b_cert.cert), client_key=str(b_cert.key),
                                 tenant="team-a", token=TOKEN) as spoof:
            with pytest.raises(PermissionDenied, match="may not act as tenant 'team-a'"):
                await spoof.lookup(TOKENS, identity=identity, dry_run=True)
        async with SidecarClient(target, root_ca=ca, token=TOKEN, tenant="team-a", **NO_RETRY) as no_cert:
            with pytest.raises(SidecarError):
                await no_cert.lookup(TOKENS, identity=identity)
        rogue = pki["rogue"]
        async with SidecarClient(target, root_ca=ca, client_cert=str(rogue.cert), client_key=str(rogue.key),
                                 **NO_RETRY) as r:
            with pytest.raises(SidecarError):
                await r.lookup(TOKENS, identity=identity)
    finally:
        await server.stop(0.1)


async def test_mtls_tenant_from_san_uri_with_prefix(pki, identity):
    server, target = await serve(pki, client_ca_file=str(pki["ca"].cert_file), require_client_cert=True,
                                 tenant_from_cert="san_uri", tenant_uri_prefix="spiffe://corp/tenant/")
    ca = str(pki["ca"].cert_file)
    a_cert = pki["team-a"]
    try:
        async with SidecarClient(target, root_ca=ca, client_cert=str(a_cert.cert), client_key=str(a_cert.key),
                                 tenant="team-a") as a:
            await a.store(TOKENS, identity=identity)
            assert (await a.lookup(TOKENS, identity=identity, dry_run=True)).summary.chunks_hit > 0
        async with SidecarClient(target, root_ca=ca, client_cert=str(a_cert.cert), client_key=str(a_cert.key),
                                 tenant="team-b") as spoof:
            with pytest.raises(PermissionDenied, match="x-tenant-id"):
                await spoof.stats()
    finally:
        await server.stop(0.1)


async def test_non_loopback_without_tls_refused_unless_allow_insecure(caplog):
    auth = AuthConfig(tokens={hash_token(TOKEN): ["team-a"]})
    with pytest.raises(ValueError, match="tls.allow_insecure"):
        await create_server(make_config(host="0.0.0.0", auth=auth))
    server, _ = await create_server(make_config(host="0.0.0.0", auth=auth, tls=TlsConfig(allow_insecure=True)))
    try:
        assert any("INSECURE" in r.getMessage() for r in caplog.records)
    finally:
        await server.stop(0.1)


@pytest.mark.parametrize(("kw", "match"), [
    (dict(cert_file="a.crt"), "tls.cert_file and tls.key_file"),
    (dict(client_ca_file="ca.crt"), "tls.client_ca_file needs"),
    (dict(cert_file="a", key_file="b", require_client_cert=True), "tls.require_client_cert needs"),
    (dict(cert_file="a", key_file="b", client_ca_file="c", tenant_from_cert="cn"), "tls.tenant_from_cert"),
    (dict(tenant_from_cert="serial"), "serial"),
    (dict(cert_file="a", key_file="b", client_ca_file="c", require_client_cert=True, tenant_from_cert="cn",
          tenant_uri_prefix="x"), "tls.tenant_uri_prefix"),
])
def test_bad_tls_config_names_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        TlsConfig(**kw)


async def test_unreadable_cert_file_named_at_start(tmp_path):
    cfg = make_config(tls=TlsConfig(cert_file=str(tmp_path / "missing.crt"), key_file=str(tmp_path / "k")))
    with pytest.raises(ValueError, match="tls.key_file: cannot read"):
        await create_server(cfg)
