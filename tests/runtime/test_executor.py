"""The executor: every node through the table, typed misses, feeds and weights checked, and
only the lowered route executed."""

import pytest
import torch

from fuel.graph import (
    DType, FusedOpParams, FusedOps, Graph, OpKind, arm_interiors, branch_fused_over_recipe,
    collapse_variant_branch, decompose, lower, open_branch,
)
from fuel.kernels import KernelBindingTable, KernelMissing, cpu_table
from fuel.runtime import FeedMismatch, MissingFeed, MissingWeight, compile_program, execute

TABLE = cpu_table()
F32, U32 = DType.F32, DType.U32


def _paged_graph():
    g = Graph()
    q = g.input("q", [1, 4, 1, 4], F32)
    kc, vc = g.input("kc", [8, 4, 2, 4], F32), g.input("vc", [8, 4, 2, 4], F32)
    bt, cl = g.input("bt", [1, 2], U32), g.input("cl", [1], U32)
    node = g.fused(FusedOps.PAGED_ATTN, FusedOpParams.PagedAttn(0.5, 4), q, kc, vc, bt, cl)
    return g, node


def test_a_fused_node_without_a_kernel_is_a_typed_error_never_a_silent_decomposition():
    g, node = _paged_graph()
    with pytest.raises(KernelMissing) as miss:
        compile_program(g, lower(g, [node]), TABLE)
    assert str(miss.value) == "no kernel for paged_attn [f32, f32, f32, u32, u32, f32] on cpu"


def test_a_primitive_without_a_kernel_names_op_dtypes_and_backend():
    g = Graph()
    x = g.input("x", [2], F32)
    y = g.prim(OpKind.EXP, x)
    with pytest.raises(KernelMissing, match=r"no kernel for exp \[f32, f32\] on cpu"):
        compile_program(g, lower(g, [y]), KernelBindingTable())


def test_feeds_and_weights_are_checked_by_name_dtype_and_shape():
    g = Graph()
    x = g.input("x", [2, "n"], F32)
    w = g.weight("w", [2, 1], F32)
    y = g.prim(OpKind.MUL, x, w)
    with pytest.raises(MissingWeight, match="`w`"):
        compile_program(g, lower(g, [y]), TABLE)
    program = compile_program(g, lower(g, [y]), TABLE, weights={"w": torch.full((2, 1), 3.0)})
    assert program.run({"x": torch.ones(2, 5)})[y].tolist() == [[3.0] * 5] * 2
    with pytest.raises(MissingFeed, match="`x`"):
        program.run({})
    with pytest.raises(FeedMismatch, match=r"expected f32\[2, n\]"):
        program.run({"x": torch.ones(3, 5)})
    with pytest.raises(FeedMismatch):
        program.run({"x": torch.ones(2, 5, dtype=torch.bfloat16)})


def test_constants_are_materialized_once_with_the_node_dtype():
    g = Graph()
    c = g.const(2.5, [2], DType.BF16)
    y = g.prim(OpKind.MUL, c, c)
    out = execute(g, [y], TABLE, {})[y]
    assert out.dtype == torch.bfloat16 and out.tolist() == [6.25, 6.25]


def test_collapse_rewires_the_merge_and_the_losing_arm_never_executes():
    g = Graph()
    x, gain = g.input("x", [3, 16], F32), g.weight("gain", [16], F32)
    h = g.prim(OpKind.MUL_SCALAR, x, value=2.0)
    fused = g.fused(FusedOps.RMS_NORM, FusedOpParams.RmsNorm(1e-6), h, gain)
    merge = g.prim(OpKind.ADD, fused, h)
    branch = branch_fused_over_recipe(g, fused, merge)
    decomposed, fused_arm = arm_interiors(g, branch)
    weights = {"gain": torch.randn(16)}
    feeds = {"x": torch.randn(3, 16)}

    oracle = compile_program(g, lower(g, [merge]), TABLE, weights=weights)
    expected = oracle.run(feeds)[merge]
    assert oracle.executed_nodes == 1 + len(decomposed) + 1  # h, the recipe, the merge
    assert not set(oracle.executed) & fused_arm

    collapse_variant_branch(g, branch, 1)
    assert g.node(merge).inputs == (fused, h)
    program = compile_program(g, lower(g, [merge]), TABLE, weights=weights)
    out = program.run(feeds)[merge]
    assert program.executed == (h, fused, merge)
    assert program.executed_nodes == 3
    assert not set(program.executed) & decomposed, "the losing arm never runs"
    torch.testing.assert_close(out, expected)


