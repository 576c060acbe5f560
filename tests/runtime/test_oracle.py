"""The transformers oracle over fuel's SmolLM2 weights: it answers like the real model, its
cached decode agrees with full forwards, and the Q/K de-permutation is right."""

from __future__ import annotations

import pytest
import torch

from fuel.runtime.gguf_loader import permute_rotary_rows
from fuel.runtime.oracle import Oracle, oracle_for
from fuel.runtime.weights import Weights

# Greedy answer of SmolLM2-Instruct to the chat-templated "What is the capital of France?":
# "The capital of France is Paris." + <|im_end|>, as pinned by a public Kotlin
# `verifyTextGeneration` test (found with the `search` tool, find_string "1, 9690, 198").
FRANCE_ANSWER_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]


def test_top_logit_of_a_factual_prompt_is_paris(smollm2_oracle, smollm2_tokenizer):
    logits = smollm2_oracle.logits(smollm2_tokenizer.encode("The capital of France is"))
    assert smollm2_tokenizer.decode([int(logits[-1].argmax())]) == " Paris"


def test_greedy_chat_answer_matches_the_published_one(smollm2_oracle, smollm2_tokenizer):
    prompt = smollm2_tokenizer.encode(smollm2_tokenizer.format_prompt("What is the capital of France?"))
    answer = smollm2_oracle.greedy(prompt, 32, stop=[smollm2_tokenizer.eos_id])
    assert answer == FRANCE_ANSWER_IDS
    assert smollm2_tokenizer.decode(answer, skip_special_tokens=True) == "The capital of France is Paris."


def test_32_greedy_tokens_decode_to_text(smollm2_oracle, smollm2_tokenizer):
    prompt = smollm2_tokenizer.encode(smollm2_tokenizer.format_prompt("Write a sentence about the sea."))
    tokens = smollm2_oracle.greedy(prompt, 32)
    assert len(tokens) == 32
    text = smollm2_tokenizer.decode(tokens, skip_special_tokens=True)
    assert len(text.split()) >= 5


def test_cached_decode_logits_match_full_forwards(smollm2_oracle, smollm2_tokenizer):
    prompt = smollm2_tokenizer.encode("Once upon a time, there was")
    continuation = smollm2_oracle.greedy(prompt, 8)
    steps = smollm2_oracle.step_logits(prompt, continuation)
    full = smollm2_oracle.logits(prompt + continuation)[len(prompt) - 1 :]
    assert len(steps) == 9
    assert max(float((step - row).abs().max()) for step, row in zip(steps, full)) <= 1e-3


def test_oracle_is_built_once_per_weights(smollm2_weights, smollm2_oracle):
    assert oracle_for(smollm2_weights) is smollm2_oracle
    model = smollm2_oracle.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.layers[3].self_attn.k_proj.weight, smollm2_weights["model.layers.3.self_attn.k_proj.weight"])


def _mean_next_token_loss(oracle: Oracle, ids: list[int]) -> float:
    logits = oracle.logits(ids)
    return float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])))


def test_llama_cpp_row_order_would_break_the_model(smollm2_weights, smollm2_oracle, smollm2_tokenizer):
    """Why the unpermute exists: with Q/K rows left in llama.cpp's order the model is far worse."""
    config = smollm2_weights.config
    permuted = dict(smollm2_weights.tensors)
    for i in range(config["num_hidden_layers"]):
        for proj, heads in (("q_proj", config["num_attention_heads"]), ("k_proj", config["num_key_value_heads"])):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            permuted[name] = torch.from_numpy(permute_rotary_rows(permuted[name].numpy(), heads))
    wrong = Oracle(Weights(permuted, config, smollm2_weights.source, smollm2_weights.dtype, smollm2_weights.aliases))
    ids = smollm2_tokenizer.encode(
        "The quick brown fox jumps over the lazy dog. Paris is the capital and largest city of France, "
        "and London is the capital of the United Kingdom."
    )
    right_loss = _mean_next_token_loss(smollm2_oracle, ids)
    wrong_loss = _mean_next_token_loss(wrong, ids)
    assert right_loss < 3.0
    assert wrong_loss > right_loss + 0.5  # measured: 2.61 vs 3.76 nats


@pytest.mark.slow
def test_transformers_gguf_loader_yields_the_same_tensors(smollm2_weights):
    """transformers' own GGUF path (its name map and reverse permutation) agrees bit for bit.
    Costs about 15 s on two cores (it dequantizes the whole file again)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = {k: v for k, v in smollm2_weights.config.items() if k != "torch_dtype"}
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(**config))
    theirs = load_gguf_checkpoint(str(smollm2_weights.source.path), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert sorted(theirs) == sorted(smollm2_weights.tensors)
    for name, tensor in theirs.items():
        assert torch.equal(torch.as_tensor(tensor, dtype=torch.float32), smollm2_weights[name]), name
