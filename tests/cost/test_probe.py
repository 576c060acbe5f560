"""The cpu-local probe: positive numbers, cached under FUEL_CACHE_DIR, re-probed on request."""

import json

import pytest

from fuel.cost import PeakClass, device
from fuel.cost import probe


def test_probe_yields_positive_numbers_and_is_cached(isolated_cache):
    spec = device("cpu-local")
    assert spec.probed and spec.name == "cpu-local"
    for rate in (*spec.peak_flops.values(), spec.vector_flops, spec.bandwidth_bytes_per_s):
        assert rate > 0
    assert set(spec.peak_flops) == {PeakClass.FP32, PeakClass.BF16, PeakClass.FP16}
    assert spec.launch_overhead_ns >= 1 and spec.memory_bytes > 0
    path = probe.cache_path()
    assert path.is_relative_to(isolated_cache) and path.exists()
    assert "probed on this machine" in spec.sources["bandwidth"]


def test_cached_numbers_are_used_without_measuring(isolated_cache, monkeypatch):
    first = device("cpu-local")
    monkeypatch.setattr(probe, "measure_cpu_local", lambda: pytest.fail("should use the cache"))
    assert device("cpu-local") == first


def test_reprobe_measures_again_and_rewrites_the_cache(isolated_cache, monkeypatch):
    device("cpu-local")
    fake = {
        "fp32_flops": 1e9, "bf16_flops": 2e9, "fp16_flops": 3e9, "vector_flops": 4e9,
        "fp32_gemv_flops": 1.5e9, "bf16_gemv_flops": 2.5e8, "fp16_gemv_flops": 3.5e8,
        "bandwidth_bytes_per_s": 5e9, "copy_bytes_per_s": 2e9, "launch_overhead_ns": 6,
        "memory_bytes": 7, "torch_threads": 1,
        "cache_bytes": 8, "cache_bandwidth_bytes_per_s": 9e9, "cache_note": "fake",
    "hot_call_ns": 1, "stream_note": "fake",
    }
    monkeypatch.setattr(probe, "measure_cpu_local", lambda: dict(fake))
    spec = device("cpu-local", reprobe=True)
    assert (spec.bandwidth_bytes_per_s, spec.launch_overhead_ns) == (5e9, 6)
    assert (spec.cache_bytes, spec.cache_bandwidth_bytes_per_s) == (8, 9e9)
    assert spec.gemv_flops == {PeakClass.FP32: 1.5e9, PeakClass.BF16: 2.5e8, PeakClass.FP16: 3.5e8}
    assert spec.host_call_ns == 6  # a view is one torch call: the per-call overhead
    # A one-row product is priced at the matrix-vector rate, a GEMM at the dense peak.
    assert spec.matrix_peak("bf16", rows=1) == 2.5e8 and spec.matrix_peak("bf16", rows=64) == 2e9
    assert json.loads(probe.cache_path().read_text())["numbers"] == fake


def test_an_unreadable_cache_is_reported_then_replaced(isolated_cache, monkeypatch):
    device("cpu-local")
    probe.cache_path().write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable cpu-local probe cache"):
        spec = device("cpu-local")
    assert spec.bandwidth_bytes_per_s > 0
    json.loads(probe.cache_path().read_text())


# cache_tier: samples are (working set bytes, ns) of in-cache copies. Slope between the first two:
# 3000 B in 300 ns = 1e10 B/s; intercept 1100 - 1000 B / 10 B/ns = 1000 ns of fixed cost.
SWEEP = [(1000, 1100.0), (4000, 1400.0), (8000, 1800.0)]


def test_cache_tier_rate_is_the_slope_and_size_the_largest_set_within_2x():
    # 16000 B in 4000 - 1000 = 3000 ns streams at 5.3e9 B/s, within 2x of 1e10: in the tier
    assert probe.cache_tier([*SWEEP, (16000, 4000.0)], 1e9) == (16000, pytest.approx(1e10))


