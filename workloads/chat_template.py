"""A deterministic, offline tokenizer and a ChatML-style chat template for the benchmarks and tests.

The benchmarks need token ids that behave like a real model's (the same text always maps to the
same ids, in any process, on any host) without downloading a vocabulary. ``HashTokenizer``
splits text with a GPT-style regex pre-tokenizer (letter runs with an optional leading space,
numbers in groups of up to three digits, punctuation runs, whitespace runs) and maps each piece
to ``xxh64(piece) % VOCAB_SIZE``. Special tokens live above that range (``SPECIAL_BASE`` and
up) and are never produced by ``encode``: text that contains ``<|im_start|>`` encodes as
ordinary text, as with a real tokenizer called without ``allowed_special``.

Hashing into a fixed vocabulary merges a few distinct pieces into one id (a birthday collision
among the ~10^5 distinct pieces of the agent traces). That only matters for ``decode``, which is
exact whenever the pieces this tokenizer has seen do not collide; ``collisions`` counts them.

``ChatTemplate`` renders OpenAI-format messages (and tool schemas) ChatML/Hermes-style::

    <|im_start|><|system|>\\n{system}\\n\\n# Tools\\n...<tools>\\n{schema}\\n...</tools><|im_end|>\\n
    <|im_start|><|user|>\\n{content}<|im_end|>\\n
    <|im_start|><|assistant|>\\n{content}<tool_call>\\n{call json}\\n</tool_call><|im_end|>\\n
    <|im_start|><|tool|>\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n
    <|im_start|><|assistant|>\\n                                   (generation prompt)

Every message block starts with ``<|im_start|>``; the tool-schema block, each tool call and each
tool result additionally start with their own opening special token. These block openers are
the chunker's anchors (``ChatTemplate.anchor_token_ids``): a boundary is forced before each one,
so identical content in a block chunks identically wherever the block sits.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

#: Ordinary pieces hash into [0, VOCAB_SIZE); a vocabulary the size of a mid-2020s model's.
VOCAB_SIZE = 100_000
#: Special tokens take ids SPECIAL_BASE, SPECIAL_BASE + 1, ... in SPECIAL_TOKENS order.
SPECIAL_BASE = 100_000

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<tools>",
    "</tools>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

#: Block openers: the tokens the chunker forces a boundary before (and resets its state at).
ANCHOR_TOKENS: tuple[str, ...] = ("<|im_start|>", "<tools>", "<tool_call>", "<tool_response>")

# Alternatives are tried left to right; the final ``.`` (DOTALL) guarantees every character is
# consumed, so ``"".join(pieces) == text`` always holds.
_PIECE_RE = re.compile(
    r"""'(?:s|t|re|ve|m|ll|d)\b"""  # English contractions
    r"""| ?[^\W\d_]+"""  # letter runs, optional leading space
    r"""| ?\d{1,3}"""  # numbers, at most three digits per piece
    r"""| ?[^\s\w]+"""  # punctuation runs, optional leading space
    r"""|_+"""  # underscores (part of \w, so not covered above)
    r"""|\s+(?!\S)|\s+"""  # whitespace runs; the last space before a word stays with the word
    r"""|.""",
    re.DOTALL,
)


class HashTokenizer:
    """Regex pre-tokenizer + stable hash vocabulary. Deterministic across processes and hosts.

    Not thread-safe (the piece cache grows on first sight of a piece); use one per thread.
    """

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._pieces: dict[int, str] = {}
        self._collisions = 0
        self.special_token_ids: dict[str, int] = {t: SPECIAL_BASE + i for i, t in enumerate(SPECIAL_TOKENS)}
        self._special_text = {i: t for t, i in self.special_token_ids.items()}

    @property
    def vocab_size(self) -> int:
        """One past the largest id this tokenizer can produce (ordinary and special)."""
        return SPECIAL_BASE + len(SPECIAL_TOKENS)

    @property
    def collisions(self) -> int:
        """Distinct pieces seen so far that share an id with an earlier, different piece."""
        return self._collisions

    def pieces(self, text: str) -> list[str]:
        """The pre-tokenizer's pieces; ``"".join(pieces(t)) == t``."""
        return _PIECE_RE.findall(text)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as ``uint32 [n]``; never emits special tokens."""
        pieces = _PIECE_RE.findall(text)
        try:
            ids = list(map(self._ids.__getitem__, pieces))
        except KeyError:
            for p in pieces:
                if p not in self._ids:
                    self._add(p)
            ids = list(map(self._ids.__getitem__, pieces))
        return np.fromiter(ids, dtype=np.uint32, count=len(ids))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; exact for ids this instance produced while ``collisions == 0``.

        Raises KeyError for an ordinary id this instance has never produced.
        """
        out = []
        for i in np.asarray(ids, dtype=np.int64).tolist():
            out.append(self._special_text[i] if i >= SPECIAL_BASE else self._pieces[i])
        return "".join(out)

    def _add(self, piece: str) -> None:
        tid = xxhash.xxh64_intdigest(piece.encode("utf-8")) % VOCAB_SIZE
        self._ids[piece] = tid
        seen = self._pieces.setdefault(tid, piece)
        if seen != piece:
            self._collisions += 1


