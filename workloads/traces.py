"""Real agent traces (workloads/data/agent_traces) and their turn-by-turn replay.

Each trajectory line holds ``turns[i].messages``, the FULL message list sent at call ``i``, plus
the ``tools`` sent with every call (README in the data folder). Replaying a trajectory renders
each call's messages with the chat template: one request per call. With a history policy the
messages are transformed first, call by call, as an agent harness applying the policy would.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from workloads.chat_template import ChatTemplate
from workloads.workload import Workload

Message = Mapping[str, Any]

#: Default location of the traces, inside the repository (overridable per call).
TRACES_DIR = Path(__file__).resolve().parent / "data" / "agent_traces"

TRACE_FILES: dict[str, str] = {
    "tau_bench": "tau_bench_airline_gpt4o.jsonl.gz",
    "mini_swe": "mini_swe_agent_deepseek_swebench.jsonl.gz",
}


@dataclass(frozen=True, kw_only=True)
class Trajectory:
    """One recorded agent run: ``calls[i]`` is the message list sent at call ``i``."""

    task_id: str
    tools: tuple[Mapping[str, Any], ...] | None
    calls: tuple[tuple[Message, ...], ...]


class HistoryPolicy(Protocol):
    """``transform(messages, turn_idx) -> messages``: the harness-side history rewrite."""

    def transform(self, messages: Sequence[Message], turn_idx: int) -> list[Message]: ...


@dataclass(frozen=True, kw_only=True)
class TruncateOldToolOutputs:
    """The reference truncation policy: stub tool outputs older than ``keep_turns`` turns.

    A tool message's age is the number of assistant messages after it in the list. At a call
    whose prompt ends with the newest tool result (age 0), the outputs of the ``keep_turns``
    most recent assistant turns stay intact (ages ``0 .. keep_turns - 1``); every older tool
    output longer than the stub is cut to its first ``head`` and last ``tail`` characters
    joined by ``" ... "`` (a 200-character head/tail stub by default). Stateless and
    idempotent: the same input list always gives the same output, so an output is intact for
    its first ``keep_turns`` calls and stubbed from then on, which moves every later message
    at the call where it is first stubbed.
    """

    keep_turns: int = 2
    head: int = 100
    tail: int = 100
    joiner: str = " ... "

    def transform(self, messages: Sequence[Message], turn_idx: int) -> list[Message]:
        out: list[Message] = []
        later_assistants = sum(1 for m in messages if m.get("role") == "assistant")
        limit = self.head + self.tail + len(self.joiner)
        for m in messages:
            role = m.get("role")
            if role == "assistant":
                later_assistants -= 1
            content = m.get("content")
            old = role == "tool" and later_assistants >= self.keep_turns
            if old and isinstance(content, str) and len(content) > limit:
                m = {**m, "content": content[: self.head] + self.joiner + content[len(content) - self.tail :]}
            out.append(m)
        return out


def load_trajectories(name: str, *, limit: int | None = None, traces_dir: Path | None = None) -> list[Trajectory]:
    """The first ``limit`` trajectories of trace ``name`` (a key of ``TRACE_FILES``), in file order."""
    if name not in TRACE_FILES:
        raise ValueError(f"unknown trace {name!r}; expected one of {sorted(TRACE_FILES)}")
    path = (traces_dir or TRACES_DIR) / TRACE_FILES[name]
    out: list[Trajectory] = []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if limit is not None and len(out) >= limit:
                break
            rec = json.loads(line)
            out.append(
                Trajectory(
                    task_id=str(rec.get("task_id", len(out))),
                    tools=tuple(rec["tools"]) if rec.get("tools") else None,
                    calls=tuple(tuple(t["messages"]) for t in rec["turns"]),
                )
            )
    return out


def replay(
    trajectories: Sequence[Trajectory], template: ChatTemplate, *, policy: HistoryPolicy | None = None
) -> list[np.ndarray]:
    """Rendered prompts of every call of every trajectory, trajectory after trajectory."""
    requests: list[np.ndarray] = []
    for traj in trajectories:
        for i, messages in enumerate(traj.calls):
            msgs = policy.transform(messages, i) if policy is not None else messages
            requests.append(template.render(msgs, traj.tools))
    return requests


def trace_workload(
    name: str,
    template: ChatTemplate,
    *,
    limit: int | None = None,
    policy: HistoryPolicy | None = None,
    traces_dir: Path | None = None,
) -> Workload:
    """Trace ``name`` replayed call by call, as recorded or with ``policy`` applied."""
    trajs = load_trajectories(name, limit=limit, traces_dir=traces_dir)
    variant = "truncated" if policy is not None else "recorded"
    how = "with tool outputs older than 2 turns cut to a head/tail stub" if policy is not None else "as recorded"
    return Workload(
        name=f"trace:{name}",
        variant=f"{variant},n={len(trajs)}",
        synthetic=False,
        description=f"{len(trajs)} real {name} trajectories replayed call by call, {how}",
        requests=tuple(replay(trajs, template, policy=policy)),
    )