def test_cache_tier_stops_at_the_first_set_that_streams_more_than_2x_slower():
    # 16000 B in 5000 - 1000 = 4000 ns is 4e9 B/s, under half of 1e10; the larger one is not seen
    assert probe.cache_tier([*SWEEP, (16000, 5000.0), (32000, 4200.0)], 1e9) == (8000, pytest.approx(1e10))


def test_cache_tier_declines_with_a_reason():
    assert "not faster than DRAM" in probe.cache_tier(SWEEP, 2e10)
    assert "did not resolve" in probe.cache_tier([(1000, 1400.0), (4000, 1100.0)], 1e9)
    assert "fewer than two" in probe.cache_tier(SWEEP[:1], 1e9)


def test_the_cache_tier_the_sweep_finds_is_the_one_reported(monkeypatch):
    # Why: the probe's answer must follow its sweep: a tier found is a tier reported (with its
    # numbers and how they were measured), a tier refused is no tier with the reason.
    import torch

    monkeypatch.setattr(probe, "_l2_bytes_per_core", lambda: 64 * 1024)
    monkeypatch.setattr(probe, "cache_tier", lambda samples, dram: (65536, 5e10))
    size, rate, note = probe._measure_cache_tier(torch, 2, 1e9)
    assert (size, rate) == (65536, 5e10) and note.startswith("L2 65536 B per core")
    monkeypatch.setattr(probe, "cache_tier", lambda samples, dram: "in-cache copy is not faster")
    size, rate, note = probe._measure_cache_tier(torch, 2, 1e9)
    assert (size, rate) == (None, None) and note.startswith("no tier: in-cache copy")


def test_without_an_l2_size_from_the_os_there_is_no_tier(monkeypatch):
    import torch

    monkeypatch.setattr(probe, "_l2_bytes_per_core", lambda: None)
    assert probe._measure_cache_tier(torch, 2, 1e9) == (
        None, None, "no tier: the OS reports no L2 cache size")


def test_the_probe_prices_what_the_cpu_kernels_do(isolated_cache):
    # Why: the probe priced bf16 at a GEMM peak the decode step never runs and used a copy rate
    # for a step that only reads. It now measures the linear kernel one row at a time, per
    # dtype, and the read rate of that product.
    spec = device("cpu-local")
    assert set(spec.gemv_flops) == {PeakClass.FP32, PeakClass.BF16, PeakClass.FP16}
    assert all(rate > 0 for rate in spec.gemv_flops.values())
    assert "read" in spec.sources["bandwidth"] and "matrix-vector" in spec.sources["peak_tflops"]
    assert spec.host_call_ns == spec.launch_overhead_ns > 0


def test_the_bandwidth_probe_streams_twice_the_last_level_cache(monkeypatch):
    # Why: one 64 MiB weight read again and again stays in a large LLC (480 MiB on this VM's
    # host): the probe said 50 GB/s where a decode step of an f32 model reads at ~20.
    import torch

    from fuel.cost import probe

    monkeypatch.setattr(probe, "_GEMV_SHAPE", (64, 64))  # 16 KiB slices keep the test small
    monkeypatch.setattr(probe, "_STREAM_MIN_BYTES", 64 * 1024)
    monkeypatch.setattr(probe, "_llc_bytes", lambda: 100 * 1024)
    monkeypatch.setattr(probe, "_physical_memory_bytes", lambda: 1 << 40)
    slices, llc = probe._stream_slices(torch)
    assert llc == 100 * 1024 and len(slices) * 64 * 64 * 4 >= 2 * llc
    assert len({w.data_ptr() for w in slices}) == len(slices)  # distinct weights, not one re-read
    monkeypatch.setattr(probe, "_llc_bytes", lambda: None)  # unknown LLC: the floor
    assert len(probe._stream_slices(torch)[0]) * 64 * 64 * 4 >= 64 * 1024
