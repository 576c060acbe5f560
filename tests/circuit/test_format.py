"""Formats (SPEC §A1): one spelling each, edge legality, exact byte counts with scales."""

import pytest
from hypothesis import given, strategies as st

from fuel.circuit.format import Format, FormatError, FormatKind, Scale, ScaleKind, parse

ALL_NAMES = ["bf16", "f16", "f32", "i32", "fp8/tensor", "fp8/token", "fp8/channel", "fp8/g128",
             "fp8/block128x128", "nvfp4/g16", "mxfp4/g32"]


@pytest.mark.parametrize("name", ALL_NAMES)
def test_every_format_round_trips_through_its_name(name):
    assert parse(name).name() == name
    assert parse(parse(name).name()) == parse(name)


@given(st.sampled_from(["fp8", "nvfp4"]), st.integers(min_value=1, max_value=4096))
def test_group_scales_round_trip_for_any_group(head, group):
    fmt = parse(f"{head}/g{group}")
    assert fmt == Format(FormatKind(head), Scale(ScaleKind.GROUP, group=group))
    assert parse(fmt.name()) == fmt


@pytest.mark.parametrize("text", ["BF16", "fp8", "fp8/Token", "fp8/g0", "fp8/g012", "nvfp4/tensor",
                                  "mxfp4/g16", "fp8/block0x4", "int4", "fp8/token/x", ""])
def test_other_spellings_are_refused_naming_the_text(text):
    with pytest.raises(FormatError) as caught:
        parse(text)
    assert f"`{text}`" in str(caught.value) or text == ""


@pytest.mark.parametrize("name,legal", [("bf16", True), ("fp8/token", True), ("fp8/tensor", True),
                                        ("fp8/g128", True), ("nvfp4/g16", True), ("mxfp4/g32", True),
                                        ("fp8/channel", False), ("fp8/block128x128", False)])
def test_channel_and_block_scales_are_weight_only(name, legal):
    assert parse(name).edge_legal is legal


def test_plain_bytes_are_element_size_times_elements():
    assert parse("bf16").bytes(3, 5) == 30
    assert parse("f32").bytes(3, 5) == 60
    assert parse("i32").bytes(2, 1) == 8


def test_fp8_bytes_count_each_scale_as_f32():
    assert parse("fp8/tensor").bytes(4, 256) == 4 * 256 + 4
    assert parse("fp8/token").bytes(4, 256) == 4 * 256 + 4 * 4
    assert parse("fp8/channel").bytes(4, 256) == 4 * 256 + 4 * 4  # one scale per row
    assert parse("fp8/g128").bytes(4, 384) == 4 * 384 + 4 * (4 * 3)
    assert parse("fp8/block128x128").bytes(200, 300) == 200 * 300 + 4 * (2 * 3)


def test_channel_scales_count_one_per_output_row_of_a_weight():
    # Why: a per-channel weight [out, in] is priced weight_bytes(out, in); its scales are one
    # per output channel (compressed-tensors' weight_scale [out, 1]), so a 1536x576 up
    # projection carries 1536 of them, not 576.
    assert parse("int8/channel").weight_bytes(1536, 576) == 1536 * 576 + 4 * 1536
    assert parse("fp8/channel").weight_bytes(1536, 576) == 1536 * 576 + 4 * 1536


def test_four_bit_bytes_pack_two_per_byte_and_count_one_byte_scales():
    # nvfp4: packed data, one E4M3 byte per group of 16, plus f32 global scales.
    assert parse("nvfp4/g16").weight_bytes(2, 48) == 2 * 24 + 2 * 3 + 4
    # mxfp4: packed data and one E8M0 byte per 32 elements; no global scale.
    assert parse("mxfp4/g32").bytes(2, 64) == 2 * 32 + 2 * 2


@given(st.sampled_from(ALL_NAMES), st.integers(0, 64), st.integers(0, 4))
def test_bytes_grow_with_rows(name, rows, groups):
    fmt = parse(name)
    dim = 128 * groups  # a multiple of every group in ALL_NAMES
    assert fmt.bytes(rows + 1, dim) >= fmt.bytes(rows, dim) >= 0


def test_nvfp4_activations_carry_one_global_scale_per_row_weights_one_per_tensor():
    # Why: an activation's rows are quantized one by one (a global scale each); a weight has
    # one global scale. Edge bytes must count every row's.
    fmt = parse("nvfp4/g16")
    data, block_scales = 3 * 16, 3 * 2
    assert fmt.bytes(3, 32) == data + block_scales + 3 * 4
    assert fmt.weight_bytes(3, 32) == data + block_scales + 4
    assert fmt.bytes(0, 32) == 0


@pytest.mark.parametrize(("name", "dim", "group"), [("fp8/g128", 300, 128), ("nvfp4/g16", 33, 16),
                                                    ("mxfp4/g32", 48, 32)])
def test_a_dim_that_does_not_divide_into_the_scale_group_has_no_size(name, dim, group):
    # Why: a partial group was rounded up silently; no kernel stores one.
    from fuel.circuit.format import UnsizedFormat

    for size in (parse(name).bytes, parse(name).weight_bytes):
        with pytest.raises(UnsizedFormat) as caught:
            size(2, dim)
        assert (caught.value.format, caught.value.dim, caught.value.group) == (name, dim, group)
        assert f"`{name}`" in str(caught.value) and str(dim) in str(caught.value)


def test_block_scales_keep_partial_edge_tiles():
    assert parse("fp8/block128x128").weight_bytes(200, 300) == 200 * 300 + 4 * (2 * 3)
