"""RoPE delta-rotation throughput as a fraction of copy bandwidth, and chained-rotation drift.

    ./dev bench rotation                 # table on stdout
    ./dev bench rotation --json          # also bench/results/rotation.json
    ./dev bench rotation --drift-only    # only the drift table (docs/rotation.md)

The drift is ``sidecar.rotation.drift.chained_drift`` on Llama-3.1's rotary table.

Every ratio divides by ``dst.copy_(src)`` of the same bytes, measured in the same run and
interleaved with the kernel (copy, kernel, copy, kernel, ...) so that load from other processes
hits both alike, in ``--passes`` sweeps over all cases so a burst of load hits few samples of
any one case; each figure is the best sample (the least noisy estimate of what the hardware
allows). Rotation out of place moves the same bytes as the copy (read k, write out);
``rotate_slots_`` moves the listed slots (read, write in place) and is compared with a copy of
that many slots. Single-threaded and two-threaded (torch and numba thread counts set together).
On a CUDA device the Triton path is compared with a device-to-device ``copy_``.

Columns: ``fused/copy`` one delta for the call; ``per-chunk`` one delta per 128-token chunk
(keys: 256 distinct) or per 512-slot region (slots: 64 distinct); ``batched`` the Fetch path:
the same keys as separate 128-token chunk payloads of 32 layers (keys: 8 chunks) or
16 layers (k_pe: 16 chunks), each chunk with its own delta, rotated in place by one
``rotate_payloads_`` call; ``per-call`` the Fetch path before it, one in-place ``rotate_keys``
call per chunk per layer (256 calls); ``native`` the eager-torch reference (first
thread count only). ``--crossover`` times the serial and the parallel batched kernel on growing
batches (how ``cpu.SERIAL_BELOW_BYTES`` was chosen). The k_pe tensors (4-8 MB) stay in the 32 MB L3, so their
``copy_`` runs at cache speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numba
import torch
import transformers as tf

from bench.harness import machine, write_results
from sidecar.identity import KVLayout, KVPart
from sidecar.rotation import Pairing, RopeSpec, rotate_keys, rotate_keys_native, rotate_payloads_, rotate_slots_
from sidecar.rotation.drift import chained_drift

KEYS = (32768, 8, 128)  # 32K tokens x 8 KV heads x head_dim 128 (Llama-3.1-8B layer)
K_PE = (32768, 1, 64)  # 32K tokens of MLA k_pe (DeepSeek-V2/V3)
POOL_BLOCKS, BLOCK_SIZE = 4096, 16  # paged pool: 65536 slots x 8 heads x 128


def llama31_spec() -> RopeSpec:
    cfg = tf.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )  # fmt: skip
    return RopeSpec.from_hf_config(cfg)


def deepseek_kpe_spec(pairing: Pairing) -> RopeSpec:
    cfg = tf.DeepseekV3Config(
        hidden_size=7168, num_attention_heads=128, qk_rope_head_dim=64, qk_nope_head_dim=128, kv_lora_rank=512,
        max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    )  # fmt: skip
    return RopeSpec.from_hf_config(cfg, pairing=pairing)


@dataclass
class Case:
    """One tensor and its timed operations; ``copy`` moves the same bytes as each kernel."""

    name: str
    dtype: torch.dtype
    nbytes: int
    copy: Callable[[], Any]
    kernels: dict[str, Callable[[], Any]]  # label -> call; "native" is timed once, first thread count
    best: dict[tuple[int, str], float] = field(default_factory=dict)  # (threads, label or "copy") -> s

    def time_pairs(self, threads: int, label: str, reps: int, sync: Callable[[], None]) -> None:
        """Interleave copy and kernel ``reps`` times; keep the best of every sample so far."""
        kernel = self.kernels[label]
        for fn, key in ((self.copy, "copy"), (kernel, label)):  # warm-up
            fn()
        sync()
        for _ in range(reps):
            for fn, key in ((self.copy, "copy"), (kernel, label)):
                t0 = time.perf_counter()
                fn()
                sync()
                dt = time.perf_counter() - t0
                self.best[threads, key] = min(dt, self.best.get((threads, key), dt))


def _threads(n: int) -> None:
    # numba first: its first set_num_threads starts its OpenMP thread pool, which resets
    # torch's intra-op thread count to the core count (before this order, the first
    # one-thread pass timed copy_ on two threads).
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    torch.set_num_threads(n)
    assert torch.get_num_threads() == n, f"torch runs {torch.get_num_threads()} threads, not {n}"


def build_cases(device: str) -> list[Case]:
    gen = torch.Generator().manual_seed(0)
    llama = llama31_spec()
    specs = [
        ("keys", KEYS, llama),
        ("keys", KEYS, dataclasses.replace(llama, pairing=Pairing.INTERLEAVED)),  # GLM / Cohere pairing
        ("k_pe", K_PE, deepseek_kpe_spec(Pairing.HALF)),
        ("k_pe", K_PE, deepseek_kpe_spec(Pairing.INTERLEAVED)),
    ]
    cases: list[Case] = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, shape, spec in specs:
            k = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
            out = torch.empty_like(k)
            # One delta per 128-token chunk (a Fetch of 256 shifted chunk hits), per token.
            per_chunk = torch.randint(-5000, 5000, (shape[0] // 128, 1), generator=gen)
            per_token = per_chunk.repeat_interleave(128, dim=0).to(device)
            # The Fetch path: 128-token chunk payloads of 32 (Llama-3-8B keys) or 16 (k_pe) layers.
            layers = 32 if name == "keys" else 16
            chunk_deltas = per_chunk.view(-1)[: shape[0] // (128 * layers)].tolist()
            layout, items, views = _chunk_payloads(k, chunk_deltas, layers)
            kernels = {
                "fused": lambda k=k, out=out, spec=spec: rotate_keys(k, 4099, spec, out=out),
                "per_chunk": lambda k=k, out=out, spec=spec, d=per_token: rotate_keys(k, d, spec, out=out),
                "batched": lambda items=items, layout=layout, spec=spec: rotate_payloads_(items, layout, spec),
                "per_call": lambda views=views, spec=spec: [rotate_keys(v, d, spec, out=v) for v, d in views],
            }
            if device == "cpu":
                kernels["native"] = lambda k=k, spec=spec: rotate_keys_native(k, 4099, spec)
            cases.append(Case(f"{name} {list(shape)} {spec.pairing.value}", dtype, 2 * k.numel() * k.element_size(),
                              lambda k=k, out=out: out.copy_(k), kernels))  # fmt: skip
        cases.append(_slots_case(dtype, device, gen))
    return cases


def _chunk_payloads(k: torch.Tensor, deltas: list[int], layers: int = 1, tokens: int = 128):
    """``k``'s rows as ``len(deltas)`` chunk payloads of ``tokens`` tokens x ``layers`` layers
    (separate buffers; a layout holding only the rotary part, so the bytes equal ``k``'s), as
    a Fetch window holds them: (layout, items, one key view per chunk and layer)."""
    dtype = str(k.dtype).removeprefix("torch.")
    layout = KVLayout(num_layers=layers, parts=(KVPart(name="k", shape=tuple(k.shape[1:]), dtype=dtype, rotary=True),))
    per = layers * tokens
    assert k.shape[0] == per * len(deltas), "rows must split into the chunks"
    bufs = [k[i * per : (i + 1) * per].clone().view(-1).view(torch.uint8) for i in range(len(deltas))]
    items = [(b, tokens, d) for b, d in zip(bufs, deltas)]
    views = [(b.view(k.dtype).view(layers, tokens, *k.shape[1:])[layer], d) for b, d in zip(bufs, deltas)
             for layer in range(layers)]
    return layout, items, views


def crossover(reps: int, threads: int) -> list[dict[str, Any]]:
    """Serial vs parallel batched kernel (``rotate_payloads_(parallel=False/True)``) on batches of
    growing size (bf16 MLA k_pe chunks and Llama GQA key chunks, 128 tokens each); the size from
    which the parallel kernel wins is ``cpu.SERIAL_BELOW_BYTES``."""
    _threads(threads)
    gen = torch.Generator().manual_seed(5)
    rows = []
    for name, shape, spec in (("k_pe bf16", (128, 1, 64), deepseek_kpe_spec(Pairing.HALF)),
                              ("keys bf16", (128, 8, 128), llama31_spec())):
        for chunks in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            k = torch.randn(shape[0] * chunks, *shape[1:], generator=gen).to(torch.bfloat16)
            layout, items, _ = _chunk_payloads(k, torch.randint(-5000, 5000, (chunks,), generator=gen).tolist())
            best = {}
            for par in (False, True, False, True):
                rotate_payloads_(items, layout, spec, parallel=par)
            for _ in range(reps):
                for par in (False, True):
                    t0 = time.perf_counter()
                    rotate_payloads_(items, layout, spec, parallel=par)
                    dt = time.perf_counter() - t0
                    best[par] = min(dt, best.get(par, dt))
            rows.append({"case": name, "chunks": chunks, "rotated_bytes": k.numel() * 2, "threads": threads,
                         "serial_us": best[False] * 1e6, "parallel_us": best[True] * 1e6})
    return rows


def _slots_case(dtype: torch.dtype, device: str, gen: torch.Generator) -> Case:
    """rotate_slots_ on a paged NHD pool: half the blocks (32768 slots) in random block order.

    Timed with one delta for all slots (one spliced region) and with 64 regions of 512 slots,
    each with its own delta (per-slot tensor).
    """
    spec = llama31_spec()
    pool = torch.randn(POOL_BLOCKS, BLOCK_SIZE, *KEYS[1:], generator=gen).to(device=device, dtype=dtype)
    blocks = torch.randperm(POOL_BLOCKS, generator=gen)[: POOL_BLOCKS // 2]
    ids = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).reshape(-1).to(device)
    regions = torch.randint(-5000, 5000, (64, 1), generator=gen).expand(64, ids.numel() // 64).reshape(-1).to(device)
    src = torch.randn(ids.numel(), *KEYS[1:], generator=gen).to(device=device, dtype=dtype)
    dst = torch.empty_like(src)
    slots = pool.flatten(0, 1)
    kernels = {
        "fused": lambda: rotate_slots_(slots, ids, 4099, spec, check=False),
        "per_chunk": lambda: rotate_slots_(slots, ids, regions, spec, check=False),
    }
    name = f"rotate_slots_ paged [{POOL_BLOCKS}x{BLOCK_SIZE}, 8, 128], {ids.numel()} slots"
    return Case(name, dtype, 2 * src.numel() * src.element_size(), lambda: dst.copy_(src), kernels)


def throughput(reps: int, passes: int, threads: list[int], device: str) -> list[dict[str, Any]]:
    """Best-of-(passes x reps) timings; passes sweep every case so load bursts hit few samples."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    cases = build_cases(device)
    threads = threads if device == "cpu" else [1]
    for p in range(passes):
        for n in threads:
            if device == "cpu":
                _threads(n)
            for case in cases:
                for label in case.kernels:
                    if label == "native":
                        if p == 0 and n == threads[0]:
                            case.time_pairs(n, label, 2, sync)
                        continue
                    case.time_pairs(n, label, reps, sync)
    rows = []
    for n in threads:
        for case in cases:
            tc = case.best[n, "copy"]
            row = {
                "case": case.name, "dtype": str(case.dtype).removeprefix("torch."), "device": device,
                "threads": n if device == "cpu" else None, "bytes_moved": case.nbytes,
                "copy_GBps": case.nbytes / tc / 1e9, "fused_GBps": case.nbytes / case.best[n, "fused"] / 1e9,
                "fused_vs_copy": tc / case.best[n, "fused"], "per_chunk_delta_vs_copy": tc / case.best[n, "per_chunk"],
            }  # fmt: skip
            for label in ("batched", "per_call"):
                if (n, label) in case.best:
                    row[f"{label}_vs_copy"] = tc / case.best[n, label]
            if (n, "native") in case.best:
                row["native_vs_copy"] = tc / case.best[n, "native"]
            rows.append(row)
    return rows


# ------------------------------------------------------------------ output


def _print_throughput(rows: list[dict[str, Any]]) -> None:
    head = (f"{'case':58s} {'dtype':8s} {'thr':>3s} {'copy GB/s':>9s} {'fused GB/s':>10s} {'fused/copy':>10s} {'per-chunk':>9s} "
            f"{'batched':>7s} {'per-call':>8s} {'native':>7s}")
    print(head)
    print("-" * len(head))
    for r in rows:
        thr = "-" if r["threads"] is None else str(r["threads"])
        pt = f"{r['per_chunk_delta_vs_copy']:.2f}" if "per_chunk_delta_vs_copy" in r else "-"
        nat = f"{r['native_vs_copy']:.3f}" if "native_vs_copy" in r else "-"
        bat = f"{r['batched_vs_copy']:.2f}" if "batched_vs_copy" in r else "-"
        pcl = f"{r['per_call_vs_copy']:.2f}" if "per_call_vs_copy" in r else "-"
        print(
            f"{r['case']:58s} {r['dtype']:8s} {thr:>3s} {r['copy_GBps']:9.1f} {r['fused_GBps']:10.1f} "
            f"{r['fused_vs_copy']:10.2f} {pt:>9s} {bat:>7s} {pcl:>8s} {nat:>7s}"
        )


def _print_drift(drift: dict[str, dict[str, float]]) -> None:
    keys = [k for k in next(iter(drift.values())) if not k.endswith("_worst")]
    print(f"{'dtype':9s} " + " ".join(f"{k:>17s}" for k in keys) + "   (rel. error: all keys / worst key)")
    for dtype, res in drift.items():
        print(f"{dtype:9s} " + " ".join(f"{res[k]:8.1e}/{res[k + '_worst']:8.1e}" for k in keys))


def _write_keeping_before(payload: dict[str, Any], partial: bool = False):
    """Write bench/results/rotation.json keeping the figures measured before batched rotation under
    ``before`` (and, for a partial run, every other key of the file)."""
    import json

    from bench.harness import RESULTS

    path = RESULTS / "rotation.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    before = old.get("before")
    if before is None and "throughput" in old:  # the first run after batched rotation: keep the old figures
        before = {k: old[k] for k in ("throughput", "machine") if k in old}
        before["note"] = "fused kernels and per-chunk-per-layer Fetch rotation (commit 4a610a9)"
    doc = {**old, **payload} if partial else {**payload, **({"crossover": old["crossover"]} if "crossover" in old else {})}
    if before is not None:
        doc["before"] = before
    return write_results("rotation", doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="timed copy/kernel pairs per case per pass")
    ap.add_argument("--passes", type=int, default=3, help="sweeps over all cases (best sample is kept)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--json", action="store_true", help="write bench/results/rotation.json")
    ap.add_argument("--drift-only", action="store_true")
    ap.add_argument("--crossover", action="store_true",
                    help="only the serial vs parallel batched-kernel sweep (how SERIAL_BELOW_BYTES was chosen)")
    args = ap.parse_args()

    if args.crossover:
        rows = []
        for n in args.threads:
            rows += crossover(max(args.reps, 20), n)
        print(f"{'case':10s} {'thr':>3s} {'chunks':>6s} {'KiB':>7s} {'serial us':>9s} {'parallel us':>11s} {'par/ser':>7s}")
        for r in rows:
            print(f"{r['case']:10s} {r['threads']:>3d} {r['chunks']:>6d} {r['rotated_bytes'] / 1024:>7.0f} "
                  f"{r['serial_us']:>9.1f} {r['parallel_us']:>11.1f} {r['parallel_us'] / r['serial_us']:>7.2f}")
        if args.json:
            print(f"\nwrote {_write_keeping_before({'crossover': rows}, partial=True)}")
        return

    payload: dict[str, Any] = {"machine": machine()}
    if not args.drift_only:
        rows = throughput(args.reps, args.passes, args.threads, "cpu")
        if torch.cuda.is_available():
            rows += throughput(args.reps, args.passes, [1], "cuda")
        _print_throughput(rows)
        payload["throughput"] = rows
        payload["goal_fused_vs_copy"] = 0.5
        print()
    drift = {str(d).removeprefix("torch."): chained_drift(llama31_spec(), d) for d in (torch.float32, torch.bfloat16)}
    _print_drift(drift)
    payload["drift"] = drift
    if args.json:
        print(f"\nwrote {_write_keeping_before(payload)}")


if __name__ == "__main__":
    main()
