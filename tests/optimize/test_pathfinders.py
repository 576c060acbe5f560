"""Pathfinders: where each arm is offered, where it is declined and why, and that offers keep the
graph's value."""

from __future__ import annotations

import pytest
import torch

from fuel.graph import (
    BackendId, Branch, Device, DType, FusedOpParams, FusedOps, Graph, OpKind, RuntimeFusedRegistry, decompose,
    lower, recipe_for,
)
from fuel.kernels import KernelBindingTable, KernelEntry, cpu_table
from fuel.optimize import offer_decode_flash_arms, offer_placement_forks, offer_runtime_fused_arms
from fuel.runtime import execute

from tests.optimize.builders import decode_attention

FEEDS_SEED = 0


def feeds(graph: Graph) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(FEEDS_SEED)
    out = {}
    for node in graph.nodes():
        name = getattr(node.op, "name", None)
        if name is not None and type(node.op).__name__ == "Input":
            out[name] = torch.randn(*node.shape.dims, generator=generator, dtype=torch.float32)
    return out


def attention_graph(decomposed: bool = False, **shape):
    graph = Graph()
    attn = decode_attention(graph, **shape)
    if decomposed:
        merge_input = decompose(graph, attn)
    else:
        merge_input = attn
    out = graph.prim(OpKind.MUL_SCALAR, merge_input, value=2.0)
    return graph, out, attn


def branches(graph):
    return [n for n in range(len(graph)) if isinstance(graph.node(n).op, Branch)]


@pytest.mark.parametrize("decomposed", [False, True])
def test_decode_attention_gets_a_flash_arm_and_keeps_its_value(decomposed):
    graph, out, attn = attention_graph(decomposed)
    table = cpu_table()
    before = execute(graph, [out], table, feeds(graph))[out]
    offers = offer_decode_flash_arms(graph, (out,), table, BackendId.CPU)
    assert [o.branch is not None for o in offers] == [True]
    (branch,) = branches(graph)
    exits = graph.node(branch).inputs
    assert graph.node(exits[1]).op.id == FusedOps.FLASH_ATTN
    assert graph.node(out).inputs == (exits[0],)  # the merge still reads arm 0
    for arm in (0, 1):
        got = execute(graph, [out], table, feeds(graph), route={branch: arm})[out]
        torch.testing.assert_close(got, before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape, reason", [
    ({"q_rows": 4}, "not 1 (not decode)"),
    ({"head_dim": 12}, "head dim 12 not admitted"),
    ({"head_dim": 512}, "head dim 512 not admitted"),
    ({"softcap": 30.0}, "soft-capped"),
    ({"dtype": DType.F64}, "dtype f64 not admitted"),
])
def test_flash_arm_declined_outside_its_admission(shape, reason):
    graph, out, attn = attention_graph(**shape)
    offers = offer_decode_flash_arms(graph, (out,), cpu_table(), BackendId.CPU)
    assert len(offers) == 1 and offers[0].branch is None and reason in offers[0].detail
    assert branches(graph) == []


def test_flash_arm_declined_without_a_bound_kernel():
    graph, out, attn = attention_graph(decomposed=True)
    size = len(graph)
    offers = offer_decode_flash_arms(graph, (out,), KernelBindingTable(), BackendId.CPU)
    assert offers[0].branch is None and "no flash_attn kernel" in offers[0].detail
    assert len(graph) == size


def test_flash_arm_declined_for_a_root_value():
    graph = Graph()
    attn = decode_attention(graph)
    offers = offer_decode_flash_arms(graph, (attn,), cpu_table(), BackendId.CPU)
    assert offers[0].branch is None and "root" in offers[0].detail


def test_decomposed_region_read_from_outside_is_not_offered():
    graph, out, attn = attention_graph(decomposed=True)
    root = graph.node(out).inputs[0]
    inner = graph.node(root).inputs[0]  # the softmax, also read by an outside node below
    spy = graph.prim(OpKind.NEG, inner)
    offers = offer_decode_flash_arms(graph, (out, spy), cpu_table(), BackendId.CPU)
    assert offers[0].branch is None and "outside the region" in offers[0].detail


def test_an_offered_region_is_not_offered_twice():
    graph, out, attn = attention_graph()
    table = cpu_table()
    offer_decode_flash_arms(graph, (out,), table, BackendId.CPU)
    assert offer_decode_flash_arms(graph, (out,), table, BackendId.CPU) == []
    assert len(branches(graph)) == 1


def softmax_registry():
    registry = RuntimeFusedRegistry()
    probe = Graph()
    node = probe.fused(FusedOps.SOFTMAX_LAST_DIM, FusedOpParams.SoftmaxLastDim(),
                       probe.input("x", [8, 32], DType.F32))
    return registry, registry.register_runtime_fused("softmax_jit", recipe_for(probe, node))


def test_registered_runtime_region_is_offered_where_it_matches():
    registry, runtime_id = softmax_registry()
    graph = Graph()
    x = graph.input("x", [8, 32], DType.F32)
    region = decompose(graph, graph.fused(FusedOps.SOFTMAX_LAST_DIM, FusedOpParams.SoftmaxLastDim(), x))
    out = graph.prim(OpKind.NEG, region)
    table = cpu_table()
    assert [o.branch for o in offer_runtime_fused_arms(graph, (out,), registry, table, BackendId.CPU)] \
        == [None]  # not bound yet
    table.bind(runtime_id, (DType.F32, DType.F32), BackendId.CPU,
               KernelEntry(lambda node: lambda t: torch.softmax(t, -1)))
    offers = offer_runtime_fused_arms(graph, (out,), registry, table, BackendId.CPU)
    assert offers[0].branch is not None
    exits = graph.node(offers[0].branch).inputs
    assert graph.node(exits[1]).op.id == runtime_id and graph.node(exits[1]).inputs == (x,)
    ref = execute(graph, [out], table, feeds(graph))[out]
    got = execute(graph, [out], table, feeds(graph), route={offers[0].branch: 1})[out]
    torch.testing.assert_close(got, ref)


def test_placement_fork_offers_the_other_backend_with_stamps():
    graph, out, attn = attention_graph()
    table = cpu_table()
    table.bind(FusedOps.FLASH_ATTN, (DType.F32,) * 4, BackendId.CUDA,
               KernelEntry(lambda node: None, frozenset({"causal"})))
    cuda = Device(BackendId.CUDA)
    offers = offer_placement_forks(graph, (out,), table, Device(BackendId.CPU), (cuda,))
    assert [o.node for o in offers if o.branch is not None] == [attn]
    branch = offers[0].branch
    cpu_arm, cuda_arm = graph.node(branch).inputs
    assert (graph.placement[cpu_arm], graph.placement[cuda_arm]) == (Device(BackendId.CPU), cuda)
    assert lower(graph, [out]).order[-2:] == (attn, out)


def test_no_placement_fork_where_no_other_backend_can_run_the_node():
    graph, out, attn = attention_graph()
    offers = offer_placement_forks(graph, (out,), cpu_table(), Device(BackendId.CPU),
                                   (Device(BackendId.CUDA),))
    assert offers == [] and branches(graph) == []
