"""``expert_matmul``: each row times the expert its id names, rows grouped by expert (one
matmul per distinct expert), for every index dtype, and typed refusals for misfit operands."""

from __future__ import annotations

import pytest
import torch

from fuel.graph import DType, Graph
from fuel.graph.ops import OpKind, ShapeError
from fuel.kernels import cpu_table
from fuel.kernels.torch_kernels import _expert_groups
from fuel.runtime.executor import execute


def run(x, w, ids, index=DType.I64):
    g = Graph()
    node = g.prim(OpKind.EXPERT_MATMUL, g.input("x", list(x.shape), DType.F32),
                  g.input("w", list(w.shape), DType.F32), g.input("ids", list(ids.shape), index))
    return execute(g, [node], cpu_table(), {"x": x, "w": w, "ids": ids})[node]


@pytest.mark.parametrize("rows", [1, 5, 300])  # 300 > the Python grouping limit: argsort path
@pytest.mark.parametrize("index", [DType.I64, DType.I32, DType.U32])
def test_each_row_is_multiplied_by_its_expert(rows, index):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 8, generator=gen), torch.randn(5, 6, 8, generator=gen)
    ids = torch.randint(0, 5, (rows,), generator=gen)
    dtype = {DType.I64: torch.int64, DType.I32: torch.int32, DType.U32: torch.uint32}[index]
    got = run(x, w, ids.to(dtype), index)
    expected = torch.stack([w[e] @ x[r] for r, e in enumerate(ids.tolist())])
    assert torch.allclose(got, expected, atol=1e-5)


def test_rows_are_grouped_one_group_per_distinct_expert_in_order():
    groups = _expert_groups(torch.tensor([3, 1, 3, 3, 0]))
    assert [(e, rows.tolist()) for e, rows in groups] == [(0, [4]), (1, [1]), (3, [0, 2, 3])]


def test_misfit_operands_are_a_shape_error_naming_the_op():
    g = Graph()
    x = g.input("x", [2, 8], DType.F32)
    w = g.input("w", [4, 6, 7], DType.F32)
    with pytest.raises(ShapeError, match="expert_matmul"):
        g.prim(OpKind.EXPERT_MATMUL, x, w, g.input("ids", [2], DType.I64))
    w8 = g.input("w8", [4, 6, 8], DType.F32)
    with pytest.raises(ShapeError, match="index operand"):
        g.prim(OpKind.EXPERT_MATMUL, x, w8, g.input("f", [2], DType.F32))
