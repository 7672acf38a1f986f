"""The tier list and its backends: one list (``Tier``), one backend class per tier, of the kind
the store drives it as, each disabled by its configuration alone."""

from __future__ import annotations

import pytest

from sidecar.tiers import TIER_NAMES, TIER_ORDER, TIER_RANK, StoreConfig, Tier
from sidecar.tiers.backends import BACKENDS, ObjectBackend, PoolBackend, TierBackend


def test_the_tier_list_is_derived_from_the_enum_fastest_first() -> None:
    assert TIER_ORDER == (Tier.GPU, Tier.CPU, Tier.DISK, Tier.REMOTE)
    assert TIER_NAMES == ("gpu", "cpu", "disk", "remote")
    assert [TIER_RANK[t] for t in TIER_ORDER] == [0, 1, 2, 3]
    assert TIER_RANK["disk"] == TIER_RANK[Tier.DISK] == 2  # a name looks its tier up too
    assert min((Tier.REMOTE, Tier.CPU, Tier.DISK), key=TIER_RANK.__getitem__) is Tier.CPU


def test_registry_record_tier_codes_are_unchanged() -> None:
    # The shared registry's records carry a tier code on the wire: 0 none, then 1 + rank.
    from sidecar.registry.shared_keys import _TIERS

    assert _TIERS == ("", "gpu", "cpu", "disk", "remote")


def test_every_tier_has_one_backend_of_its_kind() -> None:
    assert set(BACKENDS) == set(Tier)
    for tier, cls in BACKENDS.items():
        assert cls.tier is tier and issubclass(cls, TierBackend)
        assert not getattr(cls, "__abstractmethods__", None), f"{cls.__name__} leaves primitives abstract"
    assert {t for t, cls in BACKENDS.items() if issubclass(cls, PoolBackend)} == {Tier.GPU, Tier.CPU}
    assert {t for t, cls in BACKENDS.items() if issubclass(cls, ObjectBackend)} == {Tier.DISK, Tier.REMOTE}


@pytest.mark.parametrize("tier", list(Tier))
def test_a_tier_with_no_capacity_is_not_opened(tier: Tier) -> None:
    on = 1 << 20  # the store needs one tier: the CPU, or the GPU when the CPU is the one tested
    config = StoreConfig(cpu_bytes=0 if tier == Tier.CPU else on, gpu_bytes=on if tier == Tier.CPU else 0)
    assert BACKENDS[tier].from_config(config) is None
