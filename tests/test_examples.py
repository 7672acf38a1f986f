"""The runnable examples (examples/*.py) end to end: each runs as its own process, exactly as a
user runs it (``--fast``, a sidecar started in-process, the real SmolLM2 model), and what it
prints is checked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str) -> str:
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--fast"], check=False, cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"{name} failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_quickstart_serves_the_moved_records_from_shifted_hits():
    out = run_example("quickstart.py")
    first = re.search(r"\[1\] agent-07: (\d+) prompt tokens, prefilled (\d+), stored (\d+) chunks", out)
    assert first, out
    n1, prefilled1, stored = map(int, first.groups())
    assert prefilled1 == n1 and stored > 0  # nothing cached yet: the whole prompt is computed

    n2 = int(re.search(r"\[2\] agent-12: (\d+) prompt tokens", out).group(1))
    reuse = re.search(r"tokens: prefix=(\d+) exact=(\d+) shifted=(\d+) prefilled=(\d+)", out)
    assert reuse, out
    prefix, exact, shifted, prefilled = map(int, reuse.groups())
    assert prefix + exact + shifted + prefilled == n2
    # The records moved behind a longer header: most of the prompt is served shifted.
    assert shifted > n2 // 2 > prefilled
    assert re.search(r"CHUNK_HIT .* delta=\+\d+", out), out
    assert "rotated by the sidecar: yes" in out
    assert re.search(r"answer: '.+'", out)


def test_splice_forget_reprefills_what_amortize_keeps():
    out = run_example("splice.py")
    total = int(re.search(r"appends a message: (\d+) tokens, (\d+) directives", out).group(1))
    rows = {m.group(1): (int(m.group(2)), int(m.group(3)))
            for m in re.finditer(r"^(amortize|forget): re-prefilled=(\d+) kept=(\d+)", out, re.MULTILINE)}
    assert set(rows) == {"amortize", "forget"}, out
    (a_prefilled, a_kept), (f_prefilled, f_kept) = rows["amortize"], rows["forget"]
    for prefilled, kept in rows.values():
        assert prefilled + kept == total  # every token of the edited prompt is kept or computed
    # forget recomputes everything from the first edit on; amortize only the new tokens.
    assert f_prefilled > a_prefilled > 0
    assert a_kept > f_kept > 0
