"""Builders for JIT tests: fused nodes at given shapes, their requests, and their references."""

from __future__ import annotations

import torch

from fuel.graph import BackendId, DType, FusedOpParams, FusedOps, Graph, decompose
from fuel.jit import ArchSku, JitBudget, JitRequest, jit_request_for_unplaceable_fused
from fuel.kernels import KernelBindingTable, cpu_table
from fuel.kernels.torch_kernels import torch_dtype
from fuel.runtime.executor import execute

BUDGET = JitBudget(max_compile_ms=120_000)  # numba's first parallel compile takes seconds


def fused_node(fused_id, params, shapes, dtypes):
    g = Graph()
    inputs = [g.input(f"in{i}", s, d) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    return g, g.fused(fused_id, params, *inputs)


def request_for(g: Graph, node: int, arch: ArchSku = ArchSku.CPU,
                budget: JitBudget = BUDGET) -> JitRequest:
    request = jit_request_for_unplaceable_fused(g, node, arch.backend, KernelBindingTable(), arch,
                                                budget)
    assert request is not None
    return request


def reference(g: Graph, node: int, feeds: dict[str, torch.Tensor]) -> torch.Tensor:
    root = decompose(g, node)
    assert root != node, "the recipe must decompose"
    return execute(g, [root], cpu_table(), feeds)[root]


def float_feeds(g: Graph, node: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    feeds = {}
    for i in g.node(node).inputs:
        n = g.node(i)
        feeds[n.op.name] = torch.randn(n.shape.dims, generator=gen).to(torch_dtype(n.dtype))
    return feeds


def paged(batch=2, q_heads=8, kv_heads=2, q_len=1, head_dim=16, block=4, per_seq=6, blocks=20,
          dtype=DType.F32, index=DType.U32, softcap=None, scale=0.25):
    params = FusedOpParams.PagedAttn(softmax_scale=scale, block_size=block, softcap=softcap)
    shapes = [[batch, q_heads, q_len, head_dim], [blocks, block, kv_heads, head_dim],
              [blocks, block, kv_heads, head_dim], [batch, per_seq], [batch]]
    g, node = fused_node(FusedOps.PAGED_ATTN, params, shapes, [dtype] * 3 + [index] * 2)
    gen = torch.Generator().manual_seed(1)
    feeds = {f"in{i}": torch.randn(s, generator=gen).to(torch_dtype(dtype))
             for i, s in enumerate(shapes[:3])}
    table = torch.stack([torch.randperm(blocks, generator=gen)[:per_seq] for _ in range(batch)])
    lens = torch.randint(q_len, per_seq * block + 1, (batch,), generator=gen)
    lens[-1] = per_seq * block
    feeds["in3"], feeds["in4"] = table.to(torch_dtype(index)), lens.to(torch_dtype(index))
    return g, node, feeds


__all__ = ["BUDGET", "BackendId", "fused_node", "float_feeds", "paged", "reference", "request_for"]
