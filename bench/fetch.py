"""Fetch throughput and the end-to-end cost of a reused chunk, measured in one run.

    ./dev bench fetch

Every Fetch is timed twice on this checkout's sidecar, interleaved: over the gRPC stream and
through the shared-memory data plane (``shared_memory=True``: a same-host engine's default).

1. ``Fetch`` of one 16 MiB chunk (CPU tier, raw: no rotation) over loopback gRPC, as a fraction
   of a bare server-streaming RPC that sends the same bytes in the same 2 MiB messages from a
   grpc.aio server process of its own (goal: >= 50%).
2. Lookup + Fetch (rotated by a non-zero delta, CPU tier) per 128-token chunk for a
   DeepSeek-V2-Lite-shaped payload (MLA: 27 layers x (c_kv 512 + k_pe 64), bf16: 4.5 MiB) and a
   Llama-3-8B-shaped one (32 layers x K,V 8 x 128, bf16: 16 MiB), with the breakdown.
3. The same for the TTFT bench's agent_meta body on its ``--model random`` KV: 64 chunks (8K
   tokens, 4 layers x K,V 2 x 64, fp32: 32 MiB) shifted behind a 1000-token header, also as the
   span items an engine sends (``plan.fetch_spans()``: one 8K-token item).

``--baseline DIR`` starts a second sidecar from another checkout (e.g. ``git archive`` of the
commit before a change) and times it in the same run, interleaved rep by rep; the figures of the
result file from before batched Fetch rotation (commit 4a610a9) stay under ``before``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import torch

from bench.harness import RESULTS, machine, pct, sidecar_process, time_calls, write_results
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



def random_llama_4x512() -> tuple[KVLayout, RopeSpec]:
    """The TTFT bench's ``--model random`` KV: 4 layers x K,V 2 x 64, fp32 (4 KiB per token)."""
    layout = KVLayout.gqa(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32")
    inv = (1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))).tolist()
    return layout, RopeSpec(rotary_dim=64, key_dim=64, layout=RotaryLayout.LEADING, pairing=Pairing.HALF, inv_freq=inv)


#: name -> (layout and spec, chunks of 128 tokens, shift): one chunk of each big shape, and the
#: TTFT bench's agent_meta body (8K tokens behind a changed 1000-token header).
CASES = {
    "llama3_8b": (llama3_8b, 1, 40),
    "deepseek_v2_lite": (deepseek_v2_lite, 1, 40),
    "agent_meta_8k_random_4x512": (random_llama_4x512, 64, 1000),
}


