"""The routing benchmark's workload and settings (bench/routing.py): the header modes and the cache
sizes its settings run at."""

from __future__ import annotations

import numpy as np
import pytest

from bench import routing
from workloads.chat_template import ChatTemplate


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate()


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


def test_stable_headers_keep_an_agents_prefix(template):
    """Stable headers: an agent's previous prompt is its next one's prefix up to the first cut tool
    output (the whole previous prompt when nothing was cut). Stamped headers: every call differs
    from the previous within its first message. The same trajectories and agents either way, and
    another ``first`` replays other trajectories."""
    kw = {"agents": 4, "turns": 6, "max_tokens": 6144, "seed": 3}
    stable = routing.agent_prompts(template, stamped=False, **kw)
    stamped = routing.agent_prompts(template, stamped=True, **kw)
    assert [t for t, _ in stable] == [t for t, _ in stamped] == ["mini_swe", "tau_bench"] * 2
    assert [len(p) for _, p in stable] == [len(p) for _, p in stamped]
    first_message = int(np.flatnonzero(np.isin(stable[1][1][0], template.anchor_token_ids))[1])
    whole = 0
    for (_, ps), (_, qs) in zip(stable, stamped):
        for prev, nxt in zip(ps, ps[1:]):
            assert lcp(prev, nxt) > first_message
            whole += lcp(prev, nxt) == len(prev)
        for prev, nxt in zip(qs, qs[1:]):
            assert lcp(prev, nxt) < first_message
    assert whole >= 5
    # agents differ from their first message on (their own header), so share no prefix
    assert lcp(stable[0][1][0], stable[2][1][0]) < first_message
    other = routing.agent_prompts(template, stamped=False, first=5, **kw)
    assert not np.array_equal(other[0][1][0], stable[0][1][0])


def test_cache_sizes():
    assert routing.cache_mib("all", 96.3) == 1024
    assert routing.cache_mib("1/2", 96.3) == 49
    assert routing.cache_mib("1/8", 96.3) == 13
    assert routing.cache_mib("1", 96.3) == 97
    with pytest.raises(ValueError):
        routing.cache_mib("half", 96.3)
