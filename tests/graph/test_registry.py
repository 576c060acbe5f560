"""The fused-op registry: every static op has params, a shape rule and a recipe that decomposes
into primitives; the runtime sidecar registers, deduplicates and refuses regions."""

import pytest

from fuel.graph import (
    SPECS, Bind, DType, Fused, FusedOpParams, FusedOps, Graph, Node, OpKind, PatternOp, Prim,
    RegionRefused, RuntimeFusedParams, RuntimeFusedRegistry, Shape, ShapeError, Slot,
    canonical_text, decompose, recipe_for, structural_hash,
)
from fuel.graph.branch import ancestors
from fuel.graph.recipe import op

F32 = DType.F32


def _inputs(g, *specs):
    return [g.input(f"in{i}", dims, dtype) for i, (dims, dtype) in enumerate(specs)]


CASES = {
    "softmax": (FusedOps.SOFTMAX_LAST_DIM, FusedOpParams.SoftmaxLastDim(), [([2, 7], F32)]),
    "rms_gain": (FusedOps.RMS_NORM, FusedOpParams.RmsNorm(1e-6), [([2, 3, 8], F32), ([8], F32)]),
    "rms_plain": (FusedOps.RMS_NORM, FusedOpParams.RmsNorm(1e-6, has_gain=False), [([2, 8], F32)]),
    "layer_norm": (FusedOps.LAYER_NORM, FusedOpParams.LayerNorm(1e-5),
                   [([2, 8], F32), ([8], F32), ([8], F32)]),
    "rope": (FusedOps.ROPE, FusedOpParams.Rope(),
             [([1, 2, 5, 8], F32), ([5, 8], F32), ([5, 8], F32)]),
    "linear": (FusedOps.FUSED_LINEAR, FusedOpParams.FusedLinear(), [([3, 8], F32), ([4, 8], F32)]),
    "linear_bias": (FusedOps.FUSED_LINEAR, FusedOpParams.FusedLinear(has_bias=True),
                    [([3, 8], F32), ([4, 8], F32), ([4], F32)]),
    "silu_mul": (FusedOps.SILU_MUL, FusedOpParams.SiluMul(), [([2, 6], F32), ([2, 6], F32)]),
    "residual_rms": (FusedOps.RESIDUAL_ADD_RMS_NORM, FusedOpParams.ResidualAddRmsNorm(1e-6),
                     [([2, 8], F32), ([2, 8], F32), ([8], F32)]),
    "flash": (FusedOps.FLASH_ATTN, FusedOpParams.FlashAttn(0.25),
              [([1, 4, 3, 8], F32), ([1, 2, 5, 8], F32), ([1, 2, 5, 8], F32)]),
    "flash_symbolic": (FusedOps.FLASH_ATTN, FusedOpParams.FlashAttn(0.25, softcap=30.0),
                       [([1, 4, 1, 8], F32), ([1, 2, "k_len", 8], F32), ([1, 2, "k_len", 8], F32)]),
    "paged": (FusedOps.PAGED_ATTN, FusedOpParams.PagedAttn(0.5, 4),
              [([2, 4, 1, 8], F32), ([16, 4, 2, 8], F32), ([16, 4, 2, 8], F32),
               ([2, 3], DType.U32), ([2], DType.U32)]),
    "quant_linear": (FusedOps.QUANT_LINEAR, FusedOpParams.QuantLinear("q4_1", 32),
                     [([3, 32], F32), ([4, 20], DType.U8)]),
    "moe": (FusedOps.MOE, FusedOpParams.Moe(2, True),
            [([3, 8], F32), ([3, 4], F32), ([4, 12, 8], F32), ([4, 8, 6], F32)]),
    "moe_shared": (FusedOps.MOE, FusedOpParams.Moe(2, False, shared=True),
                   [([3, 8], F32), ([3, 4], F32), ([4, 12, 8], F32), ([4, 8, 6], F32),
                    ([3, 8], F32), ([3, 1], F32)]),
}


def _build(case):
    fused_id, params, specs = CASES[case]
    g = Graph()
    node = g.fused(fused_id, params, *_inputs(g, *specs))
    return g, node


def test_every_static_fused_op_has_a_spec_and_a_case_here():
    assert set(SPECS) == set(FusedOps)
    assert {fused_id for fused_id, _, _ in CASES.values()} == set(FusedOps)