def prepare(c: SyncSidecarClient, name: str, rng: np.random.Generator, shm: SyncSidecarClient | None = None):
    """Store the case's chunks (128-token anchored messages at position 0..) with payloads; return
    the calls to time: Lookup of the shifted prompt, rotated Fetch and raw Fetch of its hits over
    the stream (``c``), and with ``shm`` the same Fetches through shared-memory buffers."""
    make, chunks, shift = CASES[name]
    layout, spec = make()
    ident = CacheIdentity(model_id=name, kv_layout=layout.fingerprint(), rope_fingerprint=spec.fingerprint)
    msgs = [np.concatenate([[ANCHOR], rng.integers(0, 150_000, 127)]) for _ in range(chunks)]
    first = np.concatenate([*msgs, [ANCHOR]]).astype(np.uint32)
    meta = c.store(first, identity=ident)
    bounds = meta.chunk_bounds
    g = torch.Generator().manual_seed(0)
    payloads = {int(a): torch.randn((b - a) * layout.bytes_per_token // 2, generator=g).to(torch.bfloat16)
                for a, b in zip(bounds[:-1], bounds[1:]) if b - a == 128}
    c.store(first, identity=ident, layout=layout, payloads=payloads)
    # The same messages later in another prompt: shifted by ``shift``.
    prompt = np.concatenate([[ANCHOR], rng.integers(0, 150_000, shift - 1), *msgs]).astype(np.uint32)
    hits = c.lookup(prompt, identity=ident).hits()
    items = [(h.chunk_hash, h.start - h.chunk_offset) for h in hits]
    # The same hits as span items (plan.fetch_spans: one item per hit segment, joined by the
    # sidecar), as the reference engine fetches them; whole chunks (no boundary repair).
    spans = c.lookup(prompt, identity=ident, recompute_tokens=0).fetch_spans()
    assert len(items) == chunks, f"{name}: {len(items)} hits for {chunks} chunks"
    size = sum(int(b - a) for a, b in zip(bounds[:-1], bounds[1:]) if b - a == 128) * layout.bytes_per_token
    calls = {
        "lookup": lambda: c.lookup(prompt, identity=ident),
        "fetch_rotated": lambda: c.fetch(items, identity=ident, layout=layout, rope=spec),
        "fetch_raw": lambda: c.fetch(items, identity=ident, layout=layout, raw=True),
    }
    if shm is not None:
        calls["fetch_rotated_shm"] = lambda: shm.fetch(items, identity=ident, layout=layout, rope=spec)
        calls["fetch_raw_shm"] = lambda: shm.fetch(items, identity=ident, layout=layout, raw=True)
        if chunks > 1:
            calls["fetch_span_rotated"] = lambda: c.fetch(spans, identity=ident, layout=layout, rope=spec)
            calls["fetch_span_rotated_shm"] = lambda: shm.fetch(spans, identity=ident, layout=layout, rope=spec)
    info = {"span_items": len(spans)}
    return calls, {**info, "chunks": chunks, "chunk_tokens": 128, "tokens": 128 * chunks, "shift": shift,
                   "payload_mib": size / MiB}


def paired(calls: dict[str, dict[str, Callable]], reps: int, warmup: int) -> dict[str, dict[str, np.ndarray]]:
    """Time every server's calls rep by rep, interleaved (server A, server B, A, B, ...), so that
    load from other processes hits both alike."""
    for fns in calls.values():
        for fn in fns.values():
            for _ in range(warmup):
                fn()
    out = {srv: {k: np.empty(reps) for k in fns} for srv, fns in calls.items()}
    for i in range(reps):
        for srv, fns in calls.items():
            for k, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                out[srv][k][i] = time.perf_counter() - t0
    return out


def summarize(t: dict[str, np.ndarray], info: dict) -> dict:
    size = info["payload_mib"] * MiB
    return {
        **info,
        "lookup_p50_ms": pct(t["lookup"], 50) * 1e3,
        "fetch_rotated_p50_ms": pct(t["fetch_rotated"], 50) * 1e3,
        "fetch_raw_p50_ms": pct(t["fetch_raw"], 50) * 1e3,
        "end_to_end_p50_ms": (pct(t["lookup"], 50) + pct(t["fetch_rotated"], 50)) * 1e3,
        "end_to_end_p99_ms": (pct(t["lookup"], 99) + pct(t["fetch_rotated"], 99)) * 1e3,
        "rotation_overhead_ms": (pct(t["fetch_rotated"], 50) - pct(t["fetch_raw"], 50)) * 1e3,
        "fetch_rotated_gbps": size / pct(t["fetch_rotated"], 50) / 1e9,
        **({
            "fetch_rotated_shm_p50_ms": pct(t["fetch_rotated_shm"], 50) * 1e3,
            "fetch_rotated_shm_p99_ms": pct(t["fetch_rotated_shm"], 99) * 1e3,
            "fetch_raw_shm_p50_ms": pct(t["fetch_raw_shm"], 50) * 1e3,
            "fetch_rotated_p99_ms": pct(t["fetch_rotated"], 99) * 1e3,
            "shm_vs_stream_rotated": pct(t["fetch_rotated_shm"], 50) / pct(t["fetch_rotated"], 50),
        } if "fetch_rotated_shm" in t else {}),
        **({
            "fetch_span_rotated_p50_ms": pct(t["fetch_span_rotated"], 50) * 1e3,
            "fetch_span_rotated_shm_p50_ms": pct(t["fetch_span_rotated_shm"], 50) * 1e3,
            "shm_vs_stream_span_rotated": pct(t["fetch_span_rotated_shm"], 50) / pct(t["fetch_span_rotated"], 50),
        } if "fetch_span_rotated" in t else {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another checkout (e.g. the commit before a change): its sidecar is timed in the same run, "
                         "interleaved with this one, under 'baseline_same_run'")
    ap.add_argument("--bare-server", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_server:
        _bare_server(args.bare_server)
        return
    old = json.loads((RESULTS / "fetch.json").read_text()) if (RESULTS / "fetch.json").exists() else {}
    results: dict = {"machine": machine()}
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

    flags = ("--set", f"chunker.anchor_tokens=[{ANCHOR}]", "--set", "store.cpu_bytes=2147483648",
             "--set", "chunker.min_size=128", "--set", "chunker.max_size=128")
    servers = {"new": None} if args.baseline is None else {"new": None, "baseline": args.baseline.resolve()}
    with contextlib.ExitStack() as stack:
        clients, targets = {}, {}
        for srv, root in servers.items():
            target = targets[srv] = stack.enter_context(sidecar_process(*flags, root=root))
            clients[srv] = stack.enter_context(SyncSidecarClient(target, tenant="bench", timeout_s=120, shared_memory=False))
        # The shared-memory data plane (same-host engines), on this checkout's sidecar only.
        shm_client = stack.enter_context(SyncSidecarClient(targets["new"], tenant="bench", timeout_s=120,
                                                           shared_memory=True))
        rows: dict[str, dict] = {srv: {} for srv in servers}
        for name in CASES:
            calls, info = {}, {}
            for srv, c in clients.items():
                calls[srv], info = prepare(c, name, np.random.default_rng(0), shm_client if srv == "new" else None)
            reps = args.reps if info["chunks"] == 1 else max(10, args.reps // 2)
            timed = paired(calls, reps, warmup=3)
            for srv in servers:
                rows[srv][name] = summarize(timed[srv], info)
    results["chunks"] = rows["new"]
    big = rows["new"]["llama3_8b"]
    results["fetch_16mib_raw_p50_ms"] = big["fetch_raw_p50_ms"]
    results["bare_stream_16mib_p50_ms"] = pct(bare, 50) * 1e3
    results["fetch_vs_bare"] = pct(bare, 50) / (big["fetch_raw_p50_ms"] / 1e3)
    results["fetch_shm_16mib_raw_p50_ms"] = big["fetch_raw_shm_p50_ms"]
    results["fetch_shm_vs_bare"] = pct(bare, 50) / (big["fetch_raw_shm_p50_ms"] / 1e3)
    if "baseline" in rows:
        results["baseline_same_run"] = {"root": str(args.baseline), "chunks": rows["baseline"]}
    before = old.get("before")
    if before is None and "chunks" in old:  # the first run after batched rotation keeps the figures before it
        before = {k: old[k] for k in old if k != "machine"}
        before["note"] = "per-chunk-per-layer rotation on Fetch, before batched rotation (commit 4a610a9)"
    if before is not None:
        results["before"] = before
    results.update({k: v for k, v in old.items() if k.startswith("ab_")})  # recorded A/B runs stay

    print(f"16 MiB over loopback: bare stream {results['bare_stream_16mib_p50_ms']:.2f} ms "
          f"({nbytes / results['bare_stream_16mib_p50_ms'] / 1e6:.2f} GB/s), Fetch (raw) "
          f"{results['fetch_16mib_raw_p50_ms']:.2f} ms -> Fetch = {results['fetch_vs_bare']:.2f} of bare "
          f"(goal >= 0.50: {'met' if results['fetch_vs_bare'] >= 0.5 else 'MISSED'}); through shared memory "
          f"{results['fetch_shm_16mib_raw_p50_ms']:.2f} ms = {results['fetch_shm_vs_bare']:.2f} of bare")
    print(f"{'payload':<28} {'server':<9} {'tokens':>6} {'MiB':>6} {'lookup':>8} {'fetch+rot':>10} {'fetch raw':>10} "
          f"{'rot cost':>9} {'e2e p50':>8} {'e2e p99':>8}  (ms)")
    for name in CASES:
        for srv in servers:
            r = rows[srv][name]
            print(f"{name:<28} {srv:<9} {r['tokens']:>6} {r['payload_mib']:>6.2f} {r['lookup_p50_ms']:>8.3f} "
                  f"{r['fetch_rotated_p50_ms']:>10.2f} {r['fetch_raw_p50_ms']:>10.2f} {r['rotation_overhead_ms']:>9.2f} "
                  f"{r['end_to_end_p50_ms']:>8.2f} {r['end_to_end_p99_ms']:>8.2f}")
        n = rows["new"][name]
        print(f"{'':<28} {'shm':<9} {'':>6} {'':>6} {'':>8} {n['fetch_rotated_shm_p50_ms']:>10.2f} "
              f"{n['fetch_raw_shm_p50_ms']:>10.2f}  shared memory / stream (rotated): {n['shm_vs_stream_rotated']:.2f}")
        if "fetch_span_rotated_p50_ms" in n:
            print(f"{'':<28} {n['span_items']} span item(s), rotated: stream {n['fetch_span_rotated_p50_ms']:.2f} ms, "
                  f"shared memory {n['fetch_span_rotated_shm_p50_ms']:.2f} ms ({n['shm_vs_stream_span_rotated']:.2f})")
        if "baseline" in rows:
            b, n = rows["baseline"][name], rows["new"][name]
            print(f"{'':<28} new/baseline: fetch+rot {n['fetch_rotated_p50_ms'] / b['fetch_rotated_p50_ms']:.2f}, "
                  f"rot cost {n['rotation_overhead_ms']:.2f} vs {b['rotation_overhead_ms']:.2f} ms")
    print(f"results: {write_results('fetch', results)}")


if __name__ == "__main__":
    main()
