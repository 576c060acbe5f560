"""Layer 1 on graph nodes: each family priced with the node's real shapes and params."""

from fuel.cost import CostEstimate
from fuel.cost import families as fam
from fuel.cost.estimate import Unestimated, estimate, judge_op_name, size_class_of
from fuel.graph import DType, FusedOpParams, FusedOps, Graph, OpKind


def attention_graph():
    g = Graph()
    q = g.input("q", [2, 8, 1, 16], DType.BF16)
    k_cache = g.input("kc", [10, 4, 2, 16], DType.BF16)
    v_cache = g.input("vc", [10, 4, 2, 16], DType.BF16)
    table = g.input("bt", [2, 3], DType.U32)
    lens = g.input("cl", [2], DType.U32)
    paged = g.fused(FusedOps.PAGED_ATTN, FusedOpParams.PagedAttn(softmax_scale=0.25, block_size=4), q, k_cache, v_cache, table, lens)
    k = g.input("k", [2, 2, "k_len", 16], DType.BF16)
    v = g.input("v", [2, 2, "k_len", 16], DType.BF16)
    flash = g.fused(FusedOps.FLASH_ATTN, FusedOpParams.FlashAttn(softmax_scale=0.25), q, k, v)
    return g, paged, flash


def test_matmul_with_batch_dims_reads_a_shared_weight_once():
    g = Graph()
    a = g.input("a", [3, 4, 5], DType.F32)
    b = g.input("b", [5, 6], DType.F32)
    m = g.prim(OpKind.MATMUL, a, b)
    assert estimate(g, m) == fam.matmul(batch=3, m=4, k=5, n=6, dtype="f32", a_batch=3, b_batch=1)
    assert estimate(g, m).bytes == 4 * (60 + 30 + 72)
    assert size_class_of(g, m) == "mm:b2:m2:k2:n3"


def test_linear_norm_rope_and_softmax_nodes_use_their_params():
    g = Graph()
    x = g.input("x", [4, 32], DType.F32)
    w = g.weight("w", [64, 32], DType.F32)
    gain = g.weight("g", [32], DType.F32)
    cos = g.input("cos", [4, 32], DType.F32)
    linear = g.fused(FusedOps.FUSED_LINEAR, FusedOpParams.FusedLinear(), x, w)
    norm = g.fused(FusedOps.RMS_NORM, FusedOpParams.RmsNorm(eps=1e-5), x, gain)
    rope = g.fused(FusedOps.ROPE, FusedOpParams.Rope(), x, cos, cos)
    soft = g.fused(FusedOps.SOFTMAX_LAST_DIM, FusedOpParams.SoftmaxLastDim(), x)
    assert estimate(g, linear) == fam.matmul(batch=1, m=4, k=32, n=64, dtype="f32")
    assert estimate(g, norm) == fam.rms_norm(4, 32, "f32", gain=True)
    assert estimate(g, rope) == fam.rope(128, 4, 32, "f32")
    assert estimate(g, soft) == fam.softmax(4, 32, "f32")
    assert estimate(g, soft).flops > 0 and estimate(g, norm).flops > 0
    assert judge_op_name(g.node(soft)) == "softmax_last_dim"
    assert size_class_of(g, linear) == "mm:b0:m2:k5:n6"


def test_symbolic_k_len_is_priced_at_its_capacity_and_declines_without_one():
    g, _, flash = attention_graph()
    priced = estimate(g, flash, symbols={"k_len": 4096})
    assert priced == fam.attention(batch=2, heads=8, kv_heads=2, q_len=1, k_len=4096, head_dim=16, dtype="bf16")
    unbound = estimate(g, flash)
    assert isinstance(unbound, Unestimated) and "k_len" in unbound.reason
    assert size_class_of(g, flash, symbols={"k_len": 4096}) == "attn:b1:h3:q0:k12:d4"
    assert size_class_of(g, flash) is None


def test_paged_attention_at_capacity_and_at_occupancy():
    g, paged, _ = attention_graph()
    capacity = estimate(g, paged)
    occupied = estimate(g, paged, context_lens=[5, 9])
    common = dict(seqs=2, heads=8, kv_heads=2, q_len=1, head_dim=16, dtype="bf16", block_size=4, blocks_per_seq=3)
    assert capacity == fam.paged_attention(**common)
    assert occupied == fam.paged_attention(**common, context_lens=[5, 9])
    assert occupied.bytes < capacity.bytes
    assert size_class_of(g, paged) == "attn:b1:h3:q0:k4:d4"  # 3 blocks x 4 slots = 12 keys


def test_views_launch_nothing_cost_one_host_call_and_leaves_cost_nothing():
    # Why: a view is metadata only (families.view): never a kernel launch.
    g = Graph()
    x = g.input("x", [4, 32], DType.F32)
    views = [g.prim(OpKind.TRANSPOSE, x, dim0=0, dim1=1), g.prim(OpKind.RESHAPE, x, shape=(128,)),
             g.prim(OpKind.UNSQUEEZE, x, dim=0), g.prim(OpKind.PERMUTE, x, dims=(1, 0))]
    for view in views:
        assert estimate(g, view) == CostEstimate(flops=0, bytes=0, launches=0, host_calls=1)
    assert estimate(g, x) == CostEstimate(flops=0, bytes=0, launches=0)


def test_transcendental_elementwise_ops_cost_more_than_adds():
    g = Graph()
    x = g.input("x", [1000], DType.F32)
    assert estimate(g, g.prim(OpKind.EXP, x)).flops == 1000 * fam.TRANSCENDENTAL_FLOPS
    assert estimate(g, g.prim(OpKind.ADD, x, x)) == CostEstimate(flops=1000, bytes=12000)
