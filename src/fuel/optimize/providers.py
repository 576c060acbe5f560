"""Arm cost providers: what a branch arm costs on its device, from Layer 1 and the Judge.

Decides how an arm is priced for the bake.

- An arm costs the sum of its interior nodes' costs: each node is its own kernel launch, priced
  on its own roofline (no overlap between launches), so a measured node and a Layer-1 node add
  up on the same footing.
- :func:`decode_arm_composite_ns` — Layer 1 only: ``composite_ns(estimate(node))`` per node on
  the placed device's spec, symbolic dims at their capacity (``Pricing.symbols``).
- :func:`decode_arm_composite_ns_judged` — per node, the Judge's measured median where it has
  one (keyed exactly as the profiler stores it: op name, output dtype, the shared size class,
  backend, and the kernel source the table would dispatch), Layer 1 otherwise. With no Judge it
  *is* the Layer-1 provider.
- Availability: a node whose key has no kernel on its backend (with the capabilities its params
  require) makes the arm "kernel unavailable" — unless the Judge measured it: a measured cell is
  evidence the kernel exists. ``Pricing.table = None`` is the offline view: availability is not
  checked (every kernel the graph names is assumed bound), as in a plan made without a target.
- Runtime fused ops have no Layer-1 family. By default they are unpriceable (the seed's
  behaviour: such an arm never wins). With ``Pricing.price_runtime_fused`` they are priced by
  composing their recipe: the primitives' FLOPs, the bytes crossing the region's boundary
  (inputs read once, output written once) and one launch.
- The Judge key of a node (:func:`judge_key`) is the profiler's (op name, shared size class),
  except for a runtime fused op whose region the registry knows: its op is ``jit:<first 16 hex
  of the region's structural hash>`` and its size class the log2 buckets of every operand
  (inputs, then ``>`` the output: ``io:e10,e20,e20,e3,e0>e10``). Runtime ids follow
  registration order and differ between processes; the region's hash does not, so a kernel
  measured in one run is found by the next. The operand buckets keep what the output's size
  hides (paged attention's block-table width, hence its KV length). A ``quant_linear`` node
  (a table's variant arm: torch's int4pack kernel) is keyed by its operand buckets too: its
  output's size alone would give q_proj (K=576) and down_proj (K=1536) one cell.
- A *variant arm* kernel (``KernelEntry.variant_arm``) is priced only by the Judge's
  measurement, as an adopted kernel is: Layer 1 prices a packed weight at its bytes, which says
  nothing of how fast torch's kernel reads them (its exact f32 path here is ~10x slower than
  the dequantize+matmul recipe it would replace for a decode row, 50-80x for a 64-row chunk:
  ``benchmarks/bench_native_kquant.py --table int4pack``), so an unmeasured variant cannot win.

Invariants: pure (reads the graph, the table, the spec and the Judge snapshot; mutates nothing);
never raises for a well-formed graph — every "cannot price" is an :class:`ArmDeclined`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from fuel.cost.estimate import Unestimated, estimate, judge_op_name, size_class_of
from fuel.cost.roofline import SATURATED_NS, CostEstimate, composite_ns
from fuel.cost.sizeclass import log2_bucket
from fuel.cost.spec import DeviceSpec
from fuel.graph.branch import arm_interiors
from fuel.graph.dtype import BackendId
from fuel.graph.ir import Branch, Fused, Graph, Input, NodeId, Weight
from fuel.graph.recipe import EmitRefused, emit
from fuel.graph.registry import (
    RUNTIME_FUSED_BASE, FusedOps, RuntimeFusedRegistry, fused_name, recipe_for,
)
from fuel.kernels.table import KernelBindingTable, Precision, key_dtypes, op_key, required_caps
from fuel.optimize.decisions import CostSource, Reason
from fuel.optimize.variant_bake import ArmDeclined, ArmPrice, NodePrice, _weaker


@dataclass(frozen=True)
class Pricing:
    """What pricing an arm needs: the device's roofline spec, the kernels bound (None: offline
    view, availability unchecked), symbol capacities, runtime regions, and whether runtime fused
    ops are priced by their recipe."""

    device: DeviceSpec
    table: KernelBindingTable | None = None
    symbols: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    runtime: RuntimeFusedRegistry | None = None
    price_runtime_fused: bool = False
    backend: BackendId = BackendId.CPU
    """The backend of a node that carries no stamp of its own."""


@dataclass(frozen=True, slots=True)
class _Node:
    ns: int | None
    source: CostSource | None
    precision: Precision | None
    declined: ArmDeclined | None = None


def _kernel_source(entry, backend: BackendId) -> str:
    return entry.kernel_source if entry is not None else f"torch.{backend.value}"


def recipe_estimate(graph: Graph, node_id: NodeId, pricing: Pricing) -> CostEstimate | Unestimated:
    """A fused node's work composed from its recipe: the primitives' FLOPs, the boundary bytes
    (inputs read once, output written once) and one launch. Emits into a scratch graph whose
    leaves mirror the node's inputs, so the real graph is never touched."""
    region = recipe_for(graph, node_id, pricing.runtime)
    if region is None:
        return Unestimated(f"node {node_id}: no recipe to compose")
    node = graph.node(node_id)
    scratch = Graph()
    binds = [scratch.input(f"bind{i}", graph.node(i).shape.dims, graph.node(i).dtype)
             for i in node.inputs]
    root = emit(scratch, region, binds, expect=(node.shape, node.dtype))
    if isinstance(root, EmitRefused):
        return Unestimated(f"node {node_id}: recipe not emittable: {root.reason}")
    flops = matrix = 0
    matrix_dtype = None
    for inner in range(len(binds), len(scratch)):
        work = estimate(scratch, inner, symbols=pricing.symbols)
        if isinstance(work, Unestimated):
            return work
        flops += work.flops
        if work.matrix_flops:
            if matrix_dtype not in (None, work.matrix_dtype):
                return Unestimated(f"node {node_id}: recipe mixes matrix dtypes")
            matrix, matrix_dtype = matrix + work.matrix_flops, work.matrix_dtype
    boundary = 0
    for leaf in (*binds, root):
        size = scratch.value_bytes(leaf, pricing.symbols)
        if size is None:
            return Unestimated(f"node {node_id}: symbolic dims of {scratch.node(leaf).shape} "
                               "have no capacity")
        boundary += size
    return CostEstimate(flops=flops, bytes=boundary, launches=1, matrix_flops=matrix,
                        matrix_dtype=matrix_dtype)


