"""Soak: replay the real agent traces against one sidecar for a long time, watching for drift.

    ./dev bench soak                      # one hour, by command, never in CI
    ./dev bench soak --minutes 5          # a short look

Every trace call of the repository's tau-bench and mini-SWE-agent trajectories (old tool outputs
truncated, as agents do) is replayed in order, over and over, by ``--clients`` concurrent
clients on loopback, each as its own tenant: Lookup, then Store of the call's chunks with a
random KV payload (a small GQA layout, so the tiers fill and evict), then Fetch of the plan's
hits (raw: the soak watches the service, `./dev bench fetch` the rotation). The sidecar runs in its own process with deliberately small tiers and registry, so
capacity eviction runs all the time.

Every window (``--window-s``) it records: calls and errors per RPC, Lookup p50 / p99, recovery
(share of prompt tokens the plans serve), the server's RSS (``/proc/<pid>/status``) and
``kv_sidecar_cache_invariant_violations_total`` from the metrics endpoint. Goals: zero errors
and zero invariant violations; memory, latency and recovery flat after warm-up (the report
prints the last window over the first post-warm-up window for each). Writes
bench/results/soak.json.
"""

from __future__ import annotations

import argparse
import re
import threading
import time
import urllib.request
from collections import defaultdict

import numpy as np
import torch

from bench.harness import machine, pct, sidecar_process, write_results
from sidecar.client import RetryPolicy, SyncSidecarClient
from sidecar.identity import CacheIdentity, KVLayout
from workloads import TruncateOldToolOutputs, trace_workload
from workloads.chat_template import ChatTemplate

LAYOUT = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16")
IDENT = CacheIdentity(model_id="soak", kv_layout=LAYOUT.fingerprint())


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        m = re.search(r"VmRSS:\s+(\d+) kB", f.read())
    return int(m.group(1)) / 1024 if m else float("nan")


def _sidecar_pid(port: int) -> int:
    """The pid of the ``kv-sidecar serve`` child whose metrics listen on ``port``."""
    import os

    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "sidecar.cli" in cmd and f"--metrics-port {port}" in cmd:
            return int(pid)
    raise RuntimeError("sidecar process not found")


