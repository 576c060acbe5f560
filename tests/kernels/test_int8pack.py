"""Per-channel int8 weights as packed rows (``int8_channel``) and torch's int8 weight-only CPU kernel
as their ``quant_linear`` arm: the row layout's bytes are the format's, the reference dequantizer
means ``f32(q) * scale``, torch's kernel computes what the module says it does (checked, not
assumed), its product is the recipe's within the derived bound and the f32 recipe tolerance at
every shape tried, the table binds it as a variant arm for that layout only, and a weight is
converted once and not kept past its kernels."""

from __future__ import annotations

import pytest
import torch

from fuel.circuit.format import INT8_CHANNEL_LAYOUT, ROW_LAYOUTS, parse, row_bytes, row_cols
from fuel.graph.dtype import BackendId, DType
from fuel.graph.ir import Graph
from fuel.graph.ops import OpKind, ShapeError
from fuel.graph.registry import FusedOpParams, FusedOps
from fuel.jit.adopt import verify
from fuel.kernels import RECIPE_TOLERANCE, cpu_table, required_caps
from fuel.kernels.int8pack import KERNEL_SOURCE, Int8Packed, error_bound
from fuel.kernels.quant_blocks import (
    dequantize, int8_channel_parts, pack_int8_channel, packed_row_bytes, quantize_int8_channel,
    random_blocks,
)

from tests.kernels.test_weight_only import quant_node

LAYOUT = INT8_CHANNEL_LAYOUT
TOLERANCE = RECIPE_TOLERANCE[DType.F32]


def test_a_packed_row_is_the_int8_weights_then_an_f32_scale():
    q = torch.tensor([[1, -2, 127], [-128, 0, 5]], dtype=torch.int8)
    scale = torch.tensor([0.5, 0.25])
    packed = pack_int8_channel(q, scale)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (2, 3 + 4)
    assert torch.equal(packed[:, :3].view(torch.int8), q)
    assert torch.equal(packed[:, 3:].contiguous().view(torch.float32).reshape(2), scale)
    assert torch.equal(dequantize(packed, LAYOUT, 3),
                       torch.tensor([[0.5, -1.0, 63.5], [-32.0, 0.0, 1.25]]))


@pytest.mark.parametrize(("rows", "cols"), [(1536, 576), (57, 33), (1, 1)])
def test_packed_rows_occupy_exactly_the_formats_weight_bytes(rows, cols):
    # Why: planning prices int8/channel with Format.weight_bytes; the rows a run holds must be
    # those bytes, scales included (one f32 per output row, not per input column).
    packed = random_blocks(LAYOUT, rows, cols, torch.Generator().manual_seed(0))
    assert packed.numel() == parse("int8/channel").weight_bytes(rows, cols) == rows * (cols + 4)
    assert packed_row_bytes(LAYOUT, cols) == row_bytes(LAYOUT, cols) == cols + 4
    assert row_cols(LAYOUT, cols + 4) == cols and ROW_LAYOUTS[LAYOUT] == (1, 1)


def test_the_reference_dequantizer_is_q_times_its_rows_scale_in_f32():
    generator = torch.Generator().manual_seed(1)
    packed = random_blocks(LAYOUT, 40, 96, generator)
    q, scale = int8_channel_parts(packed, 96)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and tuple(scale.shape) == (40,)
    assert int(q.min()) == -128 and int(q.max()) == 127, "random rows use every int8"
    expected = q.double() * scale.double()[:, None]  # exact in f64, then one f32 rounding
    assert torch.equal(dequantize(packed, LAYOUT, 96), expected.float())
    batched = dequantize(packed.reshape(4, 10, 100), LAYOUT, 96)
    assert torch.equal(batched.reshape(40, 96), dequantize(packed, LAYOUT, 96))


