"""Tokenizer: the GGUF-built SmolLM2 tokenizer reproduces the real tokenizer's ids, round-trips
text, keeps special tokens whole, and renders the chat template."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuel.runtime.gguf_loader import WeightsFileMissing, read_gguf
from fuel.runtime.tokenizer import (
    ChatTemplateError,
    UnsupportedTokenizer,
    load_tokenizer,
    tokenizer_from_gguf_metadata,
)

# Ids the Hugging Face SmolLM2 tokenizer gives for the chat-templated question "What is the
# capital of France?" (default system prompt), as pinned by public test fixtures found with the
# `search` tool (find_string "1, 9690, 198": e.g. a C++ engine test and a Kotlin
# `verifyTextGeneration` test over SmolLM2-Instruct).
FRANCE_PROMPT_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
]
# The same source's user turn "hello world" (a tokenizer service printing HF ids).
HELLO_WORLD_IDS = [28120, 905]


def test_chat_prompt_ids_match_the_reference_tokenizer(smollm2_tokenizer):
    prompt = smollm2_tokenizer.format_prompt("What is the capital of France?")
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert smollm2_tokenizer.encode(prompt) == FRANCE_PROMPT_IDS


def test_plain_text_ids_match_the_reference_tokenizer(smollm2_tokenizer):
    assert smollm2_tokenizer.encode("hello world") == HELLO_WORLD_IDS


def test_special_ids_come_from_the_gguf(smollm2_tokenizer):
    assert (smollm2_tokenizer.bos_id, smollm2_tokenizer.eos_id, smollm2_tokenizer.pad_id) == (1, 2, 2)
    assert smollm2_tokenizer.bos_token == "<|im_start|>" and smollm2_tokenizer.eos_token == "<|im_end|>"
    assert smollm2_tokenizer.vocab_size == 49152


def test_special_tokens_stay_whole_and_can_be_skipped(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_digits_are_split_one_by_one(smollm2_tokenizer):
    # llama.cpp's `smollm` pre-tokenizer: \p{N} pieces first, as the original tokenizer does.
    ids = smollm2_tokenizer.encode("2024")
    assert len(ids) == 4
    assert [smollm2_tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_no_bos_is_added_because_the_model_asks_for_none(smollm2_tokenizer):
    assert smollm2_tokenizer.encode("hello world", add_special_tokens=True) == HELLO_WORLD_IDS


# SmolLM2's vocabulary has no token for the bytes 0x04 0x06 0x13 0x14 0x16 0x1d (control
# characters) nor for the UTF-8 lead bytes 0xF1/0xF2 (code points U+40000..U+BFFFF, unassigned
# planes), so the original tokenizer drops them too; everything else must round-trip.
_UNENCODABLE = "\x04\x06\x13\x14\x16\x1d"
_ENCODABLE_TEXT = st.text(st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cs",), exclude_characters=_UNENCODABLE), max_size=80)


@settings(max_examples=60, deadline=None)
@given(_ENCODABLE_TEXT)
def test_decode_inverts_encode_for_any_text(smollm2_tokenizer, text):
    assert smollm2_tokenizer.decode(smollm2_tokenizer.encode(text)) == text


def test_stream_decoding_holds_back_split_characters(smollm2_tokenizer):
    text = "héllo 世界 🙂 done"
    ids = smollm2_tokenizer.encode(text)
    stream = smollm2_tokenizer.decode_stream()
    pieces = [stream.step(token) for token in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_folder_tokenizer_equals_the_gguf_built_one(smollm2_weights, smollm2_tokenizer):
    direct = tokenizer_from_gguf_metadata(read_gguf(smollm2_weights.source.path).metadata, source="gguf")
    sample = "Numbers 1234, émojis 🙂, code `x = y + 1`\n<|im_end|>"
    assert direct.encode(sample) == smollm2_tokenizer.encode(sample)
    assert direct.chat_template == smollm2_tokenizer.chat_template
    assert smollm2_tokenizer.source == str(smollm2_weights.source.folder)


def test_tiny_gguf_tokenizer_uses_merges_and_the_digit_split(tiny_gguf):
    tokenizer = load_tokenizer(tiny_gguf.path)
    # "ab" and "Ġa" merge; "12" is in the vocabulary but `smollm` splits digits first.
    assert tokenizer.encode("ab a12<|im_end|>") == [7, 8, 9, 10, 2]


def test_gpt2_pre_tokenizer_keeps_digit_runs(make_tiny_gguf, tmp_path):
    tokenizer = load_tokenizer(make_tiny_gguf(tmp_path / "gpt2.gguf", pre="gpt2").path)
    assert tokenizer.encode("12") == [11]


def test_unknown_pre_tokenizer_is_refused_naming_the_key(make_tiny_gguf, tmp_path):
    path = make_tiny_gguf(tmp_path / "odd.gguf", pre="mystery").path
    with pytest.raises(UnsupportedTokenizer, match=r"key `tokenizer.ggml.pre`: pre-tokenizer 'mystery' is not mapped"):
        load_tokenizer(path)


def test_model_without_template_passes_prompts_through(tiny_gguf):
    tokenizer = load_tokenizer(tiny_gguf.path)
    assert tokenizer.chat_template is None
    assert tokenizer.format_prompt("ab") == "ab"
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "ab"}])


def test_template_raise_exception_becomes_a_typed_error(make_tiny_gguf, tmp_path):
    template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    tokenizer = load_tokenizer(make_tiny_gguf(tmp_path / "t.gguf", chat_template=template).path)
    with pytest.raises(ChatTemplateError, match="system first"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_generation_prompt_is_optional(smollm2_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    without = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert without == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert smollm2_tokenizer.apply_chat_template(messages) == without + "<|im_start|>assistant\n"


def test_missing_tokenizer_source_is_reported(tmp_path):
    with pytest.raises(WeightsFileMissing, match=r"tokenizer\.json: no such tokenizer\.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(WeightsFileMissing, match="absent: no such tokenizer source"):
        load_tokenizer(tmp_path / "absent")
