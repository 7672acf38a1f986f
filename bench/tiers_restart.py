"""Restart over a populated disk tier: time from process start to the first Lookup served.

    python -m bench.tiers_restart --chunks 100000                      # this checkout
    python -m bench.tiers_restart --chunks 100000 --baseline /work/main  # and another, alternating

Populates a disk tier directory in-process with ``--chunks`` small chunks exactly as Stores
would leave it (registry metadata in each object's aux bytes, so recovery re-registers them):
tenant ``default``, a 1-layer, 1-head, head_dim-8 fp16 layout (32 B per token), 4,096-token
random prompts cut by the default chunker (~128 tokens, ~4 KiB payload, ~8 KiB stored object
with its 4 KiB header). Then, for each arm, starts ``kv-sidecar serve`` over that directory
(registry capacity above the chunk count) and times, from ``Popen``: the "serving" log line,
and the first Lookup of a stored prompt answered with its chunks as hits. An empty-disk start
is timed too (imports and kernel warm-up, the floor under any restart). With ``--baseline``
the arms alternate (this, baseline, this, ...) over the same directory; the page cache is
warm for all but the first start.

Each start also reports where its time went, from the server's own log lines (wall seconds
from ``Popen``): ``store_recovered_s`` (the tiered store has re-indexed the disk tier: imports,
configuration, ``TieredStore``) and ``registry_recovered_s`` (registry entries rebuilt; absent
on an empty disk); and, because a shared host makes wall time noisy, the server's CPU seconds
up to the first Lookup (``cpu_s``, all its threads) and the 1-minute load average then
(``load``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import tempfile
import time
from collections import deque
from datetime import datetime
from pathlib import Path

os.environ["LMCACHE_TRACK_USAGE"] = "false"

import numpy as np

from bench.harness import spawn_sidecar, stop_process
from bench.tiers_stores import SERVER_FLAGS
from sidecar.client import RetryPolicy, SidecarClient
from sidecar.config import load_config
from sidecar.dataplane import DataPlane
from sidecar.dataplane.records import encode_aux
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.registry.chunk_index import ChunkIndex
from sidecar.registry.registry import InMemoryRegistry
from sidecar.tiers import chunk_key

LAYOUT = KVLayout.gqa(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")
IDENT = CacheIdentity(model_id="bench-restart", kv_layout=LAYOUT.fingerprint())
PROMPT = 4096
NAMESPACE = "restart"


def flags(disk: Path, chunks: int) -> tuple[str, ...]:
    return ("--set", f"store.disk_path={disk}", "--set", f"store.disk_bytes={chunks * 64 * 1024}",
            "--set", "store.cpu_bytes=16777216", "--set", f"store.namespace={NAMESPACE}",
            "--set", f"registry.capacity_entries={chunks * 2}")


def populate(disk: Path, chunks: int) -> np.ndarray:
    """Write ``chunks`` chunks; returns the first prompt (all of its chunks are stored)."""
    overrides = {}
    it = iter(flags(disk, chunks))
    for _, kv in zip(it, it):
        k, v = kv.split("=", 1)
        overrides[k] = v
    overrides["store.cpu_bytes"] = "0"  # every chunk on disk, as after a graceful stop's spill
    cfg = load_config(env={}, overrides=overrides)
    index = ChunkIndex(cfg.chunker, InMemoryRegistry(cfg.registry))
    dp = DataPlane(index, cfg.limits.store_config(cfg.store))
    rng = np.random.default_rng(5)
    noise = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    first = None
    n = 0
    t0 = time.perf_counter()
    try:
        while n < chunks:
            tokens = rng.integers(0, 100_000, PROMPT).astype(np.uint32)
            first = tokens if first is None else first
            entries, _ = dp.store_entries(tokens, tokens.tobytes(), IDENT, "default", LAYOUT, 0)
            for e in entries:
                nb = e.num_tokens * LAYOUT.bytes_per_token
                off = int(rng.integers(0, len(noise) - nb))
                dp.store.put(chunk_key(e.key), noise[off:off + nb], layout=LAYOUT, num_tokens=e.num_tokens,
                             tenant="default", scope="default", source_position=e.source_pos, aux=encode_aux(e))
                n += 1
                if n >= chunks:
                    break
    finally:
        dp.close()
    print(f"populated {n} chunks in {time.perf_counter() - t0:.1f} s", flush=True)
    return first


async def _first_lookup(target: str, tokens: np.ndarray) -> int:
    async with SidecarClient(target, retry=RetryPolicy(attempts=1), timeout_s=120) as c:
        plan = await c.lookup(tokens, identity=IDENT)
        return sum(h.end - h.start for h in plan.hits())


#: (row key, the server log line that ends the phase); ``SidecarServer.start`` logs both
_PHASES = (("store_recovered_s", "disk tier recovered"), ("registry_recovered_s", "from the tiers"))
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all threads (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _phases(log: deque[str], started: float) -> dict[str, float]:
    """Wall seconds from ``started`` (epoch) to the log lines of ``_PHASES`` (ms resolution)."""
    out = {}
    for line in list(log):
        m = _LOG_TIME.match(line)
        for name, text in _PHASES:
            if m and text in line and name not in out:
                out[name] = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - started
    return out


def restart(root: Path, disk: Path, chunks: int, tokens: np.ndarray) -> dict:
    python = root / ".venv" / "bin" / "python"
    log: deque[str] = deque(maxlen=500)
    started, t0 = time.time(), time.perf_counter()
    proc, target = spawn_sidecar(*SERVER_FLAGS, *flags(disk, chunks), python=str(python) if python.exists() else None,
                                 log=log, root=root)
    try:
        serving = time.perf_counter() - t0
        hit = asyncio.run(_first_lookup(target, tokens))
        first = time.perf_counter() - t0
        cpu = _cpu_seconds(proc.pid)
        load = os.getloadavg()[0]
    finally:
        stop_process(proc, timeout=15)
    return {"serving_s": serving, "first_lookup_s": first, "hit_tokens": hit, "cpu_s": cpu, "load": load,
            **_phases(log, started)}


def run(roots: dict[str, Path], chunks: int, rounds: int, workdir: Path) -> dict:
    disk = workdir / "disk"
    tokens = populate(disk, chunks)
    n_files = sum(1 for p in disk.iterdir() if p.name.endswith(".data"))
    empty = workdir / "empty"
    out: dict = {"chunks": n_files, "object_bytes": 4096 + 128 * LAYOUT.bytes_per_token, "rounds": rounds, "arms": {}}
    rows: dict[str, list[dict]] = {arm: [] for arm in roots}
    floor: dict[str, list[float]] = {arm: [] for arm in roots}
    index_file = disk / f"{NAMESPACE}.kvindex"
    for r in range(rounds):
        for arm, root in roots.items():
            empty_row = restart(root, empty, chunks, tokens)
            floor[arm].append(empty_row["first_lookup_s"])
            row = restart(root, disk, chunks, tokens)
            rows[arm].append(row)
            print(f"  round {r} {arm:>7}: serving {row['serving_s']:.2f} s, first Lookup {row['first_lookup_s']:.2f} s "
                  f"({row['hit_tokens']} tokens hit; store recovered at {row.get('store_recovered_s', 0):.2f} s, "
                  f"registry at {row.get('registry_recovered_s', 0):.2f} s; server CPU {row['cpu_s']:.2f} s; "
                  f"load {row['load']:.2f}; empty-disk start {empty_row['first_lookup_s']:.2f} s, "
                  f"CPU {empty_row['cpu_s']:.2f} s, load {empty_row['load']:.2f}; "
                  f"index {'present' if index_file.exists() else 'absent'})", flush=True)
    for arm in roots:
        best = min(rows[arm], key=lambda x: x["first_lookup_s"])
        out["arms"][arm] = {**best, "empty_disk_first_lookup_s": min(floor[arm]),
                            "all_first_lookup_s": [x["first_lookup_s"] for x in rows[arm]],
                            "all_cpu_s": [x["cpu_s"] for x in rows[arm]], "all_load": [x["load"] for x in rows[arm]]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", default=None, help="another checkout whose server runs as the 'before' arm")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    roots = {"after": Path(__file__).resolve().parents[1]}
    if args.baseline:
        roots = {"before": Path(args.baseline), **roots}
    workdir = Path(tempfile.mkdtemp(prefix="kvs-bench-restart-", dir=args.dir))
    try:
        out = run(roots, args.chunks, args.rounds, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(out)


if __name__ == "__main__":
    main()
