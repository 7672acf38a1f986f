"""Chunker throughput: compiled fast path vs the plain-Python reference, same inputs, one run.

    ./dev bench chunker            # 32K tokens; budget <= 0.1 ms including fingerprints

Reports the median/p99 time to chunk and fingerprint 32K tokens (two scope seeds, as a Lookup
does), boundaries alone, and the speed-up over the reference implementation.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.harness import machine, pct, time_calls, write_results
from sidecar.identity import CacheIdentity
from sidecar.registry.chunker import _U, ChunkerConfig, _boundaries, chunk_tokens, chunk_tokens_reference, warmup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=2000)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    anchors = tuple(range(151643, 151650))
    cfg = ChunkerConfig(anchor_tokens=anchors)
    toks = rng.integers(0, 150_000, size=args.tokens).astype(np.uint32)
    toks[rng.integers(0, args.tokens, size=args.tokens // 400)] = anchors[0]  # a message every ~400 tokens
    ident = CacheIdentity(model_id="bench")
    seeds = [ident.scope_seed("tenant"), ident.scope_seed("shared")]
    warmup(cfg)

    fast = time_calls(lambda: chunk_tokens(toks, cfg, seeds, ident.salt), args.reps)
    bounds_only = time_calls(
        lambda: _boundaries(toks, cfg._anchors, cfg._marker_flat, cfg._marker_offsets, _U(cfg.mask), 32, 512),
        args.reps,
    )
    t0 = time.perf_counter()
    ref_reps = 3
    for _ in range(ref_reps):
        ref = chunk_tokens_reference(toks, cfg, seeds, ident.salt)
    ref_s = (time.perf_counter() - t0) / ref_reps
    out = chunk_tokens(toks, cfg, seeds, ident.salt)
    assert np.array_equal(out.bounds, ref.bounds) and np.array_equal(out.fingerprints, ref.fingerprints)

    rows = {
        "tokens": args.tokens,
        "chunks": len(out),
        "mean_chunk_tokens": float(np.diff(out.bounds).mean()),
        "fast_p50_us": pct(fast, 50) * 1e6,
        "fast_p99_us": pct(fast, 99) * 1e6,
        "boundaries_only_p50_us": pct(bounds_only, 50) * 1e6,
        "reference_ms": ref_s * 1e3,
        "speedup_vs_reference": ref_s / pct(fast, 50),
        "ns_per_token": pct(fast, 50) * 1e9 / args.tokens,
        "budget_us": 100.0,
        "within_budget": pct(fast, 50) * 1e6 <= 100.0,
        "machine": machine(),
    }
    print(f"chunker over {args.tokens} tokens ({rows['chunks']} chunks, mean {rows['mean_chunk_tokens']:.0f} tokens)")
    print(f"  fast path (bounds + 2 scope keys + prefix digests): p50 {rows['fast_p50_us']:.1f} us, "
          f"p99 {rows['fast_p99_us']:.1f} us  ({rows['ns_per_token']:.2f} ns/token)")
    print(f"  boundaries only:                                    p50 {rows['boundaries_only_p50_us']:.1f} us")
    print(f"  reference (plain Python):                           {rows['reference_ms']:.1f} ms")
    print(f"  speed-up vs reference: {rows['speedup_vs_reference']:.0f}x; budget 100 us: "
          f"{'met' if rows['within_budget'] else 'MISSED'}")
    print(f"results: {write_results('chunker', rows)}")


if __name__ == "__main__":
    main()
