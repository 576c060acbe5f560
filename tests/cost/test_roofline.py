"""The roofline's arithmetic: max(compute, memory at the tier the working set fits) + launches,
saturating, never dividing by an unusable rate."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuel.cost import (
    SATURATED_NS,
    Bound,
    CostEstimate,
    DeviceKind,
    DeviceSpec,
    MemoryTier,
    PeakClass,
    Priced,
    Unpriced,
    composite_ns,
    memory_tier,
    roofline,
    sum_composite_ns,
)


def toy(**overrides) -> DeviceSpec:
    """1 GFLOP/s vector, 4 GFLOP/s bf16 matrix, 2 GB/s, 100 ns launches: easy hand arithmetic."""
    values = dict(
        name="toy", title="toy", kind=DeviceKind.GPU,
        peak_flops={PeakClass.BF16: 4e9, PeakClass.FP32: 1e9},
        vector_flops=1e9, bandwidth_bytes_per_s=2e9, memory_bytes=1 << 30,
        launch_overhead_ns=100,
    )
    values.update(overrides)
    return DeviceSpec(**values)


def test_memory_bound_time_is_bytes_over_bandwidth_plus_launch():
    priced = roofline(CostEstimate(flops=1000, bytes=4000), toy())
    assert priced == Priced(ns=2100, compute_ns=1000, memory_ns=2000, overhead_ns=100, bound=Bound.MEMORY)


def test_compute_bound_adds_vector_and_matrix_time():
    estimate = CostEstimate(flops=9000, bytes=100, matrix_flops=8000, matrix_dtype="bf16")
    priced = roofline(estimate, toy())
    # vector 1000 flop / 1e9 = 1000 ns; matrix 8000 / 4e9 = 2000 ns; memory 50 ns
    assert (priced.compute_ns, priced.memory_ns, priced.ns, priced.bound) == (3000, 50, 3100, Bound.COMPUTE)


def test_launches_and_fixed_overhead_are_added_outside_the_max():
    estimate = CostEstimate(flops=0, bytes=0, overhead_ns=7, launches=3)
    assert roofline(estimate, toy()) == Priced(307, 0, 0, 307, Bound.OVERHEAD)


def test_a_view_with_no_launch_costs_nothing():
    assert composite_ns(CostEstimate(flops=0, bytes=0, launches=0), toy()) == 0


def test_nonzero_work_never_rounds_to_zero():
    assert roofline(CostEstimate(flops=1, bytes=1, launches=0), toy()).ns == 1


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_unusable_bandwidth_declines_instead_of_dividing(bad):
    result = roofline(CostEstimate(flops=0, bytes=10), toy(bandwidth_bytes_per_s=bad))
    assert isinstance(result, Unpriced)
    assert "bandwidth" in result.reason
    assert composite_ns(CostEstimate(flops=0, bytes=10), toy(bandwidth_bytes_per_s=bad)) is None


@pytest.mark.parametrize("bad", [0.0, -5.0, math.inf, math.nan])
def test_unusable_vector_rate_declines(bad):
    assert isinstance(roofline(CostEstimate(flops=10, bytes=0), toy(vector_flops=bad)), Unpriced)


def test_a_missing_matrix_peak_declines_with_the_dtype_named():
    estimate = CostEstimate(flops=10, bytes=0, matrix_flops=10, matrix_dtype="f8e4m3")
    result = roofline(estimate, toy())
    assert isinstance(result, Unpriced) and "f8e4m3" in result.reason


def test_zero_work_needs_no_rate():
    device = toy(bandwidth_bytes_per_s=0.0, vector_flops=math.nan)
    assert composite_ns(CostEstimate(flops=0, bytes=0), device) == 100


def test_huge_work_saturates_instead_of_overflowing():
    estimate = CostEstimate(flops=10**30, bytes=10**30, launches=10**20)
    assert composite_ns(estimate, toy(vector_flops=1e-300)) == SATURATED_NS


def test_folding_estimates_adds_every_field():
    a = CostEstimate(flops=10, bytes=20, overhead_ns=1, launches=1, matrix_flops=4, matrix_dtype="bf16")
    b = CostEstimate(flops=5, bytes=7, launches=2)
    assert a + b == CostEstimate(flops=15, bytes=27, overhead_ns=1, launches=3, matrix_flops=4, matrix_dtype="bf16")


def test_folding_matrix_work_of_two_dtypes_is_refused():
    a = CostEstimate(flops=4, bytes=0, matrix_flops=4, matrix_dtype="bf16")
    b = CostEstimate(flops=4, bytes=0, matrix_flops=4, matrix_dtype="f32")
    with pytest.raises(ValueError, match="cannot fold"):
        a + b


def test_sum_of_composites_is_none_when_any_is_unpriced():
    ok = CostEstimate(flops=1000, bytes=0)
    bad = CostEstimate(flops=4, bytes=0, matrix_flops=4, matrix_dtype="f8e4m3")
    assert sum_composite_ns([ok, ok], toy()) == 2 * 1100
    assert sum_composite_ns([ok, bad], toy()) is None


@pytest.mark.parametrize("field", ["flops", "bytes", "overhead_ns", "launches", "matrix_flops"])
def test_negative_counts_are_rejected(field):
    values = dict(flops=1, bytes=1)
    values[field] = -1
    with pytest.raises(ValueError, match=field):
        CostEstimate(**values)


@given(
    flops=st.integers(0, 10**15), bytes_=st.integers(0, 10**15),
    bandwidth=st.floats(1e3, 1e13), rate=st.floats(1e3, 1e16),
)
def test_time_is_at_least_each_side_of_the_roofline(flops, bytes_, bandwidth, rate):
    device = toy(vector_flops=rate, bandwidth_bytes_per_s=bandwidth, launch_overhead_ns=0)
    priced = roofline(CostEstimate(flops=flops, bytes=bytes_), device)
    assert priced.ns >= min(math.floor(flops / rate * 1e9), SATURATED_NS)
    assert priced.ns >= min(math.floor(bytes_ / bandwidth * 1e9), SATURATED_NS)
    assert priced.ns == max(priced.compute_ns, priced.memory_ns)


# The cache tier: toy() has DRAM at 2 GB/s; these give it a 4000-byte cache at 8 GB/s.
def cached(**overrides) -> DeviceSpec:
    return toy(**{"cache_bytes": 4000, "cache_bandwidth_bytes_per_s": 8e9, **overrides})


def test_a_working_set_that_fits_the_cache_streams_at_the_cache_bandwidth():
    priced = roofline(CostEstimate(flops=0, bytes=4000), cached())
    # 4000 B / 8e9 B/s = 500 ns, + one 100 ns launch
    assert priced == Priced(600, 0, 500, 100, Bound.MEMORY, MemoryTier.CACHE)


def test_one_byte_over_the_cache_falls_back_to_dram_bandwidth():
    priced = roofline(CostEstimate(flops=0, bytes=4001), cached())
    # 4001 B / 2e9 B/s = 2000.5 ns, rounded up
    assert (priced.memory_ns, priced.ns, priced.tier) == (2001, 2101, MemoryTier.DRAM)


def test_a_device_without_a_cache_tier_prices_every_byte_at_dram():
    assert memory_tier(CostEstimate(flops=0, bytes=1), toy()) is MemoryTier.DRAM
    assert memory_tier(CostEstimate(flops=0, bytes=1), toy(cache_bytes=4000)) is MemoryTier.DRAM


def test_the_cache_tier_still_takes_the_max_with_compute():
    # 3000 flop at 1 GFLOP/s = 3000 ns beats 4000 B at 8 GB/s = 500 ns
    priced = roofline(CostEstimate(flops=3000, bytes=4000), cached())
    assert (priced.ns, priced.bound, priced.tier) == (3100, Bound.COMPUTE, MemoryTier.CACHE)


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan, math.inf])
def test_an_unusable_cache_bandwidth_declines_only_for_ops_in_the_tier(rate):
    device = cached(cache_bandwidth_bytes_per_s=rate)
    priced = roofline(CostEstimate(flops=0, bytes=100), device)
    assert isinstance(priced, Unpriced) and "cache bandwidth" in priced.reason
    assert composite_ns(CostEstimate(flops=0, bytes=8000), device) == 4000 + 100


@given(st.integers(0, 10**7), st.integers(0, 10**7))
def test_a_cache_faster_than_dram_never_makes_an_op_slower(flops, size):
    estimate = CostEstimate(flops=flops, bytes=size)
    assert composite_ns(estimate, cached()) <= composite_ns(estimate, toy())
