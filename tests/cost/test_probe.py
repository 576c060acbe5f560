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
    monkeypatch.setattr(probe, "measure_cpu_local", lambda *a: pytest.fail("should use the cache"))
    monkeypatch.setattr(probe, "_measure_halves", lambda *a: pytest.fail("should use the cache"))
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
        "fp32_gemm_rows_flops": [[16, 4e8], [256, 1e9]], "bf16_gemm_rows_flops": [[16, 5e8], [256, 2e9]],
        "fp16_gemm_rows_flops": None, "attention_rows_flops": [[16, 1e8], [256, 4e8]],
        "bf16_gemm_rows_fit": None, "fp16_gemm_rows_fit": None, "half_bandwidth_by_bytes": [],
    }
    monkeypatch.setattr(probe, "measure_cpu_local", lambda *a: dict(fake))
    spec = device("cpu-local", reprobe=True)
    assert (spec.bandwidth_bytes_per_s, spec.launch_overhead_ns) == (5e9, 6)
    assert (spec.cache_bytes, spec.cache_bandwidth_bytes_per_s) == (8, 9e9)
    assert spec.gemv_flops == {PeakClass.FP32: 1.5e9, PeakClass.BF16: 2.5e8, PeakClass.FP16: 3.5e8}
    assert spec.host_call_ns == 6  # a view is one torch call: the per-call overhead
    # A one-row product is priced at the matrix-vector rate, a GEMM at the rate measured at its
    # rows (halfway between 16 and 256 rows in log2: 64 rows), an unknown row count at the dense
    # peak; fp16, measured with no rows curve, at its dense peak whatever the rows.
    assert spec.matrix_peak("bf16", rows=1) == 2.5e8
    assert spec.matrix_peak("bf16", rows=64) == pytest.approx(1.25e9)
    assert spec.matrix_peak("bf16", rows=0) == 2e9
    assert spec.matrix_peak("f16", rows=64) == 3e9
    assert spec.gemm_rows_flops == {PeakClass.FP32: ((16, 4e8), (256, 1e9)),
                                    PeakClass.BF16: ((16, 5e8), (256, 2e9))}
    assert spec.attention_rows_flops == ((16, 1e8), (256, 4e8))
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


def test_a_probe_without_rows_curves_prices_every_gemm_at_the_dense_peak(isolated_cache, monkeypatch):
    # Why: numbers from before the rows curves (or a dtype that has none) must still make a
    # spec, priced as before: the dense peak for a GEMM, the matrix-vector rate for one row.
    numbers = {"fp32_flops": 1e9, "bf16_flops": 2e9, "fp16_flops": 3e9, "vector_flops": 4e9,
               "fp32_gemv_flops": 1.5e9, "bf16_gemv_flops": 2.5e8, "fp16_gemv_flops": 3.5e8,
               "bandwidth_bytes_per_s": 5e9, "copy_bytes_per_s": 2e9, "launch_overhead_ns": 6,
               "memory_bytes": 7, "torch_threads": 1, "cache_bytes": None,
               "cache_bandwidth_bytes_per_s": None, "cache_note": "fake", "hot_call_ns": 1,
               "stream_note": "fake"}
    spec = probe._spec_from(numbers, "fake")
    assert spec.gemm_rows_flops == {} and spec.attention_rows_flops == ()
    assert spec.matrix_peak("f32", rows=128) == 1e9 and spec.matrix_peak("f32", rows=1) == 1.5e9


def test_a_call_is_split_into_its_fixed_cost_and_rate_through_two_widths():
    # time = fixed + flops / rate through two calls' (FLOPs, ns).
    # 40 us a call at 50 GFLOP/s: 1 and 4 MFLOP take 60 and 120 us.
    fixed, rate = probe.call_fit((1e6, 60e3), (4e6, 120e3))
    assert fixed == pytest.approx(40e3) and rate == pytest.approx(5e10)
    # Noise that hides the slope (the wider call no slower; a negative fixed part) keeps the
    # wider call's plain rate and no fixed part, never a negative or infinite one.
    assert probe.call_fit((1e6, 100.0), (4e6, 90.0)) == (0.0, pytest.approx(4e6 / 90e-9))
    assert probe.call_fit((1e6, 10.0), (4e6, 100.0)) == (0.0, pytest.approx(4e6 / 100e-9))


