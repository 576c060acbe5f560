"""A table's variant-arm kernel (torch's int4pack for a Q4 ``quant_linear``) beside the recipe and
the JIT's kernel: the node is still lowered to its recipe (arm 0, the oracle) and the carrier
still asked; the variant is offered in the same branch as the adopted kernel, priced only by the
Judge's measurement; the bake keeps the fastest and records every arm's cost."""

from __future__ import annotations

import torch

from fuel.graph import BackendId, DType, FusedOpParams, FusedOps, Graph, OpKind, lower
from fuel.graph.ir import Fused
from fuel.jit import ArchSku, JitBudget
from fuel.jit.adopt import verify
from fuel.kernels import RECIPE_TOLERANCE, KernelEntry, Precision, cpu_table
from fuel.kernels.int4pack import KERNEL_SOURCE
from fuel.kernels.quant_blocks import dequantize, packed_row_bytes, random_blocks
from fuel.optimize import (
    ADOPTED, TABLE_VARIANT, CostSource, OptimizeOptions, Reason, optimize_graph,
)
from fuel.runtime import compile_program

from tests.optimize.builders import SPEC

ROWS, COLS = 48, 256
JIT = dict(jit_arch=ArchSku.CPU, jit_budget=JitBudget(max_compile_ms=1_000))


def quant_graph(layout: str = "q4_1"):
    """x -> quant_linear(x, w) -> mul_scalar (its single reader)."""
    graph = Graph()
    x = graph.input("x", [2, COLS], DType.F32)
    w = graph.input("w", [ROWS, packed_row_bytes(layout, COLS)], DType.U8)
    node = graph.fused(FusedOps.QUANT_LINEAR, FusedOpParams.QuantLinear(layout, COLS), x, w)
    return graph, graph.prim(OpKind.MUL_SCALAR, node, value=2.0), node


def feeds(layout: str = "q4_1"):
    generator = torch.Generator().manual_seed(0)
    return {"x": torch.randn(2, COLS, generator=generator),
            "w": random_blocks(layout, ROWS, COLS, generator)}


class Judge:
    """Measures the int4pack arm and the adopted kernel (by name) at fixed latencies; the
    recipe's nodes are priced by Layer 1."""

    def __init__(self, int4pack: int | None, adopted: tuple[str, int] | None = None):
        self.int4pack, self.adopted = int4pack, adopted

    def measured_latency_ns(self, op, dtype, size_class, backend, kernel_source):
        if op == "quant_linear" and kernel_source == KERNEL_SOURCE:
            assert size_class.startswith("io:"), "keyed by its operands, not its output alone"
            return self.int4pack
        if self.adopted is not None and op == self.adopted[0]:
            return self.adopted[1]
        return None


def adopt_stand_in(layout: str = "q4_1"):
    """The node's recipe registered as a runtime region with a torch kernel bound for it (what
    adopting the JIT's kernel leaves behind), in a CPU table that has the int4pack variant."""
    from fuel.graph import RuntimeFusedRegistry
    from fuel.graph.recipe import structural_hash
    from fuel.graph.registry import recipe_for
    from fuel.optimize import runtime_judge_name

    probe, _, node = quant_graph(layout)
    region = recipe_for(probe, node)
    registry, table = RuntimeFusedRegistry(), cpu_table()
    runtime_id = registry.register_runtime_fused("quant", region)
    table.bind(runtime_id, (DType.F32, DType.U8, DType.F32), BackendId.CPU, KernelEntry(
        lambda n: (lambda x, w: x @ dequantize(w, layout, COLS).T),
        precision=Precision.RECIPE_TOLERANCE, kernel_source="test.native"))
    return registry, table, runtime_id, runtime_judge_name(structural_hash(region))


def run(graph, result, table):
    values = compile_program(graph, lower(graph, result.roots), table).run(feeds())
    return values[result.roots[0]]


def reference():
    f = feeds()
    return (f["x"] @ dequantize(f["w"], "q4_1", COLS).T) * 2.0


def test_a_q4_node_keeps_its_jit_request_and_gets_int4pack_beside_its_recipe():
    # Why: binding a kernel for quant_linear must not make the node "runnable" (the JIT would
    # never be asked, and the recipe would stop being arm 0).
    graph, out, node = quant_graph()
    table = cpu_table()
    result = optimize_graph(graph, [out], OptimizeOptions(
        table=table, device_spec=SPEC, judge=Judge(int4pack=1), **JIT))
    (lowering,) = result.lowerings
    assert lowering.node == node and lowering.jit_request is not None
    assert KERNEL_SOURCE in lowering.reason
    (offer,) = result.offers
    assert offer.pathfinder == TABLE_VARIANT and offer.branch is not None
    (decision,) = result.decisions
    assert [a.arm for a in decision.arms] == [0, 1]
    assert decision.winner == 1 and decision.reason is Reason.CHEAPER and result.bakes == 1
    assert decision.arms[1].cost_ns == 1 and decision.arms[1].source is CostSource.JUDGE
    ops = [graph.node(n).op for n in result.order]
    assert sum(isinstance(op, Fused) and op.id == FusedOps.QUANT_LINEAR for op in ops) == 1
    assert not any(getattr(op, "kind", None) is OpKind.DEQUANTIZE for op in ops), "arm 0 pruned"
    check = verify(run(graph, result, table), reference(), RECIPE_TOLERANCE[DType.F32])
    assert check.ok, check.report


