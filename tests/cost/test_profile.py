"""The profiler: warm-up, calibrated batches, median and spread — checked with a fake clock."""

import itertools

import pytest

from fuel.cost import profile_kernel


def fake_clock(durations):
    """A clock where each kernel call advances time by the next duration."""
    state = {"now": 0}
    calls = itertools.cycle(durations)

    def call():
        state["now"] += next(calls)

    return call, lambda: state["now"]


def test_warmup_calls_are_not_timed_and_the_median_is_per_call():
    seen = []
    call, clock = fake_clock([1000])
    measured = profile_kernel(lambda: (seen.append(1), call()), warmup=4, repeats=5, min_sample_ns=1, clock=clock)
    assert measured.median_ns == 1000
    assert measured.samples == 5
    assert measured.spread_ns == 0
    assert len(seen) == 4 + 1 + 5  # warm-up, one calibration call, five samples


def test_short_calls_are_batched_until_a_sample_spans_the_minimum():
    call, clock = fake_clock([10])
    measured = profile_kernel(call, warmup=0, repeats=3, min_sample_ns=1000, clock=clock)
    assert measured.calls_per_sample == 128  # first power of two with 10 * calls >= 1000
    assert measured.median_ns == 10


def test_spread_is_the_interquartile_range_of_samples():
    durations = [100, 100, 200, 300, 1000]  # one call per sample
    call, clock = fake_clock([100] + durations)  # the first feeds calibration
    measured = profile_kernel(call, warmup=0, repeats=5, min_sample_ns=1, clock=clock)
    assert measured.median_ns == 200
    assert measured.spread_ns == 300 - 100


def test_a_latency_is_never_zero():
    call, clock = fake_clock([0])
    assert profile_kernel(call, warmup=0, repeats=3, min_sample_ns=0, max_calls_per_sample=4, clock=clock).median_ns == 1


def test_repeats_must_be_positive():
    with pytest.raises(ValueError):
        profile_kernel(lambda: None, repeats=0)


def test_a_slow_kernel_under_a_budget_is_sampled_three_times_after_one_warmup():
    seen = []
    call, clock = fake_clock([100_000_000])  # 100 ms a call
    measured = profile_kernel(lambda: (seen.append(1), call()), warmup=2, repeats=9,
                              min_sample_ns=1, budget_ns=300_000_000, clock=clock)
    assert measured.samples == 3 and measured.median_ns == 100_000_000
    assert len(seen) == 1 + 1 + 3  # one warm-up (the second skipped), calibration, 3 samples


def test_a_fast_kernel_under_a_budget_keeps_every_sample():
    call, clock = fake_clock([1000])
    measured = profile_kernel(call, warmup=2, repeats=9, min_sample_ns=1,
                              budget_ns=300_000_000, clock=clock)
    assert measured.samples == 9


def test_a_call_past_the_ceiling_is_measured_once_not_sampled():
    seen = []
    # the first call pays a conversion; the next two are both past the ceiling
    call, clock = fake_clock([50_000_000, 40_000_000, 45_000_000])
    measured = profile_kernel(lambda: (seen.append(1), call()), warmup=2, repeats=9,
                              min_sample_ns=1, ceiling_ns=1_000_000, clock=clock)
    assert (measured.samples, measured.median_ns, measured.spread_ns) == (1, 40_000_000, 0)
    assert len(seen) == 3  # the first call untimed, the faster of the next two the measurement


def test_one_call_caught_by_a_time_slice_does_not_lose_the_race():
    # Why: noise only adds time. A call another process's time slice caught (4 ms of a 1 us
    # kernel) once recorded the kernel as slower than its recipe and cost a decode step its
    # native step list; a second call decides.
    seen = []
    call, clock = fake_clock([1000, 4_000_000, 1000])
    measured = profile_kernel(lambda: (seen.append(1), call()), warmup=2, repeats=9,
                              min_sample_ns=1, ceiling_ns=1_000_000, clock=clock)
    assert measured.samples == 9 and measured.median_ns == 1000


def test_a_call_under_the_ceiling_is_sampled_as_usual():
    seen = []
    call, clock = fake_clock([1000])
    measured = profile_kernel(lambda: (seen.append(1), call()), warmup=2, repeats=9,
                              min_sample_ns=1, ceiling_ns=1_000_000, clock=clock)
    assert measured.samples == 9 and measured.median_ns == 1000
    assert len(seen) == 2 + 1 + 9  # the two racing calls stand for the warm-up


