"""Synthetic workloads: Irminsul's failure patterns (section 7.4, Table 3) on real agent text.

Each generator returns a ``Workload`` of ``n_requests`` rendered prompts (80 by default, as in
Irminsul) and is a pure function of its arguments: the same seed gives the same token ids.
What varies between requests, and where, is the point of each workload:

==================  ==========================================================================
agent_meta          per-agent header of H tokens BEFORE a shared body (policy, tool schemas,
                    reference notes): the earliest variation, so exact-prefix loses the body
sysvar              a time stamp + request id inside the system prompt changes every call of
                    interleaved multi-turn sessions; everything after it loses its left context
rerank              the same retrieved documents, reordered per request by a noisy reranker
compact             long coding sessions whose oldest tool outputs are collapsed to a one-line
                    summary whenever the prompt exceeds a budget (forward-iterating compaction)
tool_variants       the same conversation, with an early tool call rendered in different
                    variants (preamble text, a failed attempt kept in history)
edit_replay         build a conversation call by call, edit one early user turn, replay it all
==================  ==========================================================================

``agent_meta`` and ``rerank`` take a ``placement`` that says whether the moving content starts
its own message block (``message``: the chat template puts an anchor token in front of it) or is
glued inside one message to text that differs between requests (``inline``: no anchor; the
chunker must resynchronise on content alone).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import numpy as np

from workloads.chat_template import ChatTemplate
from workloads.pool import TextPool
from workloads.traces import Trajectory
from workloads.workload import Workload

Message = dict[str, Any]

DEFAULT_REQUESTS = 80
AGENT_META_HEADERS = (50, 250, 1000, 2000)
PLACEMENTS = ("message", "inline")


def take_tokens(template: ChatTemplate, texts: Sequence[str], n: int) -> str:
    """The longest prefix of ``"\\n\\n".join(texts)`` that encodes to exactly ``n`` tokens.

    Cuts at a pre-tokenizer piece boundary, so the cut text encodes to the same ids as the
    first ``n`` ids of the joined text. Raises ValueError if the texts are too short.
    """
    tok = template.tokenizer
    pieces = tok.pieces("\n\n".join(texts))
    if len(pieces) < n:
        raise ValueError(f"need {n} tokens of text, the pool gave {len(pieces)}")
    # A BPE tokenizer can merge across the cut differently than inside the longer text; step the
    # cut until the text encodes to exactly n ids (the offline tokenizer never needs a step).
    m = n
    for _ in range(8):
        text = "".join(pieces[:m])
        got = len(tok.encode(text))
        if got == n:
            return text
        m += n - got
    raise ValueError(f"could not cut the text at exactly {n} tokens")


# ---------------------------------------------------------------------------------------------
# agent_meta
# ---------------------------------------------------------------------------------------------


def agent_meta(
    pool: TextPool,
    template: ChatTemplate,
    *,
    header_tokens: int,
    placement: str = "message",
    n_requests: int = DEFAULT_REQUESTS,
    seed: int = 0,
) -> Workload:
    """Many agents share one body but each puts its own header in front of it.

    Models a multi-agent deployment (orchestrator spawning workers, one call per worker here):
    every request starts with a per-agent header of exactly ``header_tokens`` tokens (agent id,
    role, notes: random short lines of real customer messages and tool outputs, so no two
    headers share a 64-token window), then the shared body: the tau-bench airline policy, its 14
    tool schemas and two reference notes (real tool outputs), ~4.5K tokens; then the agent's
    query (a real customer message) as its own user message. ``placement="message"``: the header is its own system message (tool
    schemas are rendered into it, after an anchor) and policy + notes are a second system
    message. ``"inline"``: header, policy and notes share one system message.
    """
    _check_placement(placement)
    rng = np.random.default_rng([seed, header_tokens])  # same draws for both placements
    docs = [pool.documents[i] for i in rng.choice(len(pool.documents), size=2, replace=False)]
    notes = "Reference notes:\n\n" + "\n\n".join(docs)
    lines = pool.short_lines
    requests = []
    for a in range(n_requests):
        # Random short lines (<= 200 chars): a 64-token window spans several of them, so one
        # agent's header practically never repeats a window of another's.
        n_lines = header_tokens // 4 + 8
        picked = [lines[i] for i in rng.choice(len(lines), size=n_lines, replace=False)]
        agent_id = f"worker-{a:04d}-{rng.integers(1 << 32):08x}"
        intro = f"# Agent profile\nagent_id: {agent_id}\nrole: airline support worker\nnotes:\n"
        header = take_tokens(template, [intro + "\n".join(picked)], header_tokens)
        query = pool.user_queries[int(rng.integers(len(pool.user_queries)))]
        body = pool.tau_system + "\n\n" + notes
        if placement == "message":
            msgs = [{"role": "system", "content": header}, {"role": "system", "content": body}]
        else:
            msgs = [{"role": "system", "content": header + "\n\n" + body}]
        msgs.append({"role": "user", "content": query})
        requests.append(template.render(msgs, pool.tau_tools))
    return Workload(
        name="agent_meta" if placement == "message" else "agent_meta_inline",
        variant=f"H={header_tokens}",
        synthetic=True,
        description=f"{n_requests} agents: unique {header_tokens}-token header ({placement}), shared ~4.5K-token body",
        requests=tuple(requests),
    )


# ---------------------------------------------------------------------------------------------
# sysvar
# ---------------------------------------------------------------------------------------------

_TAU_CLOCK_LINE = "The current time is 2024-05-15 15:00:00 EST."


def sysvar(
    pool: TextPool,
    template: ChatTemplate,
    *,
    n_sessions: int = 8,
    n_requests: int = DEFAULT_REQUESTS,
    seed: int = 0,
) -> Workload:
    """Interleaved multi-turn sessions whose system prompt carries a per-call variable.

    Real tau-bench sessions (at least ``n_requests / n_sessions`` calls each) replayed call by
    call, interleaved at random as a serving engine sees them. The policy's own clock line
    (third line of the system prompt) is rewritten on every call to the current time and a
    request id, as harnesses that stamp "now" into the system prompt do. Exact-prefix keeps
    only the first ~20 tokens; everything after sits at the same or a nearby position but
    behind a different left context.
    """
    rng = np.random.default_rng([seed, 1])
    per = -(-n_requests // n_sessions)
    sessions = _pick_trajectories(pool.tau, n_sessions, min_calls=per, rng=rng)
    now = datetime(2024, 5, 15, 15, 0, 0)
    order = _interleave([min(per, len(t.calls)) for t in sessions], rng)[:n_requests]
    cursor = [0] * len(sessions)
    requests = []
    for s in order:
        msgs = [dict(m) for m in sessions[s].calls[cursor[s]]]
        cursor[s] += 1
        now += timedelta(seconds=int(rng.integers(3, 240)))
        rid = f"{rng.integers(1 << 40):x}"
        line = f"The current time is {now:%Y-%m-%d %H:%M:%S} EST. Request id: {rid}."
        if _TAU_CLOCK_LINE not in msgs[0]["content"]:
            raise ValueError("tau-bench system prompt no longer carries its clock line")
        msgs[0]["content"] = msgs[0]["content"].replace(_TAU_CLOCK_LINE, line)
        requests.append(template.render(msgs, sessions[s].tools))
    return Workload(
        name="sysvar",
        synthetic=True,
        description=f"{n_sessions} interleaved tau-bench sessions, system-prompt clock + request id change per call",
        requests=tuple(requests),
    )


# ---------------------------------------------------------------------------------------------
# rerank
# ---------------------------------------------------------------------------------------------

_SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_code",
        "description": "Search the repository and return the most relevant files and command outputs.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "What to look for"}},
            "required": ["query"],
        },
    },
}


def rerank(
    pool: TextPool,
    template: ChatTemplate,
    *,
    placement: str = "message",
    n_topics: int = 12,
    docs_per_topic: int = 5,
    n_requests: int = DEFAULT_REQUESTS,
    seed: int = 0,
) -> Workload:
    """Retrieval results whose order changes between requests for the same question.

    ``n_topics`` questions (real assistant thoughts from mini-swe-agent runs), each with a fixed
    set of ``docs_per_topic`` retrieved documents (real tool outputs, ~250-1,000 tokens each).
    Every request asks one topic's question; the harness calls ``search_code`` and the results
    come back ordered by the reranker's score plus noise, so the same documents arrive in a
    different order. ``placement="message"``: one tool message per document (each behind an
    anchor); ``"inline"``: all documents concatenated into one tool message.
    """
    _check_placement(placement)
    rng = np.random.default_rng([seed, 2])  # same draws for both placements
    questions = _assistant_thoughts(pool.swe)
    topic_q = [questions[i] for i in rng.choice(len(questions), size=n_topics, replace=False)]
    topic_docs = [rng.choice(len(pool.documents), size=docs_per_topic, replace=False) for _ in range(n_topics)]
    topic_scores = [np.sort(rng.random(docs_per_topic))[::-1] for _ in range(n_topics)]
    tools = [*pool.swe_tools, _SEARCH_TOOL]
    requests = []
    for r in range(n_requests):
        t = int(rng.integers(n_topics))
        order = np.argsort(-(topic_scores[t] + rng.normal(0.0, 0.15, docs_per_topic)), kind="stable")
        docs = [pool.documents[int(topic_docs[t][i])] for i in order]
        call_id = f"call_{r:04d}"
        msgs: list[Message] = [
            {"role": "system", "content": pool.swe_system},
            {"role": "user", "content": topic_q[t]},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [_tool_call(call_id, "search_code", {"query": topic_q[t][:80]})],
            },
        ]
        if placement == "message":
            msgs += [{"role": "tool", "tool_call_id": call_id, "content": d} for d in docs]
        else:
            joined = "\n\n".join(f"[result {k + 1}]\n{d}" for k, d in enumerate(docs))
            msgs.append({"role": "tool", "tool_call_id": call_id, "content": joined})
        requests.append(template.render(msgs, tools))
    return Workload(
        name="rerank" if placement == "message" else "rerank_inline",
        synthetic=True,
        description=f"{n_topics} questions x {docs_per_topic} fixed documents, reordered per request ({placement})",
        requests=tuple(requests),
    )


# ---------------------------------------------------------------------------------------------
# compact
# ---------------------------------------------------------------------------------------------


def compact(
    pool: TextPool,
    template: ChatTemplate,
    *,
    budget_tokens: int = 6000,
    target_fraction: float = 0.6,
    n_requests: int = DEFAULT_REQUESTS,
    seed: int = 0,
) -> Workload:
    """Coding sessions whose oldest tool outputs are collapsed when the prompt grows too long.

    Real mini-swe-agent sessions replayed call by call. Whenever a rendered prompt exceeds
    ``budget_tokens``, the harness collapses tool outputs oldest first into a one-line summary
    until the prompt is under ``target_fraction * budget_tokens``; collapsed outputs stay
    collapsed. Each compaction rewrites an early message and moves everything after it
    (the forward-iterating compaction that busts prefix caches in OpenClaw).
    """
    rng = np.random.default_rng([seed, 3])
    order = rng.permutation(len(pool.swe))
    requests: list[np.ndarray] = []
    for ti in order:
        traj = pool.swe[int(ti)]
        collapsed: set[int] = set()
        for call in traj.calls:
            if len(requests) >= n_requests:
                break
            msgs = _collapse(call, collapsed)
            tokens = template.render(msgs, traj.tools)
            if len(tokens) > budget_tokens:
                tool_idx = [i for i, m in enumerate(call) if m.get("role") == "tool" and i not in collapsed]
                # Collapse oldest first, rendering once per step: prompts are ~10K tokens, a few steps.
                for i in tool_idx[:-1]:  # never the newest output: the model has not read it yet
                    collapsed.add(i)
                    msgs = _collapse(call, collapsed)
                    tokens = template.render(msgs, traj.tools)
                    if len(tokens) <= target_fraction * budget_tokens:
                        break
            requests.append(tokens)
        if len(requests) >= n_requests:
            break
    return Workload(
        name="compact",
        synthetic=True,
        description=f"mini-swe sessions, oldest tool outputs collapsed to a summary above {budget_tokens} tokens",
        requests=tuple(requests),
    )


def _collapse(messages: Sequence[Mapping[str, Any]], collapsed: set[int]) -> list[Mapping[str, Any]]:
    out: list[Mapping[str, Any]] = []
    for i, m in enumerate(messages):
        if i in collapsed:
            content = str(m.get("content") or "")
            first = content.strip().splitlines()[0][:80] if content.strip() else ""
            summary = f"[output collapsed: {content.count(chr(10)) + 1} lines, {len(content)} chars; began: {first}]"
            m = {**m, "content": summary}
        out.append(m)
    return out


# ---------------------------------------------------------------------------------------------
# tool_variants
# ---------------------------------------------------------------------------------------------

_PREAMBLES = ("Let me look that up for you.", "Sure, one moment while I check the details.")


def tool_variants(
    pool: TextPool,
    template: ChatTemplate,
    *,
    n_sessions: int = 8,
    n_requests: int = DEFAULT_REQUESTS,
    seed: int = 0,
) -> Workload:
    """One conversation, several renderings of its first tool call.

    Real tau-bench sessions, interleaved call by call from the first call that contains a tool
    call. Each request renders that first tool call in one of four variants: as recorded; with
    a preamble sentence in the assistant message; with a failed attempt (no arguments, error
    result) kept in history before it; both. Tool schemas, policy and the rest of the
    conversation are identical, but everything after the call moves by the variant's length.
    """
    rng = np.random.default_rng([seed, 4])
    per = -(-n_requests // n_sessions)
    candidates = [t for t in pool.tau if _first_tool_call(t.calls[-1]) is not None]
    sessions = _pick_trajectories(candidates, n_sessions, min_calls=per, rng=rng, start=_calls_from_first_tool_call)
    starts = [_calls_from_first_tool_call(t) for t in sessions]
    order = _interleave([min(per, len(t.calls) - s) for t, s in zip(sessions, starts)], rng)[:n_requests]
    cursor = list(starts)
    requests = []
    for s in order:
        call = sessions[s].calls[cursor[s]]
        cursor[s] += 1
        variant = int(rng.integers(4))
        requests.append(template.render(_tool_call_variant(call, variant), sessions[s].tools))
    return Workload(
        name="tool_variants",
        synthetic=True,
        description=f"{n_sessions} interleaved tau-bench sessions, first tool call in 1 of 4 variants per call",
        requests=tuple(requests),
    )


def _first_tool_call(messages: Sequence[Mapping[str, Any]]) -> int | None:
    return next((i for i, m in enumerate(messages) if m.get("role") == "assistant" and m.get("tool_calls")), None)


def _calls_from_first_tool_call(t: Trajectory) -> int:
    """Index of the first call whose messages include the trajectory's first tool call."""
    return next(i for i, c in enumerate(t.calls) if _first_tool_call(c) is not None)


