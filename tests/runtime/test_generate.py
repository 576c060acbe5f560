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


@pytest.mark.slow
def test_a_step_asked_for_some_rows_multiplies_the_lm_head_over_those_rows_alone(
        engine, prompt_ids):
    # Why: a generation reads one row of a prompt chunk's logits; the LM head over every row
    # was a fifth of the chunk's work. The rows asked for must be the rows the full step gives.
    rows = [3, 15, 0]
    engine.add_sequence("all")
    engine.add_sequence("some")
    try:
        full = engine.step(Mode.PREFILL, [("all", prompt_ids[:16])])
        some = engine.step(Mode.PREFILL, [("some", prompt_ids[:16])], logit_rows=rows)
    finally:
        engine.free("all")
        engine.free("some")
    assert some.logits.shape == (3, full.logits.shape[1])
    torch.testing.assert_close(some.logits, full.logits[rows], rtol=0, atol=1e-4)
    assert some.tokens == [full.tokens[r] for r in rows]
    graph = some.program.step.graph
    assert graph.node(some.program.step.logits).shape.dims == (3, 49152)
    assert some.program is not full.program, "a program of its own (the shape names the rows)"


@pytest.mark.slow
def test_a_padded_prompt_chunk_gives_the_last_real_row_not_a_padding_row(engine, prompt_ids):
    # 13 tokens are fed as a 16-row chunk (three padding rows repeat the last token): the
    # token chosen must be the 13th row's, as the unpadded all-row prefill gives it.
    ids = prompt_ids[:13]
    engine.add_sequence("last")
    engine.add_sequence("every")
    try:
        last = prefill(engine, "last", ids, last_only=True)
        every = prefill(engine, "every", ids)
        assert engine.length("last") == engine.length("every") == 13
    finally:
        engine.free("last")
        engine.free("every")
    assert len(last.tokens) == 1 and last.tokens[-1] == every.tokens[-1]
    torch.testing.assert_close(last.logits[-1], every.logits[-1], rtol=0, atol=1e-4)


def test_logit_rows_outside_the_step_are_refused_and_append_nothing(engine, prompt_ids):
    from fuel.runtime.engine import BadStep

    engine.add_sequence("bad")
    try:
        for rows in ([4], [], [-1]):
            with pytest.raises(BadStep, match="logit rows"):
                engine.step(Mode.PREFILL, [("bad", prompt_ids[:4])], logit_rows=rows)
        assert engine.length("bad") == 0
    finally:
        engine.free("bad")


@given(st.integers(1, 256))
def test_a_padded_chunk_wastes_under_half_its_rows_and_prompts_share_nine_programs(rows):
    # Why: padding rows are computed and thrown away (a 41-token prompt padded to 64 rows did
    # 56% more work); each distinct size is one more program to build.
    from fuel.runtime.generate import bucket

    padded = bucket(rows)
    assert rows <= padded <= 256
    assert padded == 16 or padded * 2 < rows * 3, "the padding stays under half the real rows"
    assert len({bucket(n) for n in range(1, 257)}) == 9
