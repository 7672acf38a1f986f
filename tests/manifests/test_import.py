"""ImportManifest over real gRPC and the CLI: outcomes, malformed lines, tenancy, the metric."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sidecar import cli
from sidecar.app import ServerThread, create_server
from sidecar.client import SidecarClient, SyncSidecarClient
from sidecar.config import AuthConfig
from sidecar.errors import PermissionDenied
from sidecar.manifests.config import ManifestsConfig
from tests.conftest import make_config, message

OPERATOR = "operator"


def _config(tmp_path: Path | None = None, **kw):
    manifests = ManifestsConfig(path=str(tmp_path / "manifest.jsonl")) if tmp_path is not None else ManifestsConfig()
    return make_config(manifests=manifests, auth=AuthConfig(shared_writers=(OPERATOR,)), **kw)


async def _produce(tmp_path: Path, identity, rng, tenant: str = "tenant-a", n_prompts: int = 3) -> tuple[bytes, int]:
    """A manifest from a sidecar that registered ``n_prompts`` prompts for ``tenant``."""
    server, port = await create_server(_config(tmp_path))
    try:
        async with SidecarClient(f"127.0.0.1:{port}", tenant=tenant) as c:
            total = 0
            for _ in range(n_prompts):
                r = await c.store(np.concatenate([message(rng, 200), message(rng, 150, anchor=100_001)]), identity=identity)
                total += r.chunks_registered
        server.manifests.producer.flush()
    finally:
        await server.stop(0.1)
    return (tmp_path / "manifest.jsonl").read_bytes(), total


def _metric(server, outcome: str) -> float:
    return server.metrics.registry.get_sample_value("kv_sidecar_manifest_entries_total", {"outcome": outcome}) or 0.0


async def test_import_rpc_outcomes_and_malformed_lines(tmp_path: Path, identity, rng) -> None:
    lines, n = await _produce(tmp_path, identity, rng)
    first = json.loads(lines.splitlines()[0])
    forged = dict(first, tokens=[1, 2, 3])  # content_hash no longer matches the tokens
    bad = b"not json\n" + json.dumps(forged).encode() + b"\n" + b'{"scope": "tenant-a"}\n'
    server, port = await create_server(_config())
    try:
        async with SidecarClient(f"127.0.0.1:{port}", tenant="tenant-a") as c:
            r = await c.import_manifest(lines + bad)
            assert (r.lines, r.planned, r.prefetched, r.present, r.malformed, r.refused) == (n + 3, n, 0, 0, 3, 0)
            assert r.warmup_pending == n
            plan = await c.warm_up_plan(identity)
            # one sequence per prompt (its chunks chain by prefix digest), the original tokens
            assert len(plan) == 3 and sum(len(q) for q in plan) == 3 * (201 + 151)
            again = await c.import_manifest(lines)  # idempotent: same keys, still planned
            assert (again.planned, again.malformed, again.warmup_pending) == (n, 0, n)
            other = CacheIdentityLike(identity)
            assert await c.warm_up_plan(other) == []  # another identity plans nothing
        assert _metric(server, "malformed") == 3
        assert _metric(server, "planned") == 2 * n
    finally:
        await server.stop(0.1)


def CacheIdentityLike(identity):
    from dataclasses import replace

    return replace(identity, namespace="elsewhere")


async def test_private_entries_never_cross_tenants(tmp_path: Path, identity, rng) -> None:
    lines, n = await _produce(tmp_path, identity, rng, tenant="tenant-a")
    server, port = await create_server(_config())
    try:
        target = f"127.0.0.1:{port}"
        async with SidecarClient(target, tenant="tenant-b") as b, SidecarClient(target, tenant="tenant-a") as a:
            r = await b.import_manifest(lines)
            assert (r.refused, r.planned, r.warmup_pending) == (n, 0, 0)
            assert await b.warm_up_plan(identity) == []
            assert await a.warm_up_plan(identity) == []  # b's attempt planned nothing for a either
            with pytest.raises(PermissionDenied, match="shared"):
                await a.import_manifest(lines, shared=True)
            with pytest.raises(PermissionDenied, match="shared"):
                await a.warm_up_plan(identity, shared=True)
            assert server.manifests.plan.pending_in_scope("shared") == 0
            # tenant-a imports its own entries: they enter its scope only
            r = await a.import_manifest(lines)
            assert (r.planned, r.refused) == (n, 0)
            assert await b.warm_up_plan(identity) == []
            assert len(await a.warm_up_plan(identity)) == 3
        assert _metric(server, "refused") == n
    finally:
        await server.stop(0.1)


async def test_shared_import_needs_the_operator(tmp_path: Path, identity, rng) -> None:
    lines, n = await _produce(tmp_path, identity, rng, tenant=OPERATOR)
    server, port = await create_server(_config())
    try:
        target = f"127.0.0.1:{port}"
        async with SidecarClient(target, tenant=OPERATOR) as op, SidecarClient(target, tenant="tenant-b") as b:
            r = await op.import_manifest(lines, shared=True)
            assert (r.planned, r.refused, r.warmup_pending) == (n, 0, n)
            assert len(await op.warm_up_plan(identity, shared=True)) == 3
            assert await op.warm_up_plan(identity) == []  # nothing went into the operator's own scope
            # the shared manifest re-exported scoped "shared" is refused to a non-operator
            shared_lines = await op.export_manifest(identity, include_shared=True)
            assert shared_lines == b""  # exported from the registry: nothing RESIDENT or registered yet
            r = await b.import_manifest(lines)
            assert r.refused == n
    finally:
        await server.stop(0.1)


def test_cli_import_inspect_export(tmp_path: Path, identity, rng, capsys) -> None:
    import asyncio

    lines, n = asyncio.run(_produce(tmp_path, identity, rng))
    path = tmp_path / "m.jsonl"
    path.write_bytes(lines + b"garbage\n")
    assert cli.main(["manifest", "inspect", str(path), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert (s["entries"], s["malformed"], s["scopes"], s["identities"]) == (
        n, 1, {"tenant-a": n}, {identity.fingerprint: n}
    )
    assert s["tokens"] == 3 * (201 + 151)
    merged = tmp_path / "merged.jsonl"
    assert cli.main(["manifest", "export", "--from", str(path), str(path), "-o", str(merged)]) == 0
    assert len(merged.read_bytes().splitlines()) == n
    with ServerThread(_config()) as st:
        assert cli.main(["manifest", "import", str(path), "--target", st.target, "--tenant", "tenant-a",
                         "--batch", "4", "--quiet"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert (out["lines"], out["planned"], out["malformed"], out["refused"]) == (n + 1, n, 1, 0)
        assert cli.main(["manifest", "import", str(path), "--target", st.target, "--tenant", "tenant-b",
                         "--shared", "--quiet"]) == 1
        assert "PERMISSION_DENIED" in capsys.readouterr().err
        with SyncSidecarClient(st.target, tenant="tenant-a") as c:
            assert len(c.warm_up_plan(identity)) == 3
