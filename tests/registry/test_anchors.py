"""Chunker anchors from a tokenizer (``sidecar.registry.anchors``), on small real tokenizers
built in the test (a word-level ``tokenizers`` model with each family's special tokens and chat
template) and on the project's real model's tokenizer."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sidecar.registry.anchors import anchor_token_ids

WORDS = ["hello", "world", "user", "assistant", "system", "alpha", "bravo", "charlie", "delta", "echo",
         "foxtrot", "golf", "hotel", "[UNK]"]

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
GEMMA = (  # no system role: the template raises, the helper falls back to user/assistant turns
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def tokenizer(specials: list[str], template: str | None, *, bos: str, eos: str) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(WORDS + specials)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    extra = [s for s in specials if s not in (bos, eos)]
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=bos, eos_token=eos, unk_token="[UNK]",
                                  additional_special_tokens=extra)
    tok.chat_template = template
    return tok


def names(tok, ids) -> list[str]:
    return tok.convert_ids_to_tokens(list(ids))


def test_llama3_style_block_opener_and_tool_opener():
    tok = tokenizer(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                     "<tool_call>", "</tool_call>"], LLAMA3, bos="<|begin_of_text|>", eos="<|eot_id|>")
    # The header opener starts every message block; the closing tokens and BOS are not anchors.
    assert names(tok, anchor_token_ids(tok)) == ["<|start_header_id|>", "<tool_call>"]


def test_template_rejecting_a_system_role_falls_back_to_alternating_turns():
    tok = tokenizer(["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], GEMMA, bos="<bos>", eos="<eos>")
    assert names(tok, anchor_token_ids(tok)) == ["<start_of_turn>"]


def test_without_a_chat_template_the_bos_token_is_the_anchor():
    tok = tokenizer(["<s>", "</s>"], None, bos="<s>", eos="</s>")
    assert names(tok, anchor_token_ids(tok)) == ["<s>"]


@pytest.mark.slow
def test_the_real_models_anchor_is_im_start():
    from clients.transformers import load_tokenizer

    tok = load_tokenizer("smollm2")
    assert names(tok, anchor_token_ids(tok)) == ["<|im_start|>"]