def test_recipe_int4pack_and_the_adopted_kernel_are_one_branch_and_the_fastest_wins():
    registry, table, runtime_id, name = adopt_stand_in()
    for int4pack, adopted, winner in ((50, 5, 2), (5, 50, 1)):
        graph, out, _ = quant_graph()
        result = optimize_graph(graph, [out], OptimizeOptions(
            table=table, runtime=registry, device_spec=SPEC,
            judge=Judge(int4pack, (name, adopted)), **JIT))
        (offer,) = result.offers
        assert offer.pathfinder == ADOPTED and "as arm 1" in offer.detail and "as arm 2" in offer.detail
        (decision,) = result.decisions
        assert [a.cost_ns for a in decision.arms[1:]] == [int4pack, adopted], "both recorded"
        assert decision.winner == winner and decision.reason is Reason.CHEAPER
        kernel = runtime_id if winner == 2 else FusedOps.QUANT_LINEAR
        ops = [graph.node(n).op for n in result.order]
        assert [op.id for op in ops if isinstance(op, Fused)] == [kernel]
        check = verify(run(graph, result, table), reference(), RECIPE_TOLERANCE[DType.F32])
        assert check.ok, check.report


def test_an_int4pack_arm_the_judge_has_not_measured_cannot_win():
    # Why: Layer 1 prices the packed bytes, not how fast torch's kernel reads them (its f32
    # path is many times slower than the recipe here): only a measurement may adopt it.
    graph, out, _ = quant_graph()
    result = optimize_graph(graph, [out], OptimizeOptions(
        table=cpu_table(), device_spec=SPEC, judge=Judge(int4pack=None)))
    (decision,) = result.decisions
    assert decision.winner == 0 and decision.reason is Reason.UNKNOWN_COST
    assert "priced only by the Judge" in decision.arms[1].declined
    assert not any(isinstance(graph.node(n).op, Fused) for n in result.order)


def test_a_slower_int4pack_arm_keeps_the_recipe_with_its_measured_cost():
    graph, out, _ = quant_graph()
    result = optimize_graph(graph, [out], OptimizeOptions(
        table=cpu_table(), device_spec=SPEC, judge=Judge(int4pack=10**12)))
    (decision,) = result.decisions
    assert decision.winner == 0 and decision.reason is Reason.NOT_CHEAPER
    assert decision.arms[1].cost_ns == 10**12


def test_a_q8_0_node_gets_no_int4pack_arm_and_still_its_jit_request():
    graph, out, _ = quant_graph("q8_0")
    result = optimize_graph(graph, [out], OptimizeOptions(
        table=cpu_table(), device_spec=SPEC, judge=Judge(int4pack=1), **JIT))
    (lowering,) = result.lowerings
    assert lowering.jit_request is not None and "variant" not in lowering.reason
    assert result.offers == () and result.decisions == ()


def test_without_a_device_spec_nothing_is_offered_and_the_recipe_runs():
    # --no-jit builds price nothing: the recipe runs, as before the variant existed.
    graph, out, _ = quant_graph()
    table = cpu_table()
    result = optimize_graph(graph, [out], OptimizeOptions(table=table, **JIT))
    assert result.lowerings[0].jit_request is not None
    assert result.offers == () and result.decisions == ()
    assert torch.allclose(run(graph, result, table), reference(), atol=1e-5)


def test_a_variant_arm_far_slower_than_the_other_arms_is_timed_from_one_call():
    """The Judge times the variant arm last, racing the arms measured before it: a single call
    past RACE_MARGIN times the cheapest other arm is its measurement (no samples after it);
    an injected profile is consulted in full."""
    from fuel.kernels import int4pack
    from fuel.optimize.judge_arms import RACE_MARGIN, measure_branches
    from fuel.optimize.optimize import offer_arms

    calls = []
    slow = int4pack.quant_linear_int4pack

    def counted(node):
        kernel = slow(node)

        def run(*args):
            calls.append(1)
            import time
            time.sleep(0.02)  # far past any recipe of this size
            return kernel(*args)
        return run

    table = cpu_table()
    for entries in table._entries.values():
        for index, entry in enumerate(entries):
            if entry.variant_arm:
                entries[index] = KernelEntry(counted, entry.caps, entry.precision,
                                             kernel_source=entry.kernel_source,
                                             calls=entry.calls, variant_arm=True)
    graph, root, _ = quant_graph()
    offered = offer_arms(graph, [root], OptimizeOptions(table=table, device_spec=SPEC))
    profile = {"warmup": 2, "repeats": 9, "min_sample_ns": 100_000}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the recipe's tiny ops timed without waiting on a busy sibling
    try:
        rows = measure_branches(graph, offered.branches(), feeds(), table, weights=None, **profile)
    finally:
        torch.set_num_threads(threads)
    variant = [r for r in rows if r.kernel_source == KERNEL_SOURCE]
    others = [r for r in rows if r.kernel_source != KERNEL_SOURCE]
    assert len(variant) == 1 and others
    assert variant[0].samples == 1 and len(calls) == 3  # untimed, then two past the ceiling
    assert variant[0].median_ns > RACE_MARGIN * sum(r.median_ns for r in others)
    calls.clear()
    injected = measure_branches(graph, offered.branches(), feeds(), table, weights=None,
                                profile=lambda key, call: profile_all(call), **profile)
    assert len(calls) > 2 and all(r.samples > 1 for r in injected)


def profile_all(call):
    from fuel.cost import profile_kernel

    return profile_kernel(call, warmup=1, repeats=3, min_sample_ns=1)