def _layer1_ns(graph: Graph, node_id: NodeId, pricing: Pricing) -> int | str:
    """Layer-1 ns of one node, or the reason it has none."""
    work = estimate(graph, node_id, symbols=pricing.symbols)
    if isinstance(work, Unestimated):
        op = graph.node(node_id).op
        if pricing.price_runtime_fused and isinstance(op, Fused) and op.id >= RUNTIME_FUSED_BASE:
            work = recipe_estimate(graph, node_id, pricing)
        if isinstance(work, Unestimated):
            return work.reason
    ns = composite_ns(work, pricing.device)
    return ns if ns is not None else f"node {node_id}: {pricing.device.name} cannot price it"


def runtime_judge_name(region_hash: str) -> str:
    """The Judge op name of a runtime fused region: stable across processes (module docs)."""
    return f"jit:{region_hash[:16]}"


def _operand_size_class(graph: Graph, node_id: NodeId, symbols: Mapping[str, int]) -> str | None:
    node = graph.node(node_id)
    buckets = []
    for operand in (*node.inputs, node_id):
        count = 1
        for dim in graph.node(operand).shape.dims:
            if isinstance(dim, str):
                if dim not in symbols:
                    return None
                dim = int(symbols[dim])
            count *= dim
        buckets.append(f"e{log2_bucket(count)}")
    return f"io:{','.join(buckets[:-1])}>{buckets[-1]}"


def judge_key(graph: Graph, node_id: NodeId, *, symbols: Mapping[str, int] | None = None,
              runtime: RuntimeFusedRegistry | None = None) -> tuple[str, str] | None:
    """``(op, size_class)`` under which the Judge stores and serves ``node_id``'s latency;
    ``None`` when the node has no kernel key or a symbolic dim has no capacity."""
    node = graph.node(node_id)
    symbols = symbols or {}
    if isinstance(node.op, Fused) and node.op.id >= RUNTIME_FUSED_BASE and runtime is not None:
        registered = runtime.get(node.op.id)
        if registered is not None:
            size_class = _operand_size_class(graph, node_id, symbols)
            return None if size_class is None else (runtime_judge_name(registered.hash), size_class)
    if isinstance(node.op, Fused) and node.op.id == FusedOps.QUANT_LINEAR:
        size_class = _operand_size_class(graph, node_id, symbols)
        return None if size_class is None else (fused_name(node.op.id), size_class)
    op = judge_op_name(node)
    size_class = size_class_of(graph, node_id, symbols=symbols)
    return None if op is None or size_class is None else (op, size_class)


