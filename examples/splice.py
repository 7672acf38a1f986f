"""Splice: an agent truncates an old tool output; the engine edits its live cache in place.

    python examples/splice.py                           # starts a sidecar in this process
    python examples/splice.py --target 127.0.0.1:50051  # uses a running `./dev serve`
    python examples/splice.py --fast                    # shorter history, fewer tokens (CI; or KV_SIDECAR_EXAMPLES_FAST=1)

A coding agent's conversation (a file listing and two source files as tool outputs)
is prefilled into an engine session, opened on the sidecar (``OpenSession``). At the next
call the agent appends a user message and applies the reference truncation policy
(``TruncateOldToolOutputs``: tool outputs older than two assistant turns are cut to a
head/tail stub). ``diff_directives`` diffs the old and new message lists into span directives over
the session's tokens; ``Splice`` answers an op plan (MOVE / ROTATE / PREFILL ...); the reference
engine (``clients.transformers.SpliceSession``, SmolLM2-135M-Instruct) applies it to its cache
and commits it (``CommitSplice``). The same edit runs in both modes, side by side:

    amortize  only the stubs and the new message are prefilled; everything after an edit keeps
              its KV, its rotary keys rotated once by the shift (docs/splice.md)
    forget    everything from the first edit on is re-prefilled: the removed text leaves the
              cache (for content that must not stay, e.g. PII)
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
import warnings
from contextlib import ExitStack
from dataclasses import dataclass, replace

import numpy as np

import sidecar.errors
import sidecar.identity
from clients.transformers import (
    CACHE_OFF,
    Engine,
    PrefillResult,
    ReusePolicy,
    SpliceSession,
    anchor_token_ids,
    load_model,
    load_tokenizer,
)
from sidecar.client import SyncSidecarClient, TokenizerRenderer, TruncateOldToolOutputs, diff_directives

MODES = ("amortize", "forget")


@dataclass(frozen=True, kw_only=True)
class ModeRun:
    """One mode's splice of the same edit: what it cost and what the model answered."""

    mode: str
    tokens_before: int  # the session before the Splice
    tokens_after: int  # the edited prompt (stubs + the new message)
    directives: int
    prefilled: int  # tokens computed by the plan (PREFILL + REFRESH)
    kept: int  # tokens whose KV survived the edit (reindexed, rotated or untouched)
    rotated: int
    moved: int
    splice_ms: float  # Splice RPC + applying the plan + CommitSplice
    prefill_ms: float  # of which the plan's forward passes
    rotate_ms: float  # of which moving and rotating kept rows
    new_ids: np.ndarray
    answer_ids: list[int]
    answer: str


def conversation(source_chars: int) -> list[dict]:
    """A coding agent's history: three tool calls (a file listing and two real source files of
    this package, ``source_chars`` characters each) and its diagnosis. At the next call the
    listing and the first file are older than two assistant turns: the policy stubs them; the
    second file, read last, stays whole."""
    listing = "\n".join(
        f"src/kvs/{pkg}/{name}.py" for pkg in ("registry", "tiers", "rotation", "directives", "claims")
        for name in ("__init__", "core", "codec", "limits", "planner", "store", "events", "metrics")
    )
    return [
        {"role": "system", "content": "You are a coding agent. You run shell commands with the bash tool and "
                                      "fix failing tests with minimal changes."},
        {"role": "user", "content": "test_identity_key_changes_with_rope fails with AssertionError: "
                                    "assert 'c0ffee' != 'c0ffee'. Find out why."},
        {"role": "assistant", "content": "I will list the source files first."},
        {"role": "tool", "content": listing},
        {"role": "assistant", "content": "Errors are defined in sidecar/errors.py; let me read it."},
        {"role": "tool", "content": inspect.getsource(sidecar.errors)[:source_chars]},
        {"role": "assistant", "content": "Nothing there. The key is built in sidecar/identity.py; let me read it."},
        {"role": "tool", "content": inspect.getsource(sidecar.identity)[:source_chars]},
        {"role": "assistant", "content": "The cache key does not include the RoPE fingerprint, so two "
                                         "identities that differ only in RoPE get the same key."},
    ]


def start_sidecar(stack: ExitStack, anchors: tuple[int, ...]) -> str:
    """A sidecar on its own thread in this process (port 0: any free port), with the model's anchors."""
    from sidecar.app import ServerThread
    from sidecar.config import load_config

    config = load_config(env={}, overrides={"port": 0, "metrics_port": -1, "grace_period_s": 0.2,
                                            "chunker.anchor_tokens": list(anchors)})
    return stack.enter_context(ServerThread(config)).target


