"""The binding table: exact keys, typed misses, siblings, capabilities."""

import pytest

from fuel.graph import BackendId, DType, FusedOpParams, FusedOps, Graph, OpKind
from fuel.kernels import (
    KernelBindingTable, KernelEntry, KernelMissing, Precision, cpu_table, key_dtypes, op_key,
    required_caps,
)

F32, U32, I32 = DType.F32, DType.U32, DType.I32


def _entry(source, caps=()):
    return KernelEntry(lambda node: None, frozenset(caps), Precision.EXACT, None, source)


def test_lookup_miss_raises_a_typed_error_naming_op_dtypes_and_backend():
    table = KernelBindingTable.new()
    with pytest.raises(KernelMissing) as miss:
        table.lookup(FusedOps.PAGED_ATTN, (F32, F32, F32, U32, U32, F32), BackendId.CUDA)
    assert str(miss.value) == "no kernel for paged_attn [f32, f32, f32, u32, u32, f32] on cuda"
    assert miss.value.backend is BackendId.CUDA and miss.value.dtypes[3] is U32
    assert table.find(OpKind.ADD, (F32, F32, F32), BackendId.CPU) is None


def test_keys_are_exact_u32_is_not_i32_and_cpu_is_not_cuda():
    table = KernelBindingTable()
    table.bind(OpKind.INDEX_SELECT, (F32, U32, F32), BackendId.CPU, _entry("a"))
    assert table.lookup(OpKind.INDEX_SELECT, (F32, U32, F32), BackendId.CPU).kernel_source == "a"
    assert table.find(OpKind.INDEX_SELECT, (F32, I32, F32), BackendId.CPU) is None
    assert table.find(OpKind.INDEX_SELECT, (F32, U32, F32), BackendId.CUDA) is None


def test_siblings_keep_bind_order_and_filter_by_capabilities():
    table = KernelBindingTable()
    key = (FusedOps.FLASH_ATTN, (F32, F32, F32, F32), BackendId.CPU)
    table.bind(*key, _entry("plain", {"causal"}))
    table.bind(*key, _entry("capped", {"causal", "softcap"}))
    assert [e.kernel_source for e in table.lookup_alternatives(*key)] == ["plain", "capped"]
    assert table.lookup(*key, caps=frozenset({"softcap"})).kernel_source == "capped"
    with pytest.raises(KernelMissing, match="lack capabilities"):
        table.lookup(*key, caps=frozenset({"paged"}))


def test_required_caps_follow_the_params():
    g = Graph()
    q, k, v = (g.input(n, [1, 2, 3, 4], F32) for n in "qkv")
    plain = g.fused(FusedOps.FLASH_ATTN, FusedOpParams.FlashAttn(0.5, causal=False), q, k, v)
    capped = g.fused(FusedOps.FLASH_ATTN, FusedOpParams.FlashAttn(0.5, softcap=30.0), q, k, v)
    assert required_caps(g.node(plain)) == frozenset()
    assert required_caps(g.node(capped)) == frozenset({"causal", "softcap"})


def test_key_of_a_node_is_its_op_then_inputs_then_output_dtypes():
    g = Graph()
    table_w = g.weight("embed", [10, 4], DType.BF16)
    ids = g.input("ids", [3], U32)
    out = g.prim(OpKind.INDEX_SELECT, table_w, ids, dim=0)
    assert op_key(g.node(out).op) is OpKind.INDEX_SELECT
    assert key_dtypes(g, out) == (DType.BF16, U32, DType.BF16)
    assert op_key(g.node(ids).op) is None  # leaves have no kernel


def test_cpu_table_binds_every_primitive_in_f32_and_bf16_where_it_computes():
    table = cpu_table()
    bound = {key.op for key in table.keys()}
    assert set(OpKind) <= bound
    for dtype in (F32, DType.BF16):
        assert table.find(OpKind.MATMUL, (dtype, dtype, dtype), BackendId.CPU) is not None
        assert table.find(OpKind.RSQRT, (dtype, dtype), BackendId.CPU) is not None
    assert table.find(OpKind.ADD, (U32, U32, U32), BackendId.CPU) is not None
    assert table.find(OpKind.DIV, (I32, I32, I32), BackendId.CPU) is None  # no silent int division


def test_cpu_table_has_no_fused_kernel_for_paged_attn_residual_add_rms_norm_or_quant_linear():
    # quant_linear is a JIT request on the CPU: the native/numba synthesizer answers it per
    # layout. torch's int4pack kernel is bound for the Q4 layouts only as a variant arm, an arm
    # beside the recipe, never the node's own kernel.
    table = cpu_table()
    fused_keys = {key.op for key in table.keys() if isinstance(key.op, FusedOps)
                  and any(not e.variant_arm for e in table.lookup_alternatives(
                      key.op, key.dtypes, key.backend))}
    assert FusedOps.PAGED_ATTN not in fused_keys
    assert FusedOps.RESIDUAL_ADD_RMS_NORM not in fused_keys
    # moe too: it runs as its recipe (grouped expert_matmul) until the JIT adopts a kernel.
    assert FusedOps.MOE not in fused_keys
    assert fused_keys == set(FusedOps) - {FusedOps.PAGED_ATTN, FusedOps.RESIDUAL_ADD_RMS_NORM,
                                          FusedOps.QUANT_LINEAR, FusedOps.MOE}
    quant = (FusedOps.QUANT_LINEAR, (F32, DType.U8, F32), BackendId.CPU, frozenset({"layout:q4_1"}))
    assert table.find(*quant).variant_arm and table.find_default(*quant) is None
    with pytest.raises(KernelMissing, match="paged_attn"):
        table.lookup(FusedOps.PAGED_ATTN, (F32, F32, F32, U32, U32, F32), BackendId.CPU)
