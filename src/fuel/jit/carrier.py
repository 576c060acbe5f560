"""The JIT carrier: the trigger that turns a region no backend can run into a :class:`JitRequest`.

Decides, for one fused node and one backend, the question the JIT seam exists to answer: this
op has no kernel on this device; can its region be handed to a synthesizer instead of moving the
tensors to a device that can run it? Lowering to primitives needs *every* primitive of the
recipe bound on the target; handing the region over needs *none* of them. That asymmetry is why
the trigger keys on the fused op's absence, not on the recipe's placeability.

Every reason not to synthesize is ``None`` (producing a request is the exception, declining the
norm): not fused; already runnable here; no recipe exposed; an operand dtype with no seam
spelling. The last is deliberate: substituting a nearby kind would ask about a different kernel
than the graph has (typing paged attention's u32 indices as i32 is exactly that mistake).

Invariants:
- "Runnable here" means what it means to the planner and the executor: the table lookup keyed
  on the op, the input dtypes in order then the output dtype, the backend, and the capabilities
  the node's params require (a soft-capped attention is not served by a kernel without
  ``softcap``, so it is not runnable here). A *variant arm* kernel does not make a node
  runnable (``KernelBindingTable.find_default``): torch's int4pack kernel for a Q4 matmul is an
  arm beside the recipe, and the synthesized kernel must be there to be measured against it.
- Operands: the inputs in bind order, then the output (``n_inputs + 1`` entries); row-major
  strides with the innermost 1; alignment = the element size. A symbolic extent stays a symbol.
- Pure: reads the graph and the table, mutates neither.
"""

from __future__ import annotations

from fuel.graph.ir import Fused, Graph, NodeId
from fuel.graph.registry import RuntimeFusedRegistry, recipe_for
from fuel.jit.protocol import (
    ArchSku, JitBudget, JitRequest, OperandDesc, dtype_to_element_kind,
)
from fuel.kernels.table import KernelBindingTable, key_dtypes, op_key, required_caps
from fuel.graph.dtype import BackendId


def jit_request_for_unplaceable_fused(
    graph: Graph,
    node_id: NodeId,
    backend: BackendId,
    table: KernelBindingTable,
    arch: ArchSku,
    budget: JitBudget,
    runtime: RuntimeFusedRegistry | None = None,
) -> JitRequest | None:
    """A request for ``node_id`` if and only if it is a fused node that cannot run on
    ``backend`` and whose region can be described honestly; otherwise ``None``.

    ``runtime`` resolves runtime fused ids (>= 0x8000) to their regions.
    """
    node = graph.node(node_id)
    if not isinstance(node.op, Fused):
        return None

    # The trigger: synthesize only when this device cannot already run it.
    key = op_key(node.op)
    if key is not None and table.find_default(key, key_dtypes(graph, node_id), backend,
                                              required_caps(node)) is not None:
        return None

    region = recipe_for(graph, node_id, runtime)
    if region is None:
        return None

    operands: list[OperandDesc] = []
    for operand in (*node.inputs, node_id):
        desc = _operand_desc(graph, operand)
        if desc is None:
            return None
        operands.append(desc)
    return JitRequest(region, tuple(operands), arch, budget)


def _operand_desc(graph: Graph, node_id: NodeId) -> OperandDesc | None:
    """One node's shape, row-major strides and kind; ``None`` when its dtype has no spelling."""
    node = graph.node(node_id)
    kind = dtype_to_element_kind(node.dtype)
    if kind is None:
        return None
    dims = node.shape.dims
    strides: list[int | str] = [1] * len(dims)
    for axis in range(len(dims) - 2, -1, -1):
        inner, extent = strides[axis + 1], dims[axis + 1]
        strides[axis] = inner * extent if isinstance(inner, int) and isinstance(extent, int) \
            else f"{inner}*{extent}"
    return OperandDesc(len(dims), tuple(dims), tuple(strides), kind, kind.size_in_bytes)
