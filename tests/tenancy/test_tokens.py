"""Bearer tokens stored hashed: real sidecar over loopback gRPC."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
import yaml

from sidecar.app import create_server
from sidecar.auth.tokens import TokenTable, hash_token
from sidecar.client import SidecarClient
from sidecar.config import AuthConfig, load_config
from sidecar.errors import PermissionDenied, Unauthenticated
from tests.conftest import make_config

TOKEN_A = "tok-a-0123456789abcdefghijklmnop"
TOKEN_AB = "tok-ab-0123456789abcdefghijklmno"


@pytest.fixture
async def hashed():
    cfg = make_config(auth=AuthConfig(tokens={hash_token(TOKEN_A): ["team-a"], hash_token(TOKEN_AB): ["team-a", "team-b"]}))
    server, port = await create_server(cfg)
    yield server, f"127.0.0.1:{port}"
    await server.stop(0.1)


async def test_hashed_token_accepted_wrong_token_and_spoofed_tenant_refused(hashed, identity):
    _, target = hashed
    tokens = np.arange(1000, 1300, dtype=np.uint32)
    async with SidecarClient(target, token=TOKEN_A) as a:
        assert (await a.store(tokens, identity=identity)).chunks_registered > 0
        assert (await a.lookup(tokens, identity=identity, dry_run=True)).summary.chunks_hit > 0
    async with SidecarClient(target, token=TOKEN_A + "x", tenant="team-a") as wrong:
        with pytest.raises(Unauthenticated, match="unknown bearer token"):
            await wrong.lookup(tokens, identity=identity)
    # The hash itself is not a credential.
    async with SidecarClient(target, token=hash_token(TOKEN_A), tenant="team-a") as digest:
        with pytest.raises(Unauthenticated, match="unknown bearer token"):
            await digest.lookup(tokens, identity=identity)
    async with SidecarClient(target, tenant="team-a") as spoof:
        with pytest.raises(Unauthenticated, match="Bearer"):
            await spoof.lookup(tokens, identity=identity)
        with pytest.raises(Unauthenticated):
            await spoof.stats()
    async with SidecarClient(target, token=TOKEN_A, tenant="team-b") as other:
        with pytest.raises(PermissionDenied, match="team-b"):
            await other.lookup(tokens, identity=identity)
    async with SidecarClient(target, token=TOKEN_AB, tenant="team-b") as b:
        plan = await b.lookup(tokens, identity=identity, dry_run=True)
        assert plan.summary.chunks_hit == 0  # team-a's chunks stay team-a's


def test_token_table_and_entry_validation():
    table = TokenTable({hash_token(TOKEN_A): ("a",), TOKEN_AB: ("b",)})
    assert table.allowed(TOKEN_A) == ("a",) and table.allowed(TOKEN_AB) == ("b",)
    assert table.allowed("nope") is None and table.plaintext_entries == 1
    with pytest.raises(ValueError, match="auth.tokens.*sha256:<64 hex digits>"):
        AuthConfig(tokens={"sha256:abcd": ["a"]})
    with pytest.raises(ValueError, match="non-hex"):
        AuthConfig(tokens={"sha256:" + "zz" * 32: ["a"]})
    with pytest.raises(ValueError, match="non-empty list of tenant"):
        AuthConfig(tokens={hash_token(TOKEN_A): []})
    with pytest.raises(ValueError, match="already names"):
        TokenTable({hash_token(TOKEN_A): ("a",), TOKEN_A: ("b",)})


async def test_plaintext_entries_warn_at_startup(caplog, identity):
    with caplog.at_level(logging.WARNING, logger="sidecar.server"):
        server, port = await create_server(make_config(auth=AuthConfig(tokens={TOKEN_A: ["team-a"]})))
    try:
        assert any("plaintext token" in r.getMessage() for r in caplog.records)
        async with SidecarClient(f"127.0.0.1:{port}", token=TOKEN_A) as c:  # still accepted
            await c.lookup(np.arange(10, 20, dtype=np.uint32), identity=identity)
    finally:
        await server.stop(0.1)


async def test_hash_token_cli_round_trips_into_a_working_config(monkeypatch, capsys, tmp_path, identity):
    from sidecar.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO(TOKEN_A + "\n"))
    assert main(["auth", "hash-token", "--tenant", "team-a"]) == 0
    line = capsys.readouterr().out
    assert TOKEN_A not in line
    assert main(["auth", "hash-token", "--generate", "--tenant", "team-g", "--tenant", "team-h"]) == 0
    out = capsys.readouterr()
    generated = out.err.rsplit(":", 1)[1].strip()
    assert generated not in out.out and len(generated) >= 43
    monkeypatch.setattr("sys.stdin", io.StringIO("short\n"))
    assert main(["auth", "hash-token", "--tenant", "x"]) == 2
    assert "at least 16 characters" in capsys.readouterr().err

    path = tmp_path / "sidecar.yaml"
    entries = "\n".join("    " + ln for ln in (line + out.out).splitlines())
    path.write_text(f"auth:\n  tokens:\n{entries}\n")
    cfg = load_config(path, env={}, overrides={"port": 0, "metrics_port": -1})
    assert all(k.startswith("sha256:") for k in cfg.auth.tokens)
    assert yaml.safe_load(path.read_text())["auth"]["tokens"][hash_token(generated)] == ["team-g", "team-h"]
    server, port = await create_server(cfg)
    try:
        async with SidecarClient(f"127.0.0.1:{port}", token=TOKEN_A) as a, \
                SidecarClient(f"127.0.0.1:{port}", token=generated, tenant="team-h") as g:
            await a.lookup(np.arange(10, 20, dtype=np.uint32), identity=identity)
            await g.lookup(np.arange(10, 20, dtype=np.uint32), identity=identity)
        async with SidecarClient(f"127.0.0.1:{port}", token=generated, tenant="team-a") as g:
            with pytest.raises(PermissionDenied):
                await g.lookup(np.arange(10, 20, dtype=np.uint32), identity=identity)
    finally:
        await server.stop(0.1)
