"""Greedy generation on the real SmolLM2-135M against transformers' LlamaForCausalLM on the same
weights (f32): prefill logits, 8 decode steps, and 32 greedy tokens. Also the prefill chunking."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from fuel.circuit import Mode
from fuel.runtime.engine import ContextTooLong, Engine
from fuel.runtime.generate import chunks, generate, prefill

TOLERANCE = 1e-3
PROMPT = "Write one sentence about the sea."


@given(st.integers(1, 5000), st.integers(1, 512))
def test_chunks_cover_the_prompt_with_at_most_two_program_sizes(length, largest):
    # Why: every chunk size is a prefill program to build; a prompt must need at most two.
    parts = chunks(length, largest)
    assert sum(parts) == length
    assert all(p == largest for p in parts[:-1]) and 1 <= parts[-1] <= largest
    assert len(set(parts)) <= 2
    assert len(parts) == -(-length // largest)


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    torch.set_num_threads(2)
    return smollm2_engine  # the session's: its programs are shared with the other modules


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer):
    return smollm2_tokenizer.encode(smollm2_tokenizer.format_prompt(PROMPT))


@pytest.mark.slow
def test_prefill_and_8_decode_steps_match_transformers(engine, smollm2_oracle, prompt_ids):
    continuation = smollm2_oracle.greedy(prompt_ids, 8)
    reference = smollm2_oracle.step_logits(prompt_ids, continuation)
    engine.add_sequence("numerics")
    try:
        first = prefill(engine, "numerics", prompt_ids)
        ours = [first.logits[-1]]
        for token in continuation:
            ours.append(engine.step(Mode.DECODE, [("numerics", [token])]).logits[-1])
    finally:
        engine.free("numerics")
    diffs = [float((a - b).abs().max()) for a, b in zip(ours, reference)]
    print(f"prefill + 8 decode steps: max abs logit diff {max(diffs):.3g} (per step {diffs})")
    assert len(diffs) == 9
    assert max(diffs) <= TOLERANCE


@pytest.mark.slow
def test_prefill_logits_of_every_row_match_transformers(engine, smollm2_oracle, prompt_ids):
    engine.add_sequence("rows")
    try:
        result = engine.step(Mode.PREFILL, [("rows", prompt_ids[:16])])
    finally:
        engine.free("rows")
    diff = float((result.logits - smollm2_oracle.logits(prompt_ids[:16])).abs().max())
    print(f"prefill of 16 rows: max abs logit diff {diff:.3g}")
    assert diff <= TOLERANCE


@pytest.mark.slow
def test_32_greedy_tokens_equal_transformers(engine, smollm2_oracle, prompt_ids):
    ours = generate(engine, prompt_ids, 32).tokens
    assert ours == smollm2_oracle.greedy(prompt_ids, 32)
    assert len(ours) == 32


@pytest.mark.slow
def test_generation_stops_after_a_stop_token(engine, prompt_ids, smollm2_oracle):
    reference = smollm2_oracle.greedy(prompt_ids, 32)
    stop = reference[5]
    ours = generate(engine, prompt_ids, 32, stop=[stop]).tokens
    assert ours == reference[:reference.index(stop) + 1]


@pytest.mark.slow
def test_prompt_longer_than_the_cache_is_refused_and_leaves_no_sequence(smollm2_weights):
    small = Engine(smollm2_weights, max_context=32)
    with pytest.raises(ContextTooLong, match="needs 48 positions.*at most 32"):
        generate(small, list(range(40)), 8)
    assert small.tables[next(iter(small.tables))].sequences() == []
