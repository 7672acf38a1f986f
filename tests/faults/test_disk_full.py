"""The disk tier's filesystem fills up.

The disk tier sits on a real 2 MiB tmpfs while the sidecar believes it has 64 MiB, so demotions
from the 512 KiB CPU tier hit ENOSPC. Expected: no RPC fails and nothing crashes; every chunk a
Store acknowledged is served with its exact bytes or is a clean miss; no partial file is left
behind; once the filesystem has room again (remounted larger), demotions land on disk again and
survive a restart.

Mounting needs root (CAP_SYS_ADMIN), as in CI's container; elsewhere the test is skipped.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from sidecar.client import SidecarClient
from sidecar.tiers import breaker
from tests.faults.helpers import SidecarProc, base_config, check_exact_or_miss, store_prompt


def _mount(path: Path, size: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True,
                   capture_output=True)


@pytest.fixture
def small_fs(tmp_path: Path):
    path = tmp_path / "disk"
    path.mkdir()
    try:
        _mount(path, "2m")
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {exc}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def _files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


async def test_disk_full_then_room_again(tmp_path: Path, small_fs: Path) -> None:
    proc = SidecarProc(tmp_path, base_config(small_fs, cpu_bytes=512 << 10, disk_bytes=64 << 20))
    target = proc.start()
    try:
        async with SidecarClient(target, tenant="t") as c:
            full = list(range(40))  # ~40 x 240 KB of KV: ten times what the disk can hold
            for i in full:
                assert await store_prompt(c, i) > 0
            served, missed = await check_exact_or_miss(c, full)
            assert served > 0 and missed > 0  # what fit is served, the rest is a clean miss
            stats = await c.stats()
            assert {t.tier for t in stats.tiers} >= {"cpu", "disk"}
            assert not [p for p in _files(small_fs) if p.suffix == ".tmp"]

            subprocess.run(["mount", "-o", "remount,size=64m", str(small_fs)], check=True, capture_output=True)
            await asyncio.sleep(breaker.MAX_S)  # the disk tier's back-off after its failed writes ends
            roomy = list(range(100, 130))
            for i in roomy:
                assert await store_prompt(c, i) > 0
        proc.stop()  # graceful: spills what memory holds
        target = proc.start()
        async with SidecarClient(target, tenant="t") as c:
            served, missed = await check_exact_or_miss(c, roomy)
            assert missed == 0 and served > 0  # with room on disk, nothing acknowledged is lost
            await check_exact_or_miss(c, full)  # still exact or miss after the restart
        assert not proc.errors(), proc.errors()
    finally:
        proc.stop()