def _violations(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(r"^kv_sidecar_cache_invariant_violations_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


class Window:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: dict[str, int] = defaultdict(int)
        self.errors: dict[str, int] = defaultdict(int)
        self.lookup_s: list[float] = []
        self.tokens = 0
        self.recovered = 0
        self.last_error: dict[str, str] = {}

    def take(self) -> "Window":
        with self.lock:
            out = Window()
            out.calls, out.errors, out.lookup_s = self.calls, self.errors, self.lookup_s
            out.tokens, out.recovered, out.last_error = self.tokens, self.recovered, self.last_error
            self.last_error = {}
            self.calls, self.errors, self.lookup_s = defaultdict(int), defaultdict(int), []
            self.tokens = self.recovered = 0
        return out


def client_loop(target: str, tenant: str, prompts: list[np.ndarray], w: Window, stop: threading.Event,
                seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    per_tok = LAYOUT.bytes_per_token // 2
    with SyncSidecarClient(target, tenant=tenant, retry=RetryPolicy(attempts=1), timeout_s=30) as c:
        i = 0
        while not stop.is_set():
            tokens = prompts[i % len(prompts)]
            i += 1
            kind = "lookup"
            try:
                t0 = time.perf_counter()
                plan = c.lookup(tokens, identity=IDENT)
                dt = time.perf_counter() - t0
                s = plan.summary
                with w.lock:
                    w.calls["lookup"] += 1
                    w.lookup_s.append(dt)
                    w.tokens += len(tokens)
                    w.recovered += s.exact_tokens + s.shifted_tokens + s.prefix_tokens
                kind = "store"
                bounds = plan.chunk_bounds.tolist()
                hit = {seg.start - seg.chunk_offset for seg in plan.hits()}
                pl = {a: torch.randn((b - a) * per_tok, generator=g).half()
                      for a, b in zip(bounds, bounds[1:]) if a not in hit}
                if pl:
                    c.store(tokens, identity=IDENT, layout=LAYOUT, payloads=pl)
                with w.lock:
                    w.calls["store"] += 1
                kind = "fetch"
                hits = plan.hits()
                if hits:
                    got = c.fetch([(h.chunk_hash, h.start - h.chunk_offset) for h in hits[:64]], identity=IDENT,
                                  layout=LAYOUT, raw=True)
                    with w.lock:
                        w.calls["fetch_miss"] += sum(1 for kv in got if not kv.ok)  # evicted since the Lookup
                with w.lock:
                    w.calls["fetch"] += 1
            except Exception as exc:  # noqa: BLE001 - counted: the goal is zero
                with w.lock:
                    w.errors[kind] += 1
                    w.last_error.setdefault(kind, f"{type(exc).__name__}: {exc}"[:300])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--warmup-windows", type=int, default=1)
    args = ap.parse_args()
    tpl = ChatTemplate()
    prompts: list[np.ndarray] = []
    for name in ("tau_bench", "mini_swe"):
        w = trace_workload(name, tpl, policy=TruncateOldToolOutputs())
        prompts += [np.asarray(r, dtype=np.uint32) for r in w.requests]
    anchors = "[" + ",".join(str(a) for a in tpl.anchor_token_ids) + "]"
    from bench.ttft import free_port

    mport = free_port()
    flags = ["--set", f"chunker.anchor_tokens={anchors}", "--set", "store.cpu_bytes=67108864",
             "--set", "registry.capacity_entries=20000", "--metrics-port", str(mport)]
    windows = []
    with sidecar_process(*flags) as target:
        pid = _sidecar_pid(mport)
        win = Window()
        stop = threading.Event()
        step = len(prompts) // max(1, args.clients)
        threads = [threading.Thread(target=client_loop, daemon=True,
                                    args=(target, f"soak-{k}", prompts[k * step:] + prompts[:k * step], win, stop, k))
                   for k in range(args.clients)]
        for t in threads:
            t.start()
        t_end = time.time() + args.minutes * 60
        started = time.time()
        try:
            while time.time() < t_end:
                time.sleep(min(args.window_s, max(0.0, t_end - time.time())))
                w = win.take()
                lat = np.asarray(w.lookup_s) if w.lookup_s else np.asarray([np.nan])
                row = {"t_s": round(time.time() - started, 1), "calls": dict(w.calls), "errors": dict(w.errors),
                       "first_errors": w.last_error,
                       "lookup_p50_ms": pct(lat, 50) * 1e3, "lookup_p99_ms": pct(lat, 99) * 1e3,
                       "recovery": w.recovered / w.tokens if w.tokens else None, "rss_mb": _rss_mb(pid),
                       "invariant_violations": _violations(mport)}
                windows.append(row)
                print(f"{row['t_s']:>7.0f} s  calls {sum(w.calls.values()):>6}  errors {sum(w.errors.values())}  "
                      f"lookup p50 {row['lookup_p50_ms']:.2f} ms p99 {row['lookup_p99_ms']:.2f} ms  "
                      f"recovery {row['recovery'] or 0:.1%}  RSS {row['rss_mb']:.0f} MiB  "
                      f"violations {row['invariant_violations']:.0f}", flush=True)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
    base = windows[min(args.warmup_windows, len(windows) - 1)] if windows else None
    last = windows[-1] if windows else None
    drift = {}
    if base and last:
        for k in ("lookup_p50_ms", "lookup_p99_ms", "recovery", "rss_mb"):
            if base[k]:
                drift[k] = last[k] / base[k]
        print("last window / first after warm-up: " + ", ".join(f"{k} {v:.2f}x" for k, v in drift.items()))
    total_errors = sum(sum(w["errors"].values()) for w in windows)
    print(f"errors {total_errors}, invariant violations {last['invariant_violations'] if last else 0:.0f}")
    path = write_results("soak", {"machine": machine(), "args": vars(args), "prompts": len(prompts),
                                  "windows": windows, "drift": drift, "errors": total_errors})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
