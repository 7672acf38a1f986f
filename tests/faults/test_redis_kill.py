"""Redis SIGKILLed and restarted under load.

Two ``kv-sidecar serve`` processes share one registry and one remote tier, both on a real
redis-server that the test SIGKILLs and starts again (same port, empty). Eight clients keep
Storing, Looking up and Fetching across both sidecars before and while Redis is down, and again
after. Expected: no RPC fails and Stores keep completing while Redis is down (the sidecars
serve from their local registries and tiers and back off from the remote tier; what only Redis
held is a clean miss), every byte served is the byte stored, and within 2 s of Redis answering
again the sidecars publish and read through it again: a chunk stored on A is found and Fetched
on B with its exact bytes.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.app import REGISTRY_HEALTH_NAME
from sidecar.client import SidecarClient
from tests.conftest import ANCHORS
from tests.faults.helpers import IDENT, LAYOUT, SidecarProc, payloads, prompt, store_prompt

CLIENTS = 8
PHASE_S = 3.0  # load before the kill, while Redis is down, and after it is back
DEADLINE_S = 30.0
RECOVERY_S = 2.0  # remote reads work again this long after Redis answers (docs/operations.md)


def _config(prefix: str, url: str) -> dict:
    return {
        "grace_period_s": 0.5,
        "chunker": {"anchor_tokens": list(ANCHORS)},
        "shared_registry": {"redis_url": url, "key_prefix": prefix, "publish_interval_s": 0.02,
                            "probe_interval_s": 0.1},  # the default back-off: what operators run
        "store": {"namespace": prefix, "cpu_bytes": 64 << 20, "remote_url": url, "remote_bytes": 256 << 20,
                  "io_timeout_s": 0.5},
    }


async def _health(target: str) -> int:
    async with grpc.aio.insecure_channel(target) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=REGISTRY_HEALTH_NAME), timeout=5)
        return resp.status


async def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not await cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _client(k: int, a: str, b: str, stop: asyncio.Event, stats: dict[str, int]) -> None:
    async with SidecarClient(a, tenant="t") as ca, SidecarClient(b, tenant="t") as cb:
        i = 100 * k
        while not stop.is_set():
            await store_prompt(ca, i)
            stats["stores"] += 1
            for c in (ca, cb):  # A holds the chunks; B finds them through Redis when it is up
                plan = await c.lookup(prompt(i), identity=IDENT)
                hits = plan.hits()
                if not hits:
                    continue
                pl = payloads(i, list(plan.chunk_bounds))
                starts = [s.start - s.chunk_offset for s in hits]
                got = await c.fetch([(s.chunk_hash, p) for s, p in zip(hits, starts)], identity=IDENT,
                                    layout=LAYOUT, raw=True)
                for p, kv in zip(starts, got):
                    if kv.ok:
                        assert bytes(kv.data) == pl[p].numpy().tobytes(), f"corrupted chunk at {p} of prompt {i}"
                        stats["served"] += 1
                    else:
                        stats["missed"] += 1
            i += 1


async def test_redis_killed_and_restarted_under_load(tmp_path, restartable_redis) -> None:
    url = restartable_redis.url
    for name in "ab":
        (tmp_path / name).mkdir()
    a, b = SidecarProc(tmp_path / "a", _config("rk", url)), SidecarProc(tmp_path / "b", _config("rk", url))
    ta, tb = a.start(), b.start()
    stop = asyncio.Event()
    stats = {"stores": 0, "served": 0, "missed": 0}
    try:
        load = [asyncio.create_task(_client(k, ta, tb, stop, stats)) for k in range(CLIENTS)]

        async def phase() -> None:
            await asyncio.sleep(PHASE_S)
            for t in load:
                if t.done():
                    t.result()  # a client that failed re-raises here

        await phase()
        before = dict(stats)
        restartable_redis.kill()
        await phase()
        await _wait(lambda: _down(ta), "A's registry health NOT_SERVING")
        during = dict(stats)
        stop.set()  # the recovery is measured on quiet sidecars: the load resumes afterwards
        await asyncio.gather(*load)

        # Once Redis answers again, B finds and Fetches what A stores within RECOVERY_S: the
        # remote tier's breaker and the registry re-admit Redis on its first answered PING,
        # whatever back-off the outage had built up. Payloads A stored while the remote tier was
        # unusable stay local to A (B gets clean misses for them), so each try stores a new
        # prompt; an attempt begun RECOVERY_S after Redis answered must succeed.
        restartable_redis.start()  # returns once Redis answers a PING
        answered = time.monotonic()
        attempts: list[tuple[float, bool]] = []
        async with SidecarClient(ta, tenant="t", timeout_s=60) as ca, SidecarClient(tb, tenant="t", timeout_s=60) as cb:
            attempt = iter(range(90_000, 91_000))

            async def b_fetches_all() -> bool:
                i, began = next(attempt), time.monotonic() - answered
                await store_prompt(ca, i)
                await asyncio.sleep(0.1)  # the record's publication (publish_interval_s 0.02)
                plan = await cb.lookup(prompt(i), identity=IDENT)
                ok = False
                if len(plan.hits()) >= len(plan.chunk_bounds) - 1:
                    pl = payloads(i, list(plan.chunk_bounds))
                    got = await cb.fetch([(s.chunk_hash, s.start) for s in plan.hits()], identity=IDENT,
                                         layout=LAYOUT, raw=True)
                    for s, kv in zip(plan.hits(), got):
                        assert not kv.ok or bytes(kv.data) == pl[s.start].numpy().tobytes()
                    ok = all(kv.ok for kv in got)
                attempts.append((began, ok))
                return ok

            await _wait(b_fetches_all, "B fetching what A stored after Redis came back")
        late = [round(t, 2) for t, ok in attempts if not ok and t >= RECOVERY_S]
        assert not late, f"attempts begun {late} s after Redis answered still missed: {attempts}"
        await _wait(lambda: _up(ta), "A's registry health SERVING again")
        await _wait(lambda: _up(tb), "B's registry health SERVING again")

        stop.clear()
        load = [asyncio.create_task(_client(k, ta, tb, stop, stats)) for k in range(CLIENTS)]
        await phase()
        stop.set()
        await asyncio.gather(*load)
        assert before["stores"] > 0 and during["stores"] > before["stores"] and stats["stores"] > during["stores"]
        assert stats["served"] > 0
        for proc in (a, b):
            assert not proc.errors(), "\n".join(proc.errors())
    except BaseException:
        # What each sidecar was doing when the test gave up (a stuck call shows in its stack).
        for name, proc in (("A", a), ("B", b)):
            print(f"----- sidecar {name}: log and thread stacks -----\n{proc.dump_stacks()}")
        raise
    finally:
        stop.set()
        a.stop()
        b.stop()


async def _down(target: str) -> bool:
    return await _health(target) == health_pb2.HealthCheckResponse.NOT_SERVING


async def _up(target: str) -> bool:
    return await _health(target) == health_pb2.HealthCheckResponse.SERVING
