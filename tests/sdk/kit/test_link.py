"""``FailSoftLink``: calls to a real sidecar that answer None instead of raising, an outage logged
once, the sidecar skipped for ``retry_after_s`` after a failure."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import pytest

from sidecar.app import ServerThread
from sidecar.client import RetryPolicy, SyncSidecarClient
from sidecar.sdk.kit import FailSoftLink
from tests.conftest import make_config


@pytest.fixture(scope="module")
def target() -> Iterator[str]:
    with ServerThread(make_config()) as st:
        yield st.target


def link_to(target: str, retry_after_s: float) -> FailSoftLink[SyncSidecarClient]:
    made: list[str | None] = []

    def connect(tenant: str | None) -> SyncSidecarClient:
        made.append(tenant)
        return SyncSidecarClient(target, tenant=tenant, timeout_s=2.0, retry=RetryPolicy(attempts=1))

    link = FailSoftLink(connect, default_tenant="team-a", retry_after_s=retry_after_s, target=target, role="test")
    link.made = made  # type: ignore[attr-defined]
    return link


def test_one_client_per_tenant_and_answers_pass_through(target):
    link = link_to(target, 5.0)
    try:
        assert link.client(None) is link.client("") is link.client("team-a")  # the default tenant
        assert link.client("team-b") is not link.client(None)
        assert link.made == ["team-a", "team-b"]
        assert link.call("stats", "team-b", lambda c: c.stats()) is not None
        assert link.available and not link.errors
    finally:
        link.close()
    assert link.client("team-b") is not None and link.made == ["team-a", "team-b", "team-b"]  # reconnects
    link.close()


def test_a_failure_is_none_counted_and_skips_the_sidecar(target, caplog):
    link = link_to(target, 60.0)
    caplog.set_level(logging.WARNING, logger="sidecar.sdk.kit")

    def boom(c):
        raise RuntimeError("refused")

    try:
        assert link.call("lookup", None, boom) is None
        assert not link.available
        assert link.call("store", None, lambda c: c.stats()) is None  # skipped: no call at all
        assert link.errors == {"lookup": 1, "store:skipped": 1}
        assert len([r for r in caplog.records if "prefilling" in r.getMessage()]) == 1
    finally:
        link.close()


def test_recovery_is_logged_once(target, caplog):
    link = link_to(target, 0.0)
    caplog.set_level(logging.WARNING, logger="sidecar.sdk.kit")
    try:
        for _ in range(2):
            assert link.call("lookup", None, lambda c: 1 / 0) is None
        assert link.call("stats", None, lambda c: c.stats()) is not None
        assert link.call("stats", None, lambda c: c.stats()) is not None
        msgs = [r.getMessage() for r in caplog.records]
        assert len([m for m in msgs if "failed" in m]) == 1 and len([m for m in msgs if "answering again" in m]) == 1
        assert link.errors == {"lookup": 2}
    finally:
        link.close()


def test_a_sidecar_that_is_down_is_a_none():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    link = link_to(closed, 60.0)
    try:
        assert link.call("stats", None, lambda c: c.stats()) is None
        assert link.errors == {"stats": 1}
    finally:
        link.close()
