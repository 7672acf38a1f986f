"""The GPU check: what only a GPU can measure, in one script (``./dev gpu-check``, at most ~8 min).

Runs on a bare NVIDIA machine with PyTorch and Triton (numpy, xxhash and PyYAML come with it),
from a plain checkout (``PYTHONPATH=.``): no LMCache, no gRPC server, no network, no model.

1. Rotation: ``sidecar.rotation.rotate_keys`` on CUDA tensors (the Triton kernel) against the
   pure-torch reference ``rotate_keys_native`` on the same device, for the RoPE geometries the
   sidecar serves (NEOX half-split, GPT-J interleaved with partial rotary, an MLA ``k_pe``, an
   expanded MLA key with the rope slice trailing), bf16, per-token deltas: the largest error in
   units of the reference's magnitude, and throughput as a fraction of a device ``copy_`` of the
   same tensor (goal >= 0.7).
2. The vLLM worker's copies on CUDA caches in every ``KVCacheLayout``, GQA and MLA, bf16: exactly
   what ``clients.vllm.worker_side`` runs there, a load being the rows through the pinned buffer
   and the side stream (``staging.Staging``) into ``StandardKV.scatter`` / ``LatentKV.scatter``
   and a save ``gather`` on the device then ``gather_async``'s copy to pinned memory. Correct:
   the device cache's cells equal a CPU cache's after the same scatter (the CPU copies are
   checked cell by cell in tests/clients/vllm/test_layouts.py) and the rows read back equal the
   rows written. Timed: the load as a fraction of a pinned host-to-device ``copy_`` of the same
   bytes (goal >= 0.5), the device-side gather, and the synchronous load (rows already on the
   device) for comparison.

3. The shared pool on CUDA: a pool file in /dev/shm mapped as an engine maps it
   (``sidecar.shm.pool.MappedPool``), registered as pinned host memory (``MappedPool.pin``,
   ``cudaHostRegister``); a Llama-3-8B-shaped chunk (16 MiB) copied host-to-device straight from
   the pool, asynchronously, against a ``copy_`` from a pinned tensor of the same bytes (goal
   >= 0.8); the bytes on the device must equal the pool's. Then the vLLM worker's load from
   the pool (``clients.vllm.placing.place``, exact and shifted chunks into a standard cache):
   straight from the registered pool and through the pinned buffer, both equal to the same
   load on CPU (within bf16 rounding: the device rotates with Triton), and timed.

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
    from sidecar.rotation import cuda as rotation_cuda
    from sidecar.rotation import rotate_keys, rotate_keys_native

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


def check_layouts(tokens: int, device: str = "cuda", timed: bool = True) -> tuple[list[dict], bool]:
    """The worker's copies (see the module docstring) in every layout, GQA and MLA, timed over
    ``tokens`` on a 32-layer cache when ``timed``; ``device="cpu"`` runs the same checks through
    the CPU path (no pinned buffer, no stream), untimed, for the main test suite."""
    from bench.vllm_layouts import LAYOUTS, build, cache_for, rows_for, specs
    from clients.vllm.staging import Staging

    timed = timed and device == "cuda"
    gen = torch.Generator().manual_seed(0)
    small_layers, small_blocks, block_size = 4, 64, 16
    layers, blocks = 32, max(4096, math.ceil(tokens / block_size))
    table = torch.randperm(blocks, generator=gen)[: math.ceil(tokens / block_size)]
    positions = torch.arange(3, tokens)  # a partial first block, whole blocks, a partial tail
    check_table = torch.randperm(small_blocks, generator=gen)[: math.ceil(300 / block_size)]
    check_positions = torch.arange(3, 300)
    staging = Staging(torch.device(device))

    def load(cache, rows, tbl, pos) -> None:  # WorkerSide._load's device path
        (moved,) = staging.to_device([rows])
        with staging.context():
            cache.scatter(moved, tbl, pos)
        staging.publish()

    def save(cache, tbl, pos) -> torch.Tensor:  # WorkerSide.save's device path
        host, wait = staging.gather_async(lambda: cache.gather(tbl, pos, host=False))
        wait()
        return host

    out, ok = [], True
    for kind, spec in specs(block_size).items():
        small = rows_for(spec, small_layers, len(check_positions), gen)
        rows = rows_for(spec, layers, len(positions), gen) if timed else None
        for name, order in LAYOUTS.items():
            ref = cache_for(spec, build(spec, order, "cpu", small_layers, small_blocks))
            ref.scatter(small, check_table, check_positions)
            dev = cache_for(spec, build(spec, order, device, small_layers, small_blocks))
            load(dev, small, check_table, check_positions)
            passed = (all(torch.equal(a.cpu(), b) for a, b in zip(dev.layers, ref.layers))
                      and torch.equal(save(dev, check_table, check_positions), small))
            ok &= passed
            row = {"kind": kind, "layout": name, "correct": passed}
            if timed:
                big = cache_for(spec, build(spec, order, device, layers, blocks))
                nbytes = rows.numel() * rows.element_size()
                pinned = rows.pin_memory()
                on_dev = torch.empty_like(pinned, device=device)
                on_dev.copy_(pinned)
                load_s = _timed(lambda: load(big, rows, table, positions), reps=5)
                h2d_s = _timed(lambda: on_dev.copy_(pinned, non_blocking=True), reps=5)
                sync_s = _timed(lambda: big.scatter(on_dev, table, positions), reps=5)
                gather_s = _timed(lambda: big.gather(table, positions, host=False), reps=5)
                row.update({
                    "tokens": len(positions), "layers": layers, "bytes": nbytes,
                    "load_gbps": round(nbytes / load_s / 1e9, 1), "pinned_h2d_gbps": round(nbytes / h2d_s / 1e9, 1),
                    "load_over_pinned_h2d": round(h2d_s / load_s, 3),
                    "scatter_on_device_gbps": round(nbytes / sync_s / 1e9, 1),
                    "gather_on_device_gbps": round(nbytes / gather_s / 1e9, 1),
                })
                del big, on_dev, pinned
                print(f"layout {kind} {name}: {'ok' if passed else 'WRONG'}, load {row['load_over_pinned_h2d']}x "
                      f"pinned H2D, gather {row['gather_on_device_gbps']} GB/s on the device", flush=True)
            out.append(row)
    return out, ok


POOL_GOAL = 0.8


def check_pool(chunk_bytes: int = 16 << 20, chunks: int = 8, device: str = "cuda") -> tuple[dict, bool]:
    """Part 3: H2D from the registered pool against H2D from a pinned tensor (see the module
    docstring). ``device="cpu"``: the same mapping and copies without CUDA (no registration)."""
    import os
    import secrets

    from sidecar.shm.pool import FILE_PREFIX, SHM_DIR, MappedPool, PoolFile

    header = 4096
    size = header + chunks * chunk_bytes
    name = FILE_PREFIX + secrets.token_hex(16)
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    owner = PoolFile.adopt(name, size)  # held like a sidecar's pool (not reaped meanwhile)
    try:
        pool = MappedPool(name, size, header)
        src = pool.view(header, chunks * chunk_bytes)
        src.copy_(torch.randint(0, 256, (src.numel(),), dtype=torch.uint8))
        pinned = pool.pin() if device == "cuda" else False
        dst = torch.empty(chunk_bytes, dtype=torch.uint8, device=device)
        ok = True
        for i in range(chunks):
            dst.copy_(pool.view(header + i * chunk_bytes, chunk_bytes), non_blocking=pinned)
            if device == "cuda":
                torch.cuda.synchronize()
            ok = ok and torch.equal(dst.cpu(), pool.view(header + i * chunk_bytes, chunk_bytes))
        row = {"chunk_mib": chunk_bytes >> 20, "registered": pinned, "correct": ok}
        if device == "cuda":
            host = torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True)
            host.copy_(pool.view(header, chunk_bytes))
            t_pool = _timed(lambda: dst.copy_(pool.view(header, chunk_bytes), non_blocking=True))
            t_pinned = _timed(lambda: dst.copy_(host, non_blocking=True))
            row.update(pool_h2d_gbps=round(chunk_bytes / t_pool / 1e9, 2),
                       pinned_h2d_gbps=round(chunk_bytes / t_pinned / 1e9, 2),
                       pool_over_pinned=round(t_pinned / t_pool, 3))
        loads, loads_ok = check_pool_loads(pool, header, chunks * chunk_bytes, device)
        row["worker_loads"] = loads
        pool.close()
        return row, ok and loads_ok
    finally:
        owner.close()


def check_pool_loads(pool, header: int, nbytes: int, device: str) -> tuple[dict, bool]:
    """The vLLM worker's load from the pool (``clients.vllm.placing.place``): Llama-3-8B-shaped
    chunks of 128 tokens viewed in the pool, every other one shifted, into a standard cache on
    ``device``, straight from the registered pool and through the pinned buffer; both must
    equal the same load into a CPU cache. On CUDA, timed (the pool path over the staged one)."""
    from clients.vllm.layouts import PagedSpec, StandardKV
    from clients.vllm.placing import Scratch, place
    from clients.vllm.rows import GqaRows
    from clients.vllm.staging import Staging
    from sidecar.identity import KVLayout

    tokens, block = 128, 16
    layers = max(1, min(32, nbytes // (4 * tokens * 4096)))  # at least 4 chunks in the pool
    layout, spec = KVLayout.gqa(num_layers=layers, num_kv_heads=8, head_dim=128), rope_specs()["neox_half_128"]
    per = tokens * layout.bytes_per_token
    n = min(nbytes // per, 8)
    pool.view(header, n * per).view(torch.bfloat16).copy_(torch.randn(n * per // 2).to(torch.bfloat16))
    items = [(i * tokens, (i + 1) * tokens, GqaRows.of(pool.view(header + i * per, per), layout, tokens), 37 * (i % 2))
             for i in range(n)]
    cspec = PagedSpec(mla=False, num_heads=8, block_size=block, head_size=128, head_size_v=128, dtype=torch.bfloat16)
    nb = n * tokens // block

    def load(dev: str, registered: bool) -> StandardKV:
        cache = StandardKV([torch.zeros((nb, 8, block, 256), dtype=torch.bfloat16, device=dev) for _ in range(layers)],
                           cspec)
        staging = Staging(torch.device(dev))
        table = torch.arange(nb, dtype=torch.int64).flip(0)
        place(cache, GqaRows, items, table, staging=staging, rope=spec, layout=layout, scratch=Scratch(),
              registered=registered)
        staging.publish()
        staging.synchronize()
        return cache

    ref = load("cpu", False)
    positions = torch.arange(n * tokens)
    want = ref.gather(torch.arange(nb).flip(0), positions)
    row: dict = {"chunks": n, "layers": layers, "shifted": n // 2}
    ok = True
    for name, registered in (("pool", pool.pinned), ("staged", False)):
        got = load(device, registered).gather(torch.arange(nb).flip(0).to(device), positions.to(device))
        # device rotation (Triton) against the host's fused kernel: equal within bf16 rounding
        close = bool(torch.allclose(got.float(), want.float(), atol=0.02, rtol=0.02)) if device == "cuda" \
            else torch.equal(got, want)
        row[f"{name}_correct"] = close
        ok = ok and close
    if device == "cuda":
        t_pool = _timed(lambda: load(device, pool.pinned), reps=3)
        t_staged = _timed(lambda: load(device, False), reps=3)
        row.update(pool_load_ms=round(t_pool * 1e3, 2), staged_load_ms=round(t_staged * 1e3, 2),
                   pool_over_staged=round(t_staged / t_pool, 3))
    return row, ok


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
    pool, pool_ok = check_pool()
    worst_rot = min(r["rotate_over_copy"] for r in rotation)
    worst_load = min(r["load_over_pinned_h2d"] for r in layouts)
    doc = {
        "what": "GPU check: CUDA rotation vs the torch reference; the vLLM worker's staged loads into every "
                "standard layout vs pinned H2D",
        "command": "./dev gpu-check",
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
                     "python": platform.python_version()},
        "goals": {"rotation_over_device_copy": ROTATION_GOAL, "load_over_pinned_h2d": LOAD_GOAL,
                  "pool_h2d_over_pinned": POOL_GOAL},
        "worst": {"rotation_over_device_copy": worst_rot, "load_over_pinned_h2d": worst_load},
        "goals_met": {"rotation": worst_rot >= ROTATION_GOAL, "load": worst_load >= LOAD_GOAL,
                      "pool": pool.get("pool_over_pinned", 0) >= POOL_GOAL},
        "correct": rot_ok and lay_ok and pool_ok,
        "seconds": round(time.time() - t0, 1),
        "rotation": rotation,
        "layouts": layouts,
        "pool": pool,
    }
    (RESULTS / "gpu.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"rotation worst {worst_rot}x device copy (goal {ROTATION_GOAL}); load worst {worst_load}x pinned H2D "
          f"(goal {LOAD_GOAL}); pool H2D {pool.get('pool_over_pinned')}x pinned (goal {POOL_GOAL}, registered: "
          f"{pool['registered']}); correct: {doc['correct']}; wrote bench/results/gpu.json")
    return 0 if doc["correct"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
