"""The circuit-level roofline: each op's FLOPs and bytes, per-row loops, fusion, the floor."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuel.circuit.format import BF16, parse
from fuel.report.roofline import (ComputeClass, DeviceRates, MissingRate, PlannedGroup, PlanView,
                                  SequenceRows, Workload, decode_weight_bytes,
                                  estimate_step, expected_distinct_experts, kv_bytes_per_token,
                                  node_work, weight_floor_ns)
from tests.report.builders import dense_circuit

RATES = DeviceRates("test-gpu", bandwidth=1e12, peaks={"fp32": 50e12, "bf16": 1e15, "fp8": 2e15},
                    launch_overhead_ns=3000.0, memory_bytes=80 * 2**30)


def _node(circuit, node_id):
    return circuit.node_index(node_id)


def test_linear_costs_two_flops_per_multiply_add_and_reads_its_weight_once():
    c = dense_circuit(hidden=64, q_heads=4, head_dim=16)
    w = node_work(c, _node(c, "l0.attn.q"), Workload.decode(3, 10, BF16))
    assert w.flops == 2 * 3 * 64 * 64
    assert w.weight_bytes == 64 * 64 * 2
    assert w.activation_bytes == (3 * 64 + 3 * 64) * 2
    assert w.compute is ComputeClass.TENSOR_BF16


def test_quantized_weight_counts_its_scales():
    fp8 = parse("fp8/channel")
    c = dense_circuit(hidden=64, weight=fp8)
    w = node_work(c, _node(c, "l0.attn.o"), Workload.decode(1, 1, BF16))
    assert w.weight_bytes == 64 * 64 + 4 * 64


def test_decode_attention_reads_the_whole_cache_of_each_sequence():
    c = dense_circuit(q_heads=4, kv_heads=2, head_dim=16)
    w = node_work(c, _node(c, "l0.attn.attn"), Workload.decode(5, 100, BF16))
    assert w.kv_bytes == 5 * 100 * 2 * 2 * 16 * 2
    assert w.flops == 4 * 4 * 16 * 100 * 5
    assert w.weight_bytes == 0


def test_prefill_attention_is_causal():
    c = dense_circuit(q_heads=4, kv_heads=2, head_dim=16)
    w = node_work(c, _node(c, "l0.attn.attn"), Workload.prefill(8, BF16))
    assert w.flops == 4 * 4 * 16 * (8 * 9 // 2)
    assert w.kv_bytes == 8 * 2 * 2 * 16 * 2


def test_verify_rows_attend_the_prefix_plus_their_own_earlier_rows():
    assert SequenceRows(3, 10).attended_positions == 8 + 9 + 10


def test_kv_cache_format_sets_kv_traffic():
    c = dense_circuit(kv_heads=2, head_dim=16)
    fp8 = parse("fp8/tensor")
    w = node_work(c, _node(c, "l0.attn.kv_write"), Workload.decode(4, 50, fp8))
    assert w.kv_bytes == 4 * 2 * 2 * 16  # one byte per element; the tensor scale is not per token


def test_kv_bytes_per_token_is_two_times_layers_kv_heads_head_dim_element_size():
    c = dense_circuit(layers=3, kv_heads=2, head_dim=16)
    assert kv_bytes_per_token(c, BF16) == 2 * 3 * 2 * 16 * 2


def test_per_row_loop_rereads_weights_per_pass_but_not_flops():
    c = dense_circuit()
    i = _node(c, "l0.mlp.down")
    load = Workload.runs([(4, 1)], 20, BF16)
    once, looped = node_work(c, i, load), node_work(c, i, load, passes=4)
    assert looped.weight_bytes == 4 * once.weight_bytes
    assert looped.flops == once.flops
    assert looped.activation_bytes == once.activation_bytes


def test_per_row_attention_reads_the_sequence_cache_once_per_row():
    c = dense_circuit()
    i = _node(c, "l0.attn.attn")
    load = Workload.runs([(4, 1)], 20, BF16)
    assert node_work(c, i, load, passes=4).kv_bytes == 4 * node_work(c, i, load).kv_bytes


def test_fused_edge_moves_no_bytes():
    c = dense_circuit(intermediate=128)
    i = _node(c, "l0.mlp.act")
    load = Workload.decode(2, 8, BF16)
    plain = node_work(c, i, load)
    fused = node_work(c, i, load, view=PlanView(None, frozenset({c.edge_index("l0.mlp.act_out")})))
    assert plain.activation_bytes - fused.activation_bytes == 2 * 128 * 2


def test_fp8_input_runs_at_the_fp8_peak():
    c = dense_circuit()
    i = _node(c, "l0.attn.q")
    formats = [e.format for e in c.edges]
    formats[c.edge_index("l0.attn.h")] = parse("fp8/token")
    w = node_work(c, i, Workload.decode(1, 1, BF16), view=PlanView(formats))
    assert w.compute is ComputeClass.TENSOR_FP8


def test_node_time_is_the_slower_of_memory_and_compute():
    c = dense_circuit(hidden=64)
    i = _node(c, "l0.attn.q")
    small = node_work(c, i, Workload.decode(1, 1, BF16))
    assert small.time_ns(RATES) == pytest.approx(small.bytes / 1e12 * 1e9)
    big = node_work(c, i, Workload.prefill(1_000_000, BF16))
    assert big.time_ns(RATES) == pytest.approx(max(big.bytes / 1e12, big.flops / 1e15) * 1e9)


def test_a_missing_peak_is_a_typed_error_naming_device_and_dtype():
    rates = DeviceRates("no-fp8", 1e12, {"fp32": 1e12, "bf16": 0.0}, 0.0, 1)
    with pytest.raises(MissingRate, match="no-fp8.*bf16"):
        rates.peak(ComputeClass.TENSOR_BF16)


def test_step_ceiling_sums_nodes_and_launch_figure_adds_overhead_per_launch():
    c = dense_circuit()
    groups = [PlannedGroup((i,), "single", 1, 1) for i in range(len(c.nodes))]
    load = Workload.decode(1, 64, BF16)
    est = estimate_step(c, groups, load, RATES)
    expect = sum(node_work(c, i, load).time_ns(RATES) for i in range(len(c.nodes)))
    assert est.ceiling_ns == pytest.approx(expect)
    assert est.launches == len(c.nodes)
    assert est.with_launch_ns == pytest.approx(expect + len(c.nodes) * 3000.0)
    assert est.tokens_per_s_ceiling == pytest.approx(1e9 / expect)
    assert sum(est.time_by_op().values()) == pytest.approx(expect)


def test_weight_floor_is_every_matrix_and_gain_once_plus_one_embedding_row():
    h, q, kv, d, inter, vocab, layers = 64, 4, 2, 16, 128, 256, 2
    c = dense_circuit(layers, h, q, kv, d, inter, vocab)
    per_layer = h * q * d + 2 * h * kv * d + q * d * h + h * 2 * inter + inter * h + 2 * h
    expect = 2 * (layers * per_layer + h + vocab * h + h)
    assert decode_weight_bytes(c) == expect
    assert weight_floor_ns(c, RATES) == pytest.approx(expect / 1e12 * 1e9)


@given(experts=st.integers(1, 256), data=st.data())
def test_expected_distinct_experts_grows_from_top_k_to_all(experts, data):
    top_k = data.draw(st.integers(1, experts))
    tokens = data.draw(st.integers(1, 4096))
    one = expected_distinct_experts(experts, top_k, 1)
    many = expected_distinct_experts(experts, top_k, tokens)
    assert one == pytest.approx(top_k)
    assert one - 1e-9 <= many <= min(experts, top_k * tokens) + 1e-9
    assert many <= expected_distinct_experts(experts, top_k, tokens + 1) + 1e-9
    assert math.isfinite(many)


CPU_RATES = DeviceRates(
    "test-cpu", bandwidth=1e15, peaks={"fp32": 1e10, "fp32-matrix": 2e11},
    launch_overhead_ns=1000.0, memory_bytes=2**34, matvec_peaks={"fp32-matrix": 1e10},
    rows_peaks={"fp32-matrix": ((16, 5e10), (64, 1e11), (256, 1.6e11))},
    attention_peaks=((16, 1e9), (256, 4e10)))
"""A CPU-like device whose GEMM rate grows with rows and whose attention is no GEMM; the
bandwidth is huge so every priced time below is its compute side."""


def _f32_circuit(**dims):
    from fuel.report.build import in_dtype

    f32 = parse("f32")
    return in_dtype(dense_circuit(**dims), weights=f32, activations=f32)


def test_a_linear_is_priced_at_the_rate_measured_at_its_rows_not_the_dense_peak():
    # Why: a 128-row prompt chunk's GEMMs ran at ~0.8 of the 256-row peak on the CPU; pricing
    # them at the peak predicted the prefill step ~25% too fast.
    c = _f32_circuit(hidden=64)
    i = _node(c, "l0.attn.q")
    w = node_work(c, i, Workload.prefill(128, parse("f32")))
    assert w.matrix_rows == 128 and w.compute is ComputeClass.TENSOR_FP32
    assert w.time_ns(CPU_RATES) == pytest.approx(w.flops / 1.3e11 * 1e9)  # halfway 64 -> 256
    at_peak = DeviceRates("gpu-like", 1e15, {"fp32": 1e10, "fp32-matrix": 2e11}, 0.0, 1)
    assert w.time_ns(at_peak) == pytest.approx(w.flops / 2e11 * 1e9)  # no curve: the peak
    decode = node_work(c, i, Workload.decode(1, 10, parse("f32")))
    assert decode.matvec and decode.time_ns(CPU_RATES) == pytest.approx(decode.flops / 1e10 * 1e9)


def test_a_chunk_gemm_call_pays_its_fixed_cost_so_a_narrow_product_runs_below_a_wide_ones_rate():
    # Why: a bf16 prompt chunk's 192-wide k/v projections ran at 270 GFLOP/s and its 1536-wide
    # gate/up at 535 on this CPU: ~50 us a call plus ~540 GFLOP/s. Priced at one rate, the narrow
    # products (and the plan's prefill) came out ~25% too fast.
    from dataclasses import replace

    c = _f32_circuit(hidden=64)
    q = node_work(c, _node(c, "l0.attn.q"), Workload.prefill(128, parse("f32")))
    assert q.calls == 1 and q.matrix_rows == 128
    fitted = replace(CPU_RATES, rows_fits={"fp32-matrix": ((16, 2e4, 1e11), (256, 5e4, 2e11))})
    assert fitted.matrix_call(ComputeClass.TENSOR_FP32, 64) == pytest.approx((3.5e4, 1.5e11))
    assert q.time_ns(fitted) == pytest.approx(4.25e4 + q.flops / 1.75e11 * 1e9)  # 128: 3/4 of the way
    looped = node_work(c, _node(c, "l0.attn.q"), Workload.prefill(128, parse("f32")), passes=8)
    assert looped.calls == 8 and looped.time_ns(fitted) == pytest.approx(8 * 2e4 + looped.flops / 1e11 * 1e9)
    # Fewer rows than measured: the fixed part shrinks toward a one-row product's none.
    assert fitted.matrix_call(ComputeClass.TENSOR_FP32, 4) == pytest.approx((2e4 * 3 / 15, 1e11))
    # No fit for the class, one row, or attention: priced as before.
    assert q.time_ns(CPU_RATES) == pytest.approx(q.flops / 1.3e11 * 1e9)
    decode = node_work(c, _node(c, "l0.attn.q"), Workload.decode(1, 10, parse("f32")))
    assert decode.time_ns(fitted) == decode.time_ns(CPU_RATES)
    attention = node_work(c, _node(c, "l0.attn.attn"), Workload.prefill(64, parse("f32")))
    assert attention.calls == 1 and attention.time_ns(fitted) == attention.time_ns(CPU_RATES)


def test_a_chunk_attention_call_pays_its_fixed_cost_where_the_device_measured_one():
    # Why: a SmolLM2 (9 heads) chunk's attention ran at 34 GFLOP/s where the probe's 16-head
    # layout ran at 44: gathering the cache and masking cost per call, whatever the heads.
    from dataclasses import replace

    c = _f32_circuit(q_heads=4, kv_heads=2, head_dim=16)
    w = node_work(c, _node(c, "l0.attn.attn"), Workload.prefill(64, parse("f32")))
    fitted = replace(CPU_RATES, attention_fits=((16, 1e4, 2e9), (256, 3e4, 5e10)))
    assert fitted.attention_call(64) == pytest.approx((2e4, 2.6e10))  # halfway in log2
    assert w.time_ns(fitted) == pytest.approx(2e4 + w.flops / 2.6e10 * 1e9)
    two = node_work(c, _node(c, "l0.attn.attn"),
                    Workload((SequenceRows(64, 64), SequenceRows(64, 64)), parse("f32")))
    assert two.calls == 2  # one call a sequence
    decode = node_work(c, _node(c, "l0.attn.attn"), Workload.decode(1, 64, parse("f32")))
    assert decode.time_ns(fitted) == decode.time_ns(CPU_RATES)  # one row: no chunk call


def test_a_per_row_loop_prices_each_pass_at_the_rows_of_one_pass():
    c = _f32_circuit(hidden=64)
    w = node_work(c, _node(c, "l0.attn.q"), Workload.prefill(64, parse("f32")), passes=4)
    assert w.matrix_rows == 16
    assert w.time_ns(CPU_RATES) == pytest.approx(w.flops / 5e10 * 1e9)


def test_prefill_attention_is_priced_at_the_measured_attention_rate_at_its_rows():
    # Why: a CPU prompt chunk's attention (gather + causal SDPA) ran ~6x below the GEMM rate;
    # priced at the matrix peak it was nearly free in the prediction.
    c = _f32_circuit(q_heads=4, kv_heads=2, head_dim=16)
    i = _node(c, "l0.attn.attn")
    w = node_work(c, i, Workload.prefill(64, parse("f32")))
    assert w.attention and w.matrix_rows == 64
    assert w.time_ns(CPU_RATES) == pytest.approx(w.flops / 2.05e10 * 1e9)  # 64: half of 16->256
    no_curve = DeviceRates("gpu-like", 1e15, {"fp32": 1e10, "fp32-matrix": 2e11}, 0.0, 1)
    assert w.time_ns(no_curve) == pytest.approx(w.flops / 2e11 * 1e9)
    decode = node_work(c, i, Workload.decode(1, 64, parse("f32")))  # one row: matrix-vector
    assert decode.time_ns(CPU_RATES) == pytest.approx(decode.flops / 1e10 * 1e9)


def test_a_prefill_that_keeps_one_rows_logits_prices_the_lm_head_over_that_row_alone():
    # Why: fuel run's generation computes a prompt chunk's last-row logits only; a plan that
    # priced the LM head over every row would overstate the step it is compared with.
    c = dense_circuit(hidden=64, q_heads=4, head_dim=16)
    every = Workload.prefill(32, BF16)
    last = Workload((SequenceRows(32, 32),), BF16, logit_rows=1)
    for node in ("head.lm_head", "head.final_norm"):
        full, one = (node_work(c, _node(c, node), w) for w in (every, last))
        assert one.flops * 32 == full.flops and one.weight_bytes == full.weight_bytes
    q_full, q_one = (node_work(c, _node(c, "l0.attn.q"), w) for w in (every, last))
    assert q_full == q_one, "every other op still runs every row"
