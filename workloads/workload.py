"""The unit every benchmark arm consumes: an ordered sequence of rendered prompts."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Requests in arrival order; each is one prompt's token ids (``uint32 [n]``).

    ``name`` is the workload family (``agent_meta``, ``trace:tau_bench``...), ``variant`` the
    parameter point inside it (``H=250``, ``truncated``), ``synthetic`` whether the recovery
    goals for synthetic workloads apply. ``description`` says in one line what it models.
    """

    name: str
    variant: str = ""
    synthetic: bool
    description: str
    requests: tuple[np.ndarray, ...] = field(repr=False)

    def __post_init__(self) -> None:
        reqs = tuple(np.ascontiguousarray(r, dtype=np.uint32) for r in self.requests)
        if not reqs:
            raise ValueError(f"workload {self.label} has no requests")
        object.__setattr__(self, "requests", reqs)

    @property
    def label(self) -> str:
        return f"{self.name}[{self.variant}]" if self.variant else self.name

    @property
    def total_tokens(self) -> int:
        return int(sum(len(r) for r in self.requests))
