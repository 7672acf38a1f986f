"""The reference transformers engine honours AdmitActive: admitted runs, deferred waits (the
injected ``sleep`` stands for running requests finishing) and asks again, refused raises
``ActiveRefused`` with the blocking claims and the proof, and nothing is computed or stored."""

from __future__ import annotations

import numpy as np
import pytest

from clients.transformers import ActiveAdmission, ActiveRefused, Engine
from sidecar.app import ServerThread
from sidecar.client import SyncSidecarClient
from tests.clients.transformers.conftest import get_model
from tests.conftest import make_config

BS = 16


@pytest.fixture(scope="module")
def target():
    with ServerThread(make_config()) as st:
        yield st.target


def _engine(client, ns, **adm):
    return Engine(get_model("gqa"), sidecar=client, namespace=ns, admission=ActiveAdmission(block_size=BS, **adm))


def test_engine_refused_by_a_hard_claim(target):
    with SyncSidecarClient(target, tenant="eng-refused") as c:
        resident = np.arange(1, 20 * BS + 1, dtype=np.uint32)
        eng = _engine(c, "refused", pool_blocks=30, min_blocks=4)
        eng.prefill(resident)  # 20 blocks: admitted (nothing claimed yet), Stored
        d = c.claim("sys-prompt", identity=eng.identity, mode="hard_protected", tokens=resident)
        assert d.claim.state == "materialized"
        prompt = np.arange(50_000, 50_000 + 15 * BS, dtype=np.uint32)  # 15 blocks: 20 + 15 > 30
        stored_before = c.stats().registry.entries
        with pytest.raises(ActiveRefused) as err:
            eng.prefill(prompt)
        e = err.value
        assert e.decision == "refused" and e.blocking_claim_ids == ("sys-prompt",)
        assert (e.proof.resident, e.proof.active, e.proof.usable, e.proof.shortfall) == (20, 15, 30, 5)
        assert c.stats().registry.entries == stored_before  # not run: nothing Stored
        small = np.arange(70_000, 70_000 + 2 * BS, dtype=np.uint32)
        assert eng.prefill(small).logits is not None  # below min_blocks: not asked
        c.release_claim("sys-prompt")
        assert eng.prefill(prompt).logits is not None  # the same request fits once released


def test_engine_deferred_then_admitted(target):
    with SyncSidecarClient(target, tenant="eng-deferred") as c:
        resident = np.arange(1, 10 * BS + 1, dtype=np.uint32)
        eng = Engine(get_model("gqa"), sidecar=c, namespace="deferred")
        eng.prefill(resident)
        c.claim("r", identity=eng.identity, mode="hard_protected", tokens=resident)
        # Another engine thread holds most of the pool: 100 usable, 25 free.
        c.report_pool(usable_blocks=100, free_blocks=25, block_size=BS, hard_protection=True)
        waits: list[float] = []

        def sleep(s: float) -> None:  # running requests finish while we wait
            waits.append(s)
            c.report_pool(usable_blocks=100, free_blocks=25 + 20 * len(waits), block_size=BS, hard_protection=True)

        eng.admission = ActiveAdmission(block_size=BS, sleep=sleep, max_deferrals=5)
        prompt = np.arange(30_000, 30_000 + 40 * BS, dtype=np.uint32)  # 40 blocks; 10 + 40 <= 100
        assert eng.prefill(prompt).logits is not None
        assert len(waits) == 2 and all(w > 0 for w in waits)  # free 25, 45: deferred (10 + 40 > free); 65: admitted
        kinds = [e.event for e in c.watch_events()]
        assert kinds[-3:] == ["active_deferred", "active_deferred", "active_admitted"]


def test_engine_deferred_too_long_gives_up(target):
    with SyncSidecarClient(target, tenant="eng-stuck") as c:
        c.report_pool(usable_blocks=100, free_blocks=5, block_size=BS, hard_protection=True)
        eng = Engine(get_model("gqa"), sidecar=c, namespace="stuck",
                     admission=ActiveAdmission(block_size=BS, sleep=lambda s: None, max_deferrals=3))
        with pytest.raises(ActiveRefused) as err:
            eng.prefill(np.arange(1, 20 * BS + 1, dtype=np.uint32))
        assert err.value.decision == "deferred"
        assert [e.event for e in c.watch_events()].count("active_deferred") == 4
