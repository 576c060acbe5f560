"""The carrier (seed 002): a request only for a fused node with no kernel here, described
honestly (bind order then output, row-major strides, u32 indices never widened)."""

from __future__ import annotations

from fuel.graph import BackendId, DType, FusedOpParams, FusedOps, Graph, Node, PatternOp, Shape
from fuel.graph.ir import Const, Fused
from fuel.jit import ArchSku, ElementKind, JitBudget, jit_request_for_unplaceable_fused
from fuel.kernels import KernelBindingTable, KernelEntry, Precision

BUDGET = JitBudget(max_compile_ms=1_000)
PAGED = FusedOpParams.PagedAttn(softmax_scale=0.5, block_size=4, softcap=None)


def leaf(g: Graph, dims, dtype: DType) -> int:
    return g.push(Node(Const(), (), Shape.from_dims(dims), dtype))


def paged_node(g: Graph, index_dtype: DType = DType.U32) -> int:
    q = leaf(g, [1, 4, 1, 4], DType.F32)
    kc = leaf(g, [32, 4, 4, 4], DType.F32)
    vc = leaf(g, [32, 4, 4, 4], DType.F32)
    bt = leaf(g, [1, 8], index_dtype)
    cl = leaf(g, [1], DType.U32 if index_dtype is DType.I16 else index_dtype)
    return g.push(Node(Fused(FusedOps.PAGED_ATTN, PAGED), (q, kc, vc, bt, cl),
                       Shape.from_dims([1, 4, 1, 4]), DType.F32))


def test_builds_a_request_for_a_fused_op_with_no_kernel_here():
    # Why: the case the seam exists for; the index operands must stay U32 (widening them to I32
    # would make the request describe a different kernel).
    g = Graph()
    node = paged_node(g)
    request = jit_request_for_unplaceable_fused(g, node, BackendId.CUDA, KernelBindingTable(),
                                                ArchSku.SM89, BUDGET)
    assert request is not None
    assert len(request.operands) == 6, "5 inputs + 1 output, bind order then output"
    assert [o.dtype for o in request.operands] == [
        ElementKind.F32, ElementKind.F32, ElementKind.F32, ElementKind.U32, ElementKind.U32,
        ElementKind.F32]
    assert request.operands[3].dtype is not ElementKind.I32
    assert request.operands[1].shape == (32, 4, 4, 4)
    assert request.operands[1].strides == (64, 16, 4, 1)
    assert request.operands[3].strides == (8, 1)
    assert [o.alignment for o in request.operands] == [4, 4, 4, 4, 4, 4]
    assert isinstance(request.region, PatternOp), "a real op tree, not a bare bind"
    assert request.arch is ArchSku.SM89 and request.budget.max_compile_ms == 1_000


def test_declines_a_non_fused_node():
    # Why: a carrier answering every node would pass the test above; the trigger must be one.
    g = Graph()
    c = leaf(g, [4], DType.F32)
    assert jit_request_for_unplaceable_fused(g, c, BackendId.CUDA, KernelBindingTable(),
                                             ArchSku.SM89, BUDGET) is None


def test_declines_rather_than_approximating_an_unspellable_dtype():
    # Why: i16 is real in the graph and has no seam spelling; substituting a kind would ask the
    # synthesizer about a different kernel.
    g = Graph()
    node = paged_node(g, index_dtype=DType.I16)
    assert jit_request_for_unplaceable_fused(g, node, BackendId.CUDA, KernelBindingTable(),
                                             ArchSku.SM89, BUDGET) is None


def test_declines_a_node_with_a_kernel_on_the_backend():
    # Why: the seam is for gaps; a bound kernel under the exact key means nothing to synthesize.
    g = Graph()
    node = paged_node(g)
    table = KernelBindingTable()
    dtypes = (DType.F32, DType.F32, DType.F32, DType.U32, DType.U32, DType.F32)
    table.bind(FusedOps.PAGED_ATTN, dtypes, BackendId.CUDA,
               KernelEntry(lambda n: None, precision=Precision.RECIPE_TOLERANCE))
    assert jit_request_for_unplaceable_fused(g, node, BackendId.CUDA, table, ArchSku.SM89,
                                             BUDGET) is None
    # The same kernel on another backend leaves the gap open here.
    assert jit_request_for_unplaceable_fused(g, node, BackendId.CPU, table, ArchSku.CPU,
                                             BUDGET) is not None


