"""The GPU check: what only a GPU can measure, in one script (``./dev gpu-check``, at most ~8 min).

Runs on a bare NVIDIA machine with PyTorch and Triton (numpy, xxhash and PyYAML come with it),
from a plain checkout (``PYTHONPATH=.``): no LMCache, no gRPC server, no network, no model.

1. Rotation: ``sidecar.rotation.rotate_keys`` on CUDA tensors (the Triton kernel) against the
   pure-torch reference ``rotate_keys_native`` on the same device, for the RoPE geometries the
   sidecar serves (NEOX half-split, GPT-J interleaved with partial rotary, an MLA ``k_pe``, an
   expanded MLA key with the rope slice trailing), bf16, per-token deltas: the largest error in
   units of the reference's magnitude, and throughput as a fraction of a device ``copy_`` of the
   same tensor (goal >= 0.7).
2. vLLM's standard layouts: ``clients.vllm.layouts.load_`` / ``gather`` on CUDA caches in every
   ``KVCacheLayout``, GQA and MLA, bf16: the rows read back equal the rows written, and the load
   (pinned host payload -> device -> the cache's cells) as a fraction of a pinned host-to-device
   ``copy_`` of the same bytes (goal >= 0.5).

Writes bench/results/gpu.json (device, versions, every figure); exits 1 if a correctness check
fails (the figures are written first), 0 otherwise, goals met or not.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
ROTATION_GOAL = 0.7
LOAD_GOAL = 0.5


def _timed(fn, reps: int = 20) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, timed with CUDA events after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2]


def rope_specs():
    from sidecar.rotation import Pairing, RopeSpec, RotaryLayout

    def inv(rotary_dim: int, theta: float) -> tuple[float, ...]:
        return tuple(1.0 / theta ** (2 * i / rotary_dim) for i in range(rotary_dim // 2))

    return {
        "neox_half_128": RopeSpec(rotary_dim=128, key_dim=128, layout=RotaryLayout.LEADING, pairing=Pairing.HALF,
                                  inv_freq=inv(128, 500000.0)),
        "gptj_interleaved_partial_64of128": RopeSpec(rotary_dim=64, key_dim=128, layout=RotaryLayout.LEADING,
                                                     pairing=Pairing.INTERLEAVED, inv_freq=inv(64, 10000.0)),
        "mla_k_pe_64": RopeSpec(rotary_dim=64, key_dim=64, layout=RotaryLayout.LEADING,
                                pairing=Pairing.INTERLEAVED, inv_freq=inv(64, 10000.0)),
        "mla_expanded_trailing_64of192": RopeSpec(rotary_dim=64, key_dim=192, layout=RotaryLayout.TRAILING,
                                                  pairing=Pairing.HALF, inv_freq=inv(64, 10000.0)),
    }


def check_rotation(tokens: int) -> tuple[list[dict], bool]:
    from sidecar.rotation import rotate_keys, rotate_keys_native
    from sidecar.rotation import cuda as rotation_cuda

    rows, ok = [], True
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, spec in rope_specs().items():
        heads = 1 if name.startswith("mla_k_pe") else 8
        k = torch.randn(tokens, heads, spec.key_dim, device="cuda", generator=gen).to(torch.bfloat16)
        delta = torch.randint(-5000, 5000, (tokens, 1), device="cuda", generator=gen)
        got = rotate_keys(k, delta, spec)
        ref = rotate_keys_native(k, delta, spec)
        scale = ref.float().abs().max().item()
        err = (got.float() - ref.float()).abs().max().item() / scale
        # one bf16 rounding of an fp32 result that may differ in its last fp32 bits: <= 2^-8;
        # the dims outside the rotary slice come back bit-identical
        keep = torch.ones(spec.key_dim, dtype=torch.bool, device="cuda")
        keep[spec.rotary_offset:spec.rotary_offset + spec.rotary_dim] = False
        passed = err <= 2.0 ** -8 and torch.equal(got[..., keep], k[..., keep])
        ok &= passed
        out = torch.empty_like(k)
        rot_s = _timed(lambda: rotate_keys(k, delta, spec, out=out))
        copy_s = _timed(lambda: out.copy_(k))
        nbytes = 2 * k.numel() * k.element_size()  # read + write
        rows.append({
            "spec": name, "shape": list(k.shape), "dtype": "bfloat16", "max_rel_error": err, "correct": passed,
            "rotate_gbps": round(nbytes / rot_s / 1e9, 1), "copy_gbps": round(nbytes / copy_s / 1e9, 1),
            "rotate_over_copy": round(copy_s / rot_s, 3), "triton": rotation_cuda.TRITON_AVAILABLE,
        })
        print(f"rotation {name}: error {err:.2e} ({'ok' if passed else 'WRONG'}), "
              f"{rows[-1]['rotate_over_copy']}x device copy", flush=True)
    return rows, ok


def check_layouts(tokens: int) -> tuple[list[dict], bool]:
    from bench.vllm_layouts import LAYOUTS, build, specs
    from clients.vllm.layouts import Run, gather, load_

    layers, blocks, block_size = 32, 4096, 16
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(blocks, generator=gen)[: math.ceil(tokens / block_size)].cuda()
    run = Run.of(table, 3, tokens - 3, block_size)  # a partial first block, whole blocks, a partial tail
    rows, ok = [], True
    for kind, spec in specs(block_size).items():
        nbytes = spec.payload_layout(layers).bytes_per_token * run.n
        host = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, generator=gen).pin_memory()
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        back = torch.empty_like(dev)
        for name, order in LAYOUTS.items():
            views = build(spec, order, "cuda", layers, blocks)

            def load() -> None:
                dev.copy_(host, non_blocking=True)
                load_(views, spec, dev, run)

            load()
            gather(views, spec, run, back)
            passed = torch.equal(back.cpu(), host)
            ok &= passed
            load_s = _timed(load, reps=10)
            h2d_s = _timed(lambda: dev.copy_(host, non_blocking=True), reps=10)
            save_s = _timed(lambda: gather(views, spec, run, back), reps=10)
            rows.append({
                "kind": kind, "layout": name, "bytes": nbytes, "correct": passed,
                "load_gbps": round(nbytes / load_s / 1e9, 1), "pinned_h2d_gbps": round(nbytes / h2d_s / 1e9, 1),
                "save_gbps_on_device": round(nbytes / save_s / 1e9, 1),
                "load_over_pinned_h2d": round(h2d_s / load_s, 3),
            })
            print(f"layout {kind} {name}: {'ok' if passed else 'WRONG'}, load "
                  f"{rows[-1]['load_over_pinned_h2d']}x pinned H2D", flush=True)
    return rows, ok


def check_worker_copies(tokens: int, device: str = "cuda") -> tuple[list[dict], bool]:
    """The vLLM worker's device path (``clients.vllm.staging``): a step's rows through the pinned
    buffer and the side stream into ``StandardKV`` / ``LatentKV`` caches on CUDA, and back with
    ``gather_async``, against the same caches on the CPU; timed against the synchronous path
    (``device="cpu"``: the same checks through the CPU path, untimed, for the main test suite)."""
    from bench.vllm_layouts import LAYOUTS, build, specs
    from clients.vllm.layouts import LatentKV, StandardKV
    from clients.vllm.staging import Staging

    layers, blocks, block_size = 8, 1024, 16
    gen = torch.Generator().manual_seed(1)
    table = torch.randperm(blocks, generator=gen)[: math.ceil(tokens / block_size)]
    positions = torch.arange(3, tokens)
    cells = specs(block_size)
    cases = {"gqa": (cells["gqa"], StandardKV, (layers, 2, len(positions), 8, 128)),
             "mla": (cells["mla"], LatentKV, (layers, len(positions), 576))}
    out, ok = [], True
    for kind, (spec, cls, shape) in cases.items():
        rows = torch.randn(shape, generator=gen).to(torch.bfloat16)
        order = LAYOUTS["LBHNC"]
        ref = cls(build(spec, order, "cpu", layers, blocks), spec)
        ref.scatter(rows, table, positions)
        dev = cls(build(spec, order, device, layers, blocks), spec)
        staging = Staging(torch.device(device))

        def staged() -> None:
            (moved,) = staging.to_device([rows])
            with staging.context():
                dev.scatter(moved, table, positions)
            staging.publish()

        staged()
        host, wait = staging.gather_async(lambda: dev.gather(table, positions, host=False))
        wait()
        passed = torch.equal(host, ref.gather(table, positions)) and torch.equal(host, rows)
        ok &= passed
        out.append({"kind": kind, "tokens": len(positions), "correct": passed})
        if device == "cuda":
            out[-1]["staged_ms"] = round(_timed(staged, reps=10) * 1e3, 3)
            out[-1]["synchronous_ms"] = round(_timed(lambda: dev.scatter(rows, table, positions), reps=10) * 1e3, 3)
            print(f"worker copies {kind}: {'ok' if passed else 'WRONG'}, staged {out[-1]['staged_ms']} ms, "
                  f"synchronous {out[-1]['synchronous_ms']} ms", flush=True)
    return out, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per rotation tensor and per load run")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; nothing measured", file=sys.stderr)
        return 2
    t0 = time.time()
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    rotation, rot_ok = check_rotation(args.tokens)
    layouts, lay_ok = check_layouts(args.tokens)
    worker, worker_ok = check_worker_copies(min(args.tokens, 8192))
    worst_rot = min(r["rotate_over_copy"] for r in rotation)
    worst_load = min(r["load_over_pinned_h2d"] for r in layouts)
    doc = {
        "what": "GPU check: CUDA rotation vs the torch reference, vLLM standard-layout loads vs pinned H2D",
        "command": "./dev gpu-check",
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
                     "python": platform.python_version()},
        "goals": {"rotation_over_device_copy": ROTATION_GOAL, "load_over_pinned_h2d": LOAD_GOAL},
        "worst": {"rotation_over_device_copy": worst_rot, "load_over_pinned_h2d": worst_load},
        "goals_met": {"rotation": worst_rot >= ROTATION_GOAL, "load": worst_load >= LOAD_GOAL},
        "correct": rot_ok and lay_ok and worker_ok,
        "seconds": round(time.time() - t0, 1),
        "rotation": rotation,
        "layouts": layouts,
        "worker_copies": worker,
    }
    (RESULTS / "gpu.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"rotation worst {worst_rot}x device copy (goal {ROTATION_GOAL}); load worst {worst_load}x pinned H2D "
          f"(goal {LOAD_GOAL}); correct: {doc['correct']}; wrote bench/results/gpu.json")
    return 0 if doc["correct"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
