"""The vLLM layouts benchmark (bench/vllm_layouts.py) on a tiny cache: it times the methods the
worker calls, in every layout, GQA and MLA."""

from __future__ import annotations

from clients.vllm.layouts import KV_CACHE_LAYOUTS as LAYOUTS
from clients.vllm.layouts import LatentKV, StandardKV


def test_the_layouts_bench_times_the_workers_own_copies(monkeypatch, tmp_path):
    """``./dev bench vllm_layouts`` times the methods ``WorkerSide`` calls (``scatter`` for loads,
    ``gather`` for Stores), in every layout, GQA and MLA: counted here on a tiny cache."""
    import json

    from bench import vllm_layouts

    calls: dict[tuple[str, str], int] = {}

    def counting(cls: type, name: str) -> None:
        real = getattr(cls, name)

        def spy(self, *args, **kwargs):
            calls[(cls.__name__, name)] = calls.get((cls.__name__, name), 0) + 1
            return real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, spy)

    for cls in (StandardKV, LatentKV):
        counting(cls, "scatter")
        counting(cls, "gather")
    monkeypatch.setattr(vllm_layouts, "RESULTS", tmp_path)
    monkeypatch.setattr(vllm_layouts, "LAYERS", 2)
    monkeypatch.setattr(vllm_layouts, "BLOCKS", 16)
    monkeypatch.setattr(vllm_layouts, "RUN_TOKENS", 64)
    assert vllm_layouts.main(["--reps", "1"]) == 0
    doc = json.loads((tmp_path / "vllm_layouts.json").read_text())
    assert {(r["kind"], r["layout"]) for r in doc["rows"]} == {(k, name) for k in ("gqa", "mla") for name in LAYOUTS}
    per_layout = 3  # interleaved rounds, one rep each
    for cls in ("StandardKV", "LatentKV"):
        assert calls[(cls, "scatter")] == per_layout * len(LAYOUTS), calls
        assert calls[(cls, "gather")] == (per_layout + 1) * len(LAYOUTS), calls  # + the correctness check
