"""The seam end to end: optimize records the carrier's requests, adoption runs outside it, and
the next optimize offers the adopted kernel as an arm that the bake picks when the Judge
measured it faster than arm 0's price."""

from __future__ import annotations

import pytest

from fuel.cost import JudgeOracle, JudgeStore, device
from fuel.graph import BackendId, DType, FusedOpParams, FusedOps, Graph, OpKind, RuntimeFusedRegistry
from fuel.graph.ir import Fused
from fuel.jit import ArchSku, JitBudget
from fuel.jit.adopt import Outcome, adopt
from fuel.kernels import cpu_table
from fuel.optimize import ADOPTED, OptimizeOptions, optimize_graph

F32, U32 = DType.F32, DType.U32
BUDGET = JitBudget(max_compile_ms=120_000)


def residual_step() -> tuple[Graph, int]:
    g = Graph()
    x, r = g.input("x", [1, 576], F32), g.input("r", [1, 576], F32)
    gain = g.input("gain", [576], F32)
    fused = g.fused(FusedOps.RESIDUAL_ADD_RMS_NORM, FusedOpParams.ResidualAddRmsNorm(1e-5),
                    x, r, gain)
    return g, g.prim(OpKind.SUM, fused, dim=0, keepdim=False)  # one reader: the merge point


def paged_step() -> tuple[Graph, int]:
    g = Graph()
    q = g.input("q", [1, 9, 1, 64], F32)
    k, v = g.input("k", [64, 16, 3, 64], F32), g.input("v", [64, 16, 3, 64], F32)
    table, lens = g.input("block_table", [1, 32], U32), g.input("context_lens", [1], U32)
    fused = g.fused(FusedOps.PAGED_ATTN, FusedOpParams.PagedAttn(0.125, 16), q, k, v, table, lens)
    return g, g.prim(OpKind.RESHAPE, fused, shape=(1, 576))


@pytest.mark.parametrize("step", [residual_step, paged_step], ids=["residual_add_rms_norm",
                                                                   "paged_attn"])
def test_adopted_kernel_is_offered_and_baked_by_the_next_optimize(numba_synth, tmp_path, step):
    table, registry = cpu_table(), RuntimeFusedRegistry()
    options = OptimizeOptions(table=table, runtime=registry, jit_arch=ArchSku.CPU,
                              jit_budget=BUDGET)
    g, root = step()
    first = optimize_graph(g, [root], options)
    assert len(first.jit_requests) == 1, "the unplaceable fused node yields one request"
    store_path = tmp_path / "judge.sqlite"
    with JudgeStore.open(store_path) as store:
        record = adopt(numba_synth, first.jit_requests[0], BackendId.CPU, table=table,
                       registry=registry, store=store)
    assert record.outcome is Outcome.ADOPTED, record.reason

    g, root = step()
    second = optimize_graph(g, [root], OptimizeOptions(
        table=table, runtime=registry,
        judge=WithDecomposition(JudgeOracle.load(store_path), record.decomposed_ns),
        device_spec=device("cpu-local"), jit_arch=ArchSku.CPU, jit_budget=BUDGET))
    offered = [o for o in second.offers if o.branch is not None]
    assert len(offered) == 1 and offered[0].pathfinder == ADOPTED
    (decision,) = second.decisions
    judged = decision.arms[1]
    # Arm 1 is the stored measurement; arm 0's every node costs at least the whole decomposed
    # region adoption measured, which was slower than the kernel (that is why it was adopted):
    # the bake must pick the adopted kernel, and the step must dispatch it.
    assert judged.cost_ns == record.kernel_ns and judged.source.value == "judge"
    assert decision.arms[0].cost_ns >= record.decomposed_ns > record.kernel_ns
    assert decision.winner == 1 and second.bakes == 1
    dispatched = [g.node(n).op for n in second.order]
    assert any(isinstance(op, Fused) and op.id == record.runtime_id for op in dispatched)


class WithDecomposition:
    """The stored Judge for the adopted kernel; every other node measured at ``ns`` (the
    decomposed region's time as adoption measured it)."""

    def __init__(self, judge, ns: int):
        self.judge, self.ns = judge, ns

    def measured_latency_ns(self, op, dtype, size_class, backend, kernel_source):
        if op.startswith("jit:"):
            return self.judge.measured_latency_ns(op, dtype, size_class, backend, kernel_source)
        return self.ns


class FixedJudge:
    """Measures only the runtime fused op, at a fixed latency."""

    def __init__(self, op: str, ns: int):
        self.op, self.ns = op, ns

    def measured_latency_ns(self, op, dtype, size_class, backend, kernel_source):
        return self.ns if op == self.op and kernel_source == "jit.numba.cpu" else None


@pytest.mark.parametrize("measured_ns, winner", [(1, 1), (10**12, 0)], ids=["faster", "slower"])
def test_the_bake_picks_the_adopted_arm_only_when_measured_faster(numba_synth, measured_ns,
                                                                   winner):
    # Why: adoption offers an arm; it is the Judge's number against arm 0's that decides.
    from fuel.optimize import runtime_judge_name

    table, registry = cpu_table(), RuntimeFusedRegistry()
    g, root = residual_step()
    request = optimize_graph(g, [root], OptimizeOptions(
        table=table, jit_arch=ArchSku.CPU, jit_budget=BUDGET)).jit_requests[0]
    record = adopt(numba_synth, request, BackendId.CPU, table=table, registry=registry)
    assert record.adopted
    g, root = residual_step()
    result = optimize_graph(g, [root], OptimizeOptions(
        table=table, runtime=registry, device_spec=device("cpu-local"),
        judge=FixedJudge(runtime_judge_name(registry.get(record.runtime_id).hash), measured_ns)))
    (decision,) = result.decisions
    assert decision.arms[1].cost_ns == measured_ns
    assert decision.winner == winner and result.bakes == winner
