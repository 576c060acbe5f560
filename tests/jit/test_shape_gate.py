"""A JIT kernel is gated per shape: adopted where it verified and measured faster, never offered
(nor baked) at a shape where it failed verification, and the decision record says why."""

from __future__ import annotations

import torch

from fuel.cost import device
from fuel.graph import BackendId, DType, FusedOpParams, FusedOps, Graph, OpKind
from fuel.graph.branch import lower
from fuel.graph.ir import Fused
from fuel.graph.recipe import emit
from fuel.graph.registry import RUNTIME_FUSED_BASE
from fuel.jit.adopt import Outcome
from fuel.jit.protocol import Synthesized, SynthesizedKernel
from fuel.jit.session import JitSession
from fuel.kernels import cpu_table
from fuel.optimize import ADOPTED, OptimizeOptions, ShapeGate, optimize_graph

F32 = DType.F32
RIGHT, WRONG = 64, 96


def residual_step(width: int) -> tuple[Graph, int]:
    g = Graph()
    x, r = g.input("x", [1, width], F32), g.input("r", [1, width], F32)
    gain = g.input("gain", [width], F32)
    fused = g.fused(FusedOps.RESIDUAL_ADD_RMS_NORM, FusedOpParams.ResidualAddRmsNorm(1e-5),
                    x, r, gain)
    return g, g.prim(OpKind.SUM, fused, dim=0, keepdim=False)


class WrongAtSomeWidths:
    """A synthesizer whose kernel computes the recipe exactly, except at ``wrong_width``, where
    it is off by one. It answers from a memo of the inputs it has seen, so it is always faster
    than the decomposed region (the cost gate never decides here; verification does)."""

    name = "test-wrong-at-96"

    def __init__(self, wrong_width: int):
        self.wrong_width = wrong_width
        self.kernels: dict[str, SynthesizedKernel] = {}

    def synthesize(self, request):
        from fuel.graph.dtype import Shape
        from fuel.runtime.executor import compile_program

        g = Graph()
        binds = [g.input(f"in{i}", o.shape, o.dtype.dtype) for i, o in enumerate(request.inputs)]
        out = request.output
        root = emit(g, request.region, binds, expect=(Shape.from_dims(out.shape), out.dtype.dtype))
        program = compile_program(g, lower(g, [root]), cpu_table())
        off = 1.0 if out.shape[-1] == self.wrong_width else 0.0
        memo: dict[tuple[int, ...], torch.Tensor] = {}

        def run(*inputs):
            key = tuple(id(t) for t in inputs)
            if key not in memo:
                memo[key] = program.run({f"in{i}": t for i, t in enumerate(inputs)})[root] + off
            return memo[key]

        entry = f"residual_{out.shape[-1]}"
        self.kernels[entry] = SynthesizedKernel(entry, request.structure_key(), BackendId.CPU,
                                                "test.memo", run, "", 0.0)
        return Synthesized(entry)

    def on_rejected(self, entry_point, report):
        pass

    def take_kernel(self, entry_point):
        return self.kernels.pop(entry_point, None)


class KernelAlwaysFaster:
    """A Judge that measured every adopted kernel at 1 ns (and nothing else): wherever the
    kernel is offered, the bake picks it."""

    def measured_latency_ns(self, op, dtype, size_class, backend, kernel_source):
        return 1 if op.startswith("jit:") else None


def optimized_at(session: JitSession, width: int):
    g, root = residual_step(width)
    session.adopt_for(g, [root])
    options = OptimizeOptions(table=session.table, runtime=session.registry,
                              runtime_gate=session.gate(), device_spec=device("h100-sxm"),
                              judge=KernelAlwaysFaster())
    result = optimize_graph(g, [root], options)
    runs_kernel = any(isinstance(g.node(n).op, Fused) and g.node(n).op.id >= RUNTIME_FUSED_BASE
                      for n in result.order)
    return result, runs_kernel


def test_a_kernel_wrong_at_one_shape_is_never_offered_or_baked_there(tmp_path):
    session = JitSession(table=cpu_table(), synthesizer=WrongAtSomeWidths(WRONG),
                         store_path=tmp_path / "judge.sqlite", measure_arms=False)
    right, right_runs = optimized_at(session, RIGHT)
    wrong, wrong_runs = optimized_at(session, WRONG)
    by_width = {e.record.entry_point: e.record.outcome for e in session.events}
    assert by_width == {f"residual_{RIGHT}": Outcome.ADOPTED, f"residual_{WRONG}": Outcome.WRONG}

    # Where it verified, the kernel is offered and (measured faster) baked.
    assert [d.winner for d in right.decisions] == [1] and right_runs
    # Where it was wrong, no branch exists, nothing runs it, and the record says why.
    assert wrong.decisions == () and not wrong_runs
    (offer,) = [o for o in wrong.offers if o.pathfinder == ADOPTED]
    assert offer.branch is None
    assert f"refused at [1, {WRONG}]" in offer.detail and "wrong numbers" in offer.detail


def test_a_kernel_never_verified_at_a_shape_is_not_offered_there():
    # Why: the gate admits shapes, not regions: a shape nobody verified is not vouched for.
    gate = ShapeGate({("jit:0123456789abcdef", ((1, 64), (1, 64), (64,), (2, 1, 64))): None})
    assert gate.refusal("jit:0123456789abcdef", ((1, 64), (1, 64), (64,), (2, 1, 64))) is None
    why = gate.refusal("jit:0123456789abcdef", ((1, 96), (1, 96), (96,), (2, 1, 96)))
    assert why is not None and "never verified at [1, 96]" in why
