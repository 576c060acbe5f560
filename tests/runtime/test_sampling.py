"""Sampling: the filters and penalties on small vocabularies, seeded reproducibility, stop
strings, and — statistically, with fixed seeds so the outcome is deterministic — that
rejection-sampled speculative output is distributed exactly as the target model's."""

from __future__ import annotations

import math

import pytest
import torch

from fuel.runtime.sampling import (
    InvalidSampling, SamplerState, SamplingParams, StopMatcher, distributions, draw, sample,
    speculative_accept, speculative_sample,
)

V = 6


def state(**params) -> SamplerState:
    return SamplerState(SamplingParams(**params), V)


def test_temperature_zero_is_the_argmax_with_no_draw():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    states = [state(temperature=0.0) for _ in range(4)]
    before = [s.generator.get_state().clone() for s in states]
    assert sample(logits, states).tokens == logits.argmax(-1).tolist()
    assert all(torch.equal(b, s.generator.get_state()) for b, s in zip(before, states))


def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    probs = distributions(logits, [state(top_k=2)])
    assert (probs[0, 2:] == 0).all() and probs[0, :2].sum().item() == pytest.approx(1.0)
    assert probs[0, 0] / probs[0, 1] == pytest.approx(math.e, rel=1e-5)


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    probs_in = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04, 0.0]]).clamp(min=1e-12)
    probs = distributions(probs_in.log(), [state(top_p=0.75)])
    assert probs[0].nonzero().flatten().tolist() == [0, 1]
    assert probs[0, 0].item() == pytest.approx(0.5 / 0.8, rel=1e-5)


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    probs_in = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04, 1e-9]])
    probs = distributions(probs_in.log(), [state(min_p=0.15)])
    assert probs[0].nonzero().flatten().tolist() == [0, 1, 2]


def test_filters_always_keep_the_most_likely_token():
    logits = torch.tensor([[0.0, 9.0, 1.0, 2.0, 3.0, 4.0]])
    probs = distributions(logits, [state(top_p=1e-9, min_p=1.0, top_k=1)])
    assert probs[0].tolist() == [0, 1, 0, 0, 0, 0]


def test_frequency_and_presence_penalties_lower_repeated_tokens():
    s = state(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5)
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0, 0.0, 0.0]])
    assert sample(logits, [s]).tokens == [0]
    s.commit([0])  # 3 - 1 - 0.5 = 1.5 < 2
    assert sample(logits, [s]).tokens == [1]


def test_seeded_requests_reproduce_and_do_not_depend_on_their_neighbours():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))

    def run(seeds, steps=20):
        states = [state(seed=seed, temperature=1.0) for seed in seeds]
        return [sample(logits[:len(seeds)], states).tokens for _ in range(steps)]

    alone = [row[0] for row in run([7])]
    together = [row[0] for row in run([7, 8, 9])]
    assert alone == together
    assert run([7, 8]) == run([7, 8])
    assert [row[0] for row in run([11])] != alone


def test_draw_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]]).expand(1000, V)
    tokens = draw(probs, torch.rand(1000, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    assert set(tokens.tolist()) == {1, 3}


def test_logprobs_are_the_models_and_list_the_top_n():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -2.0, -3.0]])
    out = sample(logits, [state(temperature=0.0, logprobs=2)]).logprobs[0]
    logp = torch.log_softmax(logits[0], -1)
    assert out.token == 0 and out.logprob == pytest.approx(logp[0].item())
    assert [t for t, _ in out.top] == [0, 1] and out.top[1][1] == pytest.approx(logp[1].item())


@pytest.mark.parametrize("params", [dict(temperature=3.0), dict(top_p=0.0), dict(min_p=1.5),
                                    dict(top_k=-2), dict(presence_penalty=2.5),
                                    dict(max_tokens=0), dict(logprobs=21), dict(stop=("",)),
                                    dict(temperature=float("nan"))])
def test_out_of_range_parameters_are_refused_naming_the_field(params):
    with pytest.raises(InvalidSampling) as caught:
        SamplingParams(**params)
    assert next(iter(params)) in str(caught.value)