def _tool_call_variant(messages: Sequence[Mapping[str, Any]], variant: int) -> list[Mapping[str, Any]]:
    j = _first_tool_call(messages)
    assert j is not None, "caller picked a call without a tool call"
    out = [dict(m) for m in messages]
    call = copy.deepcopy(out[j])
    if variant & 1:
        call["content"] = ((call.get("content") or "") + " " + _PREAMBLES[0]).strip()
    inserted: list[Mapping[str, Any]] = []
    if variant & 2:
        tc = call["tool_calls"][0]
        fn = tc["function"]
        failed_id = tc.get("id", "call") + "_failed"
        inserted = [
            {
                "role": "assistant",
                "content": _PREAMBLES[1],
                "tool_calls": [_tool_call(failed_id, fn["name"], "{}")],
            },
            {"role": "tool", "tool_call_id": failed_id, "content": f"Error: missing required arguments: {fn['name']}"},
        ]
    return out[:j] + inserted + [call] + out[j + 1 :]


# ---------------------------------------------------------------------------------------------
# edit_replay
# ---------------------------------------------------------------------------------------------


def edit_replay(
    pool: TextPool,
    template: ChatTemplate,
    *,
    calls_per_pass: int = 10,
    n_requests: int = DEFAULT_REQUESTS,
    seed: int = 0,
) -> Workload:
    """Build a conversation, edit one early user turn, replay the whole conversation.

    For each of ``n_requests / (2 * calls_per_pass)`` real tau-bench conversations: the first
    ``calls_per_pass`` calls as recorded (build), then the same calls again with one of the
    first two user messages edited (a sentence from another customer appended, as when a user
    edits an earlier message and the client re-runs the thread). Every message after the edit
    moves by the edit's length.
    """
    rng = np.random.default_rng([seed, 5])
    n_conv = max(1, n_requests // (2 * calls_per_pass))
    convs = _pick_trajectories(pool.tau, n_conv, min_calls=calls_per_pass, rng=rng)
    requests = []
    for t in convs:
        calls = t.calls[:calls_per_pass]
        users = [i for i, m in enumerate(calls[-1]) if m.get("role") == "user"][:2]
        target = users[int(rng.integers(len(users)))]
        extra = pool.user_queries[int(rng.integers(len(pool.user_queries)))]
        for c in calls:
            requests.append(template.render(c, t.tools))
        for c in calls:
            msgs = [dict(m) for m in c]
            if target < len(msgs):
                msgs[target]["content"] = f"{msgs[target]['content']} Also: {extra}"
            requests.append(template.render(msgs, t.tools))
    return Workload(
        name="edit_replay",
        synthetic=True,
        description=f"{n_conv} tau-bench conversations: {calls_per_pass} calls, edit an early user turn, replay",
        requests=tuple(requests),
    )


# ---------------------------------------------------------------------------------------------
# helpers and the default suite
# ---------------------------------------------------------------------------------------------


def _tool_call(call_id: str, name: str, arguments: Any) -> Message:
    """An OpenAI-format tool call (``arguments``: a JSON string or a dict)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")


def _pick_trajectories(
    trajs: Sequence[Trajectory],
    n: int,
    *,
    min_calls: int,
    rng: np.random.Generator,
    start: Callable[[Trajectory], int] | None = None,
) -> list[Trajectory]:
    """``n`` distinct trajectories with at least ``min_calls`` calls (after ``start(t)``), chosen by ``rng``."""
    ok = [t for t in trajs if len(t.calls) - (start(t) if start else 0) >= min_calls]
    if len(ok) < n:
        raise ValueError(f"only {len(ok)} trajectories have >= {min_calls} calls, need {n}")
    return [ok[i] for i in sorted(rng.choice(len(ok), size=n, replace=False))]


def _interleave(counts: Sequence[int], rng: np.random.Generator) -> list[int]:
    """A random arrival order: session ``s`` appears ``counts[s]`` times, its calls in order."""
    seq = np.repeat(np.arange(len(counts)), counts)
    return rng.permutation(seq).tolist()


def _assistant_thoughts(trajs: Sequence[Trajectory]) -> list[str]:
    out = []
    for t in trajs:
        for m in t.calls[-1]:
            c = m.get("content")
            if m.get("role") == "assistant" and isinstance(c, str) and 40 <= len(c) <= 400:
                out.append(c)
    return out


def default_suite(
    pool: TextPool,
    template: ChatTemplate,
    *,
    n_requests: int = DEFAULT_REQUESTS,
    seed: int = 0,
    headers: Sequence[int] = AGENT_META_HEADERS,
) -> list[Workload]:
    """Every synthetic workload at its default parameters, in report order."""
    out = [
        agent_meta(pool, template, header_tokens=h, placement=p, n_requests=n_requests, seed=seed)
        for p in PLACEMENTS
        for h in headers
    ]
    out += [
        sysvar(pool, template, n_requests=n_requests, seed=seed),
        rerank(pool, template, n_requests=n_requests, seed=seed),
        rerank(pool, template, placement="inline", n_requests=n_requests, seed=seed),
        compact(pool, template, n_requests=n_requests, seed=seed),
        tool_variants(pool, template, n_requests=n_requests, seed=seed),
        edit_replay(pool, template, n_requests=n_requests, seed=seed),
    ]
    return out
