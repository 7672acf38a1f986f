"""Gap-fill sub-requests: a stored body after a new header is loaded in a second round, once a
sub-request has put ``prompt[:A]`` into vLLM's prefix cache (fake scheduler, real sidecar)."""

from __future__ import annotations

import numpy as np
import torch

from sidecar.registry.lookup_plan import SegmentKind
from tests.clients.vllm.conftest import BLOCK, Prompts
from tests.clients.vllm.fakes import FakeScheduler, Request, kv_rows


def stored_body(engine, prompts, tenant: str | None = None, **extra):
    """Engine A stores ``header_y + body + question``; returns the body (two messages)."""
    body = prompts.msg(300) + prompts.msg(300)
    side, worker = engine(**extra)
    a = FakeScheduler(side, worker)
    params = {"sidecar_tenant": tenant} if tenant else None
    a.add_request(Request("y", prompts.msg(60) + body + prompts.msg(20), params))
    a.run()
    assert a.outputs["y"]["sidecar"]["store_chunks"] > 0
    return body


def test_a_shifted_body_after_a_new_header_is_loaded_after_a_gap_fill(engine, prompts):
    body = stored_body(engine, prompts, tenant="team-g")
    header = prompts.msg(90)
    x = header + body + prompts.msg(25)
    n = len(x)
    side, worker = engine(min_gap_run=64)
    s = FakeScheduler(side, worker)
    s.add_request(Request("x", x, {"sidecar_tenant": "team-g"}))

    # step 1: the plan starts with a gap (the header); the parent waits for a sub-request prompt[:A]
    jobs = s.step()
    [(parent, sub)] = s.gap_fill_requests
    first_hit = next(seg for seg in side.reqs["x"].plan.segments if seg.kind is SegmentKind.CHUNK_HIT)
    a = -(-first_hit.start // BLOCK) * BLOCK
    assert parent == "x" and sub.request_id == "x::sidecar-gap0" and sub.max_tokens == 1
    assert sub.prompt_token_ids == x[:a] and a > len(header)
    assert sub.kv_transfer_params == {"sidecar_gap_fill": True, "sidecar_tenant": "team-g"}
    assert s.waiting[0].request_id == "x" and "x" not in s.outputs  # held, asked again next step
    assert [st.request.request_id for st in s.steps[0][0]] == [sub.request_id]  # scheduled in the same step
    [store] = jobs.stores
    assert store.req_id == sub.request_id and all(b < a for _, b in store.chunks)  # no chunk cut at A
    assert sub.request_id not in s.outputs  # a sub-request's output never reaches the client
    assert side.counters["gap_fills"] == 1 and side.counters["gap_fill_tokens"] == a
    assert side.counters["gap_fill_requests"] == 1

    # step 2: vLLM's own hit is now A; the shifted run after it is contiguous and loaded
    jobs = s.step()
    [(scheduled)] = s.steps[1][0]
    assert scheduled.local == a and scheduled.external > 0
    [load] = jobs.loads
    assert load.items[0].start == a and not load.items[0].exact  # shifted rows, rotated by the sidecar
    assert load.items[-1].end == a + scheduled.external <= n - 1
    info = s.outputs["x"]["sidecar"]
    assert info["gap_fills"] == 1 and info["local_tokens"] == a and info["first_local_tokens"] == 0
    assert info["claimed_tokens"] == scheduled.external
    # what neither the request nor its sub-request computed: the loaded run
    assert info["reused_tokens"] == scheduled.external and info["prefilled_tokens"] == n - scheduled.external
    assert scheduled.external > 0.8 * len(body)
    # V is not rotated: the loaded values are the stored body's, computed at its old positions
    got = worker.paged.gather(torch.tensor(load.block_ids, dtype=torch.int64),
                              torch.arange(load.items[0].start, load.items[-1].end))
    shift = len(header) - 61  # the body sat after a 61-token header in engine A's prompt
    src = np.arange(load.items[0].start, load.items[-1].end) - shift
    ref = kv_rows(np.asarray(x, dtype=np.uint32), np.arange(n), 2, 2, 16)  # token ids at the new positions
    stored_v = kv_rows(np.concatenate([np.zeros(61, np.uint32), np.asarray(x[len(header):], np.uint32)]), src, 2, 2, 16)
    assert torch.equal(got[:, 1], stored_v[:, 1])
    assert not torch.equal(got[:, 1], ref[:, 1, load.items[0].start:load.items[-1].end])
    assert side.reqs == {} and side.gap_fill.waiting == {} and side.gap_fill.parents == {}


def test_no_gap_fill_without_the_scheduler_plug_in_or_rounds(engine, prompts):
    """Without the scheduler plug-in (nothing bound) or with ``max_gap_fills = 0`` the request
    runs at once: the header and the body are prefilled."""
    body = stored_body(engine, prompts)
    for kw, bind in (({}, False), ({"max_gap_fills": 0}, True), ({"gap_fill": False}, True)):
        x = prompts.msg(90) + body + prompts.msg(25)  # a header no earlier round stored
        side, worker = engine(min_gap_run=64, **kw)
        s = FakeScheduler(side, worker, bind=bind)
        s.add_request(Request("x", x))
        s.step()
        info = s.outputs["x"]["sidecar"]
        assert s.gap_fill_requests == [] and info["gap_fills"] == 0 and info["claimed_tokens"] == 0, kw
        assert info["plan_recovered_tokens"] > 0.8 * len(body)  # the plan had them; vLLM could not load them


def test_a_short_run_after_the_gap_is_not_worth_a_sub_request(engine, prompts):
    """Fewer than ``min_gap_run`` planned hit tokens after the gap: no sub-request."""
    body = stored_body(engine, prompts)
    x = prompts.msg(90) + body + prompts.msg(25)
    side, worker = engine(min_gap_run=10_000)
    s = FakeScheduler(side, worker)
    s.add_request(Request("x", x))
    s.step()
    assert s.gap_fill_requests == [] and s.outputs["x"]["sidecar"]["gap_fills"] == 0


def test_the_engine_rotating_raw_rows_loads_what_the_sidecar_rotating_loads(engine):
    """``rotate = "engine"`` (the default for a cache on a GPU): the worker fetches raw rows and
    re-positions the keys on the cache's device with the project's kernels; the loaded cache is
    the one the sidecar's own rotation gives, bit for bit."""
    loaded = {}
    for mode in ("sidecar", "engine"):  # each in a tenant of its own: the same stored body, nothing else
        body = stored_body(engine, Prompts(5), tenant=f"rotate-{mode}")
        x = body[:5] + body + body[-25:]  # the body moved from position 61 to 5
        side, worker = engine(min_gap_run=64, rotate=mode)
        s = FakeScheduler(side, worker)
        s.add_request(Request("x", x, {"sidecar_tenant": f"rotate-{mode}"}))
        s.run()
        [load] = s.steps[-1][1].loads
        assert not load.items[0].exact and worker.engine_rotates is (mode == "engine")
        rotated = worker.counters["engine_rotated_tokens"]
        assert (rotated > 0) is (mode == "engine") and worker.counters["load_failed_tokens"] == 0
        loaded[mode] = worker.paged.gather(torch.tensor(load.block_ids, dtype=torch.int64), torch.arange(len(x)))
    assert torch.equal(loaded["engine"], loaded["sidecar"])


def test_the_shared_pool_loads_and_stores_what_fetch_and_store_do(engine):
    """On the sidecar's host the worker leases its hits in the sidecar's shared pool, rotates
    them itself and copies its Stores into reserved slots: the same cache, bit for bit, as
    Fetch and Store (``shared_pool = false``), exact and shifted, and nothing stays leased."""
    loaded = {}
    for pooled in (False, True):
        tenant = f"pool-{pooled}"
        body = stored_body(engine, Prompts(5), tenant=tenant, shared_pool=pooled)
        x = body[:5] + body + body[-25:]  # the body moved from position 61 to 5
        side, worker = engine(min_gap_run=64, shared_pool=pooled)
        s = FakeScheduler(side, worker)
        s.add_request(Request("x", x, {"sidecar_tenant": tenant}))
        s.run()
        [load] = s.steps[-1][1].loads
        assert worker.counters["load_failed_tokens"] == 0 and worker.counters["loaded_tokens"] > 0
        assert (worker.counters["pool_loads"] > 0) is pooled
        assert (worker.counters["pool_stores"] > 0) is pooled and worker.counters["stored_chunks"] > 0
        assert worker.counters["engine_rotated_tokens"] > 0 or not pooled  # raw rows, rotated here
        loaded[pooled] = worker.paged.gather(torch.tensor(load.block_ids, dtype=torch.int64), torch.arange(len(x)))
        if pooled:
            pool = worker._pools[tenant]
            assert pool is not None and pool.available
    assert torch.equal(loaded[True], loaded[False])