def test_a_routed_arm_runs_instead_of_arm0_without_collapsing():
    g, node = _paged_graph()
    merge = g.prim(OpKind.MUL_SCALAR, node, value=1.0)
    branch = branch_fused_over_recipe(g, node, merge)
    assert branch is not None
    # Arm 1 (the fused paged_attn) has no CPU kernel: routing to it must fail loudly...
    with pytest.raises(KernelMissing):
        compile_program(g, lower(g, [merge], {branch: 1}), TABLE)
    # ...while arm 0, the decomposed oracle, runs.
    program = compile_program(g, lower(g, [merge], {branch: 0}), TABLE)
    assert node not in program.executed


def test_a_cache_write_runs_before_the_attention_that_reads_the_updated_cache():
    g = Graph()
    q = g.input("q", [1, 2, 1, 4], F32)
    kc, vc = g.input("kc", [2, 2, 2, 4], F32), g.input("vc", [2, 2, 2, 4], F32)
    k_new, v_new = g.input("k", [1, 2, 4], F32), g.input("v", [1, 2, 4], F32)
    slot, bt, cl = g.input("slot", [1], U32), g.input("bt", [1, 2], U32), g.input("cl", [1], U32)
    kc2 = g.prim(OpKind.KV_CACHE_WRITE, kc, k_new, slot)
    vc2 = g.prim(OpKind.KV_CACHE_WRITE, vc, v_new, slot)
    attn = decompose(g, g.fused(FusedOps.PAGED_ATTN, FusedOpParams.PagedAttn(0.5, 2), q, kc2, vc2, bt, cl))
    program = compile_program(g, lower(g, [attn]), TABLE)
    assert program.executed.index(kc2) < program.executed.index(attn)
    # One token at position 0 in block 1 (slot 2): attention over it returns its value row.
    v_row = torch.randn(1, 2, 4)
    out = program.run({"q": torch.randn(1, 2, 1, 4), "kc": torch.zeros(2, 2, 2, 4),
                       "vc": torch.zeros(2, 2, 2, 4), "k": torch.randn(1, 2, 4), "v": v_row,
                       "slot": torch.tensor([2], dtype=torch.uint32),
                       "bt": torch.tensor([[1, 0]], dtype=torch.uint32),
                       "cl": torch.tensor([1], dtype=torch.uint32)})[attn]
    torch.testing.assert_close(out[0, :, 0, :], v_row[0])


def test_a_branch_built_by_hand_lowers_only_what_the_roots_need():
    g = Graph()
    x = g.input("x", [4], F32)
    d = g.prim(OpKind.ADD_SCALAR, x, value=0.0)
    arm0 = g.prim(OpKind.TANH, d)
    merge = g.prim(OpKind.MUL_SCALAR, arm0, value=2.0)
    arm1 = g.prim(OpKind.SIGMOID, d)
    builder = open_branch(g, d)
    builder.add_arm(arm0)
    builder.add_arm(arm1)
    branch = builder.finalize(merge)
    program = compile_program(g, lower(g, [merge], {branch: 1}), TABLE)
    assert program.executed == (d, arm1, merge)
    out = program.run({"x": torch.zeros(4)})[merge]
    assert out.tolist() == [1.0] * 4  # 2 * sigmoid(0)


