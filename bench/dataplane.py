"""KV bytes between an engine and a sidecar on the same host: the shared pool against Fetch and
Store, as GB/s and as a fraction of a plain ``copy_`` of the same bytes, in one run.

    ./dev bench dataplane                      # 4K and 16K tokens, writes results/dataplane.{json,png}
    ./dev bench dataplane --tokens 4096,8192   # other sizes
    ./dev bench dataplane --quick              # a small smoke run (nothing written)

The sidecar runs in its own process (``sidecar.process.sidecar_process``), its CPU tier in the
shared pool (``store.cpu_shared``); the engine is this process. The KV is Llama-3-8B-shaped
(32 layers x K,V 8 heads x 128, bf16: 128 KiB per token) in 128-token chunks (anchored
messages), stored once; the engine's KV lives in one ``[L, 2, N, H, D]`` bf16 tensor. Each
figure is the median wall time of the whole operation the engine sees (RPCs included), reps of
the paths compared interleaved rep by rep, each after a pause for the previous one's leftovers
(``settled``), over the payload bytes:

* ``copy_``: ``dst.copy_(src)`` of two preallocated, page-faulted tensors of the payload size
  (best of a few reps): what moving these bytes once costs on this machine.
* Fetch, exact (the same prompt: delta 0) and shifted (a new 64-token header before the same
  body, ``recompute_tokens=0``: every hit rotated by 64), each into a preallocated staging tensor:

  - ``pool``: ``PoolClient.lease`` of ``plan.fetch_spans()``, ``read_into`` each item's slice
    of the staging tensor (rotated on the way), ``intact``, ``release``;
  - ``segment``: ``client.fetch`` with the same-host default (payloads in a shared-memory
    segment buffer), then the engine's copy of each payload into the staging tensor;
  - ``stream``: the same over the gRPC stream (``shared_memory=False``).

  The staging tensors of the three paths are compared after the first rep of each: they must
  be bit-identical (the bench raises otherwise), and ``intact`` must hold on every rep.
* Store of a fresh prompt each rep (nothing deduplicates; deleted after the rep, untimed):

  - ``pool``: ``PoolClient.reserve``, gather each chunk from the engine's tensor into its slot
    (``w.stacked(start).copy_(src[:, :, a:b])``), ``commit``;
  - ``stream``: per-chunk contiguous copies (``src[:, :, a:b].contiguous()``, as an engine
    builds them; timed) sent by ``client.store(..., payloads=)``.
* Loads into vLLM's paged cache on CPU (``bench.vllm_load``; sizes up to 4K tokens): the
  connector's own placement from the pool, exact and shifted, into the CPU backend's cache and
  the standard layout, each checked against ``read_into``'s rows.

``x_break_even``: GB/s over 3.3 GB/s, the rate at which loading 128 KiB per token costs as much
as recomputing it on one H100 (Llama-3-8B prefill: ~16 GFLOP per token at ~400 TFLOP/s
effective, ~40 us per token). Each size runs against its own sidecar; the settings it needs (pool size,
``max_fetch_bytes``, a lease TTL longer than the slowest read) are in the result file's
``settings``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import vllm_load
from bench.harness import RESULTS, machine, sidecar_process, write_results
from clients.vllm.placing import Scratch
from clients.vllm.staging import Staging
from sidecar.client import SyncSidecarClient
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.payload import stacked_view
from sidecar.rotation.spec import Pairing, RopeSpec, RotaryLayout
from sidecar.sdk.pool import PoolClient

MiB = 1 << 20
GiB = 1 << 30
ANCHOR = 151644
CHUNK = 128
HEADER = 64
#: GB/s at which loading Llama-3-8B's 128 KiB per token costs what recomputing it does on one
#: H100 (~40 us per token of prefill).
BREAK_EVEN_GBPS = 3.3
FETCH_PATHS = ("pool", "segment", "stream")
#: the largest size whose loads into vLLM's caches are measured (a 16K cache and its scratch
#: would take 4 GiB more than this 24 GiB host has beside the rest of the run)
VLLM_LOAD_MAX_TOKENS = 4096
#: the pause before each timed rep (``settled``)
SETTLE_S = 0.3
STORE_PATHS = ("pool", "stream")


def llama3_8b(num_layers: int = 32) -> tuple[KVLayout, RopeSpec]:
    layout = KVLayout.gqa(num_layers=num_layers, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    spec = RopeSpec(rotary_dim=128, key_dim=128, layout=RotaryLayout.LEADING, pairing=Pairing.HALF,
                    inv_freq=tuple(500000 ** (-(2 * i) / 128) for i in range(64)))
    return layout, spec


def body(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """``tokens`` distinct-looking tokens as anchored 128-token messages, closed by an anchor."""
    msgs = rng.integers(0, 150_000, (tokens // CHUNK, CHUNK))
    msgs[:, 0] = ANCHOR
    return np.concatenate([msgs.ravel(), [ANCHOR]]).astype(np.uint32)


def engine_kv(layout: KVLayout, n: int, seed: int = 0) -> torch.Tensor:
    """The engine's KV for ``n`` tokens, ``[L, 2, n, H, D]`` bf16 (filled layer by layer: a
    float32 temporary of the whole would double the memory)."""
    part = layout.parts[0]
    out = torch.empty((layout.num_layers, len(layout.parts), n, *part.shape), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    for layer in range(layout.num_layers):
        out[layer].copy_(torch.randn(out[layer].shape, generator=g))
    return out


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copy_seconds(n_bytes_tensor: torch.Tensor, reps: int) -> float:
    """Best of ``reps`` ``dst.copy_(src)`` between two preallocated tensors like the payload."""
    src = n_bytes_tensor
    dst = torch.empty_like(src)
    dst.copy_(src)  # pages faulted in
    return min(timed(lambda: dst.copy_(src)) for _ in range(max(3, reps)))


class Case:
    """One size: the sidecar holds the body's KV; the engine has its KV and staging tensors."""

    def __init__(self, c: SyncSidecarClient, seg: SyncSidecarClient, stream: SyncSidecarClient, pool: PoolClient,
                 layout: KVLayout, spec: RopeSpec, ident: CacheIdentity, tokens: int, rng: np.random.Generator) -> None:
        self.c, self.seg, self.stream, self.pool = c, seg, stream, pool
        self.layout, self.spec, self.ident, self.n, self.rng = layout, spec, ident, tokens, rng
        self.src = engine_kv(layout, tokens)
        self.prompt = body(rng, tokens)
        self.stored = self.store_pool(self.prompt)
        header = np.concatenate([[ANCHOR], rng.integers(0, 150_000, HEADER - 1)]).astype(np.uint32)
        self.plans = {
            "exact": (self.c.lookup(self.prompt, identity=ident, recompute_tokens=0).fetch_spans(), 0),
            "shifted": (self.c.lookup(np.concatenate([header, self.prompt]), identity=ident,
                                      recompute_tokens=0).fetch_spans(), HEADER),
        }
        for kind, (spans, base) in self.plans.items():
            covered = sum(s.num_tokens for s in spans if base <= s.target_pos < base + tokens)
            if covered != tokens:
                raise RuntimeError(f"{kind}: the Lookup hits cover {covered} of the body's {tokens} tokens")
            self.plans[kind] = ([s for s in spans if base <= s.target_pos < base + tokens], base)
        self.staging = {p: torch.zeros_like(self.src) for p in ("pool", "old")}

    @property
    def nbytes(self) -> int:
        return self.n * self.layout.bytes_per_token

    def starts(self) -> list[int]:
        return list(range(0, self.n, CHUNK))

    # ------------------------------------------------------------------ Store

    def store_pool(self, tokens: np.ndarray) -> Any:
        w = self.pool.reserve(tokens, identity=self.ident, layout=self.layout, chunk_starts=self.starts())
        if w.held or len(w.slots) != self.n // CHUNK:
            w.abort()
            raise RuntimeError(f"reserve: {len(w.slots)} slots and {len(w.held)} held, expected {self.n // CHUNK} new")
        for a, _ in w.slots.items():
            w.stacked(a).copy_(self.src[:, :, a : a + CHUNK])
        res = w.commit()
        if res.chunks_stored != self.n // CHUNK:
            raise RuntimeError(f"commit: {res.chunks_stored} chunks stored of {self.n // CHUNK}")
        return res

    def store_stream(self, tokens: np.ndarray) -> Any:
        payloads = {a: self.src[:, :, a : a + CHUNK].contiguous() for a in self.starts()}
        res = self.c.store(tokens, identity=self.ident, layout=self.layout, payloads=payloads)
        if res.chunks_stored != self.n // CHUNK:
            raise RuntimeError(f"store: {res.chunks_stored} chunks stored of {self.n // CHUNK}")
        return res

    def forget(self, tokens: np.ndarray) -> None:
        """Delete ``tokens``' chunks (after a Store rep, untimed): the pool keeps its room."""
        hashes = [h.chunk_hash for h in self.c.lookup(tokens, identity=self.ident).hits()]
        if hashes:
            self.c.delete(hashes)

    # ------------------------------------------------------------------ Fetch

    def fetch_pool(self, kind: str) -> None:
        spans, base = self.plans[kind]
        out = self.staging["pool"]
        got = self.pool.lease(spans, identity=self.ident, layout=self.layout)
        try:
            for it in got.items:
                if not it.ok:
                    raise RuntimeError(f"lease: item {it.index} of {kind} is a miss")
                a = spans[it.index].target_pos - base
                self.pool.read_into(it, out[:, :, a : a + it.num_tokens], self.layout, self.spec)
            if not self.pool.intact(got):
                raise RuntimeError(f"intact: a lease of {kind} expired during the read (raise pool_lease_ttl_s)")
        finally:
            self.pool.release(got)

    def fetch_client(self, client: SyncSidecarClient, kind: str) -> None:
        spans, base = self.plans[kind]
        out = self.staging["old"]
        got = client.fetch(spans, identity=self.ident, layout=self.layout, rope=self.spec)
        for f in got:
            if not f.ok:
                raise RuntimeError(f"fetch: item {f.index} of {kind} is a miss")
            a = spans[f.index].target_pos - base
            out[:, :, a : a + f.num_tokens].copy_(stacked_view(f.data, self.layout, f.num_tokens))
        del got  # the segment buffer goes back to the client's pool

    def fetch(self, path: str, kind: str) -> None:
        if path == "pool":
            self.fetch_pool(kind)
        else:
            self.fetch_client(self.seg if path == "segment" else self.stream, kind)

    def check(self, kind: str, path: str) -> None:
        """The old path's staging (``path``) equals the pool path's, bit for bit."""
        a, b = self.staging["pool"].view(torch.int16), self.staging["old"].view(torch.int16)
        if not torch.equal(a, b):
            bad = int((a != b).sum())
            raise RuntimeError(f"{kind}: the pool path's staging differs from the {path} path's in {bad} of "
                               f"{a.numel()} values")


