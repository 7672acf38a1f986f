"""Load: N concurrent clients against one sidecar process, a mix of Lookup, Store (with KV
payloads), Fetch and Splice, stepped over concurrency to find the knee.

    ./dev bench load                          # sweep 1, 4, 8, 16, 32 clients, 20 s a step (~3 min)
    ./dev bench load --clients 16 --step-s 60 # one step
    ./dev bench load --profile                # one extra 16-client step with the server under cProfile

The sidecar runs in its own process (``sidecar.process.sidecar_process``: its own interpreter and
GIL, as deployed) with bounded capacities (CPU tier 64 MiB, 20,000 registry entries), so memory
must level off once they fill. The clients are asyncio tasks in this process, one channel each.
Every client is one of 4 tenants; each iteration it builds a prompt (its tenant's system prefix,
one of 48 documents drawn Zipf-like, a fresh question), then:

* Lookup; Store with payloads of every chunk the plan does not hit (random bytes of a small GQA
  layout); Fetch (raw) of up to 16 hit chunks;
* every 4th iteration, a Splice on the client's own session (replace 8 tokens) and CommitSplice.

Per step: RPC/s, p50/p99 per RPC kind, errors (goal: zero), and the same concurrency of empty
``Ping`` calls as the baseline (the same server, the same client machinery), reported as ratios.
The server's RSS (``/proc/<pid>/status``) is sampled every second over the whole run (goal: flat
after warm-up, bounded by the capacities). The knee: the smallest concurrency after which
throughput grows by less than 10% while Lookup p50 keeps growing. Writes
``bench/results/load.json`` and ``load.png`` (and ``load_profile.txt`` with ``--profile``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import stat
import tempfile
import threading
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from bench.harness import OWN_CONNECTION, RESULTS, bench_redis, child_pids, machine, sidecar_process, write_results
from sidecar.client import RetryPolicy, SidecarClient
from sidecar.directives import Directive
from sidecar.identity import CacheIdentity, KVLayout

LAYOUT = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16")
IDENT = CacheIdentity(model_id="load", kv_layout=LAYOUT.fingerprint())
ANCHORS = (200_000, 200_001, 200_002)
TENANTS = 4
DOCS = 48
#: Random payload bytes; a chunk's payload is a slice (at most 512 tokens x 256 B = 128 KiB).
NOISE = memoryview(np.random.default_rng(7).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes())
NOISE_WINDOW = len(NOISE) - 512 * LAYOUT.bytes_per_token
KINDS = ("Lookup", "Store", "Fetch", "Splice", "CommitSplice")
SERVER_FLAGS = ("--set", f"chunker.anchor_tokens=[{','.join(map(str, ANCHORS))}]",
                "--set", "store.cpu_bytes=67108864", "--set", "registry.capacity_entries=20000")


def _msg(rng: np.random.Generator, anchor: int, n: int) -> np.ndarray:
    return np.concatenate([[anchor], rng.integers(0, 100_000, n)]).astype(np.uint32)


class Corpus:
    """Per tenant: a 600-token system prefix and 48 documents of 300-900 tokens."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.system = [_msg(rng, ANCHORS[0], 600) for _ in range(TENANTS)]
        self.docs = [[_msg(rng, ANCHORS[1], int(rng.integers(300, 900))) for _ in range(DOCS)] for _ in range(TENANTS)]
        weights = 1.0 / np.arange(1, DOCS + 1)
        self.p = weights / weights.sum()

    def prompt(self, rng: np.random.Generator, tenant: int) -> np.ndarray:
        doc = self.docs[tenant][int(rng.choice(DOCS, p=self.p))]
        return np.concatenate([self.system[tenant], doc, _msg(rng, ANCHORS[2], int(rng.integers(20, 120)))])


class Recorder:
    def __init__(self) -> None:
        self.lat: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, int] = defaultdict(int)
        self.first_error: dict[str, str] = {}

    async def timed(self, kind: str, coro):
        t0 = time.perf_counter()
        try:
            out = await coro
        except Exception as exc:  # noqa: BLE001 - counted and reported, the run goes on
            self.errors[kind] += 1
            self.first_error.setdefault(kind, f"{type(exc).__name__}: {exc}"[:300])
            return None
        self.lat[kind].append(time.perf_counter() - t0)
        return out


