"""torch's int4 weight-only CPU kernel as the table's Q4_0/Q4_1/Q4_K ``quant_linear`` arm: what
torch's kernel computes (checked, not assumed), that the GGUF mapping reproduces the reference
dequantizer bit for bit (random blocks and the shipped SmolLM2 file's tensors), that the product
is the recipe's within the f32 recipe tolerance, that the table binds it as a variant arm for
those layouts only, and that a weight is converted once and not kept past its kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fuel.graph.dtype import BackendId, DType
from fuel.graph.registry import FusedOps
from fuel.jit.adopt import verify
from fuel.kernels import RECIPE_TOLERANCE, cpu_table, required_caps
from fuel.kernels.int4pack import GROUP, LAYOUTS, Int4Packed, nibbles_scales_zeros
from fuel.kernels.quant_blocks import dequantize, packed_row_bytes, quantize_reference, random_blocks
from tests.kernels.test_weight_only import quant_node

TOLERANCE = RECIPE_TOLERANCE[DType.F32]
COLS = {"q4_0": 512, "q4_1": 512, "q4_1x8": 544, "q4_k": 512}  # q4_1x8: a short last group


def _kernel_weights(held: Int4Packed, stride: int = 1) -> torch.Tensor:
    """The weights torch's kernel multiplies by (every ``stride``-th input feature, which with a
    stride under 32 still reads every group): its product with rows of the identity."""
    eye = torch.eye(held.cols)[::stride]
    return held.matmul(eye).T.contiguous()


def test_torch_int4pack_dequantizes_a_nibble_as_q_minus_8_times_scale_plus_zero():
    # Why: the whole mapping rests on this reading of torch's CPU kernel; pin it.
    generator = torch.Generator().manual_seed(0)
    rows, cols = 32, 128
    q = torch.randint(0, 16, (rows, cols), generator=generator, dtype=torch.int32)
    scale = torch.rand(cols // GROUP, rows, generator=generator) * 0.1 + 0.01
    zero = torch.randn(cols // GROUP, rows, generator=generator) * 0.1
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(
        torch.eye(cols), packed, GROUP, torch.stack([scale, zero], -1).contiguous()).T
    expected = ((q - 8).double() * scale.T.double().repeat_interleave(GROUP, 1)
                + zero.T.double().repeat_interleave(GROUP, 1))
    # Each weight is one fused (or one rounded) multiply-add in f32: within an ulp.
    assert float((got.double() - expected).abs().max()) <= 2.0 ** -23 * float(expected.abs().max())
    unsigned = q.double() * scale.T.double().repeat_interleave(GROUP, 1)
    assert float((got.double() - unsigned).abs().max()) > 0.1, "the -8 offset is real"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_mapping_reproduces_the_reference_dequantizer_bit_for_bit(layout, seed):
    cols = COLS[layout]
    packed = random_blocks(layout, 48, cols, torch.Generator().manual_seed(seed))
    q, scale, zero = nibbles_scales_zeros(packed, layout, cols)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    mapped = ((q.float() - 8) * scale.repeat_interleave(GROUP, 1)
              + zero.repeat_interleave(GROUP, 1))
    assert torch.equal(mapped, dequantize(packed, layout, cols))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_kernel_multiplies_exactly_the_reference_weights(layout):
    cols = COLS[layout]
    packed = random_blocks(layout, 64, cols, torch.Generator().manual_seed(7))
    held = Int4Packed.convert(packed, layout, cols)
    assert torch.equal(_kernel_weights(held), dequantize(packed, layout, cols))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_the_product_is_the_recipe_within_the_f32_tolerance(layout, rows):
    # 40 output rows: not a multiple of torch's 16, so the padding is exercised too.
    cols = COLS[layout]
    generator = torch.Generator().manual_seed(rows)
    packed = random_blocks(layout, 40, cols, generator)
    x = torch.randn(rows, cols, generator=generator)
    held = Int4Packed.convert(packed, layout, cols)
    got = held.matmul(x)
    assert tuple(got.shape) == (rows, 40) and got.is_contiguous()
    check = verify(got, x @ dequantize(packed, layout, cols).T, TOLERANCE)
    assert check.ok, check.report
    batched = held.matmul(x.reshape(1, rows, cols))
    assert torch.equal(batched.reshape(rows, 40), got)


@pytest.fixture(scope="module")
def shipped():
    """The shipped SmolLM2 GGUF's tensors by name (read once: the reader takes seconds)."""
    from gguf import GGUFReader

    from fuel.runtime.weights import default_model_path

    return {t.name: t for t in GGUFReader(default_model_path()).tensors}


