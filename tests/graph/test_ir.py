"""The arena: append-only ids, typed builders, seed spellings."""

import pytest

from fuel.graph import (
    BackendId, Const, DType, FusedOpParams, FusedOps, Graph, GraphError, Node, Op, OpKind, Shape,
)


def test_push_returns_ids_in_push_order_and_refuses_forward_reads():
    g = Graph()
    a = g.push(Node(op=Op.Const(), inputs=[], shape=Shape.from_dims([4]), dtype=DType.F32))
    b = g.prim(OpKind.EXP, a)
    assert (a, b) == (0, 1)
    assert g.node(a).inputs == ()  # lists are stored as tuples
    with pytest.raises(GraphError, match="reads 5"):
        g.push(Node(Const(), (5,), Shape((4,)), DType.F32))


def test_seed_spelling_of_fused_nodes_builds_a_typed_node():
    g = Graph()
    q = g.input("q", [1, 4, 1, 4], DType.F32)
    kc = g.input("kc", [32, 4, 4, 4], DType.F32)
    vc = g.input("vc", [32, 4, 4, 4], DType.F32)
    bt = g.input("bt", [1, 8], DType.U32)
    cl = g.input("cl", [1], DType.U32)
    params = FusedOpParams.PagedAttn(softmax_scale=0.5, block_size=4, softcap=None)
    node = g.fused(FusedOps.PAGED_ATTN, params, q, kc, vc, bt, cl)
    assert g.node(node).op == Op.Fused(FusedOps.PAGED_ATTN, params)
    assert g.node(node).shape == Shape((1, 4, 1, 4))
    assert g.describe(node) == "%5 = fused:paged_attn(0, 1, 2, 3, 4) : f32[1, 4, 1, 4]"


def test_side_tables_are_keyed_by_node_id():
    g = Graph()
    a = g.const(1.0, [2], DType.F32)
    g.target_backend[a] = BackendId.CUDA
    assert g.target_backend == {a: BackendId.CUDA}
    assert g.placement == {}


def test_rewire_replaces_only_the_named_input():
    g = Graph()
    a, b = g.const(1.0, [2], DType.F32), g.const(2.0, [2], DType.F32)
    s = g.prim(OpKind.ADD, a, a)
    g.rewire(s, a, b)
    assert g.node(s).inputs == (b, b)
    assert g.consumers()[b] == [s] and g.consumers()[a] == []