Message = Mapping[str, Any]


class ChatTemplate:
    """Renders OpenAI-format messages to token ids (layout in the module docstring).

    Rendered message blocks are cached by content, so replaying a trajectory whose calls resend
    the same messages tokenizes each distinct message once. Not thread-safe.
    """

    def __init__(self, tokenizer: HashTokenizer | None = None) -> None:
        self.tokenizer = tokenizer or HashTokenizer()
        sp = self.tokenizer.special_token_ids
        self._sp = sp
        self.anchor_token_ids: tuple[int, ...] = tuple(sp[t] for t in ANCHOR_TOKENS)
        self._role_ids = {
            "system": sp["<|system|>"],
            "user": sp["<|user|>"],
            "assistant": sp["<|assistant|>"],
            "tool": sp["<|tool|>"],
        }
        self._nl = self.tokenizer.encode("\n")
        self._cache: dict[str, np.ndarray] = {}
        self._tools_cache: dict[str, np.ndarray] = {}

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> np.ndarray:
        """Token ids (``uint32 [n]``) of the whole prompt.

        ``tools`` (OpenAI function schemas) are rendered into the first system message, or into
        a system block of their own when the conversation has none.
        """
        parts: list[np.ndarray] = []
        tools_key = json.dumps(list(tools), sort_keys=True) if tools else ""
        if tools_key and (not messages or messages[0].get("role") != "system"):
            parts.append(self._block("system", self._tools_block(tools_key, tools)))
            tools_key = ""
        for i, m in enumerate(messages):
            parts.append(self._message(m, tools, tools_key if i == 0 else ""))
        if add_generation_prompt:
            parts.append(np.asarray([self._sp["<|im_start|>"], self._role_ids["assistant"]], dtype=np.uint32))
            parts.append(self._nl)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)

    # -- blocks --------------------------------------------------------------------------------

    def _message(self, m: Message, tools: Sequence[Mapping[str, Any]] | None, tools_key: str) -> np.ndarray:
        """One message block; ``tools_key`` non-empty: append the tool schemas to this block."""
        key = json.dumps(m, sort_keys=True, default=str) + "\x00" + tools_key
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        role = m.get("role", "user")
        if role not in self._role_ids:
            raise ValueError(f"unknown message role {role!r}")
        enc = self.tokenizer.encode
        sp = self._sp
        body: list[np.ndarray] = []
        content = _text(m.get("content"))
        if role == "tool":
            body += [_ids(sp["<tool_response>"]), enc("\n" + content + "\n"), _ids(sp["</tool_response>"])]
        elif content:
            body.append(enc(content))
        if role == "assistant":
            for call in m.get("tool_calls") or ():
                body += [_ids(sp["<tool_call>"]), enc("\n" + _call_json(call) + "\n"), _ids(sp["</tool_call>"])]
        if tools_key:
            body.append(self._tools_block(tools_key, tools or ()))
        out = self._block(role, np.concatenate(body) if body else np.zeros(0, dtype=np.uint32))
        self._cache[key] = out
        return out

    def _block(self, role: str, body: np.ndarray) -> np.ndarray:
        head = np.asarray([self._sp["<|im_start|>"], self._role_ids[role]], dtype=np.uint32)
        return np.concatenate([head, self._nl, body, _ids(self._sp["<|im_end|>"]), self._nl])

    def _tools_block(self, key: str, tools: Sequence[Mapping[str, Any]]) -> np.ndarray:
        hit = self._tools_cache.get(key)
        if hit is not None:
            return hit
        enc = self.tokenizer.encode
        intro = (
            "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
        )
        schemas = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        outro = (
            "\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags."
        )
        out = np.concatenate(
            [enc(intro), _ids(self._sp["<tools>"]), enc(schemas + "\n"), _ids(self._sp["</tools>"]), enc(outro)]
        )
        self._tools_cache[key] = out
        return out


def _ids(*ids: int) -> np.ndarray:
    return np.asarray(ids, dtype=np.uint32)


def _text(content: Any) -> str:
    """Message content as text; OpenAI content-part lists are joined, ``None`` is empty."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, Mapping) else str(p) for p in content)
    return str(content)


def _call_json(call: Mapping[str, Any]) -> str:
    """A tool call as Hermes templates print it: ``{"name": ..., "arguments": ...}``."""
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass  # keep malformed arguments verbatim, as the model emitted them
    return json.dumps({"name": fn.get("name", ""), "arguments": args}, ensure_ascii=False)