@pytest.mark.parametrize("case", sorted(CASES))
def test_recipe_for_returns_a_primitive_region_without_touching_the_graph(case):
    g, node = _build(case)
    before = len(g)
    region = recipe_for(g, node)
    assert isinstance(region, PatternOp)
    assert len(g) == before


@pytest.mark.parametrize("case", sorted(CASES))
def test_decompose_reproduces_the_node_with_primitives_only(case):
    g, node = _build(case)
    root = decompose(g, node)
    assert root != node
    assert (g.node(root).shape, g.node(root).dtype) == (g.node(node).shape, g.node(node).dtype)
    region = [n for n in ancestors(g, [root]) if n > node]
    assert region and all(isinstance(g.node(n).op, Prim) for n in region)
    assert set(ancestors(g, [root])) - set(region) <= set(g.node(node).inputs)


def test_residual_add_rms_norm_stacks_its_two_results_on_a_leading_axis():
    g, node = _build("residual_rms")
    assert g.node(node).shape == Shape((2, 2, 8))


def test_paged_attn_region_keeps_u32_index_operands():
    # Widening the block table / context lengths to i32 or i64 would describe a different
    # kernel (the JIT's MixedDtype decline would turn into a false acceptance).
    g, node = _build("paged")
    region = recipe_for(g, node)
    assert not any(isinstance(n, PatternOp) and n.tag is OpKind.CAST for n in _walk(region))
    text = canonical_text(region)
    assert "DType.u32" in text and "DType.i32" not in text and "DType.i64" not in text
    root = decompose(g, node)
    block_table, context_lens = g.node(node).inputs[3:]
    index_path = [n for n in ancestors(g, [root]) if n > node and not g.node(n).dtype.is_float
                  and g.node(n).dtype is not DType.BOOL]
    assert index_path, "the slot and position arithmetic is part of the region"
    assert {g.node(n).dtype for n in index_path} == {DType.U32}
    readers = {n for n in index_path if block_table in g.node(n).inputs or context_lens in g.node(n).inputs}
    assert readers, "the region reads the index operands directly, not a widened copy"


def test_paged_attn_index_dtype_follows_the_operands():
    g = Graph()
    q, kc, vc = _inputs(g, ([1, 2, 1, 4], F32), ([4, 2, 1, 4], F32), ([4, 2, 1, 4], F32))
    bt, cl = g.input("bt", [1, 2], DType.I32), g.input("cl", [1], DType.I32)
    node = g.fused(FusedOps.PAGED_ATTN, FusedOpParams.PagedAttn(0.5, 2), q, kc, vc, bt, cl)
    assert "DType.i32" in canonical_text(recipe_for(g, node))


def _walk(region):
    stack = [region]
    while stack:
        n = stack.pop()
        yield n
        if isinstance(n, PatternOp):
            stack.extend(n.operands)


@pytest.mark.parametrize(("fused_id", "params", "specs", "message"), [
    (FusedOps.PAGED_ATTN, FusedOpParams.PagedAttn(0.5, 8),
     [([1, 4, 1, 8], F32), ([16, 4, 2, 8], F32), ([16, 4, 2, 8], F32), ([1, 3], DType.U32),
      ([1], DType.U32)], "block size 4 != params block_size 8"),
    (FusedOps.PAGED_ATTN, FusedOpParams.PagedAttn(0.5, 4),
     [([1, 4, 1, 8], F32), ([16, 4, 2, 8], F32), ([16, 4, 2, 8], F32), ([1, 3], DType.F32),
      ([1], DType.U32)], "index dtype"),
    (FusedOps.FLASH_ATTN, FusedOpParams.FlashAttn(0.5),
     [([1, 3, 1, 8], F32), ([1, 2, 4, 8], F32), ([1, 2, 4, 8], F32)], "not a multiple of kv heads"),
    (FusedOps.RMS_NORM, FusedOpParams.RmsNorm(1e-6), [([2, 8], F32), ([4], F32)], r"must be \[8\]"),
    (FusedOps.RMS_NORM, FusedOpParams.RmsNorm(1e-6, has_gain=False), [([2, 8], F32), ([8], F32)],
     "expects 1 inputs"),
    (FusedOps.ROPE, FusedOpParams.Rope(), [([2, 7], F32), ([2, 7], F32), ([2, 7], F32)], "even"),
    (FusedOps.SILU_MUL, FusedOpParams.RmsNorm(1e-6), [([2], F32), ([2], F32)], "are not SiluMul"),
])
def test_shape_rules_refuse_with_the_op_and_the_value(fused_id, params, specs, message):
    g = Graph()
    with pytest.raises(ShapeError, match=message):
        g.fused(fused_id, params, *_inputs(g, *specs))


