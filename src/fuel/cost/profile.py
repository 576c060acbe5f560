"""The Judge's profiler: time one kernel call the same way every time.

Decided here: how a latency is measured. Warm up (first calls pay allocation, JIT and cache
misses), calibrate a batch size so one timed sample lasts at least ``min_sample_ns`` (the clock's
resolution and the loop's own cost then vanish), take ``repeats`` samples, and keep the median
per-call time and the spread (the inter-quartile range) of the samples.

With a ``budget_ns``, a slow kernel is sampled fewer times: warm-up stops after one call that
already spends a tenth of the budget, and the samples are capped so they fit the budget, never
below :data:`MIN_SAMPLES` (a 140 ms dequantize-then-matmul arm is timed 3 times, not 9: a
program build measures every arm, and the arms it compares differ by far more than the spread
of three samples).

Invariants: a :class:`Measurement` has ``median_ns >= 1`` (a kernel that ran took time; 0 is
never a latency), ``spread_ns >= 0``, and ``samples == repeats`` (or, under a budget, between
:data:`MIN_SAMPLES` and ``repeats``; or 1, spread 0, for a call a race retired: it lost to a
rival by more than :data:`RACE_MARGIN`, which no sampling could change). This module reads the clock: it
is an edge, never called from the planning core.

Why not ``torch.utils.benchmark.Timer``: its ``blocked_autorange`` grows blocks tenfold until the
timer's overhead is 1e-4 of a block (10,000 calls of a 1 us kernel per block), so at this
profiler's budget (15 samples of 200 us, about 10 ms for a 1 us kernel) it returns ONE sample
and no spread; it needs ``min_run_time=0.2`` (24 times longer, measured on a 1x576 add) for a
dozen samples, and ``adaptive_autorange`` ran 10.8 s on the same kernel. Programs run the
profiler for every Judge arm while they build, so either would slow builds by that factor. It
also takes no injectable clock (the tests' fake clock) and pins torch to one thread unless told.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable


MIN_SAMPLES = 3
"""The fewest samples a budgeted measurement takes (a median and a spread need three)."""

RACE_MARGIN = 4
"""How many times a rival's time a call may take before it is recorded from one call alone
(well past any sampling noise: a kernel that slow cannot win): the races of
``fuel.optimize.judge_arms`` and of the JIT's adoption gate (:func:`race_pair`)."""


def race_pair(alone: list[float]) -> list[int]:
    """``profile_cells``' ``retire`` for a call and the reference it must beat
    (:func:`profile_pair`'s first and second): the reference, when it already takes more than
    :data:`RACE_MARGIN` times the call. Never the call: noise only adds time, so a call seen
    slow may be a fast one caught by another process's time slice, and it is sampled in full;
    a reference seen slow is confirmed (:func:`profile_cells`) and can only lose by more."""
    first, second = alone
    return [1] if second > RACE_MARGIN * first else []


@dataclass(frozen=True, slots=True)
class Measurement:
    """A profiled latency: the median per-call ns, the IQR of the samples, how many samples."""

    median_ns: int
    spread_ns: int
    samples: int
    calls_per_sample: int


