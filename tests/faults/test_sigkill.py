"""SIGKILL in the middle of traffic, then a restart on the same disk.

A real ``kv-sidecar serve`` process with a 1 MiB CPU tier in front of a disk tier and the
manifest producer on takes concurrent Stores (with KV) and Splice commits on a held session; it
is SIGKILLed once enough Stores are acknowledged, while Stores, a Splice commit and manifest
writes are in flight. After the restart (which also imports the torn manifest), every chunk a
Store acknowledged is served with its exact bytes or is a clean miss (none corrupted, no error),
interrupted disk writes leave no files behind, and the session is cleanly gone (NOT_FOUND).
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from sidecar.client import SidecarClient
from sidecar.directives import Directive
from sidecar.errors import NotFound, SidecarError
from tests.faults.helpers import (
    IDENT,
    NO_RETRY,
    TRANSPORT_CODES,
    SidecarProc,
    base_config,
    check_exact_or_miss,
    prompt,
    store_prompt,
)

WRITERS = 4
KILL_AFTER = 24  # acknowledged Stores before the SIGKILL


async def _writer(target: str, w: int, acked: list[int], dead: asyncio.Event) -> None:
    async with SidecarClient(target, tenant="t", retry=NO_RETRY) as c:
        i = w
        while not dead.is_set():
            try:
                n = await store_prompt(c, i)
            except SidecarError as exc:
                assert dead.is_set() and exc.code in TRANSPORT_CODES, exc
                return
            assert n > 0
            acked.append(i)
            i += WRITERS


async def _splicer(target: str, commits: list[int], dead: asyncio.Event) -> str:
    """Open a held session over prompt 0's tokens, then splice + commit in a loop."""
    async with SidecarClient(target, tenant="t", retry=NO_RETRY) as c:
        await store_prompt(c, 10_000)
        base = prompt(10_000)
        sess = await c.open_session(base, block_size=16, identity=IDENT, held=True)
        version, length = sess.version, sess.length
        while not dead.is_set():
            try:
                cut = 1 + version % 7
                plan = await c.splice(sess.session_id, version, [Directive(start=length - 40, end=length - 40 + cut)])
                state = await c.commit_splice(plan.plan_id)
                state = await c.append_session(sess.session_id, np.arange(cut, dtype=np.uint32) + 7)
            except SidecarError as exc:
                assert dead.is_set() and exc.code in TRANSPORT_CODES, exc
                break
            version, length = state.version, state.length
            commits.append(version)
        return sess.session_id


async def test_sigkill_during_stores_splice_commits_and_manifest_writes(tmp_path) -> None:
    disk, manifest = tmp_path / "disk", tmp_path / "manifest.jsonl"
    cfg = base_config(disk)
    cfg["manifests"] = {"path": str(manifest), "flush_interval_s": 0.01}
    proc = SidecarProc(tmp_path, cfg)
    target = proc.start()
    acked: list[int] = []
    commits: list[int] = []
    dead = asyncio.Event()
    try:
        tasks = [asyncio.create_task(_writer(target, w, acked, dead)) for w in range(WRITERS)]
        splicer = asyncio.create_task(_splicer(target, commits, dead))
        async with asyncio.timeout(240):
            while len(acked) < KILL_AFTER or not commits:
                for t in (*tasks, splicer):
                    if t.done():
                        t.result()  # a writer that stopped early re-raises its failure here
                await asyncio.sleep(0.01)
        dead.set()
        proc.sigkill()
        await asyncio.gather(*tasks)
        session_id = await splicer
        assert manifest.exists() and manifest.stat().st_size > 0

        # Restart on the same disk, importing the manifest the kill may have torn.
        cfg["manifests"]["import_paths"] = [str(manifest)]
        proc.config_path.write_text(json.dumps(cfg))
        target = proc.start()
        assert not list(disk.rglob("*.tmp")), "an interrupted disk write was left behind"
        async with SidecarClient(target, tenant="t") as c:
            served, missed = await check_exact_or_miss(c, sorted(acked))
            assert served > 0, "nothing acknowledged survived on disk"
            with pytest.raises(NotFound):
                await c.get_session(session_id)
            # The restarted sidecar takes new Stores of the same prompts and serves them exactly.
            for i in sorted(acked)[:3]:
                await store_prompt(c, i)
            served_again, missed_again = await check_exact_or_miss(c, sorted(acked)[:3])
            assert missed_again == 0 and served_again > 0
        assert not proc.errors(), proc.errors()
    finally:
        proc.stop()
