"""Lookup round-trip latency vs an empty unary RPC on the same server, measured in one run.

    ./dev bench lookup            # 1K / 8K / 32K-token prompts; budget: 32K Lookup <= 2x empty RTT
    ./dev bench lookup --breakdown  # where a Lookup's server time goes, in process (no gRPC)

The sidecar runs in its own process (as deployed). For each size the registry holds an earlier
prompt whose body the measured prompt shifts (a new agent header), so the Lookup does the full
work: chunk, fingerprint two scopes, find and token-verify every chunk, build the plan. The
client sends pre-packed token bytes (as an engine holds them) and decodes the plan.
"""

from __future__ import annotations

import argparse

import grpc
import numpy as np

import json

from bench.harness import RESULTS, machine, pct, sidecar_process, time_calls, write_results
from sidecar.client import SyncSidecarClient
from sidecar.identity import CacheIdentity
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc
from sidecar.wire import identity_to_wire, plan_from_wire

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
    servicer, no gRPC): request decoding, chunking + fingerprints, planning, the plan message
    and its encoding. Minimum and median microseconds over ``reps`` after warm-up."""
    import time

    from sidecar.config import load_config
    from sidecar.server import ServerThread
    from sidecar.wire import plan_to_wire

    phases = ("decode", "chunk", "plan", "to_wire", "serialize")
    cfg = load_config(None, env={}, overrides={"port": 0, "metrics_port": -1, "chunker.anchor_tokens": list(ANCHORS)})
    rng = np.random.default_rng(0)
    ident = CacheIdentity(model_id="bench")
    out = {}
    with ServerThread(cfg) as st, SyncSidecarClient(st.target, tenant="bench") as client:
        sv = st.server.servicer
        for n in sizes:
            body = conversation(rng, n - 64)
            old = np.concatenate([[ANCHORS[1]], rng.integers(0, 150_000, 40), body]).astype(np.uint32)
            new = np.concatenate([[ANCHORS[1]], rng.integers(0, 150_000, 62), body]).astype(np.uint32)
            client.store(old, identity=ident)
            req = pb.LookupRequest(tokens=new.tobytes(), identity=identity_to_wire(ident), dry_run=True,
                                   engine_prefix_len=1)

            def once() -> list[float]:
                t = [time.perf_counter()]
                q = sv._lookup_query(req, "bench")
                t.append(time.perf_counter())
                chunks = sv.index.chunk(q.tokens, q.identity, (q.scope,))
                t.append(time.perf_counter())
                plan = sv.index.lookup(q, chunks)
                t.append(time.perf_counter())
                msg = plan_to_wire(plan)
                t.append(time.perf_counter())
                msg.SerializeToString()
                t.append(time.perf_counter())
                return np.diff(t).tolist()

            for _ in range(min(200, reps)):
                once()
            a = np.array([once() for _ in range(reps)]) * 1e6
            row = {p: {"min_us": float(a[:, i].min()), "p50_us": float(np.median(a[:, i]))} for i, p in enumerate(phases)}
            out[str(n)] = row
            print(f"{n:>6} tokens, us min / p50: " + ", ".join(f"{p} {row[p]['min_us']:.0f} / {row[p]['p50_us']:.0f}"
                                                             for p in phases))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1024,8192,32768")
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--breakdown", action="store_true", help="only the in-process phase breakdown (lookup_breakdown.json)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.breakdown:
        result = {"machine": machine(), "reps": args.reps, "sizes": breakdown(sizes, args.reps)}
        print(f"results: {write_results('lookup_breakdown', result)}")
        return
    rng = np.random.default_rng(0)
    ident = CacheIdentity(model_id="bench")
    wire_ident = identity_to_wire(ident)
    results = {"machine": machine(), "reps": args.reps, "sizes": {}}
    anchors = "[" + ",".join(map(str, ANCHORS)) + "]"
    with sidecar_process("--set", f"chunker.anchor_tokens={anchors}") as target:
        with SyncSidecarClient(target, tenant="bench") as client, grpc.insecure_channel(target) as ch:
            stub = pb_grpc.KVSidecarStub(ch)
            md = (("x-tenant-id", "bench"),)
            ping_req = pb.PingRequest()
            ping = time_calls(lambda: stub.Ping(ping_req, metadata=md), args.reps)
            print(f"empty unary RTT (Ping): p50 {pct(ping, 50) * 1e3:.3f} ms  p99 {pct(ping, 99) * 1e3:.3f} ms")
            print(f"{'tokens':>7} {'hit%':>5} {'p50 ms':>8} {'p99 ms':>8} {'p50/ping':>9} {'p99/ping':>9}")
            for n in sizes:
                body = conversation(rng, n - 64)
                old = np.concatenate([[ANCHORS[1]], rng.integers(0, 150_000, 40), body]).astype(np.uint32)
                new = np.concatenate([[ANCHORS[1]], rng.integers(0, 150_000, 62), body]).astype(np.uint32)
                client.store(old, identity=ident)
                req = pb.LookupRequest(tokens=new.tobytes(), identity=wire_ident, dry_run=True, engine_prefix_len=1)
                plan = plan_from_wire(stub.Lookup(req, metadata=md))
                plan.check_tiling(len(new))
                hit = plan.summary.shifted_tokens / len(new)
                lat = time_calls(lambda: plan_from_wire(stub.Lookup(req, metadata=md)), args.reps)
                ping_n = time_calls(lambda: stub.Ping(ping_req, metadata=md), args.reps // 2)
                row = {
                    "tokens": len(new),
                    "segments": len(plan),
                    "shifted_hit_fraction": hit,
                    "lookup_p50_ms": pct(lat, 50) * 1e3,
                    "lookup_p99_ms": pct(lat, 99) * 1e3,
                    "ping_p50_ms": pct(ping_n, 50) * 1e3,
                    "ping_p99_ms": pct(ping_n, 99) * 1e3,
                }
                row["p50_ratio"] = row["lookup_p50_ms"] / row["ping_p50_ms"]
                row["p99_ratio"] = row["lookup_p99_ms"] / row["ping_p99_ms"]
                results["sizes"][str(n)] = row
                print(f"{len(new):>7} {100 * hit:>5.1f} {row['lookup_p50_ms']:>8.3f} {row['lookup_p99_ms']:>8.3f} "
                      f"{row['p50_ratio']:>9.2f} {row['p99_ratio']:>9.2f}")
    big = results["sizes"].get(str(max(sizes)))
    if big:
        print(f"budget: {max(sizes)}-token Lookup p50 <= 2x empty RTT: "
              f"{'met' if big['p50_ratio'] <= 2 else 'MISSED'} ({big['p50_ratio']:.2f}x)")
    before = _before()
    if before:
        results["before"] = before
        print(f"before ({before.get('label', 'earlier run')}) -> now, p50 ms (p50/ping):")
        for k, row in results["sizes"].items():
            b = before.get("sizes", {}).get(k)
            if b:
                print(f"  {k:>6}: {b['lookup_p50_ms']:.3f} ({b['p50_ratio']:.2f}x) -> {row['lookup_p50_ms']:.3f} "
                      f"({row['p50_ratio']:.2f}x); segments {b['segments']} -> {row['segments']}")
    print(f"results: {write_results('lookup', results)}")


BEFORE_LABEL = "before issue 14 (commit 4a610a9), same machine, run just before"


def _before() -> dict | None:
    """The ``before`` block of the previous results file, or that file's figures."""
    try:
        old = json.loads((RESULTS / "lookup.json").read_text())
    except (OSError, ValueError):
        return None
    if "before" in old:
        return old["before"]
    return {"label": BEFORE_LABEL, "machine": old.get("machine"), "reps": old.get("reps"), "sizes": old.get("sizes", {})}


if __name__ == "__main__":
    main()