def _node_price(graph: Graph, node_id: NodeId, pricing: Pricing, judge) -> _Node:
    node = graph.node(node_id)
    if isinstance(node.op, Input | Weight | Branch):
        return _Node(0, None, Precision.EXACT)
    backend = graph.target_backend.get(node_id, pricing.backend)
    key = op_key(node.op)
    entry = None
    if key is not None and pricing.table is not None:
        entry = pricing.table.find(key, key_dtypes(graph, node_id), backend, required_caps(node))
    measured = None
    if judge is not None and key is not None:
        cell = judge_key(graph, node_id, symbols=pricing.symbols, runtime=pricing.runtime)
        if cell is not None:
            measured = judge.measured_latency_ns(cell[0], node.dtype.value, cell[1],
                                                 backend.value, _kernel_source(entry, backend))
    if key is not None and pricing.table is not None and entry is None and measured is None:
        return _Node(None, None, None, ArmDeclined(
            Reason.KERNEL_UNAVAILABLE,
            f"no {backend.value} kernel for node {node_id} ({node.op}) "
            f"[{', '.join(d.value for d in key_dtypes(graph, node_id))}]"))
    precision = entry.precision if entry is not None else None
    if measured is not None:
        return _Node(measured, CostSource.JUDGE, precision)
    if entry is not None and entry.variant_arm:
        return _Node(None, None, None, ArmDeclined(
            Reason.UNKNOWN_COST, f"node {node_id} ({node.op}): the {entry.kernel_source} variant "
            "arm is priced only by the Judge's measurement, and it has none here"))
    ns = _layer1_ns(graph, node_id, pricing)
    if isinstance(ns, str):
        return _Node(None, None, None, ArmDeclined(Reason.UNKNOWN_COST, ns))
    return _Node(ns, CostSource.LAYER1, precision)


def price_arm(graph: Graph, branch: NodeId, arm: int, pricing: Pricing,
              judge=None) -> ArmPrice | ArmDeclined:
    """The arm's interior priced node by node (Judge where measured when ``judge`` is given)."""
    interior = arm_interiors(graph, branch)[arm]
    total = 0
    sources: set[CostSource] = set()
    precision: Precision | None = Precision.EXACT
    nodes: list[NodePrice] = []
    for node_id in sorted(interior):
        priced = _node_price(graph, node_id, pricing, judge)
        if priced.declined is not None:
            return priced.declined
        assert priced.ns is not None
        total = min(total + priced.ns, SATURATED_NS)
        precision = _weaker(precision, priced.precision) if pricing.table is not None else None
        if priced.source is not None:
            sources.add(priced.source)
            nodes.append(NodePrice(node_id, priced.ns, priced.source))
    if sources == {CostSource.JUDGE}:
        source = CostSource.JUDGE
    elif CostSource.JUDGE in sources:
        source = CostSource.MIXED
    else:
        source = CostSource.LAYER1
    return ArmPrice(total, source, precision, tuple(nodes))


def decode_arm_composite_ns(graph: Graph, branch: NodeId, arm: int, pricing: Pricing) -> int | None:
    """Layer 1 summed over the arm's interior on the placed device; None when unknown or a
    kernel is unavailable (the arm cannot win)."""
    price = price_arm(graph, branch, arm, pricing)
    return price.ns if isinstance(price, ArmPrice) else None


def decode_arm_composite_ns_judged(graph: Graph, branch: NodeId, arm: int, pricing: Pricing,
                                   judge=None) -> int | None:
    """The Judge per interior node where measured, Layer 1 otherwise, summed; identical to
    :func:`decode_arm_composite_ns` when ``judge`` is None."""
    price = price_arm(graph, branch, arm, pricing, judge)
    return price.ns if isinstance(price, ArmPrice) else None