def test_decompose_is_total_and_returns_the_node_itself_on_any_failure():
    g = Graph()
    x = g.input("x", [2, 8], F32)
    assert decompose(g, x) == x  # not fused
    wrong_arity = g.push(Node(Fused(FusedOps.RMS_NORM, FusedOpParams.RmsNorm(1e-6)), (x,),
                              Shape((2, 8)), F32))
    unknown = g.push(Node(Fused(0x8123, RuntimeFusedParams()), (x,), Shape((2, 8)), F32))
    lying_shape = g.push(Node(Fused(FusedOps.SOFTMAX_LAST_DIM, FusedOpParams.SoftmaxLastDim()),
                              (x,), Shape((3, 3)), F32))
    wrong_params = g.push(Node(Fused(FusedOps.SOFTMAX_LAST_DIM, "nonsense"), (x,), Shape((2, 8)), F32))
    before = len(g)
    for node in (wrong_arity, unknown, lying_shape, wrong_params):
        assert decompose(g, node) == node
    assert len(g) == before, "a declined decomposition pushes nothing"


def test_runtime_ids_start_at_0x8000_and_equal_regions_share_one_id():
    registry = RuntimeFusedRegistry()
    gelu_ish = op(OpKind.MUL, Bind(0), op(OpKind.SIGMOID, op(OpKind.MUL_SCALAR, Bind(0), value=1.702)))
    swapped = op(OpKind.MUL, op(OpKind.SIGMOID, op(OpKind.MUL_SCALAR, Bind(0), value=1.702)), Bind(0))
    first = registry.register_runtime_fused("gelu_quick", gelu_ish)
    assert first == 0x8000
    assert registry.register_runtime_fused("gelu_quick_again", swapped) == first
    second = registry.register_runtime_fused("silu_mul_jit", op(OpKind.MUL, op(OpKind.SILU, Bind(0)), Bind(1)))
    assert second == 0x8001 and len(registry) == 2
    assert registry.find_by_hash(structural_hash(gelu_ish)) == first


@pytest.mark.parametrize(("region", "reason"), [
    (Bind(0), "bare bind"),
    (op(OpKind.ADD, Bind(0), Bind(2)), "gap"),
    (PatternOp("softmax", (Bind(0),)), "has no primitive"),
    (op(OpKind.KV_CACHE_WRITE, Bind(0), Bind(1), Bind(2)), "effect"),
])
def test_regions_that_cannot_be_re_emitted_are_refused(region, reason):
    with pytest.raises(RegionRefused, match=reason) as refused:
        RuntimeFusedRegistry().register_runtime_fused("bad", region)
    assert refused.value.name == "bad"


def test_a_name_cannot_name_two_regions():
    registry = RuntimeFusedRegistry()
    registry.register_runtime_fused("r", op(OpKind.EXP, Bind(0)))
    with pytest.raises(RegionRefused, match="already names"):
        registry.register_runtime_fused("r", op(OpKind.TANH, Bind(0)))


def test_runtime_node_recipe_fills_its_slots_and_decomposes():
    registry = RuntimeFusedRegistry()
    rid = registry.register_runtime_fused("scaled_exp", op(OpKind.EXP, op(
        OpKind.MUL_SCALAR, Bind(0), value=Slot("scale"))))
    g = Graph()
    x = g.input("x", [4], F32)
    node = g.push(Node(Fused(rid, RuntimeFusedParams((("scale", 2.0),))), (x,), Shape((4,)), F32))
    assert recipe_for(g, node) is None, "without the registry the id is unknown"
    region = recipe_for(g, node, registry)
    assert region.operands[0].attr_dict() == {"value": 2.0}
    root = decompose(g, node, registry)
    assert g.node(root).op == Prim.of(OpKind.EXP)


