"""torch's weight-only CPU kernels as variant arms of ``quant_linear`` (int4pack over the 4-bit
GGUF layouts, int8pack over ``int8_channel`` rows): bound beside the recipe (arm 0) never as the
node's own kernel, run by the executor where a node routes to them, and their weights converted
once, shared by every kernel that reads them and dropped with the last
(:class:`fuel.kernels.held.HeldConversions`). The format-specific mappings and bounds are in
``test_int4pack.py`` and ``test_int8pack.py``."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from fuel.graph.dtype import BackendId, DType
from fuel.graph.ir import Graph
from fuel.graph.registry import FusedOpParams, FusedOps
from fuel.jit.adopt import verify
from fuel.kernels import RECIPE_TOLERANCE, cpu_table, int4pack, int8pack, required_caps
from fuel.kernels.quant_blocks import dequantize, packed_row_bytes, random_blocks

TOLERANCE = RECIPE_TOLERANCE[DType.F32]


@dataclass(frozen=True)
class Arm:
    module: Any
    factory: Any
    weights: Any
    layouts: tuple[str, ...]
    get_args: tuple
    held_bytes: int  # of a 48 x 256 weight's conversion

    def __str__(self) -> str:
        return self.module.__name__.rsplit(".", 1)[-1]


ARMS = [
    Arm(int4pack, int4pack.quant_linear_int4pack, int4pack.INT4_WEIGHTS, ("q4_1", "q4_0", "q4_k"),
        ("q4_1", 256), 48 * 256 // 2 + 48 * (256 // int4pack.GROUP) * 8),  # 0.75 bytes a weight
    Arm(int8pack, int8pack.quant_linear_int8pack, int8pack.INT8_WEIGHTS, ("int8_channel",),
        (256,), 48 * (256 + 4)),  # the packed rows' own size
]


def quant_node(layout: str, rows: int = 48, cols: int = 256):
    """A graph with one ``quant_linear`` over a ``rows x cols`` weight packed in ``layout``."""
    graph = Graph()
    x = graph.input("x", (2, cols), DType.F32)
    w = graph.input("w", (rows, packed_row_bytes(layout, cols)), DType.U8)
    node = graph.fused(FusedOps.QUANT_LINEAR, FusedOpParams.QuantLinear(layout, cols), x, w)
    return graph, node


@pytest.mark.parametrize("arm", ARMS, ids=str)
def test_the_cpu_table_binds_the_kernel_as_a_variant_arm_for_its_layouts(arm):
    table = cpu_table()
    for layout in arm.layouts:
        graph, node = quant_node(layout)
        key = (FusedOps.QUANT_LINEAR, (DType.F32, DType.U8, DType.F32), BackendId.CPU,
               required_caps(graph.node(node)))
        entry = table.find(*key)
        assert entry is not None and entry.variant_arm, layout
        assert entry.kernel_source == arm.module.KERNEL_SOURCE, layout
        assert table.find_default(*key) is None, "never the node's own kernel: the recipe is arm 0"


@pytest.mark.parametrize("arm", ARMS, ids=str)
def test_the_executor_runs_the_variant_where_a_node_routes_to_it(arm):
    from fuel.graph import lower
    from fuel.runtime import compile_program

    layout = arm.layouts[0]
    graph, node = quant_node(layout, rows=40)
    generator = torch.Generator().manual_seed(5)
    feeds = {"x": torch.randn(2, 256, generator=generator),
             "w": random_blocks(layout, 40, 256, generator)}
    got = compile_program(graph, lower(graph, [node]), cpu_table()).run(feeds)[node]
    check = verify(got, feeds["x"] @ dequantize(feeds["w"], layout, 256).T, TOLERANCE)
    assert check.ok, check.report


@pytest.mark.parametrize("arm", ARMS, ids=str)
def test_a_weight_is_converted_once_for_all_its_kernels_and_dropped_with_them(arm):
    layout = arm.layouts[0]
    graph, node = quant_node(layout)
    w = random_blocks(layout, 48, 256, torch.Generator().manual_seed(6))
    x = torch.randn(2, 256)
    gc.collect()
    before = len(arm.weights)
    first, second = (arm.factory(graph.node(node)) for _ in range(2))
    assert torch.equal(first(x, w), second(x, w))
    assert len(arm.weights) == before + 1, "one conversion shared by both kernels"
    held = arm.weights.get(w, *arm.get_args)
    assert held.nbytes() == arm.held_bytes
    del first, second, held
    gc.collect()
    assert len(arm.weights) == before, "no kernel reads it: the copy is gone"


@pytest.mark.parametrize("arm", ARMS, ids=str)
def test_a_weight_updated_in_place_is_converted_again(arm):
    layout = arm.layouts[-1] if arm.layouts[-1] != "q4_k" else "q4_0"
    graph, node = quant_node(layout)
    generator = torch.Generator().manual_seed(8)
    w = random_blocks(layout, 48, 256, generator)
    x = torch.randn(2, 256, generator=generator)
    kernel = arm.factory(graph.node(node))
    kernel(x, w)
    w.copy_(random_blocks(layout, 48, 256, generator))
    check = verify(kernel(x, w), x @ dequantize(w, layout, 256).T, TOLERANCE)
    assert check.ok, check.report
