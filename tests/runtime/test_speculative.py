"""Speculative decoding: greedy acceptance, the drafters, and — on the real SmolLM2-135M — that
speculative output equals plain greedy output on 5 prompts with the acceptance rate reported."""

from __future__ import annotations

import pytest
import torch

from fuel.circuit.ir import Section
from fuel.runtime.generate import generate
from fuel.runtime.speculative import (
    EarlyExitDrafter, PromptLookupDrafter, accept, speculative_generate, speculative_generate_batch,
)

PROMPTS = [
    "What is the capital of France?",
    "Count from one to ten.",
    "Write a haiku about autumn.",
    "Repeat after me: the cat sat on the mat, the cat sat on the mat.",
    "Explain what a CPU does in one sentence.",
]


def test_accept_keeps_the_agreeing_prefix():
    assert accept([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accept([5, 6, 7], [4, 6, 7, 1]) == 0
    assert accept([5, 6, 7], [5, 6, 7, 1]) == 3
    assert accept([], [3]) == 0


def test_prompt_lookup_copies_what_followed_the_latest_match():
    drafter = PromptLookupDrafter(max_ngram=2)
    context = [1, 2, 3, 4, 9, 1, 2, 3, 7, 1, 2]
    # "1 2" last occurred at index 5 and was followed by 3, 7.
    assert drafter.propose(None, "s", context, 2) == [3, 7]
    assert drafter.propose(None, "s", [1, 2, 3], 4) == []


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    torch.set_num_threads(2)
    return smollm2_engine  # the session's: its programs are shared with the other modules


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return [smollm2_tokenizer.encode(smollm2_tokenizer.format_prompt(p)) for p in PROMPTS]


@pytest.fixture(scope="module")
def plain(engine, prompts):
    return [generate(engine, p, 24).tokens for p in prompts]


@pytest.mark.slow
def test_early_exit_speculation_equals_plain_greedy_on_5_prompts(engine, prompts, plain):
    outs = [speculative_generate(engine, p, 24, 3, drafter=EarlyExitDrafter()) for p in prompts]
    proposed = sum(o.speculation.proposed for o in outs)
    accepted = sum(o.speculation.accepted for o in outs)
    print(f"early-exit draft, k=3: acceptance {accepted}/{proposed} = {accepted / proposed:.1%}")
    assert [o.tokens for o in outs] == plain
    assert proposed > 0 and 0 <= accepted <= proposed
    assert engine.tables[Section.DRAFT].sequences() == []


@pytest.mark.slow
def test_prompt_lookup_speculation_equals_plain_greedy_on_5_prompts(engine, prompts, plain):
    outs = [speculative_generate(engine, p, 24, 4, drafter=PromptLookupDrafter()) for p in prompts]
    proposed = sum(o.speculation.proposed for o in outs)
    accepted = sum(o.speculation.accepted for o in outs)
    print(f"prompt lookup, k=4: acceptance {accepted}/{proposed} = {accepted / max(proposed, 1):.1%}")
    assert [o.tokens for o in outs] == plain
    # Fewer main-model steps than tokens whenever a draft was accepted.
    assert sum(o.speculation.rounds for o in outs) == sum(len(t) - 1 for t in plain) - accepted


@pytest.mark.slow
def test_batched_speculation_verifies_with_verify_batch_and_equals_plain(engine, prompts, plain):
    before = engine.stats.steps["verify_batch"]
    outs = speculative_generate_batch(engine, prompts[:3], 24, 2, drafter=PromptLookupDrafter())
    assert [o.tokens for o in outs] == plain[:3]
    assert engine.stats.steps["verify_batch"] > before
    assert engine.tables[Section.MAIN].sequences() == []


@pytest.mark.slow
def test_prompt_lookup_accepts_drafts_on_a_repetitive_prompt(engine, smollm2_tokenizer):
    # Why: "0 <= accepted" passes a drafter that never helps. On a prompt that repeats one
    # sentence, greedy decoding continues the repetition, so the n-gram drafter's copies of
    # what followed must be accepted.
    prompt = smollm2_tokenizer.encode("one two three four five six seven eight. " * 6)
    plain_tokens = generate(engine, prompt, 16).tokens
    out = speculative_generate(engine, prompt, 16, 4, drafter=PromptLookupDrafter())
    assert out.tokens == plain_tokens
    assert out.speculation.proposed > 0
    assert out.speculation.accepted > 0
    assert out.speculation.rounds < len(plain_tokens) - 1