def test_decompose_lets_a_bug_propagate_instead_of_declining():
    # Why: a blanket `except Exception` turned any bug in recipe lookup into "no recipe", so
    # the node silently stayed fused (and read as "no kernel").
    class Broken(RuntimeError):
        pass

    class BrokenRegistry:
        def get(self, fused_id):
            raise Broken("registry bug")

    g = Graph()
    x = g.input("x", [2, 8], F32)
    node = g.push(Node(Fused(0x8123, RuntimeFusedParams()), (x,), Shape((2, 8)), F32))
    with pytest.raises(Broken):
        decompose(g, node, BrokenRegistry())


def test_moe_recipe_routes_each_token_through_its_top_k_experts_only():
    """The moe recipe against a direct per-token loop: softmax, top 2 renormalized, each chosen
    expert's SwiGLU MLP, the weighted sum (Mixtral's semantics)."""
    import torch

    from fuel.kernels import cpu_table
    from fuel.runtime.executor import execute

    g, node = _build("moe")
    root = decompose(g, node)
    gen = torch.Generator().manual_seed(0)
    names = [g.node(i).op.name for i in g.node(node).inputs]
    feeds = {n: torch.randn(tuple(g.node(i).shape.dims), generator=gen)
             for n, i in zip(names, g.node(node).inputs)}
    h, logits, gate_up, down = (feeds[n] for n in names)
    got = execute(g, [root], cpu_table(), feeds)[root]
    for t in range(3):
        weights, chosen = torch.topk(logits[t].softmax(-1), 2)
        weights = weights / weights.sum()
        expected = sum(w * (down[e] @ (torch.nn.functional.silu(gate_up[e, :6] @ h[t])
                                        * (gate_up[e, 6:] @ h[t])))
                       for w, e in zip(weights, chosen.tolist()))
        assert torch.allclose(got[t], expected, atol=1e-5)


def _half_cache_attention(kv_dtype, cache_dtype):
    g = Graph()
    q = g.input("q", [2, 6, 1, 16], DType.F32)
    k, v = (g.input(name, [10, 4, 2, 16], cache_dtype) for name in ("k", "v"))
    table, lens = g.input("table", [2, 3], DType.U32), g.input("lens", [2], DType.U32)
    params = FusedOpParams.PagedAttn(0.25, 4, None, kv_dtype)
    return g, g.fused(FusedOps.PAGED_ATTN, params, q, k, v, table, lens)


def test_paged_attention_over_a_half_precision_cache_widens_only_the_rows_it_reads():
    import torch

    from fuel.graph import decompose, lower
    from fuel.kernels import cpu_table
    from fuel.runtime import compile_program

    g, node = _half_cache_attention(DType.BF16, DType.BF16)
    assert g.node(node).dtype is DType.F32  # the query's dtype
    root = decompose(g, node)
    assert root != node
    casts = [n for n in ancestors(g, [root]) if getattr(g.node(n).op, "kind", None) is OpKind.CAST]
    assert len(casts) == 2  # keys and values, after the gather: the cache itself is never cast
    assert all(g.node(g.node(c).inputs[0]).shape.dims[0] == 2 for c in casts)  # [B, Hkv, L, D]
    generator = torch.Generator().manual_seed(3)
    feeds = {"q": torch.randn(2, 6, 1, 16, generator=generator),
             "k": torch.randn(10, 4, 2, 16, generator=generator).bfloat16(),
             "v": torch.randn(10, 4, 2, 16, generator=generator).bfloat16(),
             "table": torch.tensor([[3, 1, 7], [0, 9, 2]], dtype=torch.uint32),
             "lens": torch.tensor([11, 4], dtype=torch.uint32)}
    got = compile_program(g, lower(g, [root]), cpu_table()).run(feeds)[root]
    widened = dict(feeds, k=feeds["k"].float(), v=feeds["v"].float())
    f32, reference = _half_cache_attention(None, DType.F32)
    reference_root = decompose(f32, reference)
    want = compile_program(f32, lower(f32, [reference_root]), cpu_table()).run(widened)[reference_root]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("kv_dtype,cache_dtype", [(None, DType.BF16), (DType.BF16, DType.F32),
                                                  (DType.F16, DType.BF16)])
def test_paged_attention_refuses_caches_that_are_not_its_stated_kv_dtype(kv_dtype, cache_dtype):
    with pytest.raises(ShapeError, match="paged_attn"):
        _half_cache_attention(kv_dtype, cache_dtype)
