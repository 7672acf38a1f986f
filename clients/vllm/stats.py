"""The connector's counters as vLLM's ``KVConnectorStats``.

Each role keeps cumulative counters (a ``Counter[str]`` shared by the facade and its role
object, plus the link's errors as ``error:<call>``; ``SidecarConnector.stats()`` returns them).
vLLM asks every connector for *one interval's* stats after each step
(``get_kv_connector_stats``), so the connector reports what its counters gained since its last
report (``StatsInterval``), as a ``SidecarConnectorStats``. vLLM then::

    each worker        get_kv_connector_stats()  -> its interval (None when nothing changed)
    executor           first.aggregate(other)    the workers' reports summed (pickled across
                                                 processes under multiprocessing)
    scheduler          .aggregate(its own)       plus the scheduler side's interval
                       .to_dict()                -> SchedulerStats.kv_connector_stats
    stat logger        build_kv_connector_stats(dict), .aggregate(...) over its log period,
                       .reduce() -> "KV Transfer metrics: claimed_tokens=..., loaded_tokens=..."

Counters are summed everywhere: across workers (under tensor parallelism each rank loads and
stores its own heads of the same tokens, so ``loaded_tokens`` counts them once per rank), across
the two roles and across steps.

Imports vLLM's ``KVConnectorStats`` when vLLM is installed; without it (the main test suite)
the class stands alone with the same members, so the role classes and their tests need no vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # no vLLM: nothing will ask for stats; the counters' logic stays testable
    KVConnectorStats = object  # type: ignore[assignment,misc]

__all__ = ["SidecarConnectorStats", "StatsInterval", "snapshot"]


def snapshot(counters: Mapping[str, int], link_errors: Mapping[str, int] | None = None) -> dict[str, int]:
    """One role's cumulative counters now: ``counters`` and each of the link's errors as
    ``error:<call>`` (what ``SidecarConnector.stats()`` returns). A copy."""
    out = dict(counters)
    if link_errors:
        out.update({f"error:{k}": v for k, v in link_errors.items()})
    return out


@dataclass
class SidecarConnectorStats(KVConnectorStats):
    """One interval of the connector's counters: ``data`` maps a counter's name (those of
    ``stats()``) to what it gained in the interval. Plain ints in a dict: the form vLLM pickles
    from the workers and sends on as ``to_dict()``. ``aggregate`` sums in place, as vLLM expects
    of its accumulator."""

    data: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(cls, data: Mapping[str, Any] | None) -> "SidecarConnectorStats":
        """From ``to_dict()``'s form (``build_kv_connector_stats`` in vLLM's stat logger)."""
        return cls(data={str(k): int(v) for k, v in (data or {}).items()})

    @classmethod
    def since(cls, now: Mapping[str, int], before: Mapping[str, int]) -> "SidecarConnectorStats":
        """What the counters ``now`` gained over ``before`` (both cumulative ``snapshot``s)."""
        return cls(data={k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)})

    def to_dict(self) -> dict[str, int]:
        return self.data

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: Any) -> "SidecarConnectorStats":
        """Add ``other``'s counts to these (in place); returns self."""
        if not isinstance(other, SidecarConnectorStats):
            raise TypeError(f"SidecarConnectorStats.aggregate: got {type(other).__name__}; only the sidecar "
                            "connector's own stats add up (vLLM keeps other connectors' stats apart)")
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's sums by counter name (sorted; zeros left out): what vLLM logs."""
        return {k: v for k, v in sorted(self.data.items()) if v}


class StatsInterval:
    """The connector's side of ``get_kv_connector_stats``: each ``take`` reports what the
    counters gained since the previous one (None when nothing did) and remembers where they are.
    Reporting never changes the counters themselves. One caller (vLLM's step loop of the role)."""

    def __init__(self) -> None:
        self._before: dict[str, int] = {}

    def take(self, now: Mapping[str, int]) -> SidecarConnectorStats | None:
        stats = SidecarConnectorStats.since(now, self._before)
        self._before = dict(now)
        return None if stats.is_empty() else stats
