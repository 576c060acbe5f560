"""DTypes, shapes and devices: honest sizes, distinct index types, symbolic dims."""

from fractions import Fraction

import pytest

from fuel.graph import BackendId, Device, DType, Shape


def test_u32_and_i32_are_distinct_values():
    # Widening an index operand changes which kernel is asked for; the types must not alias.
    assert DType.U32 != DType.I32
    assert DType.U32.size_in_bytes() == DType.I32.size_in_bytes() == 4


@pytest.mark.parametrize(("dtype", "size"), [
    (DType.BF16, 2), (DType.F32, 4), (DType.I64, 8), (DType.F8E4M3, 1), (DType.F8E5M2, 1),
    (DType.F6E2M3, Fraction(3, 4)), (DType.F6E3M2, Fraction(3, 4)), (DType.F4E2M1, Fraction(1, 2)),
])
def test_sizes_are_honest_including_sub_byte_floats(dtype, size):
    assert dtype.size_in_bytes() == size


def test_storage_of_sub_byte_types_rounds_up_to_whole_bytes():
    assert DType.F4E2M1.storage_bytes(3) == 2
    assert DType.F6E2M3.storage_bytes(4) == 3
    assert DType.BF16.storage_bytes(5) == 10


def test_shape_numel_is_none_when_a_dim_is_symbolic():
    assert Shape.from_dims([2, 3]).numel() == 6
    assert Shape.from_dims([2, "k_len"]).numel() is None
    assert not Shape.from_dims([2, "k_len"]).is_concrete


def test_shape_refuses_negative_and_non_dim_values():
    with pytest.raises(ValueError):
        Shape.from_dims([2, -1])
    with pytest.raises(TypeError):
        Shape.from_dims([2.0])


def test_device_spellings_round_trip():
    assert Device.parse("cpu") == Device(BackendId.CPU)
    assert Device.parse("cuda:1") == Device(BackendId.CUDA, 1)
    assert str(Device.parse("cuda:1")) == "cuda:1"
    assert str(Device.parse("cpu")) == "cpu"