def settled(fn: Callable[[], Any]) -> float:
    """``timed(fn)`` after the previous path's leftovers are done: this process's garbage
    collected and a pause for the sidecar's (the stream paths leave the server freeing hundreds
    of MiB of messages after their answer, on the same cores the next path runs on)."""
    gc.collect()
    time.sleep(SETTLE_S)
    return timed(fn)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def run_size(case: Case, reps: int) -> dict[str, Any]:
    """Every row of one size: copy_, then Fetch (warm-up rep checked for equality, then ``reps``
    interleaved), then Store (fresh prompts, interleaved)."""
    nbytes = case.nbytes
    copy_s = copy_seconds(case.src, reps)
    case.src = None  # not needed until the Stores (rebuilt then): memory stays bounded
    gc.collect()
    fetch_t: dict[str, dict[str, list[float]]] = {k: {p: [] for p in FETCH_PATHS} for k in case.plans}
    for kind in case.plans:  # warm-up: pages faulted, buffers grown, numba compiled; bytes checked
        case.fetch("pool", kind)
        for path in FETCH_PATHS[1:]:
            case.staging["old"].zero_()
            case.fetch(path, kind)
            case.check(kind, path)
    for _ in range(reps):
        for kind in case.plans:
            for path in FETCH_PATHS:
                fetch_t[kind][path].append(settled(lambda: case.fetch(path, kind)))
    # The segment buffer and the old paths' staging go before the loads into vLLM's caches, the
    # Fetch data and the pool path's staging before the Stores: memory stays bounded.
    case.seg.close()
    del case.staging["old"]
    gc.collect()
    load_t = vllm_loads(case, reps) if case.n <= VLLM_LOAD_MAX_TOKENS else {}
    case.forget(case.prompt)
    case.staging.clear()
    gc.collect()
    case.src = engine_kv(case.layout, case.n)  # the same KV (seeded) for the Stores
    store_t: dict[str, list[float]] = {p: [] for p in STORE_PATHS}
    for i in range(reps + 1):  # rep 0 warms up
        for path in STORE_PATHS:
            tokens = body(case.rng, case.n)
            fn = case.store_pool if path == "pool" else case.store_stream
            t = settled(lambda: fn(tokens))
            case.forget(tokens)
            gc.collect()
            if i:
                store_t[path].append(t)

    def row(samples: list[float]) -> dict[str, float]:
        med = statistics.median(samples)
        rate = gbps(nbytes, med)
        return {"ms": med * 1e3, "gbps": rate, "x_copy": copy_s / med, "x_break_even": rate / BREAK_EVEN_GBPS}

    return {
        "tokens": case.n, "mib": nbytes / MiB, "chunks": case.n // CHUNK,
        "span_items": {k: len(s) for k, (s, _) in case.plans.items()},
        "copy_": {"ms": copy_s * 1e3, "gbps": gbps(nbytes, copy_s)},
        "fetch": {k: {p: row(v) for p, v in paths.items()} for k, paths in fetch_t.items()},
        "store": {p: row(v) for p, v in store_t.items()},
        "vllm_load": {c: {k: row(v) for k, v in kinds.items()} for c, kinds in load_t.items()},
    }


