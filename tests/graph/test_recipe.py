"""Recipes as data: emission, structural matching, the structural hash."""

import math
import subprocess
import sys

from fuel.graph import (
    Bind, DimOf, DType, EmitRefused, Graph, NoMatch, OpKind, PatternOp, Prim, Quot, RegionMatch,
    Slot, canonical_text, emit, fill_slots, match_region, structural_hash,
)
from fuel.graph.recipe import op


def _scaled_sum():
    """(x + y) * slot `scale`."""
    return op(OpKind.MUL_SCALAR, op(OpKind.ADD, Bind(0), Bind(1)), value=Slot("scale"))


def test_emit_types_and_pushes_the_region_and_returns_its_root():
    g = Graph()
    x, y = g.input("x", [2, 3], DType.F32), g.input("y", [2, 3], DType.F32)
    root = emit(g, _scaled_sum(), [x, y], {"scale": 0.5})
    assert isinstance(root, int) and len(g) == 4
    assert g.node(root).op == Prim.of(OpKind.MUL_SCALAR, value=0.5)
    assert g.node(g.node(root).inputs[0]).inputs == (x, y)


def test_emit_failure_is_a_value_and_leaves_the_graph_untouched():
    g = Graph()
    x, y = g.input("x", [2, 3], DType.F32), g.input("y", [4], DType.F32)
    refused = emit(g, _scaled_sum(), [x, y], {"scale": 0.5})  # [2,3] + [4] does not broadcast
    assert isinstance(refused, EmitRefused) and "broadcast" in refused.reason
    assert len(g) == 2
    missing_slot = emit(g, _scaled_sum(), [x, x])
    assert isinstance(missing_slot, EmitRefused) and "scale" in missing_slot.reason
    assert len(g) == 2


def test_equal_subtrees_emit_one_node():
    g = Graph()
    x = g.input("x", [4], DType.F32)
    e = op(OpKind.EXP, Bind(0))
    root = emit(g, op(OpKind.DIV, e, op(OpKind.SUM, e, dim=-1, keepdim=True)), [x])
    assert len(g) == 1 + 3  # exp once, sum, div
    assert g.node(root).inputs[0] == g.node(g.node(root).inputs[1]).inputs[0]


def test_shape_relative_attributes_resolve_against_the_bound_inputs():
    g = Graph()
    x = g.input("x", [3, 10], DType.F32)
    half = op(OpKind.SLICE, Bind(0), dim=-1, start=0, end=Quot(DimOf(0, -1), 2))
    root = emit(g, half, [x])
    assert g.node(root).shape.dims == (3, 5)
    assert isinstance(emit(g, op(OpKind.SLICE, Bind(0), dim=-1, start=0, end=Quot(DimOf(0, 0), 2)),
                           [x]), EmitRefused)  # 3 // 2 is not exact


def test_match_extracts_open_slots_and_binds():
    g = Graph()
    x, y = g.input("x", [2], DType.F32), g.input("y", [2], DType.F32)
    s = g.prim(OpKind.ADD, x, y)
    root = g.prim(OpKind.MUL_SCALAR, s, value=0.125)
    found = match_region(_scaled_sum(), g, root)
    assert found == RegionMatch(root, (x, y), (("scale", 0.125),))


def test_commutative_ops_match_either_way_round():
    g = Graph()
    x, w = g.input("x", [2], DType.F32), g.weight("w", [2], DType.F32)
    # The pattern wants silu(Bind 0) * Bind 1; the graph wrote the product the other way round.
    root = g.prim(OpKind.MUL, w, g.prim(OpKind.SILU, x))
    pattern = op(OpKind.MUL, op(OpKind.SILU, Bind(0)), Bind(1))
    assert match_region(pattern, g, root).binds == (x, w)
    # SUB is not commutative: the same swap does not match.
    sub_root = g.prim(OpKind.SUB, w, g.prim(OpKind.SILU, x))
    assert isinstance(match_region(op(OpKind.SUB, op(OpKind.SILU, Bind(0)), Bind(1)), g, sub_root),
                      NoMatch)


def test_a_repeated_bind_must_meet_the_same_node():
    g = Graph()
    x, y = g.input("x", [2], DType.F32), g.input("y", [2], DType.F32)
    square = op(OpKind.MUL, Bind(0), Bind(0))
    assert match_region(square, g, g.prim(OpKind.MUL, x, x)).binds == (x,)
    assert isinstance(match_region(square, g, g.prim(OpKind.MUL, x, y)), NoMatch)


