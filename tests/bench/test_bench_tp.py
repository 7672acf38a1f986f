"""The re-sharding benchmark (bench/tp.py) in ``--quick`` mode on a real sidecar process: every
direction and path is measured, each resharded plan was planned under the storing TP size
(the bench raises otherwise), and every worker read exactly its share of the bytes."""

from __future__ import annotations

from bench import tp


def test_quick_run_measures_every_direction_and_path():
    out = tp.main(["--quick"])
    rows = out["rows"]
    assert {(r["direction"], r["path"]) for r in rows} == {
        (f"TP {a} -> {b}", p) for n in tp.SIZES for a, b in ((1, n), (n, 1)) for p in ("pool", "fetch")}
    for r in rows:
        assert r["exactly_its_share"] and r["bytes_per_worker"] == [r["share_bytes"]], r
        assert r["resharded_ms"] > 0 and r["same_ms"] > 0