def vllm_loads(case: Case, reps: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per load into each vLLM cache on CPU (``bench.vllm_load``), exact and shifted,
    one cache at a time; the first load of each is checked against ``read_into``'s rows."""
    layout = case.layout
    part = layout.parts[0]
    out: dict[str, dict[str, list[float]]] = {}
    staging, scratch = Staging(torch.device("cpu")), Scratch()
    for name in vllm_load.CACHES:
        cache, table = vllm_load.build(name, layout.num_layers, part.shape[0], part.shape[1], case.n)
        out[name] = {}
        for kind in case.plans:
            case.fetch("pool", kind)  # read_into's rows: the reference
            vllm_load.load(case, kind, cache, table, staging, scratch)
            vllm_load.check(case, kind, cache, table, case.staging["pool"])
            out[name][kind] = [settled(lambda: vllm_load.load(case, kind, cache, table, staging, scratch))
                               for _ in range(reps)]
        cache = None  # its memory goes before the next cache's
        gc.collect()
    return out


def table(results: dict[str, dict]) -> str:
    lines = [f"{'tokens':>6} {'MiB':>6}  {'row':<24} {'ms':>9} {'GB/s':>7} {'x copy_':>8} {'x 3.3':>6}"]
    for r in results.values():
        c = r["copy_"]
        lines.append(f"{r['tokens']:>6} {r['mib']:>6.0f}  {'copy_':<24} {c['ms']:>9.1f} {c['gbps']:>7.2f} {1:>8.2f} "
                     f"{c['gbps'] / BREAK_EVEN_GBPS:>6.2f}")
        rows = [(f"fetch {k} {p}", v) for k, paths in r["fetch"].items() for p, v in paths.items()]
        rows += [(f"store {p}", v) for p, v in r["store"].items()]
        rows += [(f"vllm {c} {k}", v) for c, kinds in r.get("vllm_load", {}).items() for k, v in kinds.items()]
        for name, v in rows:
            lines.append(f"{'':>6} {'':>6}  {name:<24} {v['ms']:>9.1f} {v['gbps']:>7.2f} {v['x_copy']:>8.2f} "
                         f"{v['x_break_even']:>6.2f}")
    return "\n".join(lines)


def plot(results: dict[str, dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results)
    names = [(f"fetch {k}\n{p}", ("fetch", k, p)) for k in ("exact", "shifted") for p in FETCH_PATHS]
    names += [(f"store\n{p}", ("store", None, p)) for p in STORE_PATHS]
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.6), squeeze=False, sharey=True)
    colors = {"pool": "tab:green", "segment": "tab:blue", "stream": "tab:gray"}
    for ax, size in zip(axes[0], sizes):
        r = results[size]
        vals = [r["fetch"][k][p]["gbps"] if what == "fetch" else r["store"][p]["gbps"] for _, (what, k, p) in names]
        xs = np.arange(len(names))
        ax.bar(xs, vals, color=[colors[p] for _, (_, _, p) in names])
        for x, v in zip(xs, vals):
            ax.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
        ax.axhline(r["copy_"]["gbps"], color="black", ls="--", lw=1, label=f"copy_ {r['copy_']['gbps']:.1f} GB/s")
        ax.axhline(BREAK_EVEN_GBPS, color="tab:red", ls=":", lw=1.5, label=f"break-even on one H100 {BREAK_EVEN_GBPS} GB/s")
        ax.set_xticks(xs, [n for n, _ in names], fontsize=8)
        ax.set_title(f"{r['tokens']} tokens ({r['mib']:.0f} MiB, Llama-3-8B KV)")
        ax.legend(fontsize=8, loc="upper right")
    axes[0][0].set_ylabel("GB/s (median, whole operation)")
    fig.suptitle("Engine <-> sidecar on one host: shared pool vs Fetch / Store")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="4096,16384", help="comma-separated sizes in tokens (multiples of 128)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1,
                    help="the engine's intra-op threads (torch, numba): see engine_threads")
    ap.add_argument("--quick", action="store_true", help="1K tokens, 4 layers, 1 rep; nothing written")
    args = ap.parse_args(argv)
    with engine_threads(args.threads):
        return run(args)


