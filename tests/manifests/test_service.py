"""ManifestService (sidecar.manifests.service) on a real data plane: the scope rules, with the
caller's shared-scope grant as a plain value, and every entry's outcome counted in plain
counters that the server's edge drains into its metrics."""

from __future__ import annotations

import numpy as np

from sidecar.app import build
from sidecar.manifests import ManifestEntry, ManifestsConfig, Outcome, chunk_key, encode_line
from sidecar.manifests.service import ManifestCounters, ManifestService
from tests.conftest import make_config

OPERATOR = "operator"


def service() -> ManifestService:
    parts = build(make_config())
    # the domain service alone, on the wired index and data plane: no server edge drains it
    return ManifestService(ManifestsConfig(), parts.index, parts.dataplane, 4096)


def line(scope: str, salt: int, first: int) -> bytes:
    tokens = np.arange(first, first + 16, dtype="<u4").tobytes()
    return encode_line(ManifestEntry(content_hash=chunk_key(salt, scope, tokens), identity=salt, scope=scope,
                                     tokens=tokens))


async def test_import_outcomes_counted_in_plain_counters():
    svc = service()
    announced = []
    svc.on_count = lambda: announced.append(dict(svc.counters.entries))
    lines = b"not json\n" + line("tenant-a", 7, 0) + line("tenant-b", 7, 100) + line("shared", 7, 200)
    res = await svc.import_lines("tenant-a", lines, shared=False, may_write_shared=False, prefetch=True)
    want = {Outcome.MALFORMED: 1, Outcome.PLANNED: 1, Outcome.REFUSED: 2}  # b's private line; shared ungranted
    assert dict(res.outcomes) == want
    assert announced == [want]  # announced once per import, so the edge drains it at once
    assert svc.pending("tenant-a", False) == 1
    assert svc.counters.take() == ManifestCounters(entries=want)
    assert svc.counters == ManifestCounters()


async def test_the_shared_grant_decides_shared_lines():
    svc = service()
    lines = line("shared", 7, 0) + line(OPERATOR, 7, 50)
    res = await svc.import_lines(OPERATOR, lines, shared=False, may_write_shared=False, prefetch=False)
    assert dict(res.outcomes) == {Outcome.REFUSED: 1, Outcome.PLANNED: 1} and svc.pending(OPERATOR, False) == 1
    res = await svc.import_lines(OPERATOR, lines, shared=True, may_write_shared=True, prefetch=False)
    assert dict(res.outcomes) == {Outcome.PLANNED: 2} and svc.pending(OPERATOR, True) == 2
    assert svc.counters.take().entries == {Outcome.REFUSED: 1, Outcome.PLANNED: 3}
