"""Chunker anchors from a tokenizer: the special tokens that open a chat message block.

The chunker forces a boundary before each anchor and resets its rolling state there, so the
same message content chunks identically wherever the message sits (``chunker.py``). The right
anchors are the tokens a model's chat template puts at the start of every message block:
``<|im_start|>`` for ChatML models (Qwen, SmolLM, Hermes), ``<|start_header_id|>`` for Llama 3,
``<start_of_turn>`` for Gemma, ``[INST]`` for Mistral. ``anchor_token_ids`` finds them from the
template itself instead of a hand-kept list::

    render [m0], [m0, m1], [m0, m1, m2], ... with the tokenizer's chat template
    the first token of each newly appended message block that is a special token -> anchor

plus special tokens that open a tool block (``<tool_call>``, ``<tools>``, ``<tool_response>``
when the vocabulary has them as special tokens). Closing tokens (``<|im_end|>``) are never
anchors: cutting before them would leave 1-2-token chunks between a message's end and the
next one's start. A tokenizer without a chat template falls back to its BOS token.

Duck-typed (no transformers import): anything with ``apply_chat_template``, ``all_special_ids``
and ``convert_ids_to_tokens`` works. Operators get the ids with ``kv-sidecar anchors MODEL``
and put them in ``chunker.anchor_tokens``.
"""

from __future__ import annotations

from typing import Any

_SENTINELS = ("alpha bravo", "charlie delta", "echo foxtrot", "golf hotel")
#: Role sequences tried in order; templates differ in which they accept (some reject a system
#: role, some insist on strict user/assistant alternation).
_CONVERSATIONS = (
    ("system", "user", "assistant", "user"),
    ("user", "assistant", "user", "assistant"),
)


def _special_ids(tokenizer: Any) -> set[int]:
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ()}
    for tid, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(tid))
    return ids


def _render(tokenizer: Any, messages: list[dict[str, str]], *, generation_prompt: bool = False) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(t) for t in out]


def _block_openers(tokenizer: Any, special: set[int]) -> set[int]:
    for roles in _CONVERSATIONS:
        msgs = [{"role": r, "content": c} for r, c in zip(roles, _SENTINELS)]
        try:
            renders = [_render(tokenizer, msgs[: i + 1]) for i in range(len(msgs))]
            renders.append(_render(tokenizer, msgs, generation_prompt=True))
        except Exception:  # noqa: BLE001 - a template may reject a role order; try the next one
            continue
        found: set[int] = set()
        for before, after in zip(renders, renders[1:]):
            if after[: len(before)] != before or len(after) == len(before):
                continue  # the template re-renders earlier messages: no clean append point
            first = after[len(before)]
            if first in special:
                found.add(first)
        if found:
            return found
    return set()


def _tool_openers(tokenizer: Any, special: set[int]) -> set[int]:
    out = set()
    for tid in special:
        text = str(tokenizer.convert_ids_to_tokens(tid))
        if "tool" in text.lower() and not text.startswith("</") and "end" not in text.lower():
            out.add(tid)
    return out


def anchor_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """Sorted anchor token ids for ``tokenizer`` (see the module docstring)."""
    special = _special_ids(tokenizer)
    found: set[int] = set()
    if getattr(tokenizer, "chat_template", None):
        found = _block_openers(tokenizer, special)
    found |= _tool_openers(tokenizer, special)
    if not found:
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is not None:
            found = {int(bos)}
    return tuple(sorted(found))