def test_a_16_bit_matrix_is_probed_through_the_kernel_its_prompt_chunks_run(monkeypatch):
    # Why: the probe timed bf16 chunks through oneDNN's packed layout on bf16 activations; a
    # bf16 run multiplies f32 activations by its held matrices with half_chunk_linear, 1.3-1.7x
    # slower, so fuel plan priced a bf16 prefill ~40% too fast.
    import torch

    from fuel.kernels import torch_kernels
    from fuel.kernels.native import STREAM_ROWS

    called = []
    real = torch_kernels.half_chunk_linear
    monkeypatch.setattr(torch_kernels, "half_chunk_linear",
                        lambda x, w: called.append((x.dtype, w.dtype, x.shape[0])) or real(x, w))
    linear = probe._linear_kernel(torch, torch.bfloat16)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(STREAM_ROWS + 1, 64, generator=generator)
    w = torch.randn(32, 64, generator=generator).bfloat16()
    out = linear(x, w)
    assert called == [(torch.float32, torch.bfloat16, STREAM_ROWS + 1)] and out.dtype == torch.float32
    # where oneDNN multiplies bf16 natively the activations and the result are rounded to bf16;
    # elsewhere the native GEMM takes f32 activations and sums in f32 (half_chunk_linear's docs)
    if torch.bfloat16 in torch_kernels.HALF_GEMM_NATIVE:
        torch.testing.assert_close(out, x.bfloat16().float() @ w.float().T, rtol=2e-2, atol=2e-2)
    else:
        torch.testing.assert_close(out, x @ w.float().T, rtol=1e-5, atol=1e-4)
    linear(x[:1], w)  # a decode row: the native streaming kernel, as the runtime's
    assert len(called) == 1
    chunk = torch.randn(STREAM_ROWS + 1, 64)
    probe._linear_kernel(torch, torch.float32)(chunk, torch.randn(32, 64))  # f32: its own entry
    assert len(called) == 1


def test_the_rows_curve_spans_the_prompt_chunk_sizes_a_run_pads_to():
    # Why: the curve prices a prompt chunk at the rows it really runs: the powers of two a run
    # pads to are measured, the half-steps between them (24, 48 ...) interpolated in log2
    # between two measured neighbours, none priced outside the measured range.
    from fuel.runtime.generate import DEFAULT_CHUNK, MIN_BUCKET, bucket

    padded = sorted({bucket(rows) for rows in range(1, DEFAULT_CHUNK + 1)})
    powers = [size for size in padded if size & (size - 1) == 0]
    assert probe._GEMM_ROWS == tuple(powers) and powers[0] == MIN_BUCKET
    assert all(powers[0] <= size <= powers[-1] for size in padded)


def test_a_call_timed_on_fewer_rows_reports_the_time_of_the_shape_asked_for(monkeypatch):
    # Why: the rows budget prices a 256-row pass with the dense-peak call's time; a slow dtype's
    # call timed on an eighth of its rows once reported that eighth, and the probe then spent
    # 80 s timing torch's f16 GEMM at every row count.
    import time

    import torch

    def slow(torch_module, dtype):
        def linear(x, w):
            time.sleep(x.shape[0] * w.shape[0] * 2e-7)  # 256 x 512 rows: ~26 ms a call
            return None
        return linear

    monkeypatch.setattr(probe, "_linear_kernel", slow)
    rate, ns = probe._linear_rate(torch, torch.float32, 256, 512, 512)
    assert ns > probe._SLOW_CALL_NS, "the full 256-row call's time, though an eighth was timed"
    assert rate == pytest.approx(2 * 256 * 512 * 512 / (ns * 1e-9), rel=1e-6)


def test_the_attention_probe_lays_its_cache_out_as_the_engine_does():
    from fuel.runtime.engine import DEFAULT_BLOCK_SIZE

    assert probe._ATTENTION_BLOCK == DEFAULT_BLOCK_SIZE