def test_stop_matcher_holds_back_a_possible_stop_prefix_and_hides_the_stop():
    matcher = StopMatcher(["END", "\n\n"])
    assert matcher.visible("hello EN") == (6, False)
    assert matcher.visible("hello E") == (6, False)
    assert matcher.visible("hello ENDING") == (6, True)
    assert matcher.visible("a\n") == (1, False)
    assert matcher.visible("abc") == (3, False)


# -- rejection sampling: the output distribution is the target's ------------------------------

TARGET = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
                       [0.05, 0.05, 0.50, 0.10, 0.10, 0.20]], dtype=torch.float64)
DRAFT = torch.tensor([[0.10, 0.10, 0.10, 0.10, 0.10, 0.50],
                      [0.30, 0.10, 0.10, 0.30, 0.10, 0.10]], dtype=torch.float64)
TRIALS = 6_000


def joint_of_first_two(draft_probs_for, generator) -> torch.Tensor:
    """Empirical joint distribution of the first two emitted tokens, with context-independent
    targets ``TARGET[0]`` then ``TARGET[1]`` (a round that emits one token is followed by a
    plain draw from ``TARGET[1]``, as the next round would do)."""
    counts = torch.zeros(V, V, dtype=torch.float64)
    target = torch.cat([TARGET, TARGET[1:]])  # k = 2 drafts: positions 0, 1 and the bonus row
    uniforms = torch.rand(TRIALS, 4, generator=generator, dtype=torch.float64)
    for trial in range(TRIALS):
        drafts, q = draft_probs_for(generator)
        out = speculative_accept(target, drafts, uniforms[trial, :2], uniforms[trial, 2:3], q)
        if len(out) < 2:
            out.append(int(draw(TARGET[1:2], uniforms[trial, 3:4])[0]))
        counts[out[0], out[1]] += 1
    return counts / TRIALS


def assert_matches_target(empirical: torch.Tensor) -> None:
    expected = torch.outer(TARGET[0], TARGET[1])
    total_variation = 0.5 * (empirical - expected).abs().sum().item()
    chi_square = (TRIALS * (empirical - expected) ** 2 / expected).sum().item()
    # 35 degrees of freedom: the 0.999 quantile is 66.6; the expected TV of a correct sampler
    # at 6k draws over these 36 cells is about 0.03.
    assert chi_square < 66.6, chi_square
    assert total_variation < 0.06, total_variation


def test_rejection_sampling_with_a_sampled_draft_reproduces_the_target_distribution():
    proposals = draw(DRAFT.repeat(TRIALS, 1),
                     torch.rand(2 * TRIALS, generator=torch.Generator().manual_seed(9), dtype=torch.float64))
    proposals = iter(proposals.reshape(TRIALS, 2).tolist())

    def drafter(generator):
        return next(proposals), DRAFT

    assert_matches_target(joint_of_first_two(drafter, torch.Generator().manual_seed(0)))


def test_rejection_sampling_with_a_point_mass_draft_reproduces_the_target_distribution():
    # A greedy drafter always proposes its argmax (token 5, then 0): q is a point mass.
    assert_matches_target(joint_of_first_two(lambda g: ([5, 0], None), torch.Generator().manual_seed(1)))


def test_a_wrong_acceptance_rule_fails_the_same_statistical_check():
    # Keeping every draft (no rejection) is the draft's distribution, not the target's.
    def greedy_keep(generator):
        return [5, 0], None

    generator = torch.Generator().manual_seed(2)
    counts = torch.zeros(V, V, dtype=torch.float64)
    for _ in range(2000):
        drafts, _ = greedy_keep(generator)
        counts[drafts[0], drafts[1]] += 1
    with pytest.raises(AssertionError):
        assert_matches_target(counts / 2000)


def test_greedy_speculative_rows_keep_exactly_the_argmax_prefix():
    logits = torch.tensor([[0.0, 5.0, 0, 0, 0, 0], [0, 0, 5.0, 0, 0, 0], [0, 0, 0, 5.0, 0, 0]])
    tokens, _ = speculative_sample(logits, state(temperature=0.0), [1, 4])
    assert tokens == [1, 2]
    tokens, _ = speculative_sample(logits, state(temperature=0.0), [1, 2])
    assert tokens == [1, 2, 3]