def test_shape_relative_attributes_are_checked_when_matching():
    g = Graph()
    x = g.input("x", [3, 10], DType.F32)
    pattern = op(OpKind.SLICE, Bind(0), dim=-1, start=0, end=Quot(DimOf(0, -1), 2))
    assert isinstance(match_region(pattern, g, g.prim(OpKind.SLICE, x, dim=-1, start=0, end=5)),
                      RegionMatch)
    assert isinstance(match_region(pattern, g, g.prim(OpKind.SLICE, x, dim=-1, start=0, end=4)),
                      NoMatch)


def test_match_of_an_emitted_region_recovers_its_binds_and_slots():
    g = Graph()
    x, y = g.input("x", [2, 3], DType.F32), g.input("y", [2, 3], DType.F32)
    root = emit(g, _scaled_sum(), [x, y], {"scale": -math.inf})
    assert match_region(_scaled_sum(), g, root).slot_dict() == {"scale": -math.inf}


def test_structural_hash_ignores_commutative_operand_order_only():
    a = op(OpKind.ADD, Bind(0), op(OpKind.EXP, Bind(1)))
    b = op(OpKind.ADD, op(OpKind.EXP, Bind(1)), Bind(0))
    c = op(OpKind.SUB, Bind(0), op(OpKind.EXP, Bind(1)))
    d = op(OpKind.SUB, op(OpKind.EXP, Bind(1)), Bind(0))
    assert structural_hash(a) == structural_hash(b)
    assert structural_hash(c) != structural_hash(d)
    assert structural_hash(fill_slots(_scaled_sum(), {"scale": 0.5})) != structural_hash(
        fill_slots(_scaled_sum(), {"scale": 0.25}))


def test_structural_hash_is_stable_across_processes_and_hash_seeds():
    code = ("from fuel.graph.recipe import op, Bind, Slot; from fuel.graph import OpKind, "
            "structural_hash; print(structural_hash(op(OpKind.MUL_SCALAR, op(OpKind.ADD, Bind(0), "
            "Bind(1)), value=Slot('scale'))))")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={"PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert digests == {structural_hash(_scaled_sum())}
    assert canonical_text(_scaled_sum()) == "mul_scalar[value=?scale](add[]($0,$1))"


def test_fill_slots_replaces_named_slots_and_keeps_the_rest():
    region = op(OpKind.ADD_SCALAR, op(OpKind.MUL_SCALAR, Bind(0), value=Slot("a")), value=Slot("b"))
    filled = fill_slots(region, {"a": 2.0})
    assert isinstance(filled, PatternOp)
    assert filled.attr_dict() == {"value": Slot("b")}
    assert filled.operands[0].attr_dict() == {"value": 2.0}


# Property: whatever elementwise region is emitted, matching it at its root recovers the binds.
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_leaves = st.sampled_from([Bind(0), Bind(1)])


def _extend(children):
    unary = st.builds(lambda kind, x: op(kind, x), st.sampled_from([OpKind.EXP, OpKind.TANH, OpKind.NEG]),
                      children)
    scalar = st.builds(lambda x, v: op(OpKind.MUL_SCALAR, x, value=v), children,
                       st.floats(-4, 4, allow_nan=False))
    binary = st.builds(lambda kind, a, b: op(kind, a, b),
                       st.sampled_from([OpKind.ADD, OpKind.SUB, OpKind.MUL]), children, children)
    return unary | scalar | binary


@settings(max_examples=60, deadline=None)
@given(st.recursive(_leaves, _extend, max_leaves=8))
def test_emit_then_match_recovers_the_binds(region):
    g = Graph()
    x, y = g.input("x", [3], DType.F32), g.input("y", [3], DType.F32)
    root = emit(g, region, [x, y])
    if isinstance(region, Bind):
        assert root == (x, y)[region.index]
        return
    found = match_region(region, g, root)
    used = sorted({n.index for n in _walk_binds(region)})
    if used == list(range(len(used))):
        assert isinstance(found, RegionMatch) and found.binds == (x, y)[:len(used)]
    else:  # only Bind(1): a region must bind 0..n-1, so the match says why it declines
        assert isinstance(found, NoMatch) and "gaps" in found.reason


def _walk_binds(region):
    stack = [region]
    while stack:
        node = stack.pop()
        if isinstance(node, Bind):
            yield node
        else:
            stack.extend(node.operands)
