"""The vLLM worker's row copies into its standard KV layouts against a plain ``copy_`` of the same bytes.

For every ``KVCacheLayout`` (LBHNC ... BHLNC), GQA (8 KV heads x 128, like Llama-3-8B) and MLA
(one 576-wide latent row, like DeepSeek-V3), bf16: a cache of 8 layers x 512 blocks of 16 tokens
built as vLLM builds it (one flat buffer, per-layer logical ``[B, H, N, C]`` views), and a run of
4096 tokens whose blocks are scattered over the cache. Timed are exactly the calls the worker
makes (``clients.vllm.worker_side``), on one intra-op thread as the worker runs them
(``paged.single_threaded``), interleaved:

* ``load``: ``StandardKV.scatter`` / ``LatentKV.scatter`` of the run's rows (``[L, 2, n, H, D]`` /
  ``[L, n, C]``) at its positions, given the request's block table;
* ``save``: ``gather`` of the same positions back into new rows;
* ``copy``: ``dst.copy_(rows)`` of the same number of bytes into a contiguous buffer (the floor);
* ``new_copy``: ``torch.empty_like(rows).copy_(rows)``: the floor of a copy into new memory,
  which is what ``gather`` returns (its first touch costs page faults on the host).

Reported: GB/s of each and ``load / copy``, ``save / copy``, ``save / new_copy`` (goal: load and
save >= 0.5 of copy on CPU tensors).
Run: ``./dev bench vllm_layouts`` (about a minute); ``--device cuda`` on a GPU. Writes
bench/results/vllm_layouts.json (CPU) or vllm_layouts_cuda.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from clients.vllm.layouts import KV_CACHE_LAYOUTS, LatentKV, PagedSpec, StandardKV, kv_cache_views
from clients.vllm.paged import single_threaded

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUTS = KV_CACHE_LAYOUTS
LAYERS, BLOCKS, BLOCK_SIZE, RUN_TOKENS = 8, 512, 16, 4096
GOAL = 0.5


def specs(block_size: int) -> dict[str, PagedSpec]:
    """The two cells measured: a GQA cell (8 KV heads x 128, K and V) and an MLA latent row
    (DeepSeek's 512 + 64), bf16."""
    return {
        "gqa": PagedSpec(mla=False, num_heads=8, block_size=block_size, head_size=128, head_size_v=128,
                         dtype=torch.bfloat16),
        "mla": PagedSpec(mla=True, num_heads=1, block_size=block_size, head_size=576, head_size_v=0,
                         dtype=torch.bfloat16, rope_dim=64),
    }


def build(spec: PagedSpec, order: tuple[int, ...], device: str, layers: int = LAYERS,
          blocks: int = BLOCKS) -> list[torch.Tensor]:
    """``kv_cache_views`` with this benchmark's defaults."""
    return kv_cache_views(spec, order, device, layers, blocks)


def timed(fn, reps: int, sync) -> float:
    best = float("inf")
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def rows_for(spec: PagedSpec, layers: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Random rows as the worker moves them: ``[L, 2, n, H, D]`` (GQA) or ``[L, n, C]`` (MLA)."""
    shape = (layers, n, spec.content) if spec.mla else (layers, 2, n, spec.num_heads, spec.head_size)
    return torch.randn(shape, generator=gen).to(spec.dtype)


def cache_for(spec: PagedSpec, views: list[torch.Tensor]) -> StandardKV | LatentKV:
    """The worker's cache object over ``views`` (``WorkerSide.register_kv_caches``)."""
    return (LatentKV if spec.mla else StandardKV)(views, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    device = args.device
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(BLOCKS, generator=gen)[: RUN_TOKENS // BLOCK_SIZE]  # the job's block ids, on the host
    positions = torch.arange(RUN_TOKENS)
    rows = []
    for kind, spec in specs(BLOCK_SIZE).items():
        src = rows_for(spec, LAYERS, RUN_TOKENS, gen).to(device)
        nbytes = src.numel() * src.element_size()
        floor = torch.empty_like(src)
        for name, order in LAYOUTS.items():
            cache = cache_for(spec, build(spec, order, device, LAYERS, BLOCKS))
            load_s = copy_s = save_s = new_s = float("inf")
            with single_threaded():  # the worker's copies run on one intra-op thread
                for _ in range(3):  # interleaved rounds: a noisy neighbour hits every arm alike
                    load_s = min(load_s, timed(lambda: cache.scatter(src, table, positions), args.reps, sync))
                    copy_s = min(copy_s, timed(lambda: floor.copy_(src), args.reps, sync))
                    save_s = min(save_s, timed(lambda: cache.gather(table, positions, host=not cuda), args.reps, sync))
                    new_s = min(new_s, timed(lambda: torch.empty_like(src).copy_(src), args.reps, sync))
            assert torch.equal(cache.gather(table, positions, host=not cuda), src)
            row = {
                "kind": kind, "layout": name, "bytes": nbytes,
                "load_gbps": round(nbytes / load_s / 1e9, 2), "save_gbps": round(nbytes / save_s / 1e9, 2),
                "copy_gbps": round(nbytes / copy_s / 1e9, 2), "new_copy_gbps": round(nbytes / new_s / 1e9, 2),
                "load_over_copy": round(copy_s / load_s, 3), "save_over_copy": round(copy_s / save_s, 3),
                "save_over_new_copy": round(new_s / save_s, 3),
            }
            rows.append(row)
            print(f"{kind} {name}: load {row['load_gbps']} GB/s ({row['load_over_copy']}x copy), save "
                  f"{row['save_gbps']} GB/s ({row['save_over_copy']}x copy, {row['save_over_new_copy']}x new_copy), "
                  f"copy {row['copy_gbps']} GB/s, new_copy {row['new_copy_gbps']} GB/s")
    worst = min(min(r["load_over_copy"], r["save_over_copy"]) for r in rows)
    doc = {
        "what": "the vLLM worker's StandardKV / LatentKV scatter (load) and gather (save) vs a plain copy_ of the "
                "same bytes, every vLLM KVCacheLayout",
        "command": "./dev bench vllm_layouts" + ("" if device == "cpu" else f" --device {device}"),
        "machine": {"device": device if device == "cpu" else torch.cuda.get_device_name(),
                    "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": 1, "torch": torch.__version__},
        "shape": {"layers": LAYERS, "blocks": BLOCKS, "block_size": BLOCK_SIZE, "run_tokens": RUN_TOKENS,
                  "gqa": "8 kv heads x 128, bf16", "mla": "576-wide latent row (rope 64), bf16"},
        "goal": f"load and save >= {GOAL} of copy_",
        "worst_ratio": worst,
        "goal_met": worst >= GOAL,
        "rows": rows,
    }
    name = "vllm_layouts.json" if device == "cpu" else "vllm_layouts_cuda.json"
    (RESULTS / name).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"worst ratio {worst} (goal >= {GOAL}): {'met' if worst >= GOAL else 'missed'}; wrote bench/results/{name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