def test_symmetric_quantization_stays_within_half_a_step_and_keeps_zero_rows_zero():
    values = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    values[3] = 0.0
    q, scale = quantize_int8_channel(values)
    assert q.dtype == torch.int8 and float(scale[3]) == 0.0 and not bool(q[3].any())
    assert torch.allclose(scale, values.abs().amax(dim=1) / 127)
    back = dequantize(pack_int8_channel(q, scale), LAYOUT, 64)
    assert bool(((back - values).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all())


def test_the_shape_rules_require_the_rows_tail():
    graph = Graph()
    x = graph.input("x", (2, 64), DType.F32)
    good = graph.input("good", (8, 68), DType.U8)
    node = graph.fused(FusedOps.QUANT_LINEAR, FusedOpParams.QuantLinear(LAYOUT, 64), x, good)
    assert graph.node(node).shape.dims == (2, 8)
    assert graph.node(graph.prim(OpKind.DEQUANTIZE, good, layout=LAYOUT, cols=64)).shape.dims == (8, 64)
    tailless = graph.input("tailless", (8, 64), DType.U8)
    with pytest.raises(ShapeError, match="68"):
        graph.fused(FusedOps.QUANT_LINEAR, FusedOpParams.QuantLinear(LAYOUT, 64), x, tailless)
    with pytest.raises(ShapeError, match="68"):
        graph.prim(OpKind.DEQUANTIZE, tailless, layout=LAYOUT, cols=64)


def test_torch_int8pack_scales_each_output_row_of_the_int8_matrix():
    # Why: the whole arm rests on this reading of torch's CPU kernel; pin it (and that it
    # refuses the strided view of the rows, the reason for the one conversion).
    generator = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (57, 33), generator=generator, dtype=torch.int8)
    scale = torch.rand(57, generator=generator) + 0.01
    got = torch.ops.aten._weight_int8pack_mm(torch.eye(33), q, scale).T
    assert torch.equal(got, q.float() * scale[:, None]), "one rounding of q * scale[row]"
    packed = pack_int8_channel(q, scale)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.aten._weight_int8pack_mm(torch.eye(33), packed[:, :33].view(torch.int8), scale)


def test_the_kernel_multiplies_exactly_the_reference_weights():
    packed = random_blocks(LAYOUT, 57, 33, torch.Generator().manual_seed(4))
    held = Int8Packed.convert(packed, 33)
    assert held.weight.is_contiguous() and held.nbytes() == packed.numel()
    assert torch.equal(held.matmul(torch.eye(33)).T, dequantize(packed, LAYOUT, 33))


@pytest.mark.parametrize(("rows", "out", "cols"), [
    (1, 1536, 576), (1, 57, 33), (2, 40, 64), (7, 100, 96), (16, 57, 576), (64, 40, 512),
    (100, 17, 130),
])
def test_the_product_is_the_recipe_within_the_derived_bound_and_the_f32_tolerance(rows, out, cols):
    # One row (decode), a padded prompt chunk (16, 64) and odd sizes: output rows that are not
    # a multiple of 16 and input widths that are not a multiple of 32.
    generator = torch.Generator().manual_seed(rows * 1000 + out)
    packed = random_blocks(LAYOUT, out, cols, generator)
    x = torch.randn(rows, cols, generator=generator)
    weights = dequantize(packed, LAYOUT, cols)
    got = Int8Packed.convert(packed, cols).matmul(x)
    recipe = x @ weights.T
    assert tuple(got.shape) == (rows, out) and got.dtype == torch.float32
    bound = error_bound(x, weights)
    assert bool(((got.double() - recipe.double()).abs() <= bound).all())
    check = verify(got, recipe, TOLERANCE)
    assert check.ok, check.report


def test_the_derived_bound_is_tight_enough_to_catch_a_wrong_scale():
    # The bound is an accuracy claim, not a formality: one row's scale read from its neighbour
    # breaks it.
    generator = torch.Generator().manual_seed(5)
    packed = random_blocks(LAYOUT, 40, 256, generator)
    x = torch.randn(3, 256, generator=generator)
    weights = dequantize(packed, LAYOUT, 256)
    held = Int8Packed.convert(packed, 256)
    held.scales = held.scales.roll(1)
    wrong = held.matmul(x)
    assert not bool(((wrong.double() - (x @ weights.T).double()).abs() <= error_bound(x, weights)).all())


def test_batched_rows_run_as_one_matrix():
    generator = torch.Generator().manual_seed(6)
    packed = random_blocks(LAYOUT, 40, 64, generator)
    held = Int8Packed.convert(packed, 64)
    x = torch.randn(2, 3, 64, generator=generator)
    assert torch.equal(held.matmul(x).reshape(6, 40), held.matmul(x.reshape(6, 64)))


@pytest.mark.parametrize("layout", ["q8_0", "q4_1", "bf16"])
def test_int8pack_serves_no_other_layout(layout):
    graph, node = quant_node(layout)
    entry = cpu_table().find(FusedOps.QUANT_LINEAR, (DType.F32, DType.U8, DType.F32),
                             BackendId.CPU, required_caps(graph.node(node)))
    assert entry is None or entry.kernel_source != KERNEL_SOURCE
