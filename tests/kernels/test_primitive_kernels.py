"""Primitive CPU kernels: u32 stays u32, take semantics, the in-place cache write."""

import torch

from fuel.graph import DType, Graph, OpKind, Predicate
from fuel.kernels import cpu_table
from fuel.runtime import execute

TABLE = cpu_table()


def test_u32_arithmetic_runs_and_returns_u32():
    # torch has no uint32 add/compare on the CPU; the kernel widens internally, the value does not.
    g = Graph()
    a = g.input("a", [3], DType.U32)
    total = g.prim(OpKind.ADD, g.prim(OpKind.MUL_SCALAR, a, value=4), a)
    bigger = g.prim(OpKind.COMPARE, total, a, predicate=Predicate.GT)
    out = execute(g, [total, bigger], TABLE, {"a": torch.tensor([0, 1, 7], dtype=torch.uint32)})
    assert out[total].dtype == torch.uint32
    assert out[total].tolist() == [0, 5, 35]
    assert out[bigger].tolist() == [False, True, True]


def test_u32_layout_ops_are_views_of_the_fed_tensor_not_widened_copies():
    # Widening a reshape to int64 and back would cost two copies per call on every step.
    g = Graph()
    table = g.input("table", [2, 3], DType.U32)
    flat = g.prim(OpKind.RESHAPE, table, shape=(6,))
    column = g.prim(OpKind.UNSQUEEZE, g.prim(OpKind.SELECT, table, dim=0, index=1), dim=-1)
    positions = g.prim(OpKind.IOTA, table, dim=1, dtype=DType.U32)
    fed = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.uint32)
    out = execute(g, [flat, column, positions], TABLE, {"table": fed})
    assert out[flat].data_ptr() == fed.data_ptr() and out[flat].dtype == torch.uint32
    assert out[column].tolist() == [[4], [5], [6]] and out[column].dtype == torch.uint32
    assert out[positions].tolist() == [0, 1, 2] and out[positions].dtype == torch.uint32


def test_index_select_takes_rows_with_any_index_shape():
    g = Graph()
    table = g.input("table", [5, 2], DType.F32)
    ids = g.input("ids", [2, 3], DType.U32)
    rows = g.prim(OpKind.INDEX_SELECT, table, ids, dim=0)
    weights = torch.arange(10, dtype=torch.float32).reshape(5, 2)
    out = execute(g, [rows], TABLE, {"table": weights, "ids": torch.tensor([[4, 0, 1], [2, 2, 3]],
                                                                          dtype=torch.uint32)})[rows]
    assert out.shape == (2, 3, 2)
    assert out[0, 0].tolist() == [8.0, 9.0] and out[1, 2].tolist() == [6.0, 7.0]


def test_kv_cache_write_updates_the_fed_cache_in_place_and_returns_it():
    g = Graph()
    cache = g.input("cache", [3, 2, 1, 2], DType.F32)  # 3 blocks of 2 slots
    rows = g.input("rows", [2, 1, 2], DType.F32)
    slots = g.input("slots", [2], DType.U32)
    written = g.prim(OpKind.KV_CACHE_WRITE, cache, rows, slots)
    fed = torch.zeros(3, 2, 1, 2)
    out = execute(g, [written], TABLE, {"cache": fed, "rows": torch.ones(2, 1, 2),
                                        "slots": torch.tensor([5, 0], dtype=torch.uint32)})[written]
    assert out.data_ptr() == fed.data_ptr()
    assert fed[2, 1].tolist() == [[1.0, 1.0]] and fed[0, 0].tolist() == [[1.0, 1.0]]
    assert float(fed.sum()) == 4.0


def test_iota_size_and_topk_route_like_moe():
    g = Graph()
    logits = g.input("logits", [2, 4], DType.F32)
    top_values = g.prim(OpKind.TOPK_VALUES, logits, k=2, dim=-1)
    top_experts = g.prim(OpKind.TOPK_INDICES, logits, k=2, dim=-1)
    positions = g.prim(OpKind.IOTA, logits, dim=1, dtype=DType.U32)
    count = g.prim(OpKind.SIZE, logits, dim=0, dtype=DType.I64)
    feed = torch.tensor([[0.1, 0.9, 0.3, 0.5], [2.0, 1.0, 3.0, 0.0]])
    out = execute(g, [top_values, top_experts, positions, count], TABLE, {"logits": feed})
    assert out[top_experts].tolist() == [[1, 3], [2, 0]]
    torch.testing.assert_close(out[top_values], torch.tensor([[0.9, 0.5], [3.0, 2.0]]))
    assert out[positions].dtype == torch.uint32 and out[positions].tolist() == [0, 1, 2, 3]
    assert int(out[count]) == 2