def _quantile(sorted_values: list[float], q: float) -> float:
    if len(sorted_values) == 1:
        return sorted_values[0]
    position = q * (len(sorted_values) - 1)
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def profile_kernel(
    call: Callable[[], object],
    *,
    warmup: int = 3,
    repeats: int = 15,
    min_sample_ns: int = 200_000,
    max_calls_per_sample: int = 10_000,
    budget_ns: int | None = None,
    ceiling_ns: int | None = None,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> Measurement:
    """Measure ``call()`` (which must run the kernel to completion) and return its latency.

    ``ceiling_ns``: a race against arms already measured (``fuel.optimize.judge_arms``). The
    second call (the first may pay one-time work: a weight conversion, a cache fill) is timed
    alone, and when it exceeds the ceiling a third is too: when both do, the faster of the two
    is the measurement (one sample): the kernel has lost by more than sampling could change, and
    sampling it further would only cost time. (Two calls, because noise only ever adds time: one
    call caught by another process's time slice must not lose a race it would win.)"""
    if repeats < 1 or warmup < 0:
        raise ValueError("profile_kernel needs repeats >= 1 and warmup >= 0")
    if ceiling_ns is not None:
        call()
        alone = None
        for _ in range(2):
            start = clock()
            call()
            took = clock() - start
            alone = took if alone is None else min(alone, took)
            if alone <= ceiling_ns:
                break
        if alone > ceiling_ns:
            return Measurement(median_ns=max(1, alone), spread_ns=0, samples=1, calls_per_sample=1)
        warmup = max(0, warmup - 2)
    return profile_cells([call], warmup=warmup, repeats=repeats, min_sample_ns=min_sample_ns,
                         max_calls_per_sample=max_calls_per_sample, budget_ns=budget_ns,
                         clock=clock)[0]


def _summary(per_call: list[float], calls: int) -> Measurement:
    """The median and inter-quartile spread of per-call sample times."""
    per_call = sorted(per_call)
    median = statistics.median(per_call)
    spread = _quantile(per_call, 0.75) - _quantile(per_call, 0.25)
    return Measurement(
        median_ns=max(1, round(median)),
        spread_ns=max(0, round(spread)),
        samples=len(per_call),
        calls_per_sample=calls,
    )


def _warm_and_calibrate(call: Callable[[], object], warmup: int, min_sample_ns: int,
                        max_calls_per_sample: int, budget_ns: int | None,
                        clock: Callable[[], int]) -> tuple[int, int]:
    """Warm ``call`` up (a slow kernel, whose first call already spends a tenth of the budget,
    once: that call warmed what there is to warm), then double the batch until one batch spans
    ``min_sample_ns``: (calls a sample, ns of that batch)."""
    for index in range(warmup):
        start = clock()
        call()
        if budget_ns is not None and index == 0 and clock() - start >= budget_ns // 10:
            break
    calls = 1
    while True:
        start = clock()
        for _ in range(calls):
            call()
        elapsed = clock() - start
        if elapsed >= min_sample_ns or calls >= max_calls_per_sample:
            return calls, elapsed
        calls = min(calls * 2, max_calls_per_sample)


def profile_cells(
    calls: list[Callable[[], object]],
    *,
    warmup: int = 3,
    repeats: int = 15,
    min_sample_ns: int = 200_000,
    max_calls_per_sample: int = 10_000,
    budget_ns: int | None = None,
    common_repeats: bool = False,
    clock: Callable[[], int] = time.perf_counter_ns,
    on_call: Callable[[int], object] | None = None,
    retire: Callable[[list[float]], Iterable[int]] | None = None,
) -> list[Measurement]:
    """Measure several calls whose latencies will be compared, their samples taken in rounds
    (every call once a round, the order reversed each round) instead of one burst each: on a
    machine other work also uses, a stretch of interference (another process's time slice on
    the core a parallel kernel waits for) then spreads over all of them, and each median is the
    call's, not the moment's. Each call is warmed up and calibrated as :func:`profile_kernel`
    does (``on_call(index)`` is told first, for a progress bar); under ``budget_ns`` each call
    keeps as many samples as its own budget allows (never below :data:`MIN_SAMPLES`), or, with
    ``common_repeats``, all take as many as the slowest's budget allows (every sample paired).

    ``retire``: a race, as :func:`profile_kernel`'s ceiling is one. Told every call's ns from
    its calibration batch (taken after its warm-up), it names the calls that have lost by more
    than sampling could change; each of those is timed once more (one more batch: noise only
    adds time, and a batch caught by another process's time slice must not lose a race it
    would win), told again with the faster of its two batches, and if named again is recorded
    from that batch alone (one sample) and sampled no further (a 44 ms dequantize-then-matmul
    LM head beside a 1 ms kernel took 0.4 s of a cold first token's 0.6 s of sampling)."""
    if repeats < 1 or warmup < 0:
        raise ValueError("profiling needs repeats >= 1 and warmup >= 0")
    batches = []
    for index, call in enumerate(calls):
        if on_call is not None:
            on_call(index)
        batches.append(_warm_and_calibrate(call, warmup, min_sample_ns, max_calls_per_sample,
                                           budget_ns, clock))

    def fitted(elapsed: int) -> int:
        if budget_ns is None or elapsed <= 0:
            return repeats
        return max(min(repeats, MIN_SAMPLES), min(repeats, budget_ns // elapsed))

    counts = [fitted(elapsed) for _, elapsed in batches]
    if common_repeats and counts:
        counts = [min(counts)] * len(counts)
    retired: set[int] = set()
    if retire is not None:
        alone = [elapsed / batch for batch, elapsed in batches]
        named = set(retire(alone))
        for index in sorted(named):  # a second batch each: the faster of the two counts
            batch = batches[index][0]
            start = clock()
            for _ in range(batch):
                calls[index]()
            again = clock() - start
            if again < batches[index][1]:
                batches[index] = (batch, again)
                alone[index] = again / batch
        if named:
            retired = named & set(retire(alone))
    for index in retired:
        counts[index] = 0
    per_call: list[list[float]] = [[] for _ in calls]
    order = list(range(len(calls)))
    for round_ in range(max(counts, default=0)):
        for index in (order if round_ % 2 == 0 else order[::-1]):
            if round_ >= counts[index]:
                continue
            call, batch = calls[index], batches[index][0]
            start = clock()
            for _ in range(batch):
                call()
            per_call[index].append((clock() - start) / batch)
    return [Measurement(median_ns=max(1, round(elapsed / batch)), spread_ns=0, samples=1,
                        calls_per_sample=batch) if index in retired else _summary(samples, batch)
            for index, (samples, (batch, elapsed)) in enumerate(zip(per_call, batches))]


def profile_pair(first: Callable[[], object], second: Callable[[], object],
                 **options: Any) -> tuple[Measurement, Measurement]:
    """Two calls that will be compared, measured by :func:`profile_cells` (``options``: its
    keywords) with every sample paired (first, second, then second, first, ...)."""
    first_m, second_m = profile_cells([first, second], common_repeats=True, **options)
    return first_m, second_m
