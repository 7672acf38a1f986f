"""Lookup round-trip latency vs an empty unary RPC on the same server, measured in one run.

    ./dev bench lookup            # 1K / 8K / 32K-token prompts; budget: 32K Lookup <= 1.5x, 1K <= 1.2x
    ./dev bench lookup --baseline /tmp/main   # another checkout's server too, interleaved
    ./dev bench lookup --breakdown  # where a Lookup's server time goes, in process (no gRPC)

The sidecar runs in its own process (as deployed). For each size the registry holds an earlier
prompt whose body the measured prompt shifts (a new agent header), so the Lookup does the full
work: chunk, fingerprint, find and token-verify every chunk, extend and repair the hits, build
the plan. The client sends pre-packed token bytes (as an engine holds them) and decodes the
plan. Pings and Lookups (and with ``--baseline`` the other server's) are timed in alternating
blocks of back-to-back calls, so load from other processes hits every arm alike; the load
average goes into the results. ``floor`` is a 16-token Lookup timed in the same blocks: what
any Lookup costs before its first token is planned (the request and plan messages, the
servicer's tenancy, limits and metrics, grpc.aio's handling of a call that is not a constant
reply), the part of the ratio that does not grow with the prompt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

from bench.harness import RESULTS, machine, pct, sidecar_process, time_calls, write_results
from sidecar.api.kv import identity_to_wire, lookup_plan_from_wire
from sidecar.client import SyncSidecarClient
from sidecar.identity import CacheIdentity
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc

ANCHORS = (151644, 151645)


def conversation(rng: np.random.Generator, n: int) -> np.ndarray:
    """~n tokens of chat: messages of 100-1500 tokens, each opened by an anchor."""
    parts, total = [], 0
    while total < n:
        m = int(rng.integers(100, 1500))
        parts.append(np.concatenate([[ANCHORS[0]], rng.integers(0, 150_000, m)]))
        total += m + 1
    return np.concatenate(parts).astype(np.uint32)[:n]


def breakdown(sizes: list[int], reps: int) -> dict:
    """The server-side phases of the same Lookups, in this process (a ``ServerThread``'s
    servicer, no gRPC): request decoding, the Lookup (chunking + fingerprints + planning: one
    compiled call), the plan message, its encoding, the metrics. For context, not part of a
    Lookup: chunking + fingerprints alone (``chunk``) and the reference planner's Lookup
    (``reference``, Python per chunk), and what seeds cost where nothing hits: the Lookup of a
    prompt of new text (``miss``: chunk hits fail, then the whole prompt is scanned for seed
    windows and each is probed), the same with ``seed_interval: 0`` (``miss_no_seeds``), and the
    window scan alone (``seed_windows``). Minimum and median microseconds over ``reps`` after
    warm-up, the phases interleaved."""
    from sidecar.api.kv import lookup_plan_to_wire
    from sidecar.app import ServerThread
    from sidecar.config import load_config
    from sidecar.registry.chunk_index import ChunkIndex
    from sidecar.registry.registry import InMemoryRegistry, RegistryConfig
    from sidecar.registry.seeds import windows

    phases = ("decode", "lookup", "to_wire", "serialize", "metrics", "chunk", "reference", "miss", "miss_no_seeds",
              "seed_windows")
    cfg = load_config(None, env={}, overrides={"port": 0, "metrics_port": -1, "chunker.anchor_tokens": list(ANCHORS)})
    rng = np.random.default_rng(0)
    ident = CacheIdentity(model_id="bench")
    out = {}
    clock = time.perf_counter
    with ServerThread(cfg) as st, SyncSidecarClient(st.target, tenant="bench") as client:
        sv = st.server.kv
        index, observe = sv.index, sv.metrics.lookup_hit_segment_tokens.observe_many
        for n in sizes:
            body = conversation(rng, n - 64)
            old = np.concatenate([[ANCHORS[1]], rng.integers(0, 150_000, 40), body]).astype(np.uint32)
            new = np.concatenate([[ANCHORS[1]], rng.integers(0, 150_000, 62), body]).astype(np.uint32)
            client.store(old, identity=ident)
            req = pb.LookupRequest(tokens=new.tobytes(), identity=identity_to_wire(ident), dry_run=True,
                                   engine_prefix_len=1)
            unseeded = ChunkIndex(index.chunker, InMemoryRegistry(RegistryConfig(seed_interval=0)))
            unseeded.register(old, old.tobytes(), ident, "bench")
            fresh = conversation(rng, n)
            miss = sv.lookup_query(pb.LookupRequest(tokens=fresh.tobytes(), identity=identity_to_wire(ident),
                                                     dry_run=True), "bench")
            bits = index.registry.table.seed_bits

            def once() -> list[float]:
                t = [clock()]
                q = sv.lookup_query(req, "bench")
                t.append(clock())
                plan = index.lookup(q)
                t.append(clock())
                msg = lookup_plan_to_wire(plan)
                t.append(clock())
                msg.SerializeToString()
                t.append(clock())
                sv._count_lookup(q, plan.summary)
                observe(plan.hit_segment_tokens)
                t.append(clock())
                index.chunk(q.tokens, q.identity, (q.scope,))
                t.append(clock())
                index.lookup_reference(q)
                t.append(clock())
                index.lookup(miss)
                t.append(clock())
                unseeded.lookup(miss)
                t.append(clock())
                windows(fresh, 0, len(fresh), bits)
                t.append(clock())
                return np.diff(t).tolist()

            for _ in range(min(200, reps)):
                once()
            a = np.array([once() for _ in range(reps)]) * 1e6
            row = {p: {"min_us": float(a[:, i].min()), "p50_us": float(np.median(a[:, i]))} for i, p in enumerate(phases)}
            row["compiled_lookups"], row["reference_lookups"] = index.compiled_lookups, index.reference_lookups
            out[str(n)] = row
            print(f"{n:>6} tokens, us min / p50: " + ", ".join(f"{p} {row[p]['min_us']:.0f} / {row[p]['p50_us']:.0f}"
                                                             for p in phases))
    return out


def alternating(calls: dict[str, dict[str, Callable[[], object]]], reps: int, rounds: int = 20,
                warmup: int = 50) -> dict[str, dict[str, np.ndarray]]:
    """``reps`` timed calls of each server's each call, in blocks of ``reps / rounds`` back to
    back (as ``time_calls``: a call right after a different one is slower, a Ping after a 32K
    Lookup by ~0.2 ms), the blocks alternating server by server and call by call, so that load
    from other processes hits every arm alike."""
    for fns in calls.values():
        for fn in fns.values():
            for _ in range(warmup):
                fn()
    out: dict[str, dict[str, list[np.ndarray]]] = {srv: {k: [] for k in fns} for srv, fns in calls.items()}
    block = max(1, reps // rounds)
    for _ in range(rounds):
        for srv, fns in calls.items():
            for k, fn in fns.items():
                out[srv][k].append(time_calls(fn, block, warmup=5))
    return {srv: {k: np.concatenate(v) for k, v in fns.items()} for srv, fns in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1024,8192,32768")
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--breakdown", action="store_true", help="only the in-process phase breakdown (lookup_breakdown.json)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another checkout (e.g. git archive of main) served too, its blocks alternating with this "
                         "one's; under 'baseline_same_run'")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.breakdown:
        result = {"machine": machine(), "reps": args.reps, "sizes": breakdown(sizes, args.reps)}
        print(f"results: {write_results('lookup_breakdown', result)}")
        return
    ident = CacheIdentity(model_id="bench")
    wire_ident = identity_to_wire(ident)
    md = (("x-tenant-id", "bench"),)
    ping_req = pb.PingRequest()
    # The floor: a Lookup of 16 tokens (nothing to plan) costs what every Lookup pays in gRPC,
    # the servicer and the plan message before the first token is planned.
    floor_req = pb.LookupRequest(tokens=np.arange(16, dtype=np.uint32).tobytes(), identity=wire_ident, dry_run=True,
                                 engine_prefix_len=1)
    results = {"machine": machine(), "load_average": os.getloadavg(), "reps": args.reps, "sizes": {}}
    servers = {"new": None} if args.baseline is None else {"new": None, "baseline": args.baseline.resolve()}
    rows: dict[str, dict[str, dict]] = {srv: {} for srv in servers}
    anchors = "[" + ",".join(map(str, ANCHORS)) + "]"
    with contextlib.ExitStack() as stack:
        stubs = {}
        for srv, root in servers.items():
            target = stack.enter_context(sidecar_process("--set", f"chunker.anchor_tokens={anchors}", root=root))
            client = stack.enter_context(SyncSidecarClient(target, tenant="bench"))
            stubs[srv] = (client, pb_grpc.KVSidecarStub(stack.enter_context(grpc.insecure_channel(target))))
        print(f"{'tokens':>7} {'server':>8} {'hit%':>5} {'p50 ms':>8} {'p99 ms':>8} {'ping p50':>9} {'p50/ping':>9} "
              f"{'p99/ping':>9} {'floor/ping':>10}")
        rng = np.random.default_rng(0)
        for n in sizes:
            body = conversation(rng, n - 64)
            old = np.concatenate([[ANCHORS[1]], rng.integers(0, 150_000, 40), body]).astype(np.uint32)
            new = np.concatenate([[ANCHORS[1]], rng.integers(0, 150_000, 62), body]).astype(np.uint32)
            req = pb.LookupRequest(tokens=new.tobytes(), identity=wire_ident, dry_run=True, engine_prefix_len=1)
            calls, plans = {}, {}
            for srv, (client, stub) in stubs.items():
                client.store(old, identity=ident)
                plans[srv] = plan = lookup_plan_from_wire(stub.Lookup(req, metadata=md))
                plan.check_tiling(len(new))
                calls[srv] = {
                    "ping": lambda stub=stub: stub.Ping(ping_req, metadata=md),
                    "lookup": lambda stub=stub: lookup_plan_from_wire(stub.Lookup(req, metadata=md)),
                    "floor": lambda stub=stub: lookup_plan_from_wire(stub.Lookup(floor_req, metadata=md)),
                }
            timed = alternating(calls, args.reps)
            for srv in servers:
                plan, lat, ping = plans[srv], timed[srv]["lookup"], timed[srv]["ping"]
                row = {
                    "tokens": len(new),
                    "segments": len(plan),
                    "shifted_hit_fraction": plan.summary.shifted_tokens / len(new),
                    "lookup_p50_ms": pct(lat, 50) * 1e3,
                    "lookup_p99_ms": pct(lat, 99) * 1e3,
                    "ping_p50_ms": pct(ping, 50) * 1e3,
                    "ping_p99_ms": pct(ping, 99) * 1e3,
                    "floor_p50_ms": pct(timed[srv]["floor"], 50) * 1e3,
                }
                row["floor_ratio"] = row["floor_p50_ms"] / row["ping_p50_ms"]
                row["p50_ratio"] = row["lookup_p50_ms"] / row["ping_p50_ms"]
                row["p99_ratio"] = row["lookup_p99_ms"] / row["ping_p99_ms"]
                rows[srv][str(n)] = row
                print(f"{len(new):>7} {srv:>8} {100 * row['shifted_hit_fraction']:>5.1f} {row['lookup_p50_ms']:>8.3f} "
                      f"{row['lookup_p99_ms']:>8.3f} {row['ping_p50_ms']:>9.3f} {row['p50_ratio']:>9.2f} "
                      f"{row['p99_ratio']:>9.2f} {row['floor_ratio']:>10.2f}")
            if "baseline" in plans:
                assert np.array_equal(plans["new"].table, plans["baseline"].table), "the plans differ from the baseline's"
    results["sizes"] = rows["new"]
    if "baseline" in rows:
        results["baseline_same_run"] = {"root": str(args.baseline), "sizes": rows["baseline"]}
    results["load_average_after"] = os.getloadavg()
    for n, budget in ((max(sizes), 1.5), (min(sizes), 1.2)):
        row = results["sizes"][str(n)]
        print(f"budget: {n}-token Lookup p50 <= {budget}x empty RTT: "
              f"{'met' if row['p50_ratio'] <= budget else 'MISSED'} ({row['p50_ratio']:.2f}x)")
    kept = _before()
    results.update(kept)
    before = kept.get("before")
    if before:
        print(f"before ({before.get('label', 'earlier run')}) -> now, p50 ms (p50/ping):")
        for k, row in results["sizes"].items():
            b = before.get("sizes", {}).get(k)
            if b:
                print(f"  {k:>6}: {b['lookup_p50_ms']:.3f} ({b['p50_ratio']:.2f}x) -> {row['lookup_p50_ms']:.3f} "
                      f"({row['p50_ratio']:.2f}x); segments {b['segments']} -> {row['segments']}")
    print(f"load average {results['load_average']} -> {results['load_average_after']}")
    print(f"results: {write_results('lookup', results)}")


BEFORE_LABEL = "the code before hit segments (commit 4a610a9), same machine, run just before"


def _before() -> dict:
    """The earlier figures the results file keeps: the previous file's ``before*`` blocks (or,
    the first time, its figures as ``before``)."""
    try:
        old = json.loads((RESULTS / "lookup.json").read_text())
    except (OSError, ValueError):
        return {}
    if "before" in old:
        return {k: v for k, v in old.items() if k.startswith("before")}
    return {"before": {"label": BEFORE_LABEL, "machine": old.get("machine"), "reps": old.get("reps"),
                       "sizes": old.get("sizes", {})}}


if __name__ == "__main__":
    main()
