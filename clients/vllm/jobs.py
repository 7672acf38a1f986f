"""What the connector's scheduler side hands its worker side for one step.

vLLM carries them in the step's ``KVConnectorMetadata`` (``connector.SidecarMetadata``), which
may cross a process boundary (pickled to the workers): plain data only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from sidecar.sdk.kit import LoadItem


@dataclass(slots=True)
class LoadJob:
    """Fetch ``items`` and copy their rows into the request's paged blocks ``block_ids``
    (block ``i`` holds positions ``[i * block_size, (i + 1) * block_size)``)."""

    req_id: str
    tenant: str | None
    block_ids: list[int]
    items: list[LoadItem]
    #: the Lookup found the items under another tensor-parallel cut of the model: that cut's
    #: rank-0 shard (``LookupPlan.plan_shard``); None: this engine's own cut
    plan_shard: str | None = None


@dataclass(slots=True)
class StoreJob:
    """After this step's forward, gather positions ``chunks`` (``[a, b)`` each) of the request's
    paged blocks and Store them as chunks of ``tokens``."""

    req_id: str
    tenant: str | None
    tokens: np.ndarray  # uint32, the prompt
    block_ids: list[int]
    chunks: list[tuple[int, int]]


@dataclass(slots=True)
class StepJobs:
    """One step's loads (before the forward) and stores (after it)."""

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
