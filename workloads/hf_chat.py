"""A real model's tokenizer and chat template behind the benchmarks' ``ChatTemplate`` interface.

``workloads/chat_template.py``'s ``ChatTemplate`` is an offline stand-in (hashed vocabulary, ChatML-like
layout). ``HFChatTemplate`` renders the same OpenAI-format messages with a real Hugging Face
tokenizer and its own Jinja chat template, so the workload generators (``workloads/``) produce the
token ids a deployed model would see::

    tpl = HFChatTemplate(load_tokenizer("smollm2"))
    ids = tpl.render(messages, tools)          # uint32 [n], the model's real ids
    tpl.anchor_token_ids                       # from the template (sidecar.registry.anchors)

Chat templates differ in what they do with tools: many small models' templates (SmolLM2's
among them) print only ``role`` and ``content``. Tool schemas, tool calls and tool results are
therefore written into the message text first, the way Hermes-style templates print them
(``<tools>`` / ``<tool_call>`` / ``<tool_response>`` blocks as plain text), and the template
renders the result. Same messages in, same ids out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sidecar.registry.anchors import anchor_token_ids
from workloads.chat_template import _call_json, _text

_TOOLS_INTRO = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags."
)


class HFTokenizerView:
    """``encode`` / ``decode`` / ``pieces`` over a Hugging Face tokenizer (no special tokens added)."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.hf.encode(text, add_special_tokens=False), dtype=np.uint32)

    def decode(self, ids: Any) -> str:
        return self.hf.decode(np.asarray(ids, dtype=np.int64).tolist())

    def pieces(self, text: str) -> list[str]:
        """Text spans of the tokens of ``text``; ``"".join(pieces(t)) == t``. A prefix of whole
        pieces re-encodes to (nearly always exactly) the same leading ids."""
        enc = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = [s for s, _ in enc["offset_mapping"]]
        if not starts:
            return [text] if text else []
        starts[0] = 0
        ends = starts[1:] + [len(text)]
        return [text[a:b] for a, b in zip(starts, ends)]


class HFChatTemplate:
    """Renders OpenAI-format messages with a Hugging Face tokenizer's own chat template."""

    def __init__(self, hf_tokenizer: Any) -> None:
        if not getattr(hf_tokenizer, "chat_template", None):
            raise ValueError("tokenizer: has no chat template")
        self.hf = hf_tokenizer
        self.tokenizer = HFTokenizerView(hf_tokenizer)
        self.anchor_token_ids: tuple[int, ...] = anchor_token_ids(hf_tokenizer)
        self._gen: tuple[np.ndarray, np.ndarray] | None = None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> np.ndarray:
        msgs = [_plain(m) for m in messages]
        if tools:
            schemas = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
            block = _TOOLS_INTRO + schemas + _TOOLS_OUTRO
            if msgs and msgs[0]["role"] == "system":
                msgs[0] = {"role": "system", "content": msgs[0]["content"] + block}
            else:
                msgs.insert(0, {"role": "system", "content": block.lstrip()})
        text = self.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text)

    def _generation_prompt(self) -> tuple[np.ndarray, np.ndarray]:
        """(a one-message conversation without the generation prompt, the generation prompt's ids);
        rendered once per template."""
        if self._gen is None:
            base = [{"role": "system", "content": "x"}]
            closed = self.render(base, add_generation_prompt=False)
            opened = self.render(base)
            if not np.array_equal(opened[: len(closed)], closed):
                raise ValueError("chat template: messages do not render as appended blocks")
            self._gen = (closed, opened[len(closed):])
        return self._gen

    def append_user(self, prompt: np.ndarray, text: str) -> np.ndarray:
        """``prompt`` (rendered with the generation prompt) with one more user message before a
        new generation prompt: the ids ``render(messages + [user text])`` would give, for
        templates that render a conversation as the concatenation of its message blocks
        (ChatML and its relatives). Raises ValueError for templates that do not."""
        base = [{"role": "system", "content": "x"}]
        closed, gen = self._generation_prompt()
        asked = self.render(base + [{"role": "user", "content": text}])
        if not np.array_equal(asked[: len(closed)], closed):
            raise ValueError("chat template: messages do not render as appended blocks")
        if len(gen) and not np.array_equal(prompt[len(prompt) - len(gen):], gen):
            raise ValueError("prompt: does not end with the generation prompt")
        return np.concatenate([prompt[: len(prompt) - len(gen)], asked[len(closed):]]).astype(np.uint32)


def _plain(m: Mapping[str, Any]) -> dict[str, str]:
    """One message with tool calls / results written into its text content."""
    role = m.get("role", "user")
    content = _text(m.get("content"))
    if role == "tool":
        content = "<tool_response>\n" + content + "\n</tool_response>"
    elif role == "assistant":
        for call in m.get("tool_calls") or ():
            content += "<tool_call>\n" + _call_json(call) + "\n</tool_call>"
    return {"role": role, "content": content}