def test_a_value_computed_twice_runs_once_and_both_readers_get_it():
    g = Graph()
    x = g.input("x", [4], F32)
    first = g.prim(OpKind.MUL_SCALAR, g.prim(OpKind.TANH, x), value=2.0)
    again = g.prim(OpKind.MUL_SCALAR, g.prim(OpKind.TANH, x), value=2.0)
    other = g.prim(OpKind.MUL_SCALAR, g.prim(OpKind.TANH, x), value=3.0)
    program = compile_program(g, lower(g, [first, again, other]), TABLE)
    assert program.merged == 3  # the second tanh, its mul, the third tanh
    assert len(program.executed) == 3
    feed = torch.linspace(-1, 1, 4)
    out = program.run({"x": feed})
    torch.testing.assert_close(out[again], torch.tanh(feed) * 2)
    torch.testing.assert_close(out[first], out[again])
    torch.testing.assert_close(out[other], torch.tanh(feed) * 3)


def test_values_read_from_a_cache_written_in_place_are_never_merged_but_shapes_of_it_are():
    # A kv_cache_write mutates its cache: two reads of it with equal inputs may see different
    # contents, so both run. iota reads only the shape, which no write changes.
    g = Graph()
    kc, vc = g.input("kc", [2, 2, 1, 2], F32), g.input("vc", [2, 2, 1, 2], F32)
    rows, slot = g.input("rows", [1, 1, 2], F32), g.input("slot", [1], U32)
    k2 = g.prim(OpKind.KV_CACHE_WRITE, kc, rows, slot)
    v2 = g.prim(OpKind.KV_CACHE_WRITE, vc, rows, slot)
    sums = [g.prim(OpKind.SUM, g.prim(OpKind.RESHAPE, k2, shape=(-1,)), dim=0, keepdim=False)
            for _ in range(2)]
    positions = [g.prim(OpKind.IOTA, cache, dim=1, dtype=U32) for cache in (k2, v2)]
    program = compile_program(g, lower(g, [*sums, *positions]), TABLE)
    assert program.merged == 1 and positions[1] not in program.executed
    assert set(sums) <= set(program.executed)
    out = program.run({"kc": torch.zeros(2, 2, 1, 2), "vc": torch.zeros(2, 2, 1, 2),
                       "rows": torch.ones(1, 1, 2), "slot": torch.tensor([3], dtype=torch.uint32)})
    assert float(out[sums[0]]) == float(out[sums[1]]) == 2.0
    assert out[positions[1]].tolist() == [0, 1]


def test_a_timed_run_returns_the_same_values_and_one_duration_per_executed_node():
    g = Graph()
    x = g.input("x", [8], F32)
    y = g.prim(OpKind.NEG, g.prim(OpKind.EXP, g.prim(OpKind.TANH, x)))
    program = compile_program(g, lower(g, [y]), TABLE)
    feed = torch.randn(8)
    out, seconds = program.run_timed({"x": feed})
    assert len(seconds) == len(program.executed) == 3
    assert all(s >= 0 for s in seconds)
    torch.testing.assert_close(out[y], program.run({"x": feed})[y])
    assert program.executed_nodes == 3


def test_a_slice_that_takes_back_a_concatenated_part_reads_the_part_and_the_concat_never_runs():
    g = Graph()
    x = g.input("x", [2, 3], F32)
    a, b = g.prim(OpKind.TANH, x), g.prim(OpKind.EXP, x)
    joined = g.prim(OpKind.CONCAT, a, b, dim=1)
    gate = g.prim(OpKind.SLICE, joined, dim=-1, start=0, end=3)
    up = g.prim(OpKind.SLICE, joined, dim=1, start=3, end=6)
    across = g.prim(OpKind.SLICE, joined, dim=1, start=2, end=4)  # straddles both parts
    out = g.prim(OpKind.MUL, gate, up)
    program = compile_program(g, lower(g, [out]), TABLE)
    kinds = [g.node(n).op.kind for n in program.executed]
    assert OpKind.CONCAT not in kinds and OpKind.SLICE not in kinds
    feed = torch.randn(2, 3)
    torch.testing.assert_close(program.run({"x": feed})[out], torch.tanh(feed) * torch.exp(feed))
    straddling = compile_program(g, lower(g, [across]), TABLE)
    assert OpKind.CONCAT in [g.node(n).op.kind for n in straddling.executed]
    torch.testing.assert_close(straddling.run({"x": feed})[across],
                               torch.cat([torch.tanh(feed), torch.exp(feed)], 1)[:, 2:4])
