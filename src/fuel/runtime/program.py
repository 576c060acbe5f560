"""Step programs: a lowered step, optimized and compiled once, run every step.

Decides how a :class:`~fuel.runtime.lower.StepGraph` becomes something the engine calls per
step: ``fuel.optimize.optimize_graph`` (fused nodes with no kernel on the backend lowered to
their recipe — arm 0 —, pathfinder arms offered, variants baked by cost, every decision
recorded), then the executor compiles the dispatch order against the binding table and the
bound weights.

Invariants:
- A program is built once per (plan digest, step geometry) and reused; building never happens
  inside a step.
- Derived weights (concatenated projections, RoPE tables) are built once per
  :class:`WeightStore` and shared by every program of an engine; checkpoint tensors are bound
  as they are (no copy).
- ``run`` feeds exactly the step's inputs and returns ``logits`` and ``tokens``; nothing else is
  computed (losing arms are not in the order).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fuel.graph.branch import lower as lower_order
from fuel.graph.dtype import BackendId, Device
from fuel.graph.ir import Fused, Prim
from fuel.runtime.lower import DerivedKind, DerivedWeight, StepGraph

if TYPE_CHECKING:
    import torch

    from fuel.kernels.table import KernelBindingTable
    from fuel.optimize.optimize import OptimizedGraph, OptimizeOptions


class WeightStore(Mapping[str, "torch.Tensor"]):
    """Checkpoint tensors by binding path, plus the derived weights programs ask for."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype):
        self._tensors = tensors
        self._derived: dict[str, torch.Tensor] = {}
        self.dtype = dtype

    def derive(self, spec: DerivedWeight) -> None:
        """Build ``spec`` once (a second request for the same name is free)."""
        if spec.name in self._derived:
            return
        import torch

        if spec.kind is DerivedKind.CONCAT:
            value = torch.cat([self._tensors[name] for name in spec.sources], dim=0).contiguous()
        else:
            # Hugging Face's default RoPE: inv_freq = theta^(-2i/d), angle = position * inv_freq,
            # tables cat(angles, angles), computed in float32 and stored in the model dtype.
            exponents = torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float() / spec.head_dim
            inv_freq = 1.0 / (spec.theta ** exponents)
            positions = torch.arange(spec.positions, dtype=torch.float32)
            angles = torch.outer(positions, inv_freq)
            table = torch.cat((angles, angles), dim=-1)
            value = (table.cos() if spec.kind is DerivedKind.ROPE_COS else table.sin()).to(self.dtype)
        self._derived[spec.name] = value

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._derived:
            return self._derived[name]
        return self._tensors[name]

    def __iter__(self):
        yield from self._tensors
        yield from self._derived

    def __len__(self) -> int:
        return len(self._tensors) + len(self._derived)

    def __contains__(self, name: object) -> bool:
        return name in self._derived or name in self._tensors


@dataclass(frozen=True, slots=True)
class BakeSummary:
    """What optimize_graph decided for one program, in numbers a report can print."""

    lowered: tuple[tuple[str, int], ...]
    """Fused ops lowered to their recipe (no kernel on the backend), with counts."""
    offers: int
    branches: int
    bakes: int
    jit_requests: int

    def describe(self) -> str:
        lowered = ", ".join(f"{name} x{count}" for name, count in self.lowered) or "none"
        return (f"lowered to recipe: {lowered}; arms offered: {self.offers}; branches: "
                f"{self.branches}; baked to a variant: {self.bakes}; JIT requests: {self.jit_requests}")


@dataclass(slots=True)
class StepProgram:
    """One compiled step: call :meth:`run` with the feeds; ``launches`` is the plan's count,
    ``dispatched`` the kernel calls the executor makes."""

    step: StepGraph
    optimized: OptimizedGraph
    program: Any
    logits_root: int
    tokens_root: int

    @property
    def digest(self) -> str:
        return self.step.plan.digest

    @property
    def launches(self) -> int:
        return self.step.plan.launches()

    @property
    def dispatched(self) -> int:
        return len(self.program)

    def bake_summary(self) -> BakeSummary:
        counts: dict[str, int] = {}
        for lowering in self.optimized.lowerings:
            counts[lowering.op] = counts.get(lowering.op, 0) + 1
        return BakeSummary(tuple(sorted(counts.items())), len(self.optimized.offers),
                           len(self.optimized.decisions), self.optimized.bakes,
                           len(self.optimized.jit_requests))

    def run(self, feeds: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.program.run(feeds)
        return out[self.logits_root], out[self.tokens_root]


def build_program(step: StepGraph, store: WeightStore, table: KernelBindingTable,
                  options: OptimizeOptions | None = None) -> StepProgram:
    """Optimize ``step``'s graph in place, then compile it against ``table`` and ``store``."""
    from fuel.optimize.optimize import OptimizeOptions, optimize_graph
    from fuel.runtime.executor import compile_program

    for spec in step.derived:
        store.derive(spec)
    options = options or OptimizeOptions(table=table)
    optimized = optimize_graph(step.graph, step.roots, options)
    logits_root, tokens_root = optimized.roots
    lowered = lower_order(step.graph, optimized.roots, optimized.route)
    backend = options.device.backend if options.device else BackendId.CPU
    program = compile_program(step.graph, lowered, table, backend, store, Device(backend))
    return StepProgram(step, optimized, program, logits_root, tokens_root)


def dispatch_census(program: StepProgram) -> dict[str, int]:
    """Kernel calls per op name in a program's dispatch order (for reports and tests)."""
    graph = program.step.graph
    counts: dict[str, int] = {}
    for node_id in program.program.executed:
        op = graph.node(node_id).op
        name = op.kind.value if isinstance(op, Prim) else str(op) if isinstance(op, Fused) else "?"
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


__all__ = ["BakeSummary", "StepProgram", "WeightStore", "build_program", "dispatch_census"]
