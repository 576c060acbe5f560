"""The numba quantized matmul: for each block layout with a template, the adopted kernel equals
the dequantize-then-matmul recipe (stated tolerance: the JIT's f32 bound, 2e-5 absolute plus
2e-5 relative), on random blocks and on SmolLM2's own Q4_1 and Q8_0 rows; layouts without a
template are declined by name."""

from __future__ import annotations

import pytest
import torch

from fuel.graph.dtype import BackendId, DType
from fuel.graph.ir import Graph
from fuel.graph.registry import FusedOpParams, FusedOps, RuntimeFusedRegistry, recipe_for
from fuel.jit.adopt import Outcome, adopt, verify
from fuel.jit.protocol import Declined
from fuel.jit.quant_gemv import match_quant_linear
from fuel.kernels import RECIPE_TOLERANCE, cpu_table
from fuel.kernels.quant_blocks import KERNEL_LAYOUTS, dequantize, packed_row_bytes, random_blocks

from .helpers import request_for

TOLERANCE = RECIPE_TOLERANCE[DType.F32]


def quant_node(layout: str, rows: int, features: int, cols: int):
    graph = Graph()
    x = graph.input("x", (rows, cols), DType.F32)
    w = graph.input("w", (features, packed_row_bytes(layout, cols)), DType.U8)
    node = graph.fused(FusedOps.QUANT_LINEAR, FusedOpParams.QuantLinear(layout, cols), x, w)
    return graph, node


def synthesized(numba_synth, layout: str, rows: int, features: int, cols: int):
    graph, node = quant_node(layout, rows, features, cols)
    request = request_for(graph, node)
    assert request is not None and match_quant_linear(request.region).layout == layout
    result = numba_synth.synthesize(request)
    assert not isinstance(result, Declined), result
    return numba_synth.take_kernel(result.entry_point)


@pytest.mark.parametrize("layout", KERNEL_LAYOUTS)
def test_kernel_equals_dequantized_reference_on_random_blocks(numba_synth, layout):
    generator = torch.Generator().manual_seed(3)
    kernel = synthesized(numba_synth, layout, 3, 40, 96)
    w = random_blocks(layout, 40, 96, generator)
    x = torch.randn(3, 96, generator=generator)
    check = verify(kernel.run(x, w), x @ dequantize(w, layout, 96).T, TOLERANCE)
    assert check.ok, check.report


def test_adoption_verifies_and_binds_a_quant_linear_kernel(numba_synth):
    graph, node = quant_node("q4_1", 1, 64, 128)
    table, registry = cpu_table(), RuntimeFusedRegistry()
    record = adopt(numba_synth, request_for(graph, node), BackendId.CPU, table=table,
                   registry=registry)
    assert record.outcome in (Outcome.ADOPTED, Outcome.SLOWER), record.reason
    assert record.max_abs_error is not None and record.max_abs_error <= 1e-4


@pytest.mark.parametrize("layout", ["q4_k", "q5_k", "q6_k"])
def test_layouts_without_a_template_are_declined_by_name(numba_synth, layout):
    graph, node = quant_node(layout, 1, 4, 256)
    result = numba_synth.synthesize(request_for(graph, node))
    assert isinstance(result, Declined) and f"gguf/{layout}" in result.reason


def test_recipe_is_dequantize_then_matmul():
    graph, node = quant_node("q8_0", 2, 8, 64)
    region = recipe_for(graph, node)
    assert match_quant_linear(region).cols == 64


def test_kernels_equal_the_reference_on_smollm2_rows(numba_synth):
    from gguf import GGUFReader

    from fuel.runtime.weights import default_model_path

    reader = GGUFReader(default_model_path())
    tensors = {t.name: t for t in reader.tensors}
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(4))
    for name, layout in (("blk.0.ffn_gate.weight", "q4_1"), ("token_embd.weight", "q8_0")):
        assert tensors[name].tensor_type.name.lower() == layout
        w = torch.from_numpy(tensors[name].data[:512].copy())  # 512 rows keep the test quick
        kernel = synthesized(numba_synth, layout, 2, 512, 576)
        check = verify(kernel.run(x, w), x @ dequantize(w, layout, 576).T, TOLERANCE)
        assert check.ok, f"{name}: {check.report}"
