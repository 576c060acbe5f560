"""Dim expressions (SPEC §A2): parse, evaluate with overflow checks, rows must mention n."""

import pytest
from hypothesis import given, strategies as st

from fuel.circuit.dims import MAX_DIM, DimError, parse_dim, parse_shape


def test_sum_of_products_evaluates():
    expr = parse_dim("q_heads*head_dim + kv_heads*head_dim*2")
    assert expr.text == "q_heads*head_dim+kv_heads*head_dim*2"
    assert expr.names == {"q_heads", "head_dim", "kv_heads"}
    assert expr.evaluate({"q_heads": 32, "kv_heads": 8, "head_dim": 128}) == 32 * 128 + 2 * 8 * 128


@given(st.integers(1, 10**6), st.integers(1, 10**6), st.integers(1, 1000))
def test_evaluation_matches_arithmetic(a, b, c):
    assert parse_dim(f"{c}*a*b+a").evaluate({"a": a, "b": b}) == c * a * b + a


@pytest.mark.parametrize("text", ["", "a+", "+a", "a**b", "0*a", "a*0", "2a", "a-b", "a/b"])
def test_malformed_expressions_are_refused(text):
    with pytest.raises(DimError):
        parse_dim(text)


def test_undeclared_dim_is_refused_by_name():
    with pytest.raises(DimError, match="undeclared dim `hiden`"):
        parse_dim("hiden", {"hidden"})


def test_overflow_past_64_bits_is_an_error_not_a_wrap():
    with pytest.raises(DimError, match="overflows 64 bits"):
        parse_dim("a*b").evaluate({"a": 2**40, "b": 2**40})
    with pytest.raises(DimError, match="overflows"):
        parse_dim(f"{MAX_DIM}+a").evaluate({"a": 1})
    assert parse_dim("a*b").evaluate({"a": 2**31, "b": 2**31}) == 2**62


def test_evaluating_a_dim_without_a_value_names_it():
    with pytest.raises(DimError, match="dim `vocab`"):
        parse_dim("vocab").evaluate({})


def test_shape_rows_must_mention_n():
    rows, dim = parse_shape("n*top_k x 2*expert_intermediate", {"top_k", "expert_intermediate"})
    assert rows.names == {"n", "top_k"} and dim.text == "2*expert_intermediate"
    with pytest.raises(DimError, match="does not mention `n`"):
        parse_shape("top_k x hidden", {"top_k", "hidden"})
    with pytest.raises(DimError, match="not `<rows> x <dim>`"):
        parse_shape("n hidden", {"hidden"})
    with pytest.raises(DimError, match="undeclared dim `n`"):
        parse_shape("n x n", {"hidden"})