def _pack_q4_k(values: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks of f32 ``[rows, cols]`` values: round-to-nearest nibbles under 6-bit
    scales and mins (rounded up), enough to give the mapping a trained model's distribution;
    the gguf package's dequantizer judges the packing."""
    rows, cols = values.shape
    blocks = values.astype(np.float32).reshape(-1, 8, 32)
    n = blocks.shape[0]
    low = np.minimum(blocks.min(axis=-1), 0.0)
    step = (blocks.max(axis=-1) - low) / 15
    d = (step.max(axis=-1) / 63.0).astype(np.float16)
    dmin = ((-low).max(axis=-1) / 63.0).astype(np.float16)
    df, mf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.ceil(np.divide(step, df, out=np.zeros_like(step), where=df > 0)), 0, 63)
    mn = np.clip(np.ceil(np.divide(-low, mf, out=np.zeros_like(low), where=mf > 0)), 0, 63)
    a, b = (df * sc)[..., None], (mf * mn)[..., None]
    q = np.clip(np.round(np.divide(blocks + b, a, out=np.zeros_like(blocks), where=a > 0)), 0, 15)
    q = q.astype(np.uint8).reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    scales = np.zeros((n, 12), np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    packed = np.concatenate([d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8),
                             scales, qs], axis=1)
    return packed.reshape(rows, -1)


def test_every_q4_1_tensor_of_two_shipped_layers_maps_exactly(shipped):
    # The shipped file is Q4_1: its first and last layers' seven projections, as stored.
    tensors = shipped
    names = [n for n in tensors if n.startswith(("blk.0.", "blk.29.")) and n.endswith(".weight")
             and tensors[n].tensor_type.name == "Q4_1"]
    assert len(names) == 14
    x = torch.randn(3, 1536, generator=torch.Generator().manual_seed(3))
    for name in names:
        tensor = tensors[name]
        cols = int(tensor.shape[0])
        packed = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
        reference = dequantize(packed, "q4_1", cols)
        q, scale, zero = nibbles_scales_zeros(packed, "q4_1", cols)
        mapped = ((q.float() - 8) * scale.repeat_interleave(GROUP, 1)
                  + zero.repeat_interleave(GROUP, 1))
        assert torch.equal(mapped, reference), name
        held = Int4Packed.convert(packed, "q4_1", cols)
        # The kernel's own reading of the weights, a column in 24 (every group).
        assert torch.equal(_kernel_weights(held, 24), reference[:, ::24]), name
        check = verify(held.matmul(x[:, :cols]), x[:, :cols] @ reference.T, TOLERANCE)
        assert check.ok, f"{name}: {check.report}"


@pytest.mark.parametrize("layout", ["q4_0", "q4_k"])
def test_shipped_weights_requantized_to_q4_0_and_q4_k_map_exactly(shipped, layout):
    # No shipped tensor is Q4_0 or Q4_K: SmolLM2's own ffn_down rows (K = 1536) are quantized
    # to each, so the mapping sees a trained model's scales and outliers.
    tensor = shipped["blk.0.ffn_down.weight"]
    values = dequantize(torch.from_numpy(np.array(tensor.data[:200], dtype=np.uint8)), "q4_1", 1536)
    if layout == "q4_0":
        packed = quantize_reference(values, "q4_0")
    else:
        packed = torch.from_numpy(_pack_q4_k(values.numpy()))
    assert tuple(packed.shape) == (200, packed_row_bytes(layout, 1536))
    reference = dequantize(packed, layout, 1536)
    assert float((reference - values).pow(2).mean().sqrt()) < 0.15 * float(values.std())
    q, scale, zero = nibbles_scales_zeros(packed, layout, 1536)
    mapped = (q.float() - 8) * scale.repeat_interleave(GROUP, 1) + zero.repeat_interleave(GROUP, 1)
    assert torch.equal(mapped, reference)
    held = Int4Packed.convert(packed, layout, 1536)
    assert torch.equal(_kernel_weights(held, 24), reference[:, ::24])


@pytest.mark.parametrize("layout", ["q8_0", "q5_0", "q5_1", "q5_k", "q6_k", "bf16"])
def test_no_kernel_serves_a_quant_linear_over_another_layout(layout):
    graph, node = quant_node(layout)
    assert cpu_table().find(FusedOps.QUANT_LINEAR, (DType.F32, DType.U8, DType.F32),
                            BackendId.CPU, required_caps(graph.node(node))) is None
