"""Hypothesis profiles for the fuzz suite.

``ci`` (the default): derandomized (a fixed seed, so CI is reproducible) and few examples, so the
whole suite adds well under a minute. ``long``: many more random examples, by command::

    KV_SIDECAR_FUZZ=long ./dev test tests/fuzz
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                     HealthCheck.data_too_large])
settings.register_profile("ci", derandomize=True, max_examples=40, print_blob=True, **_COMMON)
settings.register_profile("long", derandomize=False, max_examples=1000, print_blob=True, **_COMMON)
settings.load_profile(os.environ.get("KV_SIDECAR_FUZZ", "ci"))


def examples(ci: int) -> int:
    """``ci`` examples under the CI profile; the profile's own (larger) count otherwise."""
    return ci if os.environ.get("KV_SIDECAR_FUZZ", "ci") == "ci" else settings.default.max_examples