def test_a_pair_is_sampled_interleaved_so_interference_lands_on_both_sides():
    from fuel.cost import profile_pair

    order, state = [], {"now": 0, "samples": 0}

    def side(name, ns):
        def call():
            order.append(name)
            state["now"] += ns
        return call

    a, b = side("a", 1000), side("b", 3000)

    def clock():
        return state["now"]

    first, second = profile_pair(a, b, warmup=1, repeats=4, min_sample_ns=1, clock=clock)
    # warm-up and one calibration call each, then the rounds: a b, b a, a b, b a
    assert order == ["a", "a", "b", "b", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert (first.median_ns, second.median_ns) == (1000, 3000)
    assert first.samples == second.samples == 4


def test_a_burst_of_interference_does_not_make_one_side_of_a_pair_look_slower():
    from fuel.cost import profile_pair

    state = {"now": 0, "call": 0}
    burst = set(range(8, 14))  # calls 8..13: another process holds the core

    def side(ns):
        def call():
            state["call"] += 1
            state["now"] += ns * (50 if state["call"] in burst else 1)
        return call

    first, second = profile_pair(side(1000), side(1000), warmup=1, repeats=9, min_sample_ns=1,
                                 clock=lambda: state["now"])
    assert first.median_ns == second.median_ns == 1000  # the burst is in both sides' tails


def test_cells_are_sampled_in_rounds_each_within_its_own_budget():
    from fuel.cost import profile_cells

    order, state = [], {"now": 0}

    def cell(name, ns):
        def call():
            order.append(name)
            state["now"] += ns
        return call

    fast, slow = cell("f", 1000), cell("s", 100_000_000)  # 0.1 s a call: 3 samples in budget
    measured = profile_cells([fast, slow], warmup=1, repeats=5, min_sample_ns=1,
                             budget_ns=300_000_000, clock=lambda: state["now"])
    assert [m.samples for m in measured] == [5, 3]
    assert [m.median_ns for m in measured] == [1000, 100_000_000]
    rounds = order[4:]  # after one warm-up and one calibration call each
    assert rounds == ["f", "s", "s", "f", "f", "s", "f", "f"]


def test_a_cell_its_race_retires_after_calibration_is_recorded_from_that_call_alone():
    # Why: a recipe arm 40x its kernel (a dequantize-then-matmul LM head: 44 ms against 1 ms)
    # was sampled like any cell and took most of a cold first token's measuring; its first
    # timed call already says it lost.
    from fuel.cost import profile_cells

    order, state, told = [], {"now": 0}, []

    def cell(name, ns):
        def call():
            order.append(name)
            state["now"] += ns
        return call

    def retire(alone):
        told.append(list(alone))
        return [i for i, ns in enumerate(alone) if ns > 4 * min(alone)]

    measured = profile_cells([cell("k", 1_000_000), cell("r", 44_000_000)], warmup=1, repeats=5,
                             min_sample_ns=1, retire=retire, clock=lambda: state["now"])
    # each call's calibration batch, per call; then again with the named one's second batch
    assert told == [[1_000_000, 44_000_000]] * 2
    assert (measured[1].samples, measured[1].median_ns, measured[1].spread_ns) == (1, 44_000_000, 0)
    assert (measured[0].samples, measured[0].median_ns) == (5, 1_000_000)
    assert order.count("r") == 3 and order.count("k") == 7  # warm-up, calibration, confirmation


def test_a_kernel_whose_calibration_a_time_slice_caught_is_sampled_not_retired():
    # Why: noise only adds time; one batch another process's time slice caught must not retire
    # the faster arm (a retired kernel once lost its branch to the recipe and forfeited a
    # decode step's native step list: 126 -> 1,088 calls a step).
    from fuel.cost import profile_cells

    state, spikes = {"now": 0}, {"k": [None, 20_000_000]}  # the kernel's calibration call

    def cell(name, ns):
        calls = {"n": 0}

        def call():
            calls["n"] += 1
            extra = spikes.get(name, [])
            state["now"] += ns + (extra[calls["n"] - 1] or 0 if calls["n"] <= len(extra) else 0)
        return call

    race = lambda alone: [i for i, ns in enumerate(alone) if ns > 4 * min(alone)]  # noqa: E731
    measured = profile_cells([cell("k", 1_000_000), cell("r", 3_000_000)], warmup=1, repeats=5,
                             min_sample_ns=1, retire=race, clock=lambda: state["now"])
    assert [m.samples for m in measured] == [5, 5]
    assert measured[0].median_ns == 1_000_000


def test_a_pair_retires_only_a_reference_past_the_margin():
    from fuel.cost.profile import RACE_MARGIN, profile_pair, race_pair

    assert race_pair([1000.0, RACE_MARGIN * 1000.0 + 1]) == [1]
    # the call seen slow is sampled in full (a time slice may have caught it): never retired
    assert race_pair([RACE_MARGIN * 1000.0 + 1, 1000.0]) == []
    assert race_pair([1000.0, RACE_MARGIN * 1000.0]) == []  # within the margin: both sampled
    state = {"now": 0}

    def side(ns):
        def call():
            state["now"] += ns
        return call

    kernel, recipe = profile_pair(side(1_000_000), side(40_000_000), warmup=1, repeats=5,
                                  min_sample_ns=1, retire=race_pair, clock=lambda: state["now"])
    assert (kernel.samples, recipe.samples, recipe.median_ns) == (5, 1, 40_000_000)