def test_the_rows_curve_times_the_linear_kernel_at_each_row_count(monkeypatch):
    # Why: a CPU GEMM's rate grows with its rows (each weight block is packed once per call);
    # the probe must report one positive rate per row count, in order, from distinct weights.
    import torch

    monkeypatch.setattr(probe, "_ROWS_SET_BYTES", 4 * 512 * 512 * 4)  # 4 weights keep it short
    seen = []
    kernel = probe._linear_kernel(torch, torch.float32)

    def counting(torch_module, dtype):
        def linear(x, w):
            seen.append((x.shape[0], w.shape[0], w.data_ptr()))
            return kernel(x, w)
        return linear

    monkeypatch.setattr(probe, "_linear_kernel", counting)
    rates, fits = probe._linear_rows_rates(torch, torch.float32, call_ns=1000.0)
    assert [rows for rows, _ in rates] == list(probe._GEMM_ROWS)
    assert all(rate > 0 for _, rate in rates)
    # Each row count also times products a quarter as wide, for the call's fixed cost.
    assert [rows for rows, _, _ in fits] == list(probe._GEMM_ROWS)
    assert all(fixed >= 0 and rate > 0 for _, fixed, rate in fits)
    for width in (512, 512 // probe._NARROW):  # every call of a pass reads another weight
        assert len({ptr for _, n, ptr in seen if n == width}) == 4
    assert {rows for rows, _, _ in seen} == set(probe._GEMM_ROWS)


def test_a_dtype_too_slow_for_a_rows_pass_keeps_its_dense_peak():
    # Why: fp16 has no fast CPU path here (~2 GFLOP/s); timing 64 of its 256-row products at
    # every row count would take seconds, and a slow, compute-bound dtype has one rate anyway.
    import torch

    assert probe._linear_rows_rates(torch, torch.float16, call_ns=probe._ROWS_BUDGET_NS) is None


def test_the_attention_probe_counts_flops_as_the_report_does():
    # Why: a rate is FLOPs over time; the report divides its own FLOP count by this rate, so
    # both must count a causal chunk the same way or the price is off by their ratio.
    from fuel.report.roofline import SequenceRows

    for rows, context in ((16, 16), (128, 128), (64, 300)):
        attended = SequenceRows(rows, context).attended_positions
        assert probe.attention_flops(9, 64, rows, context) == 4 * 9 * 64 * attended


def test_the_attention_probe_times_the_prompt_chunk_attention_at_each_row_count(monkeypatch):
    # Why: a CPU prompt chunk's attention (the native flash attention, or gather + one causal
    # SDPA) runs far below the matrix rate; the probe must time the kernel the runtime's
    # prompt chunks call (fuel.jit.paged.prefill_attention), at every chunk size, with the
    # stated layout.
    import torch

    from fuel.jit import paged

    calls = []
    real = paged.prefill_attention

    def spy(q, k_cache, v_cache, table, lens, scale, dtype):
        calls.append((tuple(q.shape), k_cache.shape[2], int(lens[0])))
        return real(q, k_cache, v_cache, table, lens, scale, dtype)

    monkeypatch.setattr(paged, "prefill_attention", spy)
    rates, fits = probe._attention_rows_rates(torch)
    assert [rows for rows, _ in rates] == list(probe._GEMM_ROWS)
    assert all(rate > 0 for _, rate in rates)
    assert [rows for rows, _, _ in fits] == list(probe._GEMM_ROWS)
    assert all(fixed >= 0 and rate > 0 for _, fixed, rate in fits)
    heads, kv_heads, head_dim = probe._ATTENTION_LAYOUT
    narrow = (heads // probe._NARROW, kv_heads // probe._NARROW)
    for rows in probe._GEMM_ROWS:  # as many rows as positions: a prompt's first chunk
        assert ((1, heads, rows, head_dim), kv_heads, rows) in calls
        assert ((1, narrow[0], rows, head_dim), narrow[1], rows) in calls  # the fixed-cost fit


def test_the_per_call_overhead_is_the_calls_own_time_whatever_the_stream_does(monkeypatch):
    # Why: it was the difference of two passes' times (with and without the calls) divided by
    # the calls; a stream whose time the machine's load moves by milliseconds swamped the
    # microseconds (a shared host once probed 31 us a call where the calls took ~2). Here the
    # stream's time jumps at random by up to 20 ms a slice and each call busy-waits 40 us: the
    # overhead must read ~40 us.
    import random
    import time
    import types

    import torch

    def busy(ns):
        end = time.perf_counter_ns() + ns
        while time.perf_counter_ns() < end:
            pass

    rng = random.Random(5)
    slices = [torch.zeros(4, 4) for _ in range(6)]
    monkeypatch.setattr(probe, "_stream_slices", lambda torch: (slices, 0))
    fake = types.SimpleNamespace(randn=torch.randn, ones=torch.ones, empty=torch.empty,
                                 add=lambda a, b, out: busy(40_000))
    bandwidth, per_call, count, _ = probe._stream_rates(
        fake, lambda x, w: busy(rng.randrange(0, 20_000_000)))
    assert count == 6 and bandwidth > 0
    assert 38_000 <= per_call <= 60_000, per_call


_CORE = {"fp32_flops": 1e9, "bf16_flops": 2e9, "fp16_flops": 3e9, "vector_flops": 4e9,
         "fp32_gemv_flops": 1.5e9, "bf16_gemv_flops": 2.5e8, "fp16_gemv_flops": 3.5e8,
         "bandwidth_bytes_per_s": 5e9, "copy_bytes_per_s": 2e9, "launch_overhead_ns": 6,
         "memory_bytes": 7, "cache_bytes": None, "cache_bandwidth_bytes_per_s": None,
         "cache_note": "fake", "hot_call_ns": 1, "stream_note": "fake",
         "fp32_gemm_rows_flops": [[16, 4e8], [256, 1e9]], "fp32_gemm_rows_fit": None,
         "attention_rows_flops": None, "attention_rows_fit": None, "bandwidth_by_bytes": []}


def _fake_halves(measured: list):
    def halves(torch, names, llc, step=None, advance=None, have=None):
        measured.append(tuple(names))
        numbers = {"half_bandwidth_by_bytes": [[1 << 20, 7e9 + len(measured)]]} if names else {}
        if have is not None and "half_bandwidth_by_bytes" in have:  # as the probe keeps it
            numbers["half_bandwidth_by_bytes"] = have["half_bandwidth_by_bytes"]
        for rate, name in enumerate(names, start=2):
            numbers[f"{name}_gemm_rows_flops"] = [[16, rate * 1e8], [256, rate * 1e9]]
            numbers[f"{name}_gemm_rows_fit"] = [[128, 1e4, rate * 1e9]]
        return numbers
    return halves


def test_a_16bit_section_is_probed_once_the_first_time_its_dtype_is_asked_for(isolated_cache, monkeypatch):
    # Why: the 16-bit prompt-chunk curves took ~2 s of a cold first token's ~4 s probe, and a
    # run of f32 or stored weights never reads them. Each is measured when a run first asks for
    # its dtype, then kept in the cache beside the rest.
    import torch

    measured, cores = [], []
    monkeypatch.setattr(probe, "_measure_halves", _fake_halves(measured))

    def core(threads=None, halves=probe.HALVES):
        cores.append(threads)
        return {**_CORE, "torch_threads": torch.get_num_threads(),
                **probe._measure_halves(torch, halves, 0)}

    monkeypatch.setattr(probe, "measure_cpu_local", core)
    spec = probe.cpu_local_spec(halves=())
    assert (cores, measured) == ([None], [()])
    assert set(spec.gemm_rows_flops) == {PeakClass.FP32} and spec.half_bandwidth_by_bytes == ()
    bf16 = probe.cpu_local_spec(halves=("bf16",))
    assert (len(cores), measured[1:]) == (1, [("bf16",)])  # the section alone, not a new probe
    assert bf16.gemm_rows_flops[PeakClass.BF16] == ((16, 2e8), (256, 2e9))
    assert bf16.half_bandwidth_by_bytes == ((1 << 20, 7e9 + 2),)
    assert bf16.matrix_peak("bf16", rows=16) == 2e8 and spec.matrix_peak("bf16", rows=16) == 2e9
    cached = json.loads(probe.cache_path().read_text())["numbers"]
    assert cached["bf16_gemm_rows_flops"] == [[16, 2e8], [256, 2e9]] and "fp16_gemm_rows_flops" not in cached
    # cached now: asked again, nothing is measured; asked without it, the spec does not carry it
    assert probe.cpu_local_spec(halves=("bf16",)) == bf16
    assert probe.cpu_local_spec(halves=()) == spec
    assert len(measured) == 2
    both = probe.cpu_local_spec()
    assert measured[2:] == [("fp16",)]
    assert set(both.gemm_rows_flops) == {PeakClass.FP32, PeakClass.BF16, PeakClass.FP16}
    # the fp16 section leaves what the bf16 one measured as it was
    assert probe.cpu_local_spec(halves=("bf16",)) == bf16
    with pytest.raises(ValueError, match="no 16-bit probe section 'f16'"):
        probe.cpu_local_spec(halves=("f16",))


def test_a_run_prices_with_the_probe_sections_of_its_own_weights(isolated_cache, monkeypatch):
    # Why: what a run prices must not depend on which runs came before it on this machine; a
    # bf16 run reads the bf16 chunk curve, an f32 or stored run none of the 16-bit ones.
    import torch

    from fuel.kernels import cpu_table
    from fuel.runtime.model import jit_options

    measured = []
    monkeypatch.setattr(probe, "_measure_halves", _fake_halves(measured))
    monkeypatch.setattr(probe, "measure_cpu_local", lambda threads=None, halves=probe.HALVES: {
        **_CORE, "torch_threads": torch.get_num_threads(), **probe._measure_halves(torch, halves, 0)})
    curves = {dtype: set(jit_options(cpu_table(), store_path=isolated_cache / "judge.sqlite",
                                     dtype=dtype).optimize.device_spec.gemm_rows_flops)
              for dtype in ("bf16", "f32", "stored", "f16")}
    assert curves == {"bf16": {PeakClass.FP32, PeakClass.BF16}, "f32": {PeakClass.FP32},
                      "stored": {PeakClass.FP32}, "f16": {PeakClass.FP32, PeakClass.FP16}}
    assert measured == [("bf16",), ("fp16",)]
