"""Tier backends: the primitives every backend provides (``base``) and one module per tier.

* ``gpu``: ``gpu.GpuTier``, a device tensor carved by LMCache's ``TensorMemoryAllocator``;
* ``cpu``: ``cpu.CpuTier``, host DRAM in LMCache's ``L1Manager``;
* ``disk``: ``disk.DiskTier``, LMCache's ``fs_native`` L2 adapter plus the tier's own index;
* ``remote``: ``remote.RemoteTier``, Redis/Valkey through redis-py with the hiredis parser.

``l2_driver`` turns an LMCache L2 adapter into blocking batch calls (the disk tier uses it).

``BACKENDS`` maps every ``Tier`` to its backend class; ``TierIO`` opens the ones a
``StoreConfig`` enables (``from_config``), fastest first. Importing this package imports torch
and LMCache (only the store needs it; ``sidecar.tiers`` resolves its names lazily).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from sidecar.tiers.backends.base import LoadFailure, ObjectBackend, PoolBackend, TierBackend
from sidecar.tiers.backends.cpu import CpuTier
from sidecar.tiers.backends.disk import DiskTier
from sidecar.tiers.backends.gpu import GpuTier
from sidecar.tiers.backends.remote import RemoteTier
from sidecar.tiers.types import TIER_ORDER, Tier

BACKENDS: Mapping[Tier, type[TierBackend]] = MappingProxyType(
    {cls.tier: cls for cls in (GpuTier, CpuTier, DiskTier, RemoteTier)}
)
assert set(BACKENDS) == set(TIER_ORDER), (
    "every Tier needs exactly one backend class in sidecar.tiers.backends.BACKENDS"
)

__all__ = [
    "BACKENDS",
    "CpuTier",
    "DiskTier",
    "GpuTier",
    "LoadFailure",
    "ObjectBackend",
    "PoolBackend",
    "RemoteTier",
    "TierBackend",
]
