"""optimize_graph end to end: stamping, lowering the unrunnable (with JIT requests), the flash
bake, the decision record, Pareto routes, residency copies — and the value never changes."""

from __future__ import annotations

import torch

from fuel.graph import BackendId, Device, DType, FusedOpParams, FusedOps, Graph, OpKind
from fuel.jit import ArchSku, JitBudget
from fuel.kernels import KernelEntry, cpu_table
from fuel.optimize import (
    BakePolicy, BranchKind, CostSource, OptimizeOptions, Reason, optimize_graph,
    variant_bakes_thread_local,
)
from fuel.runtime import compile_program, execute
from fuel.graph import lower

from tests.optimize.builders import CUDA, SPEC, decode_attention
from tests.optimize.test_pathfinders import feeds


def residual_norm_graph():
    graph = Graph()
    x = graph.input("x", [2, 8], DType.F32)
    r = graph.input("r", [2, 8], DType.F32)
    gain = graph.input("g", [8], DType.F32)
    both = graph.fused(FusedOps.RESIDUAL_ADD_RMS_NORM, FusedOpParams.ResidualAddRmsNorm(1e-5), x, r, gain)
    return graph, graph.prim(OpKind.SELECT, both, dim=0, index=0), both


def test_every_needed_node_is_stamped_with_the_pinned_device():
    graph, out, _ = residual_norm_graph()
    result = optimize_graph(graph, [out], OptimizeOptions(table=cpu_table()))
    assert all(graph.target_backend[n] is BackendId.CPU for n in result.order)
    assert all(graph.placement[n] == Device(BackendId.CPU) for n in result.order)


def test_fused_node_without_kernel_is_lowered_with_a_jit_request_and_runs():
    graph, out, fused = residual_norm_graph()
    table = cpu_table()
    result = optimize_graph(graph, [out], OptimizeOptions(
        table=table, jit_arch=ArchSku.CPU, jit_budget=JitBudget(max_compile_ms=500)))
    (lowering,) = result.lowerings
    assert lowering.node == fused and lowering.op == "residual_add_rms_norm" and lowering.root
    assert len(result.jit_requests) == 1 and result.jit_requests[0].arch is ArchSku.CPU
    assert fused not in result.order
    got = compile_program(graph, lower(graph, result.roots), table).run(feeds(graph))[out]
    x, r, g = (feeds(graph)[k] for k in "xrg")
    total = x + r
    expected = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5) * g
    torch.testing.assert_close(got, expected)


def test_a_lowered_root_is_replaced_by_its_region_root():
    graph, out, fused = residual_norm_graph()
    result = optimize_graph(graph, [fused], OptimizeOptions(table=cpu_table()))
    assert result.roots == (result.lowerings[0].root,)


def test_decode_flash_arm_is_baked_on_layer1_and_the_value_is_unchanged():
    graph = Graph()
    attn = decode_attention(graph, k_len=256, head_dim=64, heads=8, kv_heads=2)
    out = graph.prim(OpKind.MUL_SCALAR, attn, value=2.0)
    table = cpu_table()
    reference = execute(graph, [out], table, feeds(graph))[out]
    before = variant_bakes_thread_local()
    result = optimize_graph(graph, [out], OptimizeOptions(device_spec=SPEC, table=table))
    assert result.bakes == 1 and variant_bakes_thread_local() - before == 1
    (decision,) = result.decisions
    assert (decision.kind, decision.winner, decision.reason, decision.collapsed) == \
        (BranchKind.VARIANT, 1, Reason.CHEAPER, True)
    assert [a.source for a in decision.arms] == [CostSource.LAYER1, CostSource.LAYER1]
    assert decision.arms[1].cost_ns < decision.arms[0].cost_ns
    assert attn in result.order  # the fused flash node is what runs
    got = compile_program(graph, lower(graph, result.roots), table).run(feeds(graph))[out]
    torch.testing.assert_close(got, reference)


def test_without_a_device_spec_no_variant_is_offered():
    graph = Graph()
    out = graph.prim(OpKind.NEG, decode_attention(graph))
    result = optimize_graph(graph, [out], OptimizeOptions(table=cpu_table()))
    assert result.offers == () and result.decisions == () and result.bakes == 0


