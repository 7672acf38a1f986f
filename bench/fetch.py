"""Fetch throughput and the end-to-end cost of a reused chunk, measured in one run.

    ./dev bench fetch

1. ``Fetch`` of one 16 MiB chunk (CPU tier, raw: no rotation) over loopback gRPC, as a fraction
   of a bare server-streaming RPC that sends the same bytes in the same 2 MiB messages from a
   grpc.aio server process of its own (goal: >= 50%).
2. Lookup + Fetch (rotated by a non-zero delta, CPU tier) per 128-token chunk for a
   DeepSeek-V2-Lite-shaped payload (MLA: 27 layers x (c_kv 512 + k_pe 64), bf16: 4.5 MiB) and a
   Llama-3-8B-shaped one (32 layers x K,V 8 x 128, bf16: 16 MiB), with the breakdown.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

import grpc
import numpy as np
import torch

from bench.harness import machine, pct, sidecar_process, time_calls, write_results
from sidecar.client import SyncSidecarClient
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.rotation import RopeSpec
from sidecar.rotation.spec import Pairing, RotaryLayout

MiB = 1 << 20
PART = 2 * MiB
ANCHOR = 151644


def _bare_server(nbytes: int) -> None:
    """A grpc.aio server with one server-streaming method that sends ``nbytes`` in 2 MiB parts."""
    import uvloop

    blob = bytes(nbytes)
    parts = [blob[i : i + PART] for i in range(0, nbytes, PART)]

    async def stream(request, context):
        for p in parts:
            yield p

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 * MiB)])
        handler = grpc.method_handlers_generic_handler(
            "bench.Bare", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    uvloop.run(main())


def llama3_8b() -> tuple[KVLayout, RopeSpec]:
    layout = KVLayout.gqa(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    inv = (1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))).tolist()
    return layout, RopeSpec(rotary_dim=128, key_dim=128, layout=RotaryLayout.LEADING, pairing=Pairing.HALF, inv_freq=inv)


def deepseek_v2_lite() -> tuple[KVLayout, RopeSpec]:
    layout = KVLayout.mla(num_layers=27, kv_lora_rank=512, qk_rope_head_dim=64, dtype="bfloat16")
    inv = (1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))).tolist()
    spec = RopeSpec(rotary_dim=64, key_dim=64, layout=RotaryLayout.TRAILING, pairing=Pairing.INTERLEAVED, inv_freq=inv)
    return layout, spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--bare-server", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_server:
        _bare_server(args.bare_server)
        return
    results: dict = {"machine": machine()}
    rng = np.random.default_rng(0)
    nbytes = 16 * MiB

    # 1. bare stream of 16 MiB.
    proc = subprocess.Popen([sys.executable, "-m", "bench.fetch", "--bare-server", str(nbytes)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 * MiB)]) as ch:
            call = ch.unary_stream("/bench.Bare/Stream")
            bare = time_calls(lambda: b"".join(call(b"")), args.reps, warmup=5)
    finally:
        proc.kill()

    with sidecar_process("--set", f"chunker.anchor_tokens=[{ANCHOR}]", "--set", "store.cpu_bytes=2147483648",
                         "--set", "chunker.min_size=128", "--set", "chunker.max_size=128") as target:
        with SyncSidecarClient(target, tenant="bench", timeout_s=60) as c:
            rows = {}
            for name, (layout, spec) in {"llama3_8b": llama3_8b(), "deepseek_v2_lite": deepseek_v2_lite()}.items():
                ident = CacheIdentity(model_id=name, kv_layout=layout.fingerprint(), rope_fingerprint=spec.fingerprint)
                # A 128-token chunk (an anchored message), stored once at position 0.
                msg = np.concatenate([[ANCHOR], rng.integers(0, 150_000, 127)]).astype(np.uint32)
                first = np.concatenate([msg, [ANCHOR]]).astype(np.uint32)
                meta = c.store(first, identity=ident)
                n = meta.chunk_bounds[1]
                payload = torch.randn(n * layout.bytes_per_token // 2, dtype=torch.float32).to(torch.bfloat16)
                c.store(first, identity=ident, layout=layout, payloads={0: payload})
                # The same message later in another prompt: shifted by 40.
                prompt = np.concatenate([[ANCHOR], rng.integers(0, 150_000, 39), msg]).astype(np.uint32)
                plan = c.lookup(prompt, identity=ident)
                hit = plan.hits()[0]
                items = [(hit.chunk_hash, hit.start - hit.chunk_offset)]
                lookup = time_calls(lambda: c.lookup(prompt, identity=ident), args.reps, warmup=5)
                fetch_rot = time_calls(lambda: c.fetch(items, identity=ident, layout=layout, rope=spec), args.reps, warmup=3)
                fetch_raw = time_calls(lambda: c.fetch(items, identity=ident, layout=layout, raw=True), args.reps, warmup=3)
                size = n * layout.bytes_per_token
                rows[name] = {
                    "chunk_tokens": n,
                    "payload_mib": size / MiB,
                    "lookup_p50_ms": pct(lookup, 50) * 1e3,
                    "fetch_rotated_p50_ms": pct(fetch_rot, 50) * 1e3,
                    "fetch_raw_p50_ms": pct(fetch_raw, 50) * 1e3,
                    "end_to_end_p50_ms": (pct(lookup, 50) + pct(fetch_rot, 50)) * 1e3,
                    "end_to_end_p99_ms": (pct(lookup, 99) + pct(fetch_rot, 99)) * 1e3,
                    "rotation_overhead_ms": (pct(fetch_rot, 50) - pct(fetch_raw, 50)) * 1e3,
                    "fetch_rotated_gbps": size / pct(fetch_rot, 50) / 1e9,
                }
                if name == "llama3_8b":
                    results["fetch_16mib_raw_p50_ms"] = pct(fetch_raw, 50) * 1e3
                    results["bare_stream_16mib_p50_ms"] = pct(bare, 50) * 1e3
                    results["fetch_vs_bare"] = pct(bare, 50) / pct(fetch_raw, 50)
            results["chunks"] = rows

    print(f"16 MiB over loopback: bare stream {results['bare_stream_16mib_p50_ms']:.2f} ms "
          f"({nbytes / results['bare_stream_16mib_p50_ms'] / 1e6:.2f} GB/s), Fetch (raw) "
          f"{results['fetch_16mib_raw_p50_ms']:.2f} ms -> Fetch = {results['fetch_vs_bare']:.2f} of bare "
          f"(goal >= 0.50: {'met' if results['fetch_vs_bare'] >= 0.5 else 'MISSED'})")
    print(f"{'payload':<18} {'tokens':>6} {'MiB':>6} {'lookup':>8} {'fetch+rot':>10} {'fetch raw':>10} "
          f"{'rot cost':>9} {'e2e p50':>8} {'e2e p99':>8}  (ms)")
    for name, r in rows.items():
        print(f"{name:<18} {r['chunk_tokens']:>6} {r['payload_mib']:>6.2f} {r['lookup_p50_ms']:>8.3f} "
              f"{r['fetch_rotated_p50_ms']:>10.2f} {r['fetch_raw_p50_ms']:>10.2f} {r['rotation_overhead_ms']:>9.2f} "
              f"{r['end_to_end_p50_ms']:>8.2f} {r['end_to_end_p99_ms']:>8.2f}")
    print(f"results: {write_results('fetch', results)}")


if __name__ == "__main__":
    main()
