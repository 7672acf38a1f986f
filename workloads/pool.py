"""Real agentic text for the synthetic workloads, drawn from the recorded traces.

Synthetic workloads control WHERE content moves; the content itself comes from real agent runs
(tau-bench airline policy, tool schemas, customer messages and database records; mini-swe-agent
shell outputs), so token statistics (n-gram repetition, JSON punctuation, code indentation) are
those of real prompts, which is what content-defined chunking is sensitive to.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workloads.traces import Trajectory, load_trajectories


@dataclass(frozen=True, kw_only=True)
class TextPool:
    """Texts and trajectories of both traces.

    ``tau`` / ``swe``: every trajectory of each trace. ``user_queries``: the opening customer
    message of each tau trajectory. ``documents``: distinct mini-swe tool outputs between 800 and
    3,600 characters (file listings, source excerpts, grep hits; roughly 250-1,000 tokens),
    in trace order. ``short_lines``: distinct lines of 20-200 characters from the queries and
    documents (material for text that must not repeat across requests).
    """

    tau: tuple[Trajectory, ...]
    swe: tuple[Trajectory, ...]
    tau_system: str
    tau_tools: tuple[Mapping[str, Any], ...]
    swe_system: str
    swe_tools: tuple[Mapping[str, Any], ...]
    user_queries: tuple[str, ...]
    documents: tuple[str, ...]
    short_lines: tuple[str, ...]

    @classmethod
    def load(cls, traces_dir: Path | None = None) -> "TextPool":
        """Load (once per process and folder) the pool from the trace files."""
        return _load(traces_dir)


@functools.lru_cache(maxsize=2)
def _load(traces_dir: Path | None) -> TextPool:
    tau = load_trajectories("tau_bench", traces_dir=traces_dir)
    swe = load_trajectories("mini_swe", traces_dir=traces_dir)
    queries: list[str] = []
    for t in tau:
        first_user = next((m["content"] for m in t.calls[0] if m.get("role") == "user"), None)
        if isinstance(first_user, str) and first_user:
            queries.append(first_user)
    docs: list[str] = []
    seen: set[str] = set()
    for t in swe:
        for m in t.calls[-1]:
            c = m.get("content")
            if m.get("role") == "tool" and isinstance(c, str) and 800 <= len(c) <= 3600 and c not in seen:
                seen.add(c)
                docs.append(c)
    stripped = (ln.strip() for text in (*queries, *docs) for ln in text.splitlines())
    lines = sorted({ln for ln in stripped if 20 <= len(ln) <= 200})
    return TextPool(
        tau=tuple(tau),
        swe=tuple(swe),
        tau_system=str(tau[0].calls[0][0]["content"]),
        tau_tools=tuple(tau[0].tools or ()),
        swe_system=str(swe[0].calls[0][0]["content"]),
        swe_tools=tuple(swe[0].tools or ()),
        user_queries=tuple(queries),
        documents=tuple(docs),
        short_lines=tuple(lines),
    )