def test_pareto_retention_routes_the_winner_without_pruning():
    graph = Graph()
    attn = decode_attention(graph, k_len=256, head_dim=64)
    out = graph.prim(OpKind.NEG, attn)
    result = optimize_graph(graph, [out], OptimizeOptions(
        device_spec=SPEC, table=cpu_table(), policy=BakePolicy(pareto_retention=True)))
    (decision,) = result.decisions
    assert result.bakes == 0 and decision.retained and not decision.collapsed
    assert dict(result.route) == {decision.branch: 1}
    assert attn in result.order
    assert result.live_branches() == (decision,)


def test_placement_fork_is_left_live_with_its_residency_copies():
    graph = Graph()
    attn = decode_attention(graph, k_len=32)
    out = graph.prim(OpKind.NEG, attn)
    table = cpu_table()
    table.bind(FusedOps.FLASH_ATTN, (DType.F32,) * 4, BackendId.CUDA,
               KernelEntry(lambda node: None, frozenset({"causal"})))
    result = optimize_graph(graph, [out], OptimizeOptions(
        table=table, placement_devices=(CUDA,)))
    (decision,) = result.decisions
    assert decision.kind is BranchKind.PLACEMENT and decision.reason is Reason.PLACEMENT_LIVE
    copies = [(c.arm, c.value, str(c.source), str(c.target), c.bytes) for c in result.residency]
    q, k, v = graph.node(attn).inputs
    assert copies == [(1, q, "cpu", "cuda:0", 1 * 4 * 1 * 16 * 4), (1, k, "cpu", "cuda:0", 2 * 32 * 16 * 4),
                      (1, v, "cpu", "cuda:0", 2 * 32 * 16 * 4)]


DETERMINISM_SCRIPT = """
import hashlib
from fuel.graph import Graph, OpKind
from fuel.kernels import cpu_table
from fuel.optimize import OptimizeOptions, optimize_graph
from tests.optimize.builders import SPEC, decode_attention

graph = Graph()
out = graph.prim(OpKind.NEG, decode_attention(graph, k_len=128))
result = optimize_graph(graph, [out], OptimizeOptions(device_spec=SPEC, table=cpu_table()))
text = repr((graph.nodes(), result.order, result.decisions, result.offers))
print(hashlib.sha256(text.encode()).hexdigest(), len(result.decisions))
"""


def test_optimize_is_deterministic_across_processes_and_hash_seeds():
    # Why: the same inputs must give the same graph, order and decisions in any process; one
    # process calling twice cannot see set/dict-order or hash-seed dependence.
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]

    def run(seed: int) -> str:
        env = dict(os.environ, PYTHONHASHSEED=str(seed),
                   PYTHONPATH=os.pathsep.join([str(root / "src"), str(root)]))
        done = subprocess.run([sys.executable, "-c", DETERMINISM_SCRIPT], capture_output=True,
                              text=True, env=env, check=True, cwd=root)
        return done.stdout

    first, second = run(1), run(2)
    assert first == second
    assert int(first.split()[1]) >= 1, "the graph has a branch to decide"


# Adopted kernels: the branch is built where the unrunnable fused node is lowered.
class _RuntimeOnlyJudge:
    """Measures only the adopted kernel (by its stable region name), at a fixed latency; the
    recipe's nodes are priced by Layer 1."""

    def __init__(self, op: str, ns: int):
        self.op, self.ns = op, ns

    def measured_latency_ns(self, op, dtype, size_class, backend, kernel_source):
        return self.ns if op == self.op else None


def two_reader_residual():
    graph = Graph()
    x, r = graph.input("x", [2, 8], DType.F32), graph.input("r", [2, 8], DType.F32)
    gain = graph.input("g", [8], DType.F32)
    both = graph.fused(FusedOps.RESIDUAL_ADD_RMS_NORM, FusedOpParams.ResidualAddRmsNorm(1e-5),
                       x, r, gain)
    normed = graph.prim(OpKind.SELECT, both, dim=0, index=0)
    stream = graph.prim(OpKind.SELECT, both, dim=0, index=1)
    return graph, graph.prim(OpKind.ADD, normed, stream), both


