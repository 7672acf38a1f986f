"""KV stored at one tensor-parallel size, fetched by the workers of another, against the same
workers fetching what their own TP size stored, in one run.

    ./dev bench tp                 # 4K tokens, TP 1 <-> 2, 4, 8; writes results/tp.{json,png}
    ./dev bench tp --quick         # 1K tokens, 4 layers, 1 rep (nothing written)

The sidecar runs in its own process; the workers are this process, one after another, each with
the vLLM connector's own code (``clients.vllm``, on one intra-op thread as its worker copies):
a Llama-3-8B-shaped KV (32 layers, 8 KV heads of 128, bf16: 128 KiB per token) in 128-token
chunks, stored once by a TP 1 engine and once by
TP 2, 4 and 8 engines (each rank its heads). Every worker loads the whole prompt's chunks
(exact, raw: the worker would rotate) into its own memory, by each path a worker on the
sidecar's host can take:

* ``pool`` (the same-host default): leases of the shared pool, read in place;
* ``fetch``: Fetch into the same-host shared-memory buffer.

Per path, two arms:

* ``resharded``: ``clients.vllm.resharding.fetch_across``, as a worker loads a plan another cut
  stored: per source rank holding some of its heads, a lease (its heads read in place, from
  several source ranks each part placed into its own head range: no join) or a Fetch of only
  those heads (``FetchRequest.heads``; from several source ranks, joined: one copy);
* ``same``: the worker's own shard of a plan its own TP size stored (``plan_identity``): leased
  views of the pool, or a Fetch.

Both end as the worker's load does: the rows placed into the worker's paged cache (the CPU
backend's, ``clients.vllm.placing.place``).

"TP 1 -> n" is n workers reading what TP 1 stored, against n workers reading what TP n stored;
"TP n -> 1" is one worker reading what TP n stored, against it reading what TP 1 stored. Per
worker: the payload bytes of its chunks it read (goal: exactly its share, the model's bytes /
its TP size) and the median time of its whole load (goal: resharded <= 1.2x same).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.dataplane import ANCHOR, CHUNK, MiB, body, engine_kv, engine_threads, llama3_8b
from bench.harness import RESULTS, machine, sidecar_process, write_results
from clients.vllm.jobs import LoadJob
from clients.vllm.paged import BlockLayout, PagedKV, single_threaded
from clients.vllm.placing import Scratch, place
from clients.vllm.resharding import fetch_across
from clients.vllm.rows import GqaRows
from clients.vllm.settings import EngineShape, shard_name
from clients.vllm.staging import Staging
from sidecar.client import SyncSidecarClient
from sidecar.cuts import heads_layout
from sidecar.identity import CacheIdentity
from sidecar.sdk.kit.runs import load_run
from sidecar.sdk.pool import PoolClient

HEADS, HEAD, BLOCK = 8, 128, 16
SIZES = (2, 4, 8)
#: the CPU backend's placement (host memory, no device)
HOST = Staging(torch.device("cpu"))
GOAL_TIME = 1.2


def engine(layers: int, tp: int, ident: CacheIdentity, spec: Any) -> list[EngineShape]:
    """The worker shapes of a TP ``tp`` engine (rank order)."""
    layout = heads_layout(llama3_8b(layers)[0], HEADS // tp)
    planned = EngineShape(layers, HEADS // tp, HEAD, BLOCK, "bfloat16", layout, spec,
                          replace(ident, kv_layout=layout.fingerprint(), shard=shard_name(0, tp)), tp_size=tp,
                          total_kv_heads=HEADS)
    return [planned.for_rank(r, 0, num_layers=layers) for r in range(tp)] if tp > 1 else [planned]


def store(c: SyncSidecarClient, tokens: np.ndarray, workers: list[EngineShape], kv) -> None:
    """Each worker Stores its heads of every chunk of ``tokens`` (``kv``: ``[L, 2, n, H, D]``)."""
    for w in workers:
        h = w.num_kv_heads
        part = kv[:, :, :, w.tp_rank * h:(w.tp_rank + 1) * h]
        payloads = {a: part[:, :, a:a + CHUNK].contiguous() for a in range(0, kv.shape[2], CHUNK)}
        res = c.store(tokens, identity=w.identity, layout=w.layout, payloads=payloads)
        if res.chunks_stored != len(payloads):
            raise RuntimeError(f"{w.identity.shard}: {res.chunks_stored} of {len(payloads)} chunks stored")


def job_for(c: SyncSidecarClient, tokens: np.ndarray, lead: EngineShape) -> LoadJob:
    """The load a scheduler side planning under ``lead`` (rank 0) hands its workers."""
    plan = c.lookup(tokens, identity=lead.identity, recompute_tokens=0)
    run = load_run(plan, local=0, n=len(tokens), block_size=BLOCK)
    return LoadJob("bench", None, list(range(len(tokens) // BLOCK + 1)), list(run.items), plan.plan_shard)


def load_same(c: SyncSidecarClient, job: LoadJob, w: EngineShape, cache: PagedKV, scratch: Scratch,
              pool: PoolClient | None) -> int:
    """The worker's own shard of a plan its TP size stored, into its cache as its load does:
    leased views of the pool (or a Fetch) placed; the payload bytes it read."""
    items = [it.fetch_item for it in job.items]
    if pool is None:
        got = c.fetch(items, identity=w.identity, layout=w.layout, raw=True, plan_identity=w.plan_identity)
        if not all(f.ok for f in got):
            raise RuntimeError(f"{w.identity.shard}: a miss")
        rows = [GqaRows.of(f.data, w.layout, f.num_tokens).narrow(2, it.row, len(it)) for f, it in zip(got, job.items)]
        place_rows(cache, job, rows, w, scratch)
        return sum(len(f.data) for f in got)
    leased = pool.lease(items, identity=w.identity, layout=w.layout, plan_identity=w.plan_identity)
    try:
        if not all(li.ok for li in leased.items):
            raise RuntimeError(f"{w.identity.shard}: a miss")
        chunks = [li.chunks[0] for li in leased.items]
        rows = [GqaRows.of(pool.chunk_view(ch), w.layout, ch.num_tokens).narrow(2, it.row, len(it))
                for ch, it in zip(chunks, job.items)]
        place_rows(cache, job, rows, w, scratch)
        if not pool.intact(leased):
            raise RuntimeError("a lease expired during the load")
        return sum(ch.length for ch in chunks)
    finally:
        pool.release(leased)


def load_resharded(c: SyncSidecarClient, job: LoadJob, w: EngineShape, cache: PagedKV, scratch: Scratch,
                   pool: PoolClient | None) -> int:
    """The same load from what another TP size stored (``fetch_across``, then placed)."""
    read = fetch_across(job, w, lambda fn: fn(c), scratch, raw=True, pool=pool)
    if read is None or any(rows is None for _, rows, _, _ in read[0]):
        raise RuntimeError(f"{w.identity.shard} from {job.plan_shard!r}: a miss")
    got, finish = read
    place_rows(cache, job, [rows for _, rows, _, _ in got], w, scratch)
    if not finish():
        raise RuntimeError("a lease expired during the load")
    return sum(moved for *_, moved in got)


def place_rows(cache: PagedKV, job: LoadJob, rows: list, w: EngineShape, scratch: Scratch) -> None:
    items = [(it.start, it.end, r, 0) for it, r in zip(job.items, rows)]
    with single_threaded():
        place(cache, GqaRows, items, torch.tensor(job.block_ids, dtype=torch.int64), staging=HOST, rope=w.rope,
              layout=w.layout, scratch=scratch)


def timed(fn) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure(c: SyncSidecarClient, pool: PoolClient | None, cross: LoadJob, own: LoadJob,
            workers: list[EngineShape], reps: int, share: int, tokens: int) -> dict[str, Any]:
    """Median ms per worker load, resharded and same, interleaved worker by worker; bytes."""
    t_x, t_s, b_x, b_s = [], [], set(), set()
    for w in workers:
        cache = PagedKV([torch.zeros((tokens // BLOCK + 2, w.num_kv_heads, BLOCK, 2 * HEAD), dtype=torch.bfloat16)
                         for _ in range(w.num_layers)], BlockLayout.vec(w.num_kv_heads, BLOCK, HEAD))
        scratch = Scratch()  # the worker's own (placing.py, resharding.py)
        for rep in range(reps + 1):  # rep 0 warms up
            tx, bx = timed(lambda: load_resharded(c, cross, w, cache, scratch, pool))
            ts, bs = timed(lambda: load_same(c, own, w, cache, scratch, pool))
            if rep:
                t_x.append(tx)
                t_s.append(ts)
            b_x.add(bx)
            b_s.add(bs)
    row = {"bytes_per_worker": sorted(b_x), "share_bytes": share, "same_bytes_per_worker": sorted(b_s),
           "exactly_its_share": b_x == {share},
           "resharded_ms": statistics.median(t_x) * 1e3, "same_ms": statistics.median(t_s) * 1e3}
    row["x_same"] = row["resharded_ms"] / row["same_ms"]
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.tokens, args.reps, args.layers = 1024, 1, 4
    layout, spec = llama3_8b(args.layers)
    ident = CacheIdentity(model_id="llama3-8b-tp-bench", rope_fingerprint=spec.fingerprint)
    n = args.tokens
    model_bytes = n * layout.bytes_per_token
    settings = {"chunker.anchor_tokens": [ANCHOR], "chunker.min_size": CHUNK, "chunker.max_size": CHUNK,
                "store.cpu_bytes": (2 + len(SIZES)) * model_bytes + 256 * MiB, "max_fetch_bytes": 2 * model_bytes,
                "store.io_timeout_s": 120}
    flags = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    rows: list[dict[str, Any]] = []
    with engine_threads(1), sidecar_process(*flags) as target, \
            SyncSidecarClient(target, tenant="bench", timeout_s=600, shared_memory=True,
                              shared_memory_max_bytes=model_bytes + 64 * MiB) as c:
        pools = PoolClient(c)
        if not pools.available:
            raise RuntimeError("the sidecar has no shared pool to map (store.cpu_shared, /dev/shm)")
        rng = np.random.default_rng(0)
        kv = engine_kv(layout, n)
        tokens = body(rng, n)
        engines = {tp: engine(args.layers, tp, ident, spec) for tp in (1, *SIZES)}
        # One prompt per stored TP size, so each cut's Lookup finds only what that cut stored.
        prompts = {tp: np.concatenate([[ANCHOR], np.full(CHUNK - 1, 7 + tp), tokens[CHUNK:]]).astype(np.uint32)
                   if tp > 1 else tokens for tp in (1, *SIZES)}
        for tp, workers in engines.items():
            store(c, prompts[tp], workers, kv)
        for tp in SIZES:
            for direction, readers, stored_by in ((f"TP 1 -> {tp}", tp, 1), (f"TP {tp} -> 1", 1, tp)):
                prompt = prompts[stored_by]
                cross = job_for(c, prompt, engines[readers][0])
                if cross.plan_shard != shard_name(0, stored_by):
                    raise RuntimeError(f"{direction}: planned under {cross.plan_shard!r}")
                # the same readers' own-cut reference: the prompt their own TP size stored
                own = job_for(c, prompts[readers], engines[readers][0])
                if own.plan_shard is not None:
                    raise RuntimeError(f"{direction}: the own-cut plan names {own.plan_shard!r}")
                for path, pool in (("pool", pools), ("fetch", None)):
                    row = measure(c, pool, cross, own, engines[readers], args.reps, model_bytes // readers, n)
                    row.update(direction=direction, path=path, readers=readers, stored_by=stored_by)
                    rows.append(row)
                    print(f"{direction:>10} {path:>5}: {row['resharded_ms']:8.1f} ms vs {row['same_ms']:8.1f} ms "
                          f"same-TP ({row['x_same']:.2f}x); bytes per worker {row['bytes_per_worker']} "
                          f"(share {row['share_bytes']})", flush=True)
    out = {"machine": machine(),
           "settings": {"tokens": n, "layers": args.layers, "kv_heads": HEADS, "head_dim": HEAD, "dtype": "bfloat16",
                        "chunk_tokens": CHUNK, "reps": args.reps, "statistic": "median over reps and workers",
                        "paths": {"pool": "the shared pool (leases; the same-host default)", "fetch": "Fetch into the same-host shared-memory buffer"}, "goal_x_same": GOAL_TIME,
                        "sidecar": settings},
           "rows": rows}
    if not args.quick:
        print(f"results: {write_results('tp', out)}")
        print(f"plot: {plot(rows, RESULTS / 'tp.png')}")
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.6))
    xs = np.arange(len(rows))
    ax.bar(xs - 0.2, [r["same_ms"] for r in rows], 0.4, label="same TP size stored it", color="tab:gray")
    ax.bar(xs + 0.2, [r["resharded_ms"] for r in rows], 0.4, label="another TP size stored it", color="tab:green")
    for x, r in zip(xs, rows):
        ax.text(x + 0.2, r["resharded_ms"], f"{r['x_same']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, [f"{r['direction']}\n{r['path']}" for r in rows], fontsize=7)
    ax.set_ylabel("ms per worker (median)")
    ax.set_title("One worker's load of a 4K-token Llama-3-8B prompt: re-sharded vs same-TP")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="1K tokens, 4 layers, 1 rep; nothing written")
    args = ap.parse_args(argv)
    if args.tokens <= 0 or args.tokens % CHUNK:
        raise SystemExit(f"--tokens: a positive multiple of {CHUNK}, got {args.tokens}")
    return run(args)


if __name__ == "__main__":
    main()
