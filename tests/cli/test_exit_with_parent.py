"""A sidecar started by ``sidecar.process`` ends with its parent, however the parent ended: a
parent killed by SIGKILL (the OOM killer, a timeout) leaves no ``kv-sidecar serve`` behind
holding its port and memory. Real processes: a parent interpreter that spawns a real sidecar,
then is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from sidecar.process import ROOT, child_pids

PARENT = """
import sys, time
from sidecar.process import spawn_sidecar
proc, target = spawn_sidecar({flags})
print(proc.pid, target, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an orphan's zombie is reaped by init, not by us)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The ``pids`` still alive after waiting up to ``seconds`` for them to end (bounded wait)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(map(alive, pids)):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def spawned_by_a_killed_parent(*flags: str, workers: int = 0) -> list[int]:
    """Start a parent that spawns ``kv-sidecar serve`` (and its ``workers``), SIGKILL the parent;
    the sidecar's pids (its own first)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(flags=", ".join(map(repr, flags)))], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline().split()[0])
        deadline = time.monotonic() + 60
        while len(child_pids(pid)) < workers:
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.1)
        pids = [pid, *child_pids(pid)]
        assert alive(pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        return pids
    except BaseException:
        parent.kill()
        raise


def test_a_sidecar_ends_when_its_parent_is_killed():
    pids = spawned_by_a_killed_parent()
    left = gone_within(pids, 60)
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert left == [], "the sidecar outlived its killed parent"


def test_a_supervisor_and_its_workers_end_when_its_parent_is_killed(redis_url):
    pids = spawned_by_a_killed_parent("--set", "workers=2", "--set", f"shared_registry.redis_url={redis_url}",
                                      "--set", "shared_registry.key_prefix=exit-with-parent",
                                      "--set", f"store.remote_url={redis_url}", "--set", f"store.remote_bytes={16 << 20}",
                                      "--set", "store.namespace=exit-with-parent",
                                      "--set", "grace_period_s=0.5", workers=2)
    left = gone_within(pids, 60)
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert len(pids) == 3 and left == [], (pids, left)


def test_the_pipe_variable_is_no_setting():
    """The variable stays outside the settings' prefix: a sidecar that does not know it (an older
    checkout, a benchmark's baseline) would refuse it as an unknown setting and not start."""
    from sidecar.config import ENV_PREFIX, load_config
    from sidecar.process import PARENT_PIPE_ENV

    assert not PARENT_PIPE_ENV.startswith(ENV_PREFIX)
    load_config(None, env={PARENT_PIPE_ENV: "7"})  # ignored, not refused
    with pytest.raises(ValueError, match="parent_pipe"):
        load_config(None, env={ENV_PREFIX + "PARENT_PIPE": "7"})  # what the old name did
