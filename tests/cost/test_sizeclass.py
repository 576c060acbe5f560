"""One size bucketing for the profiler and the cost provider."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuel.cost import size_class, size_class_attention, size_class_elements, size_class_matmul
from fuel.cost.sizeclass import log2_bucket


@pytest.mark.parametrize(
    "value, bucket",
    [(0, "z"), (1, "0"), (2, "1"), (3, "2"), (4096, "12"), (3000, "12"), (5792, "12"), (5793, "13")],
)
def test_log2_rounds_to_the_nearest_power(value, bucket):
    assert log2_bucket(value) == bucket


@given(st.integers(1, 2**200))
def test_bucket_is_the_nearest_integer_log2(value):
    exact = math.log2(value)
    assert abs(int(log2_bucket(value)) - exact) <= 0.5 + 1e-9


def test_elementwise_classes_share_a_bucket_and_matmul_keeps_its_aspect():
    assert size_class(elements=4096) == size_class_elements(3500) == "e12"
    gemv = size_class_matmul(batch=1, m=1, k=4096, n=4096)
    gemm = size_class_matmul(batch=1, m=64, k=512, n=512)
    assert gemv == "mm:b0:m0:k12:n12"
    assert gemm != gemv  # equal element counts, different problems
    assert size_class(matmul=(1, 1, 4096, 4096)) == gemv


def test_attention_keys_decode_apart_from_prefill():
    decode = size_class_attention(batch=1, heads=32, q_len=1, k_len=4096, head_dim=128)
    assert decode == "attn:b0:h5:q0:k12:d7"
    assert size_class(attention=(1, 32, 64, 64, 128)) != decode


def test_exactly_one_description_is_required():
    with pytest.raises(ValueError):
        size_class(elements=1, matmul=(1, 1, 1, 1))
    with pytest.raises(ValueError):
        size_class()
