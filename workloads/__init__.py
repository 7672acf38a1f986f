"""Agent-traffic generators and chat templates shared by the benchmarks and the tests.

Not part of the installed product: ``sidecar/`` and ``clients/`` never import this package, and
it imports neither ``bench`` nor ``tests`` (tests/test_architecture.py).

A workload is an ordered sequence of rendered prompts (token ids) for the cache arms.
``synthetic``: Irminsul's patterns (agent_meta, sysvar, rerank, compact, tool_variants) plus
message-edit replay, built on real agent text (``pool``). ``traces``: the recorded agent runs in
workloads/data/agent_traces replayed call by call, as recorded or through a history policy.
Prompts are rendered by ``chat_template.ChatTemplate`` (offline hash tokenizer, ChatML-style)
or ``hf_chat.HFChatTemplate`` (a real model's tokenizer and template).
"""

from workloads.pool import TextPool
from workloads.synthetic import (
    agent_meta,
    compact,
    default_suite,
    edit_replay,
    rerank,
    sysvar,
    tool_variants,
)
from workloads.traces import Trajectory, TruncateOldToolOutputs, load_trajectories, replay, trace_workload
from workloads.workload import Workload

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
