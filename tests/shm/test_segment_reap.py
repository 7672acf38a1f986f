"""Client buffers of a killed process: the next pool on the host removes them (nobody holds their
lock), never a live process's buffer, never a just-created one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from sidecar.shm.segment import NAME_PATTERN, Segment, SegmentPool, reap

CHILD = """
import sys, time
from sidecar.shm.segment import Segment
s = Segment(1 << 20, sys.argv[1])
print(s.name, flush=True)
time.sleep(60)
"""


def names(d) -> set[str]:
    return {f for f in os.listdir(d) if NAME_PATTERN.fullmatch(f)}


def test_a_killed_processs_buffers_are_reaped_a_live_ones_never(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    dead = child.stdout.readline().strip()
    live = Segment(1 << 20, str(tmp_path))
    assert reap(str(tmp_path), older_than_s=0) == 0  # the child is alive: its lock holds
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert dead in names(tmp_path)  # nothing removed it: the process never got to
    assert reap(str(tmp_path)) == 0  # younger than a minute: kept (it may be being created)
    assert reap(str(tmp_path), older_than_s=0) == 1
    assert names(tmp_path) == {live.name}  # this process's buffer stays
    live.unlink()


def test_a_new_pool_reaps(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    dead = child.stdout.readline().strip()
    child.kill()
    child.wait()
    old = os.path.join(tmp_path, dead)
    os.utime(old, (0, 0))  # long ago
    SegmentPool(directory=str(tmp_path)).close()
    assert dead not in names(tmp_path)
