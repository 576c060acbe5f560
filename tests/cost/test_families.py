"""Each op family's Layer-1 work, pinned on hand-computed cases."""

import pytest

from fuel.cost import Bound, CostEstimate, device, roofline
from fuel.cost import families as f


def test_elementwise_reads_each_input_and_writes_the_output():
    # bf16 add of [1024] + broadcast [1] -> [1024]
    est = f.elementwise(1024, "bf16", [(1024, "bf16"), (1, "bf16")])
    assert est == CostEstimate(flops=1024, bytes=2048 + 2 + 2048)


def test_sub_byte_tensors_round_up():
    assert f.tensor_bytes(3, "f4e2m1") == 2
    assert f.tensor_bytes(7, "f6e2m3") == 6  # 42 bits


def test_matmul_counts_two_flops_per_multiply_add_on_the_matrix_unit():
    est = f.matmul(batch=2, m=3, k=4, n=5, dtype="f32", b_batch=1)
    assert est.matrix_flops == est.flops == 2 * 2 * 3 * 4 * 5
    assert est.matrix_dtype == "f32"
    # A: 2*3*4 floats, B shared across the batch: 4*5, C: 2*3*5
    assert est.bytes == 4 * (24 + 20 + 30)


def test_linear_with_bias_adds_one_vector_flop_per_output():
    est = f.matmul(batch=1, m=8, k=16, n=32, dtype="bf16", bias=True)
    assert est.flops - est.matrix_flops == 8 * 32
    assert est.bytes == 2 * (8 * 16 + 16 * 32 + 8 * 32 + 32)


def test_softmax_is_never_free():
    est = f.softmax(rows=4, cols=100, dtype="f32")
    assert est.flops == 400 * (4 + f.TRANSCENDENTAL_FLOPS)
    assert est.bytes == 2 * 400 * 4


def test_rms_norm_with_and_without_gain():
    with_gain = f.rms_norm(rows=2, dim=10, dtype="f32", gain=True)
    without = f.rms_norm(rows=2, dim=10, dtype="f32", gain=False)
    assert with_gain.flops == 20 * 4 + 2 * (2 + f.TRANSCENDENTAL_FLOPS)
    assert without.flops == 20 * 3 + 2 * (2 + f.TRANSCENDENTAL_FLOPS)
    assert with_gain.bytes - without.bytes == 40  # the f32 gain vector


def test_layer_norm_reads_gain_and_bias():
    est = f.layer_norm(rows=1, dim=8, dtype="bf16")
    assert est.flops == 8 * 7 + (3 + f.TRANSCENDENTAL_FLOPS)
    assert est.bytes == 2 * 16 + 2 * 16


def test_residual_rms_norm_writes_the_sum_and_the_norm():
    est = f.residual_rms_norm(rows=1, dim=4, dtype="f32")
    norm = f.rms_norm(rows=1, dim=4, dtype="f32", gain=True)
    assert est.flops == norm.flops + 4
    assert est.bytes == norm.bytes + 32


def test_rope_reads_its_cos_and_sin_tables():
    est = f.rope(elements=2 * 4 * 64, positions=4, rotary_dim=64, dtype="bf16", table_dtype="f32")
    assert est.flops == 4 * 512
    assert est.bytes == 2 * 512 * 2 + 2 * 4 * 64 * 4


def test_silu_mul_reads_gate_and_up():
    est = f.silu_mul(elements=100, dtype="bf16")
    assert est == CostEstimate(flops=100 * (f.TRANSCENDENTAL_FLOPS + 4), bytes=600)


def test_attention_reads_kv_once_per_kv_head():
    est = f.attention(batch=1, heads=8, kv_heads=2, q_len=4, k_len=16, head_dim=8, dtype="f32")
    scores = 8 * 4 * 16
    assert est.matrix_flops == 4 * scores * 8
    assert est.flops - est.matrix_flops == scores * (4 + f.TRANSCENDENTAL_FLOPS) + 8 * 4 * 8
    assert est.bytes == 4 * (8 * 4 * 8 + 2 * 2 * 16 * 8 + 8 * 4 * 8)


def test_paged_attention_prices_occupancy_when_known_and_capacity_when_not():
    common = dict(seqs=2, heads=4, kv_heads=4, q_len=1, head_dim=8, dtype="bf16", block_size=16, blocks_per_seq=8)
    at_capacity = f.paged_attention(**common)
    occupied = f.paged_attention(**common, context_lens=[16, 40])
    kv_row = 2 * 4 * 8 * 2  # K and V, 4 heads, 8 dims, bf16: bytes per key
    fixed = 2 * (2 * 4 * 8 * 2) + 2 * 8 * 4 + 2 * 4  # Q and O, u32 block table, u32 lengths
    assert at_capacity.bytes == fixed + kv_row * 128 * 2
    assert occupied.bytes == fixed + kv_row * (16 + 40)
    assert occupied.flops < at_capacity.flops
    with pytest.raises(ValueError, match="2 sequences"):
        f.paged_attention(**common, context_lens=[1])


def test_decode_attention_on_h100_sxm_is_bandwidth_bound_within_one_percent():
    # Acceptance: batch 1, 32 heads, 1 query, 4096 keys, head dim 128, bf16.
    est = f.attention(batch=1, heads=32, kv_heads=32, q_len=1, k_len=4096, head_dim=128, dtype="bf16")
    h100 = device("h100-sxm")
    priced = roofline(est, h100)
    bandwidth_ns = est.bytes / h100.bandwidth_bytes_per_s * 1e9
    assert priced.bound is Bound.MEMORY
    roofline_ns = priced.ns - priced.overhead_ns
    assert abs(roofline_ns - bandwidth_ns) / bandwidth_ns < 0.01
    assert est.bytes == 2 * (32 * 128 * 2 + 2 * 32 * 4096 * 128)