async def mixed_client(target: str, idx: int, corpus: Corpus, rec: Recorder, deadline: float) -> None:
    rng = np.random.default_rng(1000 + idx)
    tenant = idx % TENANTS
    per_tok = LAYOUT.bytes_per_token
    async with SidecarClient(target, tenant=f"tenant-{tenant}", retry=RetryPolicy(attempts=1), timeout_s=60,
                             channel_options=OWN_CONNECTION) as c:
        session = await rec.timed("OpenSession", c.open_session(corpus.prompt(rng, tenant)[:512], block_size=16,
                                                                identity=IDENT))
        it = 0
        while time.perf_counter() < deadline:
            it += 1
            tokens = corpus.prompt(rng, tenant)
            plan = await rec.timed("Lookup", c.lookup(tokens, identity=IDENT))
            if plan is None:
                continue
            hits = plan.hits()
            hit_starts = {h.start - h.chunk_offset for h in hits}
            bounds = plan.chunk_bounds.tolist()
            # Slices of one random pool: the client's CPU goes to RPCs, not to generating bytes.
            payloads = {int(a): NOISE[(off := int(rng.integers(0, NOISE_WINDOW))):off + (b - a) * per_tok]
                        for a, b in zip(bounds, bounds[1:]) if a not in hit_starts}
            if payloads:
                await rec.timed("Store", c.store(tokens, identity=IDENT, layout=LAYOUT, payloads=payloads))
            if hits:
                items = [(h.chunk_hash, h.start - h.chunk_offset) for h in hits[:16]]
                await rec.timed("Fetch", c.fetch(items, identity=IDENT, layout=LAYOUT, raw=True))
            if session is not None and it % 4 == 0:
                repl = rng.integers(0, 100_000, 8).astype(np.uint32)
                op = await rec.timed("Splice", c.splice(session.session_id, session.version,
                                                        [Directive(start=100, end=108, replacement=repl)]))
                if op is not None:
                    session = await rec.timed("CommitSplice", c.commit_splice(op.plan_id)) or session


async def ping_client(target: str, rec: Recorder, deadline: float) -> None:
    async with SidecarClient(target, tenant="ping", retry=RetryPolicy(attempts=1), timeout_s=60,
                             channel_options=OWN_CONNECTION) as c:
        while time.perf_counter() < deadline:
            await rec.timed("Ping", c.ping())


async def run_step(target: str, clients: int, seconds: float, corpus: Corpus, ping_s: float) -> dict:
    rec = Recorder()
    t0 = time.perf_counter()
    await asyncio.gather(*(ping_client(target, rec, t0 + ping_s) for _ in range(clients)))
    ping_wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    await asyncio.gather(*(mixed_client(target, i, corpus, rec, t0 + seconds) for i in range(clients)))
    wall = time.perf_counter() - t0
    kinds = {}
    for kind, xs in rec.lat.items():
        a = np.asarray(xs) * 1e3
        kinds[kind] = {"calls": len(xs), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
                       "errors": rec.errors.get(kind, 0)}
    mixed_calls = sum(len(v) for k, v in rec.lat.items() if k != "Ping")
    ping_calls = len(rec.lat["Ping"])
    return {"clients": clients, "wall_s": wall, "rpc_per_s": mixed_calls / wall,
            "ping_rpc_per_s": ping_calls / ping_wall, "kinds": kinds,
            "errors": sum(v for k, v in rec.errors.items()), "first_errors": rec.first_error}


