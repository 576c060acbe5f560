"""The CPU linear kernel prepares each weight once (transposed for f32, oneDNN-packed for bf16
where the CPU has bf16 support), reuses it across nodes and programs, and computes what
``F.linear`` on the checkpoint layout computes."""

import gc

import pytest
import torch
import torch.nn.functional as F

from fuel.graph import DType, FusedOpParams, FusedOps, Graph, lower
from fuel.kernels import RECIPE_TOLERANCE, cpu_table
from fuel.kernels.torch_kernels import PREPARED_WEIGHTS, LinearLayout, linear_layout
from fuel.runtime import compile_program

TABLE = cpu_table()
CPU = torch.device("cpu")
BF16_PACKED = (torch.backends.mkldnn.is_available()
               and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_f32_weights_are_transposed_once_and_bf16_packed_where_the_cpu_has_bf16():
    assert linear_layout(torch.float32, CPU) is LinearLayout.TRANSPOSED
    expected = LinearLayout.ONEDNN_PACKED if BF16_PACKED else LinearLayout.TRANSPOSED
    assert linear_layout(torch.bfloat16, CPU) is expected
    assert linear_layout(torch.float32, torch.device("meta")) is LinearLayout.CHECKPOINT


def _linear_program(rows: int, dtype: DType, bias: bool, copies: int = 1):
    g = Graph()
    x = g.input("x", [rows, 48], dtype)
    w = g.weight("w", [40, 48], dtype)
    operands = [x, w] + ([g.weight("b", [40], dtype)] if bias else [])
    outs = [g.fused(FusedOps.FUSED_LINEAR, FusedOpParams.FusedLinear(has_bias=bias), *operands)
            for _ in range(copies)]
    return g, outs


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_the_prepared_linear_equals_f_linear_on_the_checkpoint_layout(dtype, rows, bias):
    torch_type = torch.float32 if dtype is DType.F32 else torch.bfloat16
    gen = torch.Generator().manual_seed(rows)
    weights = {"w": torch.randn(40, 48, generator=gen).to(torch_type),
               "b": torch.randn(40, generator=gen).to(torch_type)}
    x = torch.randn(rows, 48, generator=gen).to(torch_type)
    g, (out,) = _linear_program(rows, dtype, bias)
    program = compile_program(g, lower(g, [out]), TABLE, weights=weights)
    got = program.run({"x": x})[out]
    want = F.linear(x, weights["w"], weights["b"] if bias else None)
    atol, rtol = RECIPE_TOLERANCE[dtype]
    assert got.dtype == torch_type and got.shape == (rows, 40)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_one_weight_is_prepared_once_for_every_node_and_program_that_binds_it():
    weights = {"w": torch.randn(40, 48)}
    before = len(PREPARED_WEIGHTS)
    for rows in (5, 8):  # GEMM shapes: decode shapes (<= 4 rows) stream the checkpoint layout
        g, outs = _linear_program(rows, DType.F32, bias=False, copies=2)
        program = compile_program(g, lower(g, outs), TABLE, weights=weights)
        program.run({"x": torch.randn(rows, 48)})
    assert len(PREPARED_WEIGHTS) == before + 1
    del weights, g, outs, program
    gc.collect()
    assert len(PREPARED_WEIGHTS) == before, "a dropped weight's prepared copy is dropped with it"


def test_a_weight_updated_in_place_is_prepared_again_never_read_stale():
    weights = {"w": torch.zeros(40, 48)}
    g, (out,) = _linear_program(1, DType.F32, bias=False)
    program = compile_program(g, lower(g, [out]), TABLE, weights=weights)
    x = torch.ones(1, 48)
    assert float(program.run({"x": x})[out].abs().sum()) == 0.0
    weights["w"].fill_(1.0)
    assert program.run({"x": x})[out].tolist() == [[48.0] * 40]


def test_an_f32_prompt_chunk_reads_the_checkpoint_layout_and_prepares_no_copy():
    # Why: a process's first prompt transposed every f32 weight before its first token (~0.45 s
    # and the weights' size again in memory for SmolLM2), for ~10% at prompt-chunk sizes.
    from fuel.kernels.torch_kernels import CHECKPOINT_ROWS

    weights = {"w": torch.randn(40, 48)}
    before = len(PREPARED_WEIGHTS)
    g, (out,) = _linear_program(CHECKPOINT_ROWS, DType.F32, bias=False)
    program = compile_program(g, lower(g, [out]), TABLE, weights=weights)
    x = torch.randn(CHECKPOINT_ROWS, 48)
    torch.testing.assert_close(program.run({"x": x})[out], F.linear(x, weights["w"]))
    assert len(PREPARED_WEIGHTS) == before