def run_mode(mode: str, engine: Engine, prefilled: PrefillResult, client: SyncSidecarClient,
             renderer: TokenizerRenderer, history: list[dict], question: str, new_tokens: int) -> ModeRun:
    """Open a session over ``history`` (``prefilled``: its prompt in the engine), splice in the
    policy's edit in ``mode``, answer ``question``."""
    tok = engine.tokenizer
    # The session edits a copy of the prefilled cache (``shared``), so both modes start from the
    # same one; it is opened on the sidecar with the same tokens (OpenSession, block size 1).
    session = SpliceSession.from_prefill(engine, prefilled, shared=True, sidecar=client)
    try:
        # The next call: the agent appends a message and applies its history policy; the diff
        # of the list the session holds against the policy's output gives the directives.
        policy = TruncateOldToolOutputs(keep_turns=2, mode=mode)
        new_history = policy.transform([*history, {"role": "user", "content": question}], len(history))
        diff = diff_directives(history, new_history, renderer, mode_for=policy.mode_for)
        t0 = time.perf_counter()
        plan = client.splice(session.session_id, session.version, diff.directives)
        result = session.apply(plan)  # MOVE, ROTATE, then PREFILL runs, on the engine's cache
        client.commit_splice(plan.plan_id)
        splice_s = time.perf_counter() - t0
        assert np.array_equal(session.tokens, diff.new_ids), "the session must hold the edited prompt"
        answer = session.generate(new_tokens, stop_tokens=engine.stop_token_ids)
        s = plan.summary
        return ModeRun(
            mode=mode, tokens_before=s.tokens_before, tokens_after=s.tokens_after, directives=len(diff.directives),
            prefilled=result.prefilled + result.refreshed, kept=s.tokens_kept, rotated=result.rotated,
            moved=result.moved, splice_ms=splice_s * 1e3, prefill_ms=result.timings.prefill_s * 1e3,
            rotate_ms=(result.timings.move_s + result.timings.rotate_s) * 1e3, new_ids=diff.new_ids, answer_ids=answer,
            answer=tok.decode(answer, skip_special_tokens=True).strip(),
        )
    finally:
        session.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", help="host:port of a running sidecar (default: start one in this process)")
    p.add_argument("--fast", action="store_true", default=bool(os.environ.get("KV_SIDECAR_EXAMPLES_FAST")),
                   help="shorter history and answers (CI)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate (default 32; --fast 6)")
    args = p.parse_args(argv)
    new_tokens = args.max_new_tokens or (6 if args.fast else 32)
    t_start = time.perf_counter()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notices

    tokenizer = load_tokenizer("smollm2")
    model = load_model("smollm2")
    renderer = TokenizerRenderer(tokenizer)
    history = conversation(source_chars=1200 if args.fast else 4000)
    question = "Fix it: show the one-line change."

    with ExitStack() as stack:
        target = args.target or start_sidecar(stack, anchor_token_ids(tokenizer))
        print(f"sidecar: {'running' if args.target else 'in-process'} at {target}; model: SmolLM2-135M-Instruct")
        client = stack.enter_context(SyncSidecarClient(target, tenant="splice-example", timeout_s=60))
        # The session engine prefills and edits its own cache; no prefix cache, no Lookup, no Store.
        engine = Engine(model, sidecar=client, tokenizer=tokenizer,
                        reuse=ReusePolicy(prefix_cache=False, sidecar=False, store=False))
        # The history, prefilled once in full (no reuse: this example is about the edit).
        prefilled = engine.prefill(renderer.render(history))
        rows = [run_mode(mode, engine, prefilled, client, renderer, history, question, new_tokens) for mode in MODES]

        r = rows[0]
        print(f"\nhistory: {r.tokens_before} tokens; the policy stubs the old tool outputs and the agent "
              f"appends a message: {r.tokens_after} tokens, {r.directives} directives")
        print(f"\n{'mode':<10}{'re-prefilled':>13}{'kept':>7}{'rotated':>9}{'moved':>7}"
              f"{'splice ms':>11}{'prefill ms':>12}{'move+rotate ms':>16}")
        for r in rows:
            print(f"{r.mode:<10}{r.prefilled:>13}{r.kept:>7}{r.rotated:>9}{r.moved:>7}"
                  f"{r.splice_ms:>11.0f}{r.prefill_ms:>12.0f}{r.rotate_ms:>16.1f}")
        for r in rows:
            print(f"{r.mode}: re-prefilled={r.prefilled} kept={r.kept} answer={r.answer!r}")
        if not args.fast:
            # The edited prompt prefilled from scratch: forget matches it by construction; amortize
            # keeps KV computed against the removed text (its positional contract, docs/splice.md).
            full = engine.generate(rows[0].new_ids, max_new_tokens=new_tokens, stop_tokens=engine.stop_token_ids,
                                   reuse=replace(CACHE_OFF, store=False))
            text = tokenizer.decode(full.tokens, skip_special_tokens=True).strip()
            same = ", ".join(f"{r.mode} {'yes' if r.answer_ids == full.tokens else 'no'}" for r in rows)
            print(f"full prefill of the edited prompt: answer={text!r} (same answer: {same})")
    print(f"\ndone in {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
