"""Run one vLLM engine (CPU) over a list of prompts, optionally with the sidecar connector.

``python -m clients.vllm.run SPEC.json OUT.json``: one process = one engine with an empty local
cache, so two runs are an engine restart. The tests (tests/real_engines) and the benchmark
(bench/vllm.py) drive engines through it (``run_engine``; ``model_dir`` builds the project's
standard model's directory). SPEC::

    {"model": "/path/to/hf-dir",
     "sidecar": "127.0.0.1:PORT" | null,          # null: vLLM without the connector
     "extra": {...},                              # more kv_connector_extra_config keys
     "gap_fill": true,                            # --scheduler-cls clients.vllm.scheduler.SidecarScheduler
     "prefix_caching": true, "block_size": 32, "max_model_len": 8192,
     "kv_cache_dtype": "auto",                    # vLLM's --kv-cache-dtype
     "tensor_parallel_size": 1,                   # > 1: one worker process per rank
     "requests": [{"prompt_token_ids": [...], "max_tokens": 16, "params": {...kv_transfer_params},
                   "logprobs": 5}]}              # the top-5 logprobs of each generated token

A ``params`` value ``"@i"`` is replaced by the session id (or, for a key ending in ``version``,
the session version) that request ``i``'s output returned (``sidecar_session: "open"``).

Requests run one at a time, in order (each sees what the previous ones stored). OUT gets per
request the generated token ids, ``kv_transfer_params["sidecar"]`` (planned / claimed tokens),
time to first token (vLLM's own request metrics) and wall time; plus start-up time and, when the
engine runs in-process, the worker connector's counters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sidecar.process import server_python

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

ROOT = Path(__file__).resolve().parents[2]


def model_dir() -> str:
    """SmolLM2-135M-Instruct as a Hugging Face directory for vLLM (``clients.transformers.hf_directory``
    runs in the main environment, which has transformers' GGUF support); ``KV_SIDECAR_VLLM_MODEL``
    overrides."""
    env = os.environ.get("KV_SIDECAR_VLLM_MODEL")
    if env:
        return env
    out = subprocess.run([server_python(), "-c",
                          "from clients.transformers import hf_directory; print(hf_directory('smollm2'))"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def run_engine(spec: dict[str, Any], threads: int = 2, *, multiprocess: bool = False,
               timeout: float | None = None) -> dict[str, Any]:
    """One fresh vLLM engine (its own process: an empty local prefix cache) over ``spec`` (this
    module's ``main``); its JSON result plus its log (``"log"``)."""
    with tempfile.TemporaryDirectory() as d:
        sp, op = Path(d) / "spec.json", Path(d) / "out.json"
        sp.write_text(json.dumps(spec))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
               "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.run([sys.executable, "-m", "clients.vllm.run", str(sp), str(op)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not op.exists():
            raise RuntimeError(f"engine run failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
        out = json.loads(op.read_text())
        out["log"] = proc.stderr
        return out


def build_llm(spec: dict[str, Any]):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = dict(
        model=spec["model"], enforce_eager=True, block_size=int(spec.get("block_size", 32)),
        dtype=spec.get("dtype", "bfloat16"), max_model_len=int(spec.get("max_model_len", 8192)),
        enable_prefix_caching=bool(spec.get("prefix_caching", True)), disable_log_stats=False, seed=0,
    )
    if spec.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = int(spec["max_num_batched_tokens"])
    if spec.get("kv_cache_dtype"):
        kw["kv_cache_dtype"] = spec["kv_cache_dtype"]
    if spec.get("load_format"):
        kw["load_format"] = spec["load_format"]
    if int(spec.get("tensor_parallel_size", 1)) > 1:
        kw["tensor_parallel_size"] = int(spec["tensor_parallel_size"])
    if spec.get("sidecar"):
        extra = {"sidecar": spec["sidecar"], **spec.get("extra", {})}
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="SidecarConnector", kv_connector_module_path="clients.vllm.connector",
            kv_role="kv_both", kv_connector_extra_config=extra)
        if spec.get("gap_fill", True):
            kw["scheduler_cls"] = "clients.vllm.scheduler.SidecarScheduler"
    return LLM(**kw)


def _flush_worker() -> None:
    try:
        from clients.vllm import connector as conn
    except Exception:  # noqa: BLE001
        return
    w = conn.INSTANCES.get("worker")
    if w is not None:
        w.flush()


#: vLLM's prefix-cache counters (its own cache, and the connector's loads), per request
_CACHE_COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                   "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits")


def _cache_counters(llm: Any) -> dict[str, float]:
    out = dict.fromkeys(_CACHE_COUNTERS, 0.0)
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - stats disabled
        return out
    for m in metrics:
        if m.name in out:
            out[m.name] += float(getattr(m, "value", 0.0) or 0.0)
    return out


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    t0 = time.perf_counter()
    llm = build_llm(spec)
    startup = time.perf_counter() - t0
    results = []
    for req in spec["requests"]:
        params = dict(req.get("params") or {})
        for k, v in list(params.items()):  # "@i": the session id / version request i's output returned
            if isinstance(v, str) and v.startswith("@"):
                sess = ((results[int(v[1:])].get("sidecar") or {}).get("session") or {})
                params[k] = sess.get("version" if k.endswith("version") else "id")
        extra_args = {"kv_transfer_params": params}
        sp = SamplingParams(max_tokens=int(req.get("max_tokens", 16)), temperature=0.0, extra_args=extra_args,
                            ignore_eos=bool(req.get("ignore_eos", False)), logprobs=req.get("logprobs"))
        before = _cache_counters(llm)
        t1 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": list(req["prompt_token_ids"])}], sp, use_tqdm=False)[0]
        wall = time.perf_counter() - t1
        after = _cache_counters(llm)
        _flush_worker()  # in-process: the next request sees this one's background Store
        m = out.metrics
        results.append({
            "token_ids": list(out.outputs[0].token_ids),
            "text": out.outputs[0].text,
            # per generated token: [[token id, logprob], ...] best first (with "logprobs")
            "logprobs": [sorted(([int(t), float(lp.logprob)] for t, lp in step.items()), key=lambda x: -x[1])
                         for step in (out.outputs[0].logprobs or [])],
            "sidecar": (out.kv_transfer_params or {}).get("sidecar"),
            "ttft_s": float(getattr(m, "first_token_latency", 0.0) or 0.0) if m is not None else None,
            "wall_s": wall,
            "prompt_tokens": len(req["prompt_token_ids"]),
            "num_cached_tokens": getattr(out, "num_cached_tokens", None),
            "vllm_metrics": {k.removeprefix("vllm:"): after[k] - before[k] for k in _CACHE_COUNTERS},
        })
    worker = None
    try:
        from clients.vllm import connector as conn

        w = conn.INSTANCES.get("worker")
        if w is not None:
            w.flush()
            worker = w.stats()
        s = conn.INSTANCES.get("scheduler")
        sched = s.stats() if s is not None else None
    except Exception:  # noqa: BLE001 - vLLM without the connector
        sched = None
    try:
        llm.llm_engine.engine_core.shutdown()  # workers flush their background Stores
    except Exception:  # noqa: BLE001
        pass
    return {"startup_s": startup, "results": results, "worker_stats": worker, "scheduler_stats": sched,
            "multiprocess": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(open(argv[0]).read())
    out = run(spec)
    with open(argv[1], "w") as f:
        json.dump(out, f)
    os._exit(0)  # vLLM's engine threads can keep an interpreter alive at exit


if __name__ == "__main__":
    sys.exit(main())
