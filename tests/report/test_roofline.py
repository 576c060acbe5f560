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
