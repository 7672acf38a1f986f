"""Concurrent Stores over real gRPC: Store throughput of N clients against one sidecar process.

    python -m bench.tiers_stores                      # 1 and 8 clients, this checkout's server
    python -m bench.tiers_stores --baseline /work/main  # the same against another checkout, interleaved

Each client runs in a process of its own (as engines do; ``--in-process``: as asyncio tasks of
this process, whose one interpreter then bounds the rate too) with its own channel and tenant,
and starts its timed window once every client is prepared; every Store is
a fresh random 1,024-token prompt with the KV payload of every chunk (a GQA layout of 4 KiB per
token: ~4 MiB a Store, chunks of ~512 KiB), so each call writes new chunks and, once the CPU
tier (64 MiB) is full, evicts old ones. Prompts and their chunk bounds are prepared before the
timed window (one untimed Lookup each). Throughput is payload bytes stored per wall second.
Servers run in their own processes (own interpreter and GIL, as deployed); with ``--baseline``
the two servers run side by side and the measurements alternate (this, baseline, this, ...),
so both see the same background load on a shared host.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench.harness import OWN_CONNECTION, bench_redis, spawn_sidecar, stop_process
from sidecar.client import RetryPolicy, SidecarClient
from sidecar.identity import CacheIdentity, KVLayout

LAYOUT = KVLayout.gqa(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16")  # 4 KiB per token
IDENT = CacheIdentity(model_id="bench-stores", kv_layout=LAYOUT.fingerprint())
PROMPT_TOKENS = 1024
SERVER_FLAGS = ("--set", "store.cpu_bytes=67108864", "--set", "registry.capacity_entries=50000")
NOISE = np.random.default_rng(11).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()


@contextmanager
def server(root: Path, *flags: str) -> Iterator[tuple[str, int]]:
    """``sidecar.cli serve`` of the checkout at ``root`` in a child process: (target, pid)."""
    python = root / ".venv" / "bin" / "python"
    proc, target = spawn_sidecar(*SERVER_FLAGS, *flags, python=str(python) if python.exists() else None, root=root)
    try:
        yield target, proc.pid
    finally:
        stop_process(proc, timeout=15)


_INPROC = """
import os, sys, threading, time
os.environ["LMCACHE_TRACK_USAGE"] = "false"
import numpy as np
from sidecar.identity import KVLayout
from sidecar.tiers import StoreConfig, TieredStore
threads, seconds, nbytes = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
layout = KVLayout.gqa(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16")
tokens = nbytes // layout.bytes_per_token
data = np.random.default_rng(3).integers(0, 256, nbytes, dtype=np.uint8)
store = TieredStore(StoreConfig(namespace="inproc", cpu_bytes=64 << 20))
counts = [0] * threads
start = threading.Barrier(threads + 1)
def work(t):
    start.wait()
    i = 0
    while time.perf_counter() < deadline:
        store.put(b"%d-%d" % (t, i), data, layout=layout, num_tokens=tokens, tenant="t%d" % (t % 4))
        i += 1
    counts[t] = i
ths = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
for th in ths:
    th.start()
deadline = time.perf_counter() + seconds
start.wait()
for th in ths:
    th.join()
store.close()
print(sum(counts) * nbytes / 2**20 / seconds)
"""


def inproc(root: Path, threads: int, seconds: float, nbytes: int) -> float:
    """MiB/s of ``TieredStore.put`` from ``threads`` threads in one process (the store alone,
    no gRPC), CPU tier of 64 MiB with eviction, run from the checkout at ``root``."""
    python = root / ".venv" / "bin" / "python"
    out = subprocess.run([str(python if python.exists() else sys.executable), "-c", _INPROC, str(threads),
                          str(seconds), str(nbytes)], cwd=root, capture_output=True, text=True, check=True,
                         env={**os.environ, "LMCACHE_TRACK_USAGE": "false"})
    return float(out.stdout.strip().splitlines()[-1])


def run_inproc(roots: dict[str, Path], threads: list[int], seconds: float, rounds: int,
               nbytes: int = 512 << 10) -> dict:
    """``inproc`` per (arm, threads), interleaved round by round; the best round is kept."""
    got: dict[str, dict[int, list[float]]] = {arm: {n: [] for n in threads} for arm in roots}
    for r in range(rounds):
        for n in threads:
            for arm, root in roots.items():
                got[arm][n].append(inproc(root, n, seconds, nbytes))
                print(f"  round {r} {arm:>8} {n:>2} threads: {got[arm][n][-1]:7.1f} MiB/s put", flush=True)
    out: dict = {"chunk_bytes": nbytes, "seconds": seconds, "rounds": rounds, "arms": {}}
    for arm in roots:
        best = {n: max(v) for n, v in got[arm].items()}
        lo, hi = min(threads), max(threads)
        out["arms"][arm] = {"mib_s": {str(n): b for n, b in best.items()},
                            "all_rounds_mib_s": {str(n): v for n, v in got[arm].items()},
                            f"speedup_{hi}_vs_{lo}": best[hi] / best[lo]}
    return out


async def _prepare(c: SidecarClient, rng: np.random.Generator, n: int) -> list[tuple[np.ndarray, dict]]:
    per_tok = LAYOUT.bytes_per_token
    out = []
    for _ in range(n):
        tokens = rng.integers(0, 100_000, PROMPT_TOKENS).astype(np.uint32)
        plan = await c.lookup(tokens, identity=IDENT, dry_run=True)
        bounds = plan.chunk_bounds.tolist()
        payloads = {}
        for a, b in zip(bounds, bounds[1:]):
            off = int(rng.integers(0, len(NOISE) - (b - a) * per_tok))
            payloads[int(a)] = NOISE[off:off + (b - a) * per_tok]
        out.append((tokens, payloads))
    return out


def _connect(target: str, idx: int) -> SidecarClient:
    return SidecarClient(target, tenant=f"t{idx}", retry=RetryPolicy(attempts=1), timeout_s=120,
                         channel_options=OWN_CONNECTION)


async def _ready(c: SidecarClient, idx: int, seed: int) -> list[tuple[np.ndarray, dict]]:
    """Prompts prepared and the channel warmed by one Store: what a client does before its window."""
    prepared = await _prepare(c, np.random.default_rng(seed * 1000 + idx), 24)
    await c.store(prepared[0][0], identity=IDENT, layout=LAYOUT, payloads=prepared[0][1])
    return prepared


async def _stores(c: SidecarClient, prepared: list[tuple[np.ndarray, dict]], seconds: float) -> tuple[int, int]:
    """Stores for ``seconds``: (calls, payload bytes)."""
    calls = nbytes = 0
    deadline = time.perf_counter() + seconds
    i = 1
    while time.perf_counter() < deadline:
        tokens, payloads = prepared[i % len(prepared)]
        # A prompt used again under another namespace: the same bounds, new chunk keys.
        ident = IDENT if i < len(prepared) else replace(IDENT, namespace=f"r{i}")
        await c.store(tokens, identity=ident, layout=LAYOUT, payloads=payloads)
        calls += 1
        nbytes += sum(len(p) for p in payloads.values())
        i += 1
    return calls, nbytes


async def _client(target: str, idx: int, seconds: float, seed: int) -> tuple[int, int]:
    async with _connect(target, idx) as c:
        return await _stores(c, await _ready(c, idx, seed), seconds)


def _client_process(target: str, idx: int, seconds: float, seed: int) -> None:
    """``--client``: one client in a process of its own (as an engine is). Prints ``READY`` once
    prepared, starts its window on a line from stdin, prints ``RESULT calls bytes``."""

    async def main() -> None:
        async with _connect(target, idx) as c:
            prepared = await _ready(c, idx, seed)
            print("READY", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            calls, nbytes = await _stores(c, prepared, seconds)
            print(f"RESULT {calls} {nbytes}", flush=True)

    asyncio.run(main())


def _line(proc: subprocess.Popen, tag: str) -> list[str]:
    for line in proc.stdout:
        if line.startswith(tag):
            return line.split()[1:]
    raise RuntimeError(f"a Store client exited (code {proc.wait()}) before printing {tag}")


def measure(target: str, clients: int, seconds: float, seed: int, processes: bool = True) -> dict:
    """``clients`` concurrent Store clients for ``seconds``: each in a process of its own
    (``processes``, as engines are), or all as asyncio tasks of this process (whose one
    interpreter then also bounds the rate). Throughput over the timed windows only: preparation
    is done before (processes start together once all are ready)."""
    t0 = time.perf_counter()
    if not processes:
        async def gather() -> list[tuple[int, int]]:
            return await asyncio.gather(*(_client(target, i, seconds, seed) for i in range(clients)))

        res = asyncio.run(gather())
    else:
        root = Path(__file__).resolve().parents[1]
        procs = [subprocess.Popen([sys.executable, "-m", "bench.tiers_stores", "--client", target, str(i), str(seconds),
                                   str(seed)], cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for i in range(clients)]
        done = False
        try:
            for p in procs:
                _line(p, "READY")
            t0 = time.perf_counter()
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            res = [tuple(int(x) for x in _line(p, "RESULT")) for p in procs]
            done = True
        finally:
            for p in procs:
                try:
                    p.wait(timeout=30 if done else 0.01)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    wall = time.perf_counter() - t0
    calls = sum(r[0] for r in res)
    nbytes = sum(r[1] for r in res)
    return {"clients": clients, "calls": calls, "mib": nbytes / 2**20, "mib_s": nbytes / 2**20 / seconds,
            "stores_s": calls / seconds, "wall_s": wall}


def run(roots: dict[str, Path], clients: list[int], seconds: float, rounds: int, workers: int = 1,
        processes: bool = True) -> dict:
    """Throughput per (arm, clients), interleaved round by round; the best round is kept.
    ``processes``: each client in a process of its own (else asyncio tasks of this process).
    ``workers`` > 1 adds an arm: this checkout with that many worker processes on one port,
    the shared registry and the remote tier on a Redis (docs/operations.md, "Workers")."""
    results: dict[str, dict[int, list[dict]]] = {arm: {n: [] for n in clients} for arm in roots}
    with ExitStack() as stack:
        targets = {arm: stack.enter_context(server(root))[0] for arm, root in roots.items()}
        if workers > 1:
            url = bench_redis(stack)
            arm = f"workers{workers}"
            targets[arm] = stack.enter_context(server(
                Path(__file__).resolve().parents[1], "--set", f"workers={workers}",
                "--set", f"shared_registry.redis_url={url}", "--set", f"store.remote_url={url}",
                "--set", f"store.remote_bytes={1 << 30}"))[0]
            results[arm] = {n: [] for n in clients}
        for r in range(rounds):
            for n in clients:
                for arm, target in targets.items():
                    row = measure(target, n, seconds, seed=r * 17 + n, processes=processes)
                    results[arm][n].append(row)
                    print(f"  round {r} {arm:>8} {n:>2} clients: {row['mib_s']:7.1f} MiB/s {row['stores_s']:6.1f} Stores/s",
                          flush=True)
    out: dict = {"clients_as": "processes" if processes else "asyncio tasks of one process",
                 "prompt_tokens": PROMPT_TOKENS, "bytes_per_token": LAYOUT.bytes_per_token,
                 "seconds": seconds, "rounds": rounds, "server_flags": list(SERVER_FLAGS), "arms": {}}
    for arm in results:
        best = {n: max(rows, key=lambda x: x["mib_s"]) for n, rows in results[arm].items()}
        arm_out = {"by_clients": {str(n): b for n, b in best.items()},
                   "all_rounds_mib_s": {str(n): [x["mib_s"] for x in rows] for n, rows in results[arm].items()}}
        if len(clients) > 1:
            lo, hi = min(clients), max(clients)
            arm_out[f"speedup_{hi}_vs_{lo}"] = best[hi]["mib_s"] / best[lo]["mib_s"]
        out["arms"][arm] = arm_out
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", default=None, help="another checkout whose server runs as the 'before' arm")
    ap.add_argument("--workers", type=int, default=1, help="N > 1: also an arm with N worker processes (Redis)")
    ap.add_argument("--in-process", action="store_true",
                    help="clients as asyncio tasks of this process instead of a process each")
    ap.add_argument("--client", nargs=4, metavar=("TARGET", "INDEX", "SECONDS", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        target, idx, seconds, seed = args.client
        _client_process(target, int(idx), float(seconds), int(seed))
        return
    roots = {"after": Path(__file__).resolve().parents[1]}
    if args.baseline:
        roots = {"before": Path(args.baseline), **roots}
    out = run(roots, [int(c) for c in args.clients.split(",")], args.seconds, args.rounds, args.workers,
              processes=not args.in_process)
    for arm, a in out["arms"].items():
        print(arm, {k: round(v, 2) for k, v in a.items() if k.startswith("speedup")},
              {n: round(b["mib_s"], 1) for n, b in a["by_clients"].items()})


if __name__ == "__main__":
    main()