def test_a_kernel_under_widened_index_dtypes_does_not_close_the_gap():
    # Why: the lookup keys on the exact dtypes; an i32-index kernel cannot serve u32 indices.
    g = Graph()
    node = paged_node(g)
    table = KernelBindingTable()
    widened = (DType.F32, DType.F32, DType.F32, DType.I32, DType.I32, DType.F32)
    table.bind(FusedOps.PAGED_ATTN, widened, BackendId.CPU, KernelEntry(lambda n: None))
    assert jit_request_for_unplaceable_fused(g, node, BackendId.CPU, table, ArchSku.CPU,
                                             BUDGET) is not None


def test_a_kernel_lacking_a_required_capability_does_not_close_the_gap():
    # Why: a soft-capped attention is not runnable on a kernel without `softcap`.
    g = Graph()
    q = leaf(g, [1, 4, 1, 4], DType.F32)
    kc = leaf(g, [32, 4, 4, 4], DType.F32)
    bt, cl = leaf(g, [1, 8], DType.U32), leaf(g, [1], DType.U32)
    capped = FusedOpParams.PagedAttn(softmax_scale=0.5, block_size=4, softcap=30.0)
    node = g.fused(FusedOps.PAGED_ATTN, capped, q, kc, kc, bt, cl)
    table = KernelBindingTable()
    dtypes = (DType.F32, DType.F32, DType.F32, DType.U32, DType.U32, DType.F32)
    table.bind(FusedOps.PAGED_ATTN, dtypes, BackendId.CPU, KernelEntry(lambda n: None))
    assert jit_request_for_unplaceable_fused(g, node, BackendId.CPU, table, ArchSku.CPU,
                                             BUDGET) is not None


def test_the_cpu_table_leaves_paged_attention_and_residual_rms_to_the_seam():
    # Why: the real CPU table's deliberate gaps are what the seam fills; softmax is covered.
    from fuel.kernels import cpu_table

    table = cpu_table()
    g = Graph()
    paged = paged_node(g)
    x = g.input("x", [1, 8], DType.F32)
    gain = g.weight("gain", [8], DType.F32)
    residual = g.fused(FusedOps.RESIDUAL_ADD_RMS_NORM, FusedOpParams.ResidualAddRmsNorm(1e-5),
                       x, x, gain)
    softmax = g.fused(FusedOps.SOFTMAX_LAST_DIM, FusedOpParams.SoftmaxLastDim(), x)
    ask = lambda n: jit_request_for_unplaceable_fused(g, n, BackendId.CPU, table, ArchSku.CPU,
                                                      BUDGET)
    assert ask(paged) is not None
    request = ask(residual)
    assert request is not None and request.output.shape == (2, 1, 8)
    assert ask(softmax) is None


def test_a_variant_arm_kernel_does_not_close_the_gap_but_a_default_kernel_does():
    # Why: torch's int4pack kernel is bound for Q4 quant_linear as a variant arm; if it made the
    # node runnable, the synthesizer would never be asked and could not compete with it.
    from fuel.kernels import cpu_table

    g = Graph()
    x = g.input("x", [1, 64], DType.F32)
    w = g.input("w", [32, 40], DType.U8)
    node = g.fused(FusedOps.QUANT_LINEAR, FusedOpParams.QuantLinear("q4_1", 64), x, w)
    table = cpu_table()
    ask = lambda: jit_request_for_unplaceable_fused(g, node, BackendId.CPU, table,  # noqa: E731
                                                    ArchSku.CPU, BUDGET)
    assert ask() is not None
    table.bind(FusedOps.QUANT_LINEAR, (DType.F32, DType.U8, DType.F32), BackendId.CPU,
               KernelEntry(lambda n: None, frozenset({"layout:q4_1"})))
    assert ask() is None


def test_structure_key_separates_index_dtypes_and_ignores_extents():
    # Why: per-operand dtypes are part of the key (u32 vs i32 indices are different kernels);
    # extents are not (one kernel serves every batch and context length).
    def request(index_dtype: DType, batch: int):
        g = Graph()
        q = g.input("q", [batch, 4, 1, 4], DType.F32)
        kc = g.input("k", [32, 4, 4, 4], DType.F32)
        bt, cl = g.input("bt", [batch, 8], index_dtype), g.input("cl", [batch], index_dtype)
        node = g.fused(FusedOps.PAGED_ATTN, PAGED, q, kc, kc, bt, cl)
        return jit_request_for_unplaceable_fused(g, node, BackendId.CPU, KernelBindingTable(),
                                                 ArchSku.CPU, BUDGET)

    assert request(DType.U32, 1).structure_key() == request(DType.U32, 3).structure_key()
    assert request(DType.U32, 1).structure_key() != request(DType.I32, 1).structure_key()
