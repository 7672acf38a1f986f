"""The connector's counters as vLLM's ``KVConnectorStats`` (``clients.vllm.stats``): what one
interval reports, from the real role classes against a real sidecar, and how vLLM combines the
reports (the workers' summed, then the scheduler side's, then the intervals of a log period)."""

from __future__ import annotations

import pickle

from clients.vllm.stats import SidecarConnectorStats, StatsInterval, snapshot
from tests.clients.vllm.fakes import FakeScheduler, Request


def test_an_interval_is_what_the_counters_gained_since_the_last_call(engine, prompts):
    """Engine A stores a prompt: its worker's first report is exactly that Store, the next call
    (nothing done meanwhile) reports nothing, and a second prompt reports its Store alone; the
    cumulative counters (``stats()``) are untouched by reporting."""
    side, worker = engine()
    interval = StatsInterval()
    s = FakeScheduler(side, worker)
    first = prompts.msg(200) + prompts.msg(100)
    s.add_request(Request("a", first))
    [store] = s.step().stores
    got = interval.take(snapshot(worker.counters, worker.link.errors))
    assert got is not None and got.data["stored_tokens"] == len(first)
    assert got.data["stored_chunks"] == len(store.chunks)
    assert set(got.data) == {k for k, v in worker.counters.items() if v}
    assert interval.take(snapshot(worker.counters, worker.link.errors)) is None

    second = prompts.msg(150)
    s.add_request(Request("b", second))
    [store_b] = s.step().stores
    got = interval.take(snapshot(worker.counters, worker.link.errors))
    assert got is not None and got.data["stored_tokens"] == len(second)
    assert got.data["stored_chunks"] == len(store_b.chunks)
    assert worker.counters["stored_tokens"] == len(first) + len(second)


def test_sidecar_errors_are_reported_by_call(engine, closed_target, prompts):
    """The sidecar is down: the scheduler side's interval carries the failed and the skipped
    Lookup as ``error:<call>`` counters, like ``stats()``."""
    side, worker = engine(sidecar=closed_target, retry_after_s=60.0, timeout_s=1.0)
    s = FakeScheduler(side, worker)
    tokens = prompts.msg(100)
    s.add_request(Request("one", tokens))
    s.add_request(Request("two", tokens + prompts.msg(10)))
    s.step()
    got = StatsInterval().take(snapshot(side.counters, side.link.errors))
    assert got is not None
    assert got.data["error:lookup"] == 1 and got.data["error:lookup:skipped"] == 1


def test_reports_sum_across_workers_and_intervals():
    """vLLM aggregates each worker's report into the first, then the scheduler side's; the logger
    rebuilds each step's dict (``build``) and aggregates a log period; ``reduce`` is the sums, by
    name, without zeros; ``reset`` empties it."""
    w0 = SidecarConnectorStats(data={"loaded_tokens": 64, "loads": 1, "fetch_us": 900})
    w1 = SidecarConnectorStats(data={"loaded_tokens": 64, "loads": 1, "load_failed_tokens": 32})
    sched = SidecarConnectorStats(data={"claimed_tokens": 64, "load_jobs": 1})
    step = w0.aggregate(w1).aggregate(sched)
    assert step is w0
    assert step.to_dict() == {"loaded_tokens": 128, "loads": 2, "fetch_us": 900, "load_failed_tokens": 32,
                              "claimed_tokens": 64, "load_jobs": 1}
    wire = pickle.loads(pickle.dumps(step))  # a worker process's report reaches the engine core pickled
    assert type(wire) is SidecarConnectorStats and wire.to_dict() == step.to_dict()

    period = SidecarConnectorStats.build(step.to_dict())
    period.aggregate(SidecarConnectorStats.build({"claimed_tokens": 32, "stored_tokens": 0}))
    period.aggregate(SidecarConnectorStats.build(None))
    assert period.reduce() == {"claimed_tokens": 96, "fetch_us": 900, "load_failed_tokens": 32, "load_jobs": 1,
                               "loaded_tokens": 128, "loads": 2}
    assert list(period.reduce()) == sorted(period.reduce())
    assert not period.is_empty()
    assert SidecarConnectorStats(data={"stored_tokens": 0}).is_empty() and SidecarConnectorStats().is_empty()
    period.reset()
    assert period.is_empty() and period.to_dict() == {}
