"""llama.cpp block formats: the format table agrees with the gguf package, the dequantize
primitive means what the gguf reference dequantizer says, and unknown types are named."""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from fuel.circuit.format import GGUF_BLOCKS, FormatError, FormatKind, gguf_format, parse
from fuel.graph.dtype import DType
from fuel.graph.ir import Graph
from fuel.graph.ops import OpKind, ShapeError
from fuel.kernels import cpu_table
from fuel.kernels.quant_blocks import (
    UnsupportedTensorType, dequantize, format_of_gguf_type, packed_row_bytes, quantize_reference,
    random_blocks,
)


@pytest.mark.parametrize("layout", sorted(GGUF_BLOCKS))
def test_block_table_matches_the_gguf_package(layout):
    assert GGUF_BLOCKS[layout] == GGML_QUANT_SIZES[GGMLQuantizationType[layout.upper()]]


@pytest.mark.parametrize("layout", sorted(GGUF_BLOCKS))
def test_gguf_format_spelling_round_trips_and_counts_scale_bytes(layout):
    fmt = gguf_format(layout)
    assert parse(fmt.name()) == fmt and fmt.name() == f"gguf/{layout}"
    elements, block_bytes = GGUF_BLOCKS[layout]
    assert fmt.bytes(3, 2 * elements) == 3 * 2 * block_bytes
    assert fmt.is_quantized and not fmt.edge_legal


def test_hf_weight_only_formats_parse_and_count_their_scales():
    int4 = parse("int4/g128")
    assert int4.kind is FormatKind.INT4 and int4.name() == "int4/g128"
    # 4096 nibbles = 2048 bytes per row, 32 groups: f16 scales 64 bytes + 16 bytes of zeros.
    assert int4.bytes(1, 4096) == 2048 + 64 + 16
    assert parse("int8/channel").bytes(2, 8) == 16 + 4 * 2  # an f32 scale per row
    with pytest.raises(FormatError, match="gguf/q9_9"):
        parse("gguf/q9_9")


def test_unmapped_gguf_type_is_named_with_the_tensor():
    assert format_of_gguf_type("IQ4_NL") is None
    assert format_of_gguf_type("Q4_1") == gguf_format("q4_1")
    assert format_of_gguf_type("F16") == parse("f16")
    error = UnsupportedTensorType("m.gguf", "blk.0.attn_q.weight", "IQ4_NL")
    assert "blk.0.attn_q.weight" in str(error) and "IQ4_NL" in str(error)


@pytest.mark.parametrize("layout", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_quantized_values_dequantize_within_half_a_step(layout):
    values = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    packed = quantize_reference(values, layout)
    assert tuple(packed.shape) == (4, packed_row_bytes(layout, 64))
    back = dequantize(packed, layout, 64)
    levels = {"q8_0": 127, "q4_0": 8, "q4_1": 15, "q5_0": 16, "q5_1": 31}[layout]
    step = values.abs().max() / levels
    assert float((back - values).abs().max()) <= float(step)


def test_dequantize_primitive_runs_the_reference_on_the_cpu_table():
    packed = random_blocks("q4_k", 3, 256, torch.Generator().manual_seed(2))
    graph = Graph()
    leaf = graph.input("w", tuple(packed.shape), DType.U8)
    node = graph.prim(OpKind.DEQUANTIZE, leaf, layout="q4_k", cols=256)
    assert graph.node(node).shape.dims == (3, 256) and graph.node(node).dtype is DType.F32
    kernel = cpu_table().lookup(OpKind.DEQUANTIZE, (DType.U8, DType.F32), cpu_table_backend())
    got = kernel.kernel(graph.node(node))(packed)
    assert torch.equal(got, dequantize(packed, "q4_k", 256))
    assert torch.isfinite(got).all()


def test_dequantize_refuses_rows_that_are_not_whole_blocks():
    graph = Graph()
    leaf = graph.input("w", (2, 19), DType.U8)
    with pytest.raises(ShapeError, match="whole blocks"):
        graph.prim(OpKind.DEQUANTIZE, leaf, layout="q4_1", cols=32)


def cpu_table_backend():
    from fuel.graph.dtype import BackendId

    return BackendId.CPU
