"""Primitive shape/dtype rules: what each op produces and how it refuses."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuel.graph import DType, Graph, OpKind, Predicate, Shape, ShapeError, infer


def test_index_select_has_take_semantics_for_embedding_lookup():
    g = Graph()
    table = g.weight("embed", [100, 8], DType.BF16)
    ids = g.input("ids", [2, 5], DType.U32)
    out = g.prim(OpKind.INDEX_SELECT, table, ids, dim=0)
    assert g.node(out).shape == Shape((2, 5, 8))
    assert g.node(out).dtype is DType.BF16


def test_matmul_broadcasts_batch_dims_and_keeps_symbols():
    shape, dtype = infer(OpKind.MATMUL, {}, [Shape((2, 4, 3, 16)), Shape((1, 4, 16, "k_len"))],
                         [DType.F32, DType.F32])
    assert shape == Shape((2, 4, 3, "k_len")) and dtype is DType.F32


def test_matmul_refuses_mismatched_inner_dims_naming_the_shapes():
    with pytest.raises(ShapeError, match=r"matmul.*\[2, 3\] @ \[4, 5\]"):
        infer(OpKind.MATMUL, {}, [Shape((2, 3)), Shape((4, 5))], [DType.F32, DType.F32])


def test_binary_ops_refuse_mixed_dtypes_instead_of_promoting():
    with pytest.raises(ShapeError, match="f32, bf16"):
        infer(OpKind.ADD, {}, [Shape((2,)), Shape((2,))], [DType.F32, DType.BF16])


def test_compare_yields_bool_and_where_needs_a_bool_condition():
    shape, dtype = infer(OpKind.COMPARE, {"predicate": Predicate.GT}, [Shape((3,)), Shape((3, 1))],
                         [DType.I64, DType.I64])
    assert (shape, dtype) == (Shape((3, 3)), DType.BOOL)
    with pytest.raises(ShapeError, match="condition must be bool"):
        infer(OpKind.WHERE, {}, [Shape((3,))] * 3, [DType.F32] * 3)


def test_reshape_resolves_minus_one_and_refuses_a_wrong_count():
    assert infer(OpKind.RESHAPE, {"shape": (-1, 4)}, [Shape((2, 3, 4))], [DType.F32])[0] == Shape((6, 4))
    with pytest.raises(ShapeError, match="cannot reshape"):
        infer(OpKind.RESHAPE, {"shape": (5, 5)}, [Shape((2, 3))], [DType.F32])


def test_unknown_or_missing_attributes_are_refused():
    with pytest.raises(ShapeError, match=r"missing \['dim'\]"):
        infer(OpKind.UNSQUEEZE, {}, [Shape((2,))], [DType.F32])
    with pytest.raises(ShapeError, match=r"unknown \['bogus'\]"):
        infer(OpKind.EXP, {"bogus": 1}, [Shape((2,))], [DType.F32])


def test_iota_and_size_read_extents_at_run_time_so_symbols_survive():
    assert infer(OpKind.IOTA, {"dim": 2, "dtype": DType.U32}, [Shape((1, 2, "k_len"))],
                 [DType.F32]) == (Shape(("k_len",)), DType.U32)
    assert infer(OpKind.SIZE, {"dim": 0, "dtype": DType.I64}, [Shape((7,))], [DType.F32]) == (
        Shape(()), DType.I64)


def test_kv_cache_write_returns_the_cache_shape_and_needs_index_slots():
    g = Graph()
    cache = g.input("k_cache", [8, 4, 2, 16], DType.F32)
    rows = g.input("k", [3, 2, 16], DType.F32)
    slots = g.input("slots", [3], DType.U32)
    out = g.prim(OpKind.KV_CACHE_WRITE, cache, rows, slots)
    assert g.node(out).shape == g.node(cache).shape
    bad = g.input("bad_slots", [3], DType.F32)
    with pytest.raises(ShapeError, match="index operand"):
        g.prim(OpKind.KV_CACHE_WRITE, cache, rows, bad)


dims = st.lists(st.integers(1, 4), min_size=0, max_size=4)


@given(dims, dims)
def test_broadcast_is_symmetric_when_it_succeeds(a, b):
    # ADD is commutative, so its shape rule must not depend on operand order.
    def attempt(x, y):
        try:
            return infer(OpKind.ADD, {}, [Shape(tuple(x)), Shape(tuple(y))], [DType.F32] * 2)
        except ShapeError:
            return None
    assert attempt(a, b) == attempt(b, a)
