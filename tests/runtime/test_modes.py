"""Every mode on the real SmolLM2-135M against transformers (f32, same weights): multi_seq over
3 prompts, verify (one sequence, k rows), verify_batch (a row table with two runs), and the
draft section's own KV state. Plus the engine's step bookkeeping."""

from __future__ import annotations

import pytest
import torch

from fuel.circuit import Mode
from fuel.circuit.ir import Section
from fuel.runtime.engine import BadStep, Engine, runs_of
from fuel.runtime.generate import generate_batch, prefill

TOLERANCE = 1e-3
PROMPTS = ["What is 2 + 2?", "Name a red fruit.", "Say hello in French."]


def test_runs_of_groups_adjacent_equal_lengths():
    assert runs_of([3, 3, 2]) == ((3, 2), (2, 1))
    assert runs_of([1, 1, 1]) == ((1, 3),)
    assert runs_of([2, 3, 2]) == ((2, 1), (3, 1), (2, 1))


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    torch.set_num_threads(2)
    return smollm2_engine  # the session's: its programs are shared with the other modules


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return [smollm2_tokenizer.encode(smollm2_tokenizer.format_prompt(p)) for p in PROMPTS]


def _max_diff(ours, reference) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(ours, reference, strict=True))


@pytest.mark.slow
def test_multi_seq_logits_match_transformers_for_3_prompts(engine, smollm2_oracle, prompts):
    continuations = [smollm2_oracle.greedy(p, 8) for p in prompts]
    names = [f"m{i}" for i in range(3)]
    ours: list[list[torch.Tensor]] = [[], [], []]
    try:
        for name, prompt, rows in zip(names, prompts, ours):
            engine.add_sequence(name)
            rows.append(prefill(engine, name, prompt).logits[-1])
        for step in range(8):
            result = engine.step(Mode.MULTI_SEQ, [(n, [c[step]]) for n, c in zip(names, continuations)])
            assert result.logits.shape[0] == 3
            for i in range(3):
                ours[i].append(result.logits[i])
    finally:
        for name in names:
            engine.free(name)
    diffs = [_max_diff(o, smollm2_oracle.step_logits(p, c)) for o, p, c in zip(ours, prompts, continuations)]
    print(f"multi_seq (3 prompts, prefill + 8 steps): max abs logit diff {max(diffs):.3g}")
    assert max(diffs) <= TOLERANCE


@pytest.mark.slow
def test_multi_seq_greedy_tokens_equal_transformers(engine, smollm2_oracle, prompts):
    outs = generate_batch(engine, prompts, 32)
    assert [o.tokens for o in outs] == [smollm2_oracle.greedy(p, 32) for p in prompts]
    assert engine.stats.steps["multi_seq"] >= 31


@pytest.mark.slow
def test_verify_rows_match_transformers(engine, smollm2_oracle, prompts):
    prompt = prompts[0]
    checked = smollm2_oracle.greedy(prompt, 4)
    engine.add_sequence("v")
    try:
        prefill(engine, "v", prompt[:-1])
        result = engine.step(Mode.VERIFY, [("v", [prompt[-1], *checked])])
    finally:
        engine.free("v")
    reference = smollm2_oracle.logits(prompt + checked)[-5:]
    diff = float((result.logits - reference).abs().max())
    print(f"verify (k=5 rows): max abs logit diff {diff:.3g}")
    assert result.logits.shape[0] == 5
    assert diff <= TOLERANCE
    assert result.tokens == [int(t) for t in reference.argmax(-1)]


@pytest.mark.slow
def test_verify_batch_with_two_runs_matches_transformers(engine, smollm2_oracle, prompts):
    names = ["b0", "b1", "b2"]
    fed = []
    try:
        for name, prompt, k in zip(names, prompts, (3, 3, 2)):
            engine.add_sequence(name)
            prefill(engine, name, prompt[:-1])
            fed.append((name, [prompt[-1], *smollm2_oracle.greedy(prompt, k - 1)]))
        result = engine.step(Mode.VERIFY_BATCH, fed)
    finally:
        for name in names:
            engine.free(name)
    assert result.program.step.plan.table.text() == "3x2 2x1!"
    first, diffs = 0, []
    for (name, rows), prompt in zip(fed, prompts):
        reference = smollm2_oracle.logits(prompt[:-1] + rows)[-len(rows):]
        diffs.append(float((result.logits[first:first + len(rows)] - reference).abs().max()))
        first += len(rows)
    print(f"verify_batch `3x2 2x1!`: max abs logit diff {max(diffs):.3g}")
    assert max(diffs) <= TOLERANCE


@pytest.mark.slow
def test_draft_steps_use_their_own_tables_and_leave_main_untouched(engine, prompts):
    engine.add_sequence("d")
    try:
        prefill(engine, "d", prompts[0])
        main_blocks = engine.tables[Section.MAIN].blocks("d")
        result = engine.step(Mode.DRAFT, [("d", prompts[0][:4])])
        assert engine.length("d", Section.DRAFT) == 4
        assert engine.length("d") == len(prompts[0])
        assert engine.tables[Section.MAIN].blocks("d") == main_blocks
        assert result.program.step.plan.mode is Mode.DRAFT
        assert len(result.tokens) == 4
    finally:
        engine.free("d")
    assert "d" not in engine.tables[Section.DRAFT]


@pytest.mark.slow
def test_programs_are_built_once_per_plan_and_geometry(engine, prompts):
    engine.add_sequence("p")
    try:
        prefill(engine, "p", prompts[0])
        before = len(engine.programs())
        token = engine.step(Mode.DECODE, [("p", [1])]).tokens[-1]
        engine.step(Mode.DECODE, [("p", [token])])
        after_two = len(engine.programs())
        engine.step(Mode.DECODE, [("p", [token])])
        assert len(engine.programs()) == after_two <= before + 1
    finally:
        engine.free("p")


def test_a_decode_step_with_two_rows_is_refused_before_touching_tables(smollm2_weights):
    engine = Engine(smollm2_weights, max_context=64)
    engine.add_sequence("x")
    with pytest.raises(BadStep, match="one row per sequence"):
        engine.step(Mode.DECODE, [("x", [1, 2])])
    assert engine.length("x") == 0