@contextmanager
def engine_threads(n: int) -> Iterator[None]:
    """This process's torch and numba threads set to ``n`` (restored after). One by default:
    with two on this shared 2-core VM, each parallel region (a ``copy_`` or a rotation call)
    waits milliseconds for a thread to get a core, and the pool path makes one per chunk and
    layer (measured: 16 MiB of 2 MiB strided ``copy_`` calls at 0.34 GB/s with 2 threads, 11.7
    with 1)."""
    import numba

    old = torch.get_num_threads(), numba.get_num_threads()
    torch.set_num_threads(n)
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        torch.set_num_threads(old[0])
        numba.set_num_threads(old[1])


def sidecar_settings(nbytes: int) -> dict[str, Any]:
    """The sidecar of one size: a pool for two prompts of ``nbytes`` (the stored one and a Store
    rep's), Fetches of the whole prompt, a lease TTL longer than the slowest read."""
    return {
        "chunker.anchor_tokens": [ANCHOR], "chunker.min_size": CHUNK, "chunker.max_size": CHUNK,
        "store.cpu_bytes": 2 * nbytes + 64 * MiB, "max_fetch_bytes": 2 * nbytes,
        "store.io_timeout_s": 120, "pool_lease_ttl_s": 60,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.tokens, args.reps, args.layers = "1024", 1, 4
    sizes = [int(t) for t in args.tokens.split(",")]
    if any(t <= 0 or t % CHUNK for t in sizes):
        raise SystemExit(f"--tokens: sizes must be positive multiples of {CHUNK}, got {args.tokens}")
    layout, spec = llama3_8b(args.layers)
    ident = CacheIdentity(model_id="llama3-8b-bench", kv_layout=layout.fingerprint(), rope_fingerprint=spec.fingerprint)
    results: dict[str, dict] = {}
    rng = np.random.default_rng(0)
    for n in sizes:  # a sidecar per size, its pool sized for it: memory stays bounded
        nbytes = n * layout.bytes_per_token
        settings = sidecar_settings(nbytes)
        flags = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
        with sidecar_process(*flags) as target, \
                SyncSidecarClient(target, tenant="bench", timeout_s=600) as c, \
                SyncSidecarClient(target, tenant="bench", timeout_s=600, shared_memory=False) as stream, \
                SyncSidecarClient(target, tenant="bench", timeout_s=600, shared_memory=True,
                                  shared_memory_max_bytes=nbytes + 64 * MiB) as seg:
            pool = PoolClient(c)
            if not pool.available:
                raise RuntimeError("the sidecar has no shared pool to map (store.cpu_shared, /dev/shm)")
            case = Case(c, seg, stream, pool, layout, spec, ident, n, rng)
            results[str(n)] = run_size(case, args.reps)
            del case
            if pool.mapped is not None:
                pool.mapped.close()  # the pool file goes with its sidecar: unmapped here too
        gc.collect()
        print(table({str(n): results[str(n)]}), flush=True)
    settings = {str(n): sidecar_settings(n * layout.bytes_per_token) for n in sizes}
    seg_bytes = {str(n): n * layout.bytes_per_token + 64 * MiB for n in sizes}  # the segment buffer's cap
    out = {
        "machine": machine(),
        "settings": {"layout": f"gqa {args.layers} layers x K,V 8 x 128 bf16", "bytes_per_token": layout.bytes_per_token,
                     "chunk_tokens": CHUNK, "shift": HEADER, "reps": args.reps, "engine_threads": args.threads, "statistic": "median (copy_: best)",
                     "break_even_gbps": BREAK_EVEN_GBPS, "segment_max_bytes": seg_bytes, "sidecar": settings},
        "sizes": results,
    }
    if len(results) > 1:
        print(table(results))
    if not args.quick:
        print(f"results: {write_results('dataplane', out)}")
        print(f"plot: {plot(results, RESULTS / 'dataplane.png')}")
    return out


if __name__ == "__main__":
    main()