def _child_pid() -> int:
    for pid in child_pids(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"sidecar.cli" in f.read():
                    return pid
        except OSError:
            continue
    raise RuntimeError("sidecar child process not found")


def _family(pid: int) -> list[int]:
    """``pid`` and its children (a supervisor's workers)."""
    return [pid, *child_pids(pid)]


def _cpu_s(pid: int, children: bool = False) -> float:
    """User + system CPU seconds of ``pid`` so far (all its threads; with ``children``, its
    children's too)."""
    total = 0.0
    for p in _family(pid) if children else [pid]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _rss_mb(pid: int) -> float:
    """Resident MiB of ``pid`` and its children (a supervisor and its workers)."""
    total = 0
    for p in _family(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                m = re.search(r"VmRSS:\s+(\d+) kB", f.read())
        except OSError:
            continue
        total += int(m.group(1)) if m else 0
    return total / 1024 if total else float("nan")


class RssSampler(threading.Thread):
    def __init__(self, pid: int, t0: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.t0, self.samples = pid, t0, []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.samples.append((time.perf_counter() - self.t0, _rss_mb(self.pid)))


def knee(steps: list[dict]) -> int | None:
    """First concurrency after which throughput gains < 10% while Lookup p50 still rises."""
    for a, b in zip(steps, steps[1:]):
        gain = b["rpc_per_s"] / max(a["rpc_per_s"], 1e-9)
        la, lb = a["kinds"].get("Lookup", {}).get("p50_ms"), b["kinds"].get("Lookup", {}).get("p50_ms")
        if gain < 1.10 and la is not None and lb is not None and lb > la:
            return a["clients"]
    return None


def _profiled_python(out: Path) -> str:
    """A one-line interpreter wrapper that runs the server under cProfile (``python -m cProfile
    -o OUT -m sidecar.cli serve ...``); SIGTERM drains the server, which then exits normally and
    cProfile writes its file."""
    import sys

    wrapper = Path(tempfile.mkdtemp()) / "python-cprofile"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m cProfile -o "{out}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(wrapper)


def profile_step(clients: int, seconds: float, corpus: Corpus) -> str:
    import io
    import pstats

    prof = Path(tempfile.mkdtemp()) / "server.prof"
    with sidecar_process(*SERVER_FLAGS, python=_profiled_python(prof)) as target:
        step = asyncio.run(run_step(target, clients, seconds, corpus, ping_s=1.0))
    for _ in range(100):
        if prof.exists():
            break
        time.sleep(0.1)
    buf = io.StringIO()
    stats = pstats.Stats(str(prof), stream=buf)
    buf.write(f"profiled step: {clients} clients, {step['rpc_per_s']:.0f} RPC/s under cProfile (slower than unprofiled)\n")
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    text = buf.getvalue()
    (RESULTS / "load_profile.txt").write_text(text)
    return text


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["steps"]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    xs = [s["clients"] for s in steps]
    ax[0].plot(xs, [s["rpc_per_s"] for s in steps], "o-", label="mix")
    ax[0].plot(xs, [s["ping_rpc_per_s"] for s in steps], "s--", label="Ping (baseline)")
    for w, sw in result.get("workers", {}).items():
        if w != "ratios":
            ax[0].plot(xs, [s["rpc_per_s"] for s in sw["steps"]], "^-", label=f"mix, {w} worker(s) + Redis")
    ax[0].set(xscale="log", xlabel="clients", ylabel="RPC/s", title="throughput")
    ax[0].legend()
    for kind in KINDS:
        ys = [s["kinds"].get(kind, {}).get("p50_ms", np.nan) for s in steps]
        ax[1].plot(xs, ys, "o-", label=f"{kind} p50")
    ax[1].set(xscale="log", yscale="log", xlabel="clients", ylabel="ms", title="latency p50")
    ax[1].legend(fontsize=7)
    t, r = zip(*result["rss_mb"]) if result["rss_mb"] else ((), ())
    ax[2].plot(t, r)
    ax[2].set(xlabel="s since start", ylabel="MiB", title="server RSS")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def sweep(flags: tuple[str, ...], counts: list[int], args: argparse.Namespace, corpus: Corpus) -> dict:
    """One server configuration stepped over ``counts`` clients: steps, RSS samples, knee."""
    steps = []
    with sidecar_process(*flags) as target:
        pid = _child_pid()
        t0 = time.perf_counter()
        sampler = RssSampler(pid, t0)
        sampler.start()
        for n in counts:
            cpu0, ccpu0, wall0 = _cpu_s(pid, True), _cpu_s(os.getpid()), time.perf_counter()
            s = asyncio.run(run_step(target, n, args.step_s, corpus, args.ping_s))
            # Server cores busy over the step (Ping phase included): ~1.0 = one event loop saturated.
            s["server_cores"] = (_cpu_s(pid, True) - cpu0) / (time.perf_counter() - wall0)
            s["client_cores"] = (_cpu_s(os.getpid()) - ccpu0) / (time.perf_counter() - wall0)
            s["rss_mb_end"] = _rss_mb(pid)
            s["t_end_s"] = time.perf_counter() - t0
            steps.append(s)
            lk = s["kinds"].get("Lookup", {})
            print(f"{n:3d} clients: {s['rpc_per_s']:7.0f} RPC/s (Ping {s['ping_rpc_per_s']:6.0f}/s), "
                  f"Lookup p50 {lk.get('p50_ms', float('nan')):.1f} ms, errors {s['errors']}, RSS {s['rss_mb_end']:.0f} MiB, "
                  f"cores busy: server {s['server_cores']:.2f}, clients {s['client_cores']:.2f} (of {os.cpu_count()})",
                  flush=True)
        sampler.stop.set()
        sampler.join()
    rss = sampler.samples
    warm = [r for t, r in rss if t >= steps[0]["t_end_s"]] if len(steps) > 1 else [r for _, r in rss]
    return {"server_flags": list(flags), "steps": steps, "knee_clients": knee(steps), "rss_mb": rss,
            "rss_after_warmup_mb": {"first": warm[0] if warm else None, "max": max(warm) if warm else None,
                                    "last": warm[-1] if warm else None}}


def report(name: str, result: dict) -> None:
    steps = result["steps"]
    print(f"\n{name}")
    print(f"{'clients':>7} {'RPC/s':>7} {'x Ping':>7} " + " ".join(f"{k + ' p50/p99 ms':>24}" for k in KINDS[:4])
          + f" {'errors':>6}")
    for s in steps:
        cells = []
        for k in KINDS[:4]:
            d = s["kinds"].get(k)
            cells.append(f"{d['p50_ms']:>10.1f} / {d['p99_ms']:>9.1f}" if d else f"{'-':>24}")
        ping = s["kinds"].get("Ping", {})
        print(f"{s['clients']:>7} {s['rpc_per_s']:>7.0f} {s['rpc_per_s'] / s['ping_rpc_per_s']:>7.2f} " + " ".join(cells)
              + f" {s['errors']:>6}   (Ping p50 {ping.get('p50_ms', float('nan')):.2f} ms;"
              f" Lookup p50 = {s['kinds'].get('Lookup', {}).get('p50_ms', float('nan')) / max(ping.get('p50_ms', 1), 1e-9):.1f}x Ping)")
    w = result["rss_after_warmup_mb"]
    print(f"server RSS after the first step: first {w['first']:.0f} MiB, max {w['max']:.0f} MiB, last {w['last']:.0f} MiB;"
          f" knee at {result['knee_clients']} clients")
    for s in steps:
        if s["first_errors"]:
            print(f"errors at {s['clients']} clients: {s['first_errors']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", default="1,4,8,16,32", help="client counts, one step each")
    ap.add_argument("--clients", type=int, default=None, help="one step with this many clients (overrides --sweep)")
    ap.add_argument("--step-s", type=float, default=20.0)
    ap.add_argument("--ping-s", type=float, default=4.0, help="baseline Ping phase before each step")
    ap.add_argument("--profile", action="store_true", help="also profile the server under cProfile (16 clients)")
    ap.add_argument("--workers", type=int, default=1,
                    help="N > 1: also sweep 1 worker and N workers (a supervisor, one port) with the shared "
                    "registry and remote tier on a Redis this bench starts (REDIS_URL: that one instead)")
    args = ap.parse_args()
    counts = [args.clients] if args.clients else [int(x) for x in args.sweep.split(",")]
    corpus = Corpus()
    print("embedded defaults (one process, no Redis)")
    result = {"machine": machine(), "step_s": args.step_s, **sweep(SERVER_FLAGS, counts, args, corpus)}
    report("embedded defaults (one process, no Redis)", result)
    if args.workers > 1:
        result["workers"] = compare_workers(args.workers, counts, args, corpus, result["steps"])
    if args.profile:
        text = profile_step(16, args.step_s, corpus)
        result["profile"] = "bench/results/load_profile.txt"
        print(text[:6000])
    path = write_results("load", result)
    plot(result, RESULTS / "load.png")
    print(f"wrote {path} and {RESULTS / 'load.png'}")


def compare_workers(n: int, counts: list[int], args: argparse.Namespace, corpus: Corpus, embedded: list[dict]) -> dict:
    """1 worker and ``n`` workers, both with the shared registry and the remote tier on one Redis
    (the configuration ``workers`` needs), swept in this run; throughput ratios per step."""
    out: dict = {}
    with ExitStack() as stack:
        url = bench_redis(stack)
        for w in (1, n):
            flags = (*SERVER_FLAGS, "--set", f"shared_registry.redis_url={url}", "--set", f"shared_registry.key_prefix=load{w}",
                     "--set", f"store.remote_url={url}", "--set", f"store.remote_bytes={256 << 20}",
                     "--set", f"store.namespace=load{w}", "--set", f"workers={w}")
            name = f"{w} worker{'s' if w > 1 else ''}, shared registry + remote tier on Redis"
            print(name)
            out[str(w)] = sweep(flags, counts, args, corpus)
            report(name, out[str(w)])
    ratios = []
    for e, one, many in zip(embedded, out["1"]["steps"], out[str(n)]["steps"], strict=True):
        ratios.append({"clients": e["clients"], "vs_one_worker": many["rpc_per_s"] / one["rpc_per_s"],
                       "vs_embedded": many["rpc_per_s"] / e["rpc_per_s"]})
    print(f"\n{n} workers, throughput ratios (same run): "
          + ", ".join(f"{r['clients']} clients {r['vs_one_worker']:.2f}x one worker / {r['vs_embedded']:.2f}x embedded"
                      for r in ratios))
    out["ratios"] = ratios
    return out


if __name__ == "__main__":
    main()
