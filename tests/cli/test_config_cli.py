"""Configuration precedence, the CLI, graceful shutdown on SIGTERM, generated stubs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from sidecar.config import load_config
from sidecar.registry.lookup_plan import RepairScope
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc

KV = [sys.executable, "-m", "sidecar.cli"]


def test_precedence_defaults_file_env_flags(tmp_path):
    cfg_file = tmp_path / "sidecar.yaml"
    cfg_file.write_text("port: 1111\nmetrics_port: 2222\nregistry:\n  capacity_entries: 10\n  capacity_bytes: 5000\n")
    assert load_config(env={}).port == 50051  # default
    c = load_config(cfg_file, env={})
    assert (c.port, c.metrics_port, c.registry.capacity_entries) == (1111, 2222, 10)
    env = {"KV_SIDECAR_PORT": "3333", "KV_SIDECAR_REGISTRY__CAPACITY_ENTRIES": "20"}
    c = load_config(cfg_file, env=env)
    assert (c.port, c.metrics_port, c.registry.capacity_entries, c.registry.capacity_bytes) == (3333, 2222, 20, 5000)
    c = load_config(cfg_file, env=env, overrides={"port": 4444, "chunker.anchor_tokens": [9, 3]})
    assert (c.port, c.registry.capacity_entries, c.chunker.anchor_tokens) == (4444, 20, (3, 9))
    # Variables under the prefix that are not settings are ignored.
    assert load_config(env={"KV_SIDECAR_MODEL_CACHE": "/tmp/x", "KV_SIDECAR_VENV": "/tmp/v"}).port == 50051
    # The file may also come from the environment.
    assert load_config(env={"KV_SIDECAR_CONFIG": str(cfg_file)}).port == 1111


def test_bad_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown SidecarConfig"):
        load_config(env={"KV_SIDECAR_NOPE": "1"})
    with pytest.raises(ValueError, match="registry.capacity_entries"):
        load_config(env={}, overrides={"registry.capacity_entries": 0})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(bad, env={})


def run_cli(*args, env=None):
    return subprocess.run([*KV, *args], capture_output=True, text=True, timeout=60, env=env)


def test_cli_version_help_config():
    from sidecar import __version__

    out = run_cli("version")
    assert out.returncode == 0 and out.stdout.strip() == f"kv-sidecar {__version__}"
    out = run_cli("--help")
    assert out.returncode == 0 and "serve" in out.stdout and "precedence" in out.stdout
    out = run_cli("config", "--port", "7", "--set", "registry.capacity_entries=99")
    assert out.returncode == 0 and "port: 7" in out.stdout and "capacity_entries: 99" in out.stdout
    out = run_cli("config", "--set", "nonsense")
    assert out.returncode != 0 and "KEY=VALUE" in out.stderr
    out = run_cli("config", "--set", "registry.bogus=1")
    assert out.returncode == 2 and "bogus" in out.stderr


def test_default_guards_are_validated():
    c = load_config(env={}, overrides={"default_recompute_tokens": 0, "default_left_context_window": 32})
    assert (c.default_recompute_tokens, c.default_left_context_window) == (0, 32)
    with pytest.raises(ValueError, match="default_recompute_tokens"):
        load_config(env={}, overrides={"default_recompute_tokens": 10_000})
    with pytest.raises(ValueError, match="default_left_context_window"):
        load_config(env={}, overrides={"default_left_context_window": -1})
    assert load_config(env={}, overrides={}).default_repair_scope is RepairScope.CHUNK
    assert load_config(env={}, overrides={"default_repair_scope": "segment"}).default_repair_scope is RepairScope.SEGMENT
    with pytest.raises(ValueError, match="default_repair_scope"):
        load_config(env={}, overrides={"default_repair_scope": "block"})


def test_cli_anchors_of_the_real_models_tokenizer():
    out = run_cli("anchors", "smollm2")
    assert out.returncode == 0, out.stderr
    assert "<|im_start|>" in out.stdout and "--set chunker.anchor_tokens=[1]" in out.stdout
    out = run_cli("anchors", "no-such-model")
    assert out.returncode == 2 and "no-such-model" in out.stderr and "registered name" in out.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_and_graceful_shutdown(sig):
    env = dict(os.environ, KV_SIDECAR_GRACE_PERIOD_S="0.5")
    proc = subprocess.Popen(
        [*KV, "serve", "--port", "0", "--metrics-port", "-1"], stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        port = None
        deadline = time.time() + 60
        lines = []
        while port is None and time.time() < deadline:
            line = proc.stderr.readline()
            lines.append(line)
            m = re.search(r"serving sidecar.v1.KVSidecar on 127.0.0.1:(\d+)", line)
            if m:
                port = int(m.group(1))
        assert port, "".join(lines)
        assert any("loopback only" in ln for ln in lines)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            pb_grpc.KVSidecarStub(ch).Ping(pb.PingRequest(), timeout=10)
        proc.send_signal(sig)
        rest = proc.stderr.read()
        assert proc.wait(timeout=30) == 0, rest[-4000:]
        assert "draining" in rest and "stopped" in rest
    finally:
        if proc.poll() is None:
            proc.kill()


def test_generated_stubs_are_current():
    from sidecar.v1.generate import stale_files

    assert stale_files() == [], "run: python -m sidecar.v1.generate"
    assert (Path(__file__).parents[2] / "proto/sidecar/v1/sidecar.proto").exists()
