"""The connector's scheduler side (what a request loads, what it stores, what it reports) with a
fake vLLM scheduler, the real worker side over a CPU paged cache, and a real sidecar."""

from __future__ import annotations

import numpy as np
import torch

from tests.clients.vllm.conftest import BLOCK
from tests.clients.vllm.fakes import FakeScheduler, Request, kv_rows


def rows_of(worker, block_ids: list[int], start: int, end: int) -> torch.Tensor:
    return worker.paged.gather(torch.tensor(block_ids, dtype=torch.int64), torch.arange(start, end))


def test_a_restarted_engine_loads_the_prefix_another_stored(engine, prompts):
    """Engine A computes a prompt and stores every chunk of the plan; engine B (empty local
    cache) loads the whole block-aligned prefix up to n - 1 from the sidecar, bit-exact, and
    stores nothing (the sidecar serves every chunk whole)."""
    tokens = prompts.msg(200) + prompts.msg(300) + prompts.msg(150)
    n = len(tokens)
    side_a, worker_a = engine()
    a = FakeScheduler(side_a, worker_a)
    a.add_request(Request("a", tokens))
    jobs = a.step()
    assert jobs.loads == []
    [store] = jobs.stores
    bounds = side_a.link.client(None).lookup(np.asarray(tokens, dtype=np.uint32), identity=side_a.shape.identity,
                                              dry_run=True).chunk_bounds.tolist()
    assert store.chunks == list(zip(bounds, bounds[1:])) and bounds[0] == 0 and bounds[-1] == n
    assert store.req_id == "a" and store.tokens.tolist() == tokens and store.tenant is None
    assert store.block_ids == list(range(1, -(-n // BLOCK) + 1))
    info = a.outputs["a"]["sidecar"]
    assert (info["prompt_tokens"], info["local_tokens"], info["claimed_tokens"], info["prefilled_tokens"]) == (n, 0, 0, n)
    assert info["plan_ok"] and info["store_chunks"] == len(store.chunks) and info["gap_fills"] == 0
    assert worker_a.counters["stored_tokens"] == n and worker_a.counters["stored_chunks"] == len(store.chunks)

    side_b, worker_b = engine()
    b = FakeScheduler(side_b, worker_b)
    b.add_request(Request("b", tokens))
    jobs = b.step()
    end = (n - 1) // BLOCK * BLOCK
    [load] = jobs.loads
    assert load.block_ids == list(range(1, -(-n // BLOCK) + 1))
    assert load.items[0].start == 0 and load.items[-1].end == end and all(it.exact for it in load.items)
    assert all(x.end == y.start for x, y in zip(load.items, load.items[1:]))
    assert jobs.stores == []
    expected = kv_rows(np.asarray(tokens, dtype=np.uint32), np.arange(n), 2, 2, 16)
    assert torch.equal(rows_of(worker_b, load.block_ids, 0, n), expected)  # loaded [0, end), computed the rest
    info = b.outputs["b"]["sidecar"]
    assert (info["claimed_tokens"], info["reused_tokens"], info["prefilled_tokens"]) == (end, end, n - end)
    assert info["planned_tokens"] == n and info["plan_recovered_tokens"] == n and info["store_chunks"] == 0
    assert side_b.counters["claimed_tokens"] == end and side_b.counters["load_jobs"] == 1
    assert worker_b.counters["loaded_tokens"] == end and worker_b.take_load_errors() == set()


def test_vllm_taking_fewer_tokens_cuts_the_load(engine, prompts):
    """vLLM may take fewer external tokens than offered (never more): the load job stops there
    and the output reports what was taken."""
    tokens = prompts.msg(300) + prompts.msg(200)
    side_a, worker_a = engine()
    a = FakeScheduler(side_a, worker_a)
    a.add_request(Request("a", tokens))
    a.run()
    offered: dict[str, int] = {}

    def take(rid: str, m: int) -> int:
        offered[rid] = m
        return m - 3 * BLOCK

    side_b, worker_b = engine()
    b = FakeScheduler(side_b, worker_b, take=take)
    b.add_request(Request("b", tokens))
    [load] = b.step().loads
    taken = offered["b"] - 3 * BLOCK
    assert offered["b"] == (len(tokens) - 1) // BLOCK * BLOCK and load.items[-1].end == taken
    assert b.outputs["b"]["sidecar"]["claimed_tokens"] == taken and worker_b.counters["loaded_tokens"] == taken
    expected = kv_rows(np.asarray(tokens, dtype=np.uint32), np.arange(len(tokens)), 2, 2, 16)
    assert torch.equal(rows_of(worker_b, load.block_ids, 0, len(tokens)), expected)


def test_a_chunk_gone_before_the_fetch_is_recomputed(engine, prompts):
    """A chunk deleted between the Lookup and the Fetch: its blocks are reported for recompute
    (``get_block_ids_with_load_errors``) and the request is still served, bit-exact."""
    tokens = prompts.msg(250) + prompts.msg(250)
    side_a, worker_a = engine()
    a = FakeScheduler(side_a, worker_a)
    a.add_request(Request("a", tokens))
    a.run()

    gone: list[int] = []

    def delete_first_chunk(jobs) -> None:
        first = jobs.loads[0].items[0]
        gone.append(first.chunk_hash)
        assert side_a.link.client(None).delete([first.chunk_hash]) == 1

    side_b, worker_b = engine()
    b = FakeScheduler(side_b, worker_b, before_forward=delete_first_chunk)
    b.add_request(Request("b", tokens))
    [load] = b.step().loads
    first = load.items[0]
    assert gone == [first.chunk_hash]
    assert worker_b.counters["load_failed_tokens"] == len(first)
    expected = kv_rows(np.asarray(tokens, dtype=np.uint32), np.arange(len(tokens)), 2, 2, 16)
    assert torch.equal(rows_of(worker_b, load.block_ids, 0, len(tokens)), expected)


def test_a_request_tenant_is_used_for_its_calls(engine, prompts):
    """``kv_transfer_params["sidecar_tenant"]``: the request's Lookup and Store go to that tenant;
    another tenant's request finds nothing of it."""
    tokens = prompts.msg(300) + prompts.msg(100)
    side_a, worker_a = engine()
    a = FakeScheduler(side_a, worker_a)
    a.add_request(Request("a", tokens, {"sidecar_tenant": "team-x"}))
    jobs = a.step()
    assert jobs.stores[0].tenant == "team-x"
    side_b, worker_b = engine()
    b = FakeScheduler(side_b, worker_b)
    b.add_request(Request("other", tokens, {"sidecar_tenant": "team-y"}))
    b.add_request(Request("same", tokens, {"sidecar_tenant": "team-x"}))
    b.run()
    assert b.outputs["other"]["sidecar"]["claimed_tokens"] == 0
    assert b.outputs["same"]["sidecar"]["claimed_tokens"] == (len(tokens) - 1) // BLOCK * BLOCK
    assert b.outputs["same"]["sidecar_tenant"] == "team-x"  # the request's own params come back


def test_the_store_waits_for_the_whole_prompt(engine, prompts):
    """A prompt prefilled over several steps is Stored once, in the step that completes it."""
    tokens = prompts.msg(200) + prompts.msg(100)
    n = len(tokens)
    side, _ = engine()
    req = Request("r", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, 0)
    from tests.clients.vllm.fakes import CachedRequestData, NewRequestData, SchedulerOutput

    blocks = list(range(1, -(-n // BLOCK) + 1))
    first = side.build_jobs(SchedulerOutput([NewRequestData("r", (blocks[:8],), 0)], CachedRequestData(), {"r": 128}))
    assert first.stores == [] and first.loads == []
    rest = CachedRequestData(["r"], [(blocks[8:],)], set(), [128])
    [store] = side.build_jobs(SchedulerOutput([], rest, {"r": n - 128})).stores
    assert store.block_ids == blocks and store.chunks[-1][1] == n
    again = CachedRequestData(["r"], [None], set(), [n])
    assert side.build_jobs(SchedulerOutput([], again, {"r": 1})).stores == []  # decode steps store nothing
    assert side.request_finished(req)[1]["sidecar"]["store_chunks"] == len(store.chunks)
    assert side.reqs == {}


def test_a_down_sidecar_costs_one_attempt_per_window(engine, closed_target, prompts):
    """The sidecar is down: the first Lookup fails (nothing loaded, nothing stored, the request is
    served), later ones skip the sidecar until ``retry_after_s`` has passed."""
    side, worker = engine(sidecar=closed_target, retry_after_s=60.0, timeout_s=1.0)
    s = FakeScheduler(side, worker)
    tokens = prompts.msg(100)
    s.add_request(Request("one", tokens))
    s.add_request(Request("two", tokens + prompts.msg(10)))
    jobs = s.step()
    assert jobs.loads == [] and jobs.stores == []
    for rid in ("one", "two"):
        info = s.outputs[rid]["sidecar"]
        assert info["plan_ok"] is False and info["claimed_tokens"] == 0 and info["prefilled_tokens"] == info["prompt_tokens"]
    assert side.link.errors == {"lookup": 1, "lookup:skipped": 1}


def test_bad_directives_are_reported_and_the_request_served(engine, prompts):
    """Malformed span directives never fail the request: the output says why they were ignored."""
    side, worker = engine()
    s = FakeScheduler(side, worker)
    s.add_request(Request("r", prompts.msg(80), {"sidecar_directives": [[5, 9, [], "explode"]]}))
    s.run()
    info = s.outputs["r"]["sidecar"]
    assert info["session"]["error"].startswith("bad directives:") and "explode" in info["session"]["error"]
    assert side.counters["bad_directives"] == 1 and info["plan_ok"]
