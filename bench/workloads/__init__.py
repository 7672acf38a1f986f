"""Benchmark workloads: ordered prompt sequences (token ids) for the cache arms.

``synthetic``: Irminsul's patterns (agent_meta, sysvar, rerank, compact, tool_variants) plus
message-edit replay, built on real agent text. ``traces``: the recorded agent runs in
bench/data/agent_traces replayed call by call, as recorded or through a history policy.
"""

from bench.workloads.pool import TextPool
from bench.workloads.synthetic import (
    agent_meta,
    compact,
    default_suite,
    edit_replay,
    rerank,
    sysvar,
    tool_variants,
)
from bench.workloads.traces import Trajectory, TruncateOldToolOutputs, load_trajectories, replay, trace_workload
from bench.workloads.workload import Workload

__all__ = [
    "TextPool",
    "Trajectory",
    "TruncateOldToolOutputs",
    "Workload",
    "agent_meta",
    "compact",
    "default_suite",
    "edit_replay",
    "load_trajectories",
    "replay",
    "rerank",
    "sysvar",
    "tool_variants",
    "trace_workload",
]
