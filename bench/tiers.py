"""Tiered store: throughput vs memcpy and file I/O, concurrent Stores, restart time.

    python -m bench.tiers                 # all three parts, tables on stdout
    python -m bench.tiers --json          # also bench/results/tiers.json (earlier rows kept under "before")
    python -m bench.tiers --only throughput --sizes 1,4 --samples 5 --threads 2
    python -m bench.tiers --baseline /work/main   # Stores and restart also against another checkout

Four parts (``--only throughput,stores,restart,remote``):

* ``throughput`` (below);
* ``stores``: Store throughput of 1 and 8 concurrent gRPC clients against one sidecar process
  (``bench.tiers_stores``); with ``--baseline`` the other checkout's server is measured in the
  same run, interleaved;
* ``restart``: time from process start to the first Lookup served over a disk tier of
  ``--restart-chunks`` chunks (``bench.tiers_restart``; with ``--baseline``, alternating);
* ``remote``: put and batched get on a remote-only store against a real Redis
  (``bench.tiers_remote``; with ``--baseline``, alternating).

For payloads of 1, 4 and 16 MiB, times ``TieredStore.put`` / ``get`` on the CPU tier (LMCache
L1) and on the disk tier (LMCache fs_native, CPU tier disabled) against, measured in the same
run and interleaved sample by sample (baseline, op, baseline, op, ...):

* ``copy_``: ``dst.copy_(src)`` of the payload's bytes into a preallocated tensor;
* file write: open a new file, ``write`` the payload, close (no fsync, as fs_native);
* file read: open, ``readinto`` a preallocated buffer, close (page cache warm, as the store's).

Each figure is the best of ``--samples`` samples (the least noisy estimate on a shared host).
A ratio is baseline time / store time: 1.0 means the store moves the payload as fast as the
bare operation. A put also writes the 4 KiB header and checksums the payload (xxh3); a get
verifies the checksum and returns a fresh tensor the caller owns (one copy out). Put ratios use
file write, get ratios file read. torch runs with ``--threads`` intra-op threads (default 1:
on a busy 2-core host a multi-threaded ``copy_`` of a few MiB collapses).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ["LMCACHE_TRACK_USAGE"] = "false"  # before LMCache is imported

import torch

from bench.harness import RESULTS, machine, write_results
from sidecar.identity import KVLayout
from sidecar.tiers import StoreConfig, TieredStore
from sidecar.tiers.envelope import HEADER_NBYTES

MiB = 1 << 20
# 8 layers x 8 KV heads x head_dim 128, bf16: 32 KiB per token, so 1 MiB is 32 tokens.
LAYOUT = KVLayout.gqa(num_layers=8, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def _best(samples: list[float]) -> float:
    return min(samples)


def _interleaved(
    base: Callable[[], object], op: Callable[[], object], samples: int, cleanup: Callable[[], None] = lambda: None
) -> tuple[float, float]:
    """Best time of ``base`` and of ``op``, sampled alternately after one warm-up each;
    ``cleanup`` runs untimed after each pair (it drops what the writes left behind, so dirty
    page-cache writeback does not build up and throttle later samples)."""
    base()
    op()
    cleanup()
    tb: list[float] = []
    to: list[float] = []
    clock = time.perf_counter
    for _ in range(samples):
        t0 = clock()
        base()
        tb.append(clock() - t0)
        t0 = clock()
        op()
        to.append(clock() - t0)
        cleanup()
    return _best(tb), _best(to)


def _file_write(path: Path, data: torch.Tensor) -> Callable[[], None]:
    """Write ``data`` to a new file at ``path`` (the cleanup unlinks it)."""
    mv = memoryview(data.numpy())

    def write() -> None:
        with open(path, "wb") as f:
            f.write(mv)

    return write


def _file_read(path: Path, nbytes: int) -> Callable[[], None]:
    buf = memoryview(bytearray(nbytes))

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            f.readinto(buf)

    return read


def _store_ops(
    store: TieredStore, data: torch.Tensor, tokens: int
) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
    """``put`` of key ``new`` (``drop`` deletes it again, untimed) and ``get`` of key ``kept``."""
    store.put(b"kept", data, layout=LAYOUT, num_tokens=tokens, tenant="bench")

    def put() -> None:
        assert store.put(b"new", data, layout=LAYOUT, num_tokens=tokens, tenant="bench").stored

    def drop() -> None:
        store.delete([b"new"])

    def get() -> None:
        assert store.get(b"kept", promote=False) is not None

    return put, drop, get


def run_size(size_mib: int, samples: int, workdir: Path) -> list[dict]:
    nbytes = size_mib * MiB
    tokens = nbytes // LAYOUT.bytes_per_token
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(data)
    copy = lambda: dst.copy_(data)  # noqa: E731
    obj = nbytes + HEADER_NBYTES
    plain = workdir / f"plain-{size_mib}.bin"
    _file_write(plain, data)()  # the file the read baseline reads
    written = workdir / f"written-{size_mib}.bin"
    write_file = _file_write(written, data)
    rows: list[dict] = []

    def record(op: str, t_op: float, t_copy: float, t_file: float, file_kind: str) -> None:
        rows.append(
            {
                "size_mib": size_mib,
                "op": op,
                "store_gbps": nbytes / t_op / 1e9,
                "copy_gbps": nbytes / t_copy / 1e9,
                f"file_{file_kind}_gbps": nbytes / t_file / 1e9,
                "vs_copy": t_copy / t_op,
                "vs_file": t_file / t_op,
            }
        )

    for tier in ("cpu", "disk"):
        fields = dict(namespace=f"bench{size_mib}", io_timeout_s=60.0)
        if tier == "cpu":
            fields.update(cpu_bytes=3 * obj)
        else:
            fields.update(cpu_bytes=0, disk_path=str(workdir / f"disk-{size_mib}"), disk_bytes=3 * obj)
        with TieredStore(StoreConfig(**fields)) as store:
            put, drop, get = _store_ops(store, data, tokens)

            def drop_both(drop: Callable[[], None] = drop) -> None:
                drop()
                written.unlink(missing_ok=True)

            t_copy, t_put = _interleaved(copy, put, samples, drop)
            t_write, t_put2 = _interleaved(write_file, put, samples, drop_both)
            record(f"{tier} put", min(t_put, t_put2), t_copy, t_write, "write")
            t_copy, t_get = _interleaved(copy, get, samples)
            t_read, t_get2 = _interleaved(_file_read(plain, nbytes), get, samples)
            record(f"{tier} get", min(t_get, t_get2), t_copy, t_read, "read")
    return rows


def _throughput(sizes: list[int], samples: int, threads: int, scratch: str | None) -> list[dict]:
    workdir = Path(tempfile.mkdtemp(prefix="kvs-bench-tiers-", dir=scratch))
    try:
        rows = [row for size in sizes for row in run_size(size, samples, workdir)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"tiered store vs copy_ and plain file I/O (best of {samples}, torch threads={threads})")
    print(
        f"{'size':>6} {'op':<9} {'store GB/s':>10} {'copy_ GB/s':>10} {'file GB/s':>9} {'vs copy_':>8} {'vs file':>8}"
    )
    for r in rows:
        file_gbps = r.get("file_write_gbps", r.get("file_read_gbps"))
        print(
            f"{r['size_mib']:>4}Mi {r['op']:<9} {r['store_gbps']:>10.2f} {r['copy_gbps']:>10.2f} {file_gbps:>9.2f} "
            f"{r['vs_copy']:>8.2f} {r['vs_file']:>8.2f}"
        )
    return rows


def _before(path: Path) -> dict:
    """What the previous results file measured before batched Fetch rotation (kept, never overwritten)."""
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    return old.get("before") or {k: old[k] for k in ("machine", "rows", "samples", "threads") if k in old}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="throughput,stores,restart,remote", help="parts to run, comma separated")
    parser.add_argument("--sizes", default="1,4,16", help="payload sizes in MiB, comma separated")
    parser.add_argument("--samples", type=int, default=9, help="samples per measurement (best is kept)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--dir", default=None, help="scratch directory for the disk tier and plain files")
    parser.add_argument("--baseline", default=None, help="another checkout measured as the 'before' arm")
    parser.add_argument("--store-seconds", type=float, default=6.0, help="timed window per Store measurement")
    parser.add_argument("--store-rounds", type=int, default=3)
    parser.add_argument("--restart-chunks", type=int, default=100_000)
    parser.add_argument("--restart-rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="also write bench/results/tiers.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    parts = set(args.only.split(","))
    roots = {"after": Path(__file__).resolve().parents[1]}
    if args.baseline:
        roots = {"before": Path(args.baseline), **roots}
    result: dict = {"machine": machine(), "threads": args.threads, "samples": args.samples}
    if "throughput" in parts:
        result["rows"] = _throughput([int(s) for s in args.sizes.split(",")], args.samples, args.threads, args.dir)
    if "stores" in parts:
        from bench import tiers_stores

        print("concurrent Stores over gRPC (MiB/s of payload stored; best round)")
        result["stores"] = tiers_stores.run(roots, [1, 8], args.store_seconds, args.store_rounds)
        print("TieredStore.put from 1 and 8 threads in one process (the store alone, 512 KiB chunks)")
        result["stores"]["inproc"] = tiers_stores.run_inproc(roots, [1, 8], args.store_seconds, args.store_rounds)
        for arm, a in result["stores"]["arms"].items():
            by = a["by_clients"]
            ip = result["stores"]["inproc"]["arms"][arm]
            print(f"  {arm:>7}: gRPC 1 client {by['1']['mib_s']:.0f} MiB/s, 8 clients {by['8']['mib_s']:.0f} MiB/s "
                  f"({a['speedup_8_vs_1']:.2f}x); put 1 thread {ip['mib_s']['1']:.0f} MiB/s, 8 threads "
                  f"{ip['mib_s']['8']:.0f} MiB/s ({ip['speedup_8_vs_1']:.2f}x)")
    if "restart" in parts:
        from bench import tiers_restart

        workdir = Path(tempfile.mkdtemp(prefix="kvs-bench-restart-", dir=args.dir))
        try:
            result["restart"] = tiers_restart.run(roots, args.restart_chunks, args.restart_rounds, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        for arm, a in result["restart"]["arms"].items():
            print(f"  restart over {result['restart']['chunks']} chunks, {arm:>7}: first Lookup "
                  f"{a['first_lookup_s']:.2f} s (empty-disk start {a['empty_disk_first_lookup_s']:.2f} s)")
    if "remote" in parts:
        from bench import tiers_remote

        print("remote tier (Redis): put and batched get of 64 x 1 MiB, remote-only store")
        result["remote"] = tiers_remote.run(roots, rounds=args.store_rounds)
    if args.json:
        path = RESULTS / "tiers.json"
        before = _before(path)
        if path.exists():  # a partial run keeps the parts it did not redo
            result = {**json.loads(path.read_text()), **result}
        result["before"] = before
        path = write_results("tiers", result)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
