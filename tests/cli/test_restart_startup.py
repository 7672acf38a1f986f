"""``kv-sidecar serve`` start-up: the cyclic garbage collector is off while the process imports
and recovers (long-lived objects, little garbage) and back on, over a frozen start-up heap,
once it serves (sidecar/cli/main.py)."""

from __future__ import annotations

import gc

from sidecar.cli.main import _begin_startup_gc, _end_startup_gc


def test_startup_collects_nothing_and_serving_collects_over_a_frozen_heap() -> None:
    assert gc.isenabled()
    frozen_before = gc.get_freeze_count()
    try:
        _begin_startup_gc()
        assert not gc.isenabled()
        recovered = [[i] for i in range(1000)]  # start-up objects: kept, never walked again
        _end_startup_gc()
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen_before + len(recovered)
    finally:
        gc.unfreeze()
        gc.enable()