def _adopt_reference(graph, fused):
    """Register the node's recipe as a runtime region and bind a torch kernel for it (a stand-in
    for a synthesized kernel: what adoption leaves behind)."""
    from fuel.graph import RuntimeFusedRegistry
    from fuel.graph.recipe import structural_hash
    from fuel.graph.registry import recipe_for
    from fuel.kernels import Precision
    from fuel.optimize import runtime_judge_name

    region = recipe_for(graph, fused)
    registry, table = RuntimeFusedRegistry(), cpu_table()
    runtime_id = registry.register_runtime_fused("residual", region)
    calls = []

    def kernel(x, r, gain):
        calls.append(1)
        total = x + r
        normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5) * gain
        return torch.stack([normed, total])

    table.bind(runtime_id, (DType.F32,) * 4, BackendId.CPU,
               KernelEntry(lambda node: kernel, precision=Precision.RECIPE_TOLERANCE,
                           kernel_source="test.kernel"))
    return registry, table, runtime_id, runtime_judge_name(structural_hash(region)), calls


def _feeds():
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator)
            for name, shape in (("x", (2, 8)), ("r", (2, 8)), ("g", (8,)))}


def test_adopted_kernel_read_by_two_selects_is_branched_through_one_identity_merge_and_wins():
    # Why: residual_add_rms_norm's output has two readers; the merge must feed both, and the
    # baked graph must run the adopted kernel for both without the identity merge left behind.
    from fuel.graph.ir import Fused
    from fuel.optimize import ADOPTED

    probe, probe_out, probe_fused = two_reader_residual()
    registry, table, runtime_id, name, calls = _adopt_reference(probe, probe_fused)
    graph, out, fused = two_reader_residual()
    result = optimize_graph(graph, [out], OptimizeOptions(
        table=table, runtime=registry, device_spec=SPEC, judge=_RuntimeOnlyJudge(name, 1)))
    (offer,) = [o for o in result.offers if o.pathfinder == ADOPTED]
    assert offer.branch is not None and "identity merge for 2 readers" in offer.detail
    (decision,) = result.decisions
    assert decision.winner == 1 and decision.reason is Reason.CHEAPER and result.bakes == 1
    assert decision.arms[1].cost_ns == 1 and decision.arms[1].source is CostSource.JUDGE
    ops = [graph.node(n).op for n in result.order]
    assert sum(isinstance(op, Fused) and op.id == runtime_id for op in ops) == 1
    assert not any(getattr(op, "kind", None) is OpKind.RESHAPE for op in ops), "merge spliced"
    got = compile_program(graph, lower(graph, result.roots), table).run(_feeds())[result.roots[0]]
    lowered = optimize_graph(probe, [probe_out], OptimizeOptions(table=cpu_table()))
    reference = compile_program(probe, lower(probe, lowered.roots), cpu_table()).run(
        _feeds())[lowered.roots[0]]
    assert calls and torch.allclose(got, reference, atol=1e-5)


def test_a_slower_adopted_kernel_keeps_the_recipe_and_splices_the_merge():
    from fuel.graph.ir import Fused

    probe, _, probe_fused = two_reader_residual()
    registry, table, runtime_id, name, _ = _adopt_reference(probe, probe_fused)
    graph, out, _ = two_reader_residual()
    result = optimize_graph(graph, [out], OptimizeOptions(
        table=table, runtime=registry, device_spec=SPEC, judge=_RuntimeOnlyJudge(name, 10**12)))
    (decision,) = result.decisions
    assert decision.winner == 0 and decision.reason is Reason.NOT_CHEAPER and result.bakes == 0
    ops = [graph.node(n).op for n in result.order]
    assert not any(isinstance(op, Fused) for op in ops)
    assert not any(getattr(op, "kind", None) is OpKind.RESHAPE for op in ops)


def test_an_adopted_kernel_without_a_judge_cell_keeps_arm0_unknown_cost():
    # Why: the seed's semantics: a runtime arm with no measurement is unpriceable and cannot win.
    probe, _, probe_fused = two_reader_residual()
    registry, table, _, _, _ = _adopt_reference(probe, probe_fused)
    graph, out, _ = two_reader_residual()
    result = optimize_graph(graph, [out], OptimizeOptions(table=table, runtime=registry,
                                                          device_spec=SPEC))
    (decision,) = result.decisions
    assert decision.winner == 0 and decision.reason is Reason.UNKNOWN_COST
