"""The JIT request a gap would make: the report's seam to the JIT carrier.

Decides, for a circuit node no rule covers, what request the carrier
(``fuel.jit.jit_request_for_unplaceable_fused``, SPEC §E) would make for it, or why it would
decline. The carrier reads a lowered *graph* node, and a gap has none: lowering builds each
group by its rule's kernel, so a node no rule covers has no plan and no construction (that is
what makes it a gap). Decided: the request is described here from the circuit node, following
the carrier's rules exactly where the circuit has the facts; fused nodes that *are* lowered but
have no kernel on the device (paged attention and residual_add_rms_norm on the CPU) get the
real carrier's requests from the lowered step (``fuel jit``, ``fuel explain --jit``, and
``fuel run --jit`` which adopts kernels for them):

- only an op with a fused op (and so a recipe) in the graph registry gets a request; any other op
  declines ("no recipe");
- operands are the node's inputs in bind order, then its output; shape ``[rows, dim]``,
  row-major strides (innermost 1), alignment = element size;
- an operand whose dtype has no single spelling (a quantized format carrying scales) declines the
  whole request rather than being approximated: never widen or substitute a dtype.

``source`` says the request was described from the circuit (``circuit-seam``), so a reader knows
it is not a lowered graph node's request. Pure.
"""

from __future__ import annotations

from typing import Any

from fuel.circuit.format import Format, FormatKind
from fuel.circuit.ir import Circuit, OpKind

SOURCE = ("circuit-seam: described from the circuit node; a gap has no rule, so no lowered graph "
          "node for fuel.jit's carrier (see `fuel jit MODEL` for the lowered step's requests)")

# Circuit op -> the graph registry's fused op (fuel.graph.registry.FusedOps) with that recipe.
FUSED_OP_OF: dict[OpKind, str] = {
    OpKind.RMS_NORM: "RMS_NORM",
    OpKind.FINAL_NORM: "RMS_NORM",
    OpKind.QK_NORM: "RMS_NORM",
    OpKind.ROPE: "ROPE",
    OpKind.SILU_MUL: "SILU_MUL",
    OpKind.LINEAR: "FUSED_LINEAR",
    OpKind.LM_HEAD: "FUSED_LINEAR",
    OpKind.PAGED_ATTENTION: "PAGED_ATTN",
}

_DTYPE = {FormatKind.BF16: ("bf16", 2), FormatKind.F16: ("f16", 2), FormatKind.F32: ("f32", 4),
          FormatKind.I32: ("i32", 4)}


def _operand(fmt: Format, rows: int, dim: int) -> dict[str, Any] | None:
    spelled = _DTYPE.get(fmt.kind) if not fmt.is_quantized else None
    if spelled is None:
        return None
    dtype, size = spelled
    return {"shape": [rows, dim], "strides": [dim, 1], "dtype": dtype, "alignment": size}


def gap_request(circuit: Circuit, node_index: int, rows: int, backend: str | None
                ) -> dict[str, Any]:
    """The request for node ``node_index`` at ``rows`` rows on ``backend``, or a decline."""
    node = circuit.nodes[node_index]
    if backend is None:
        return {"status": "declined", "source": SOURCE,
                "reason": "no backend: no rule set targets this device, so there is no kernel "
                          "table to synthesize into"}
    fused = FUSED_OP_OF.get(node.op.kind)
    if fused is None:
        return {"status": "declined", "source": SOURCE,
                "reason": f"`{node.op.name()}` has no fused op with a recipe in the graph "
                          "registry: there is no region to hand to a synthesizer"}
    operands = []
    dims = dict(circuit.dims)
    for e in (*node.inputs, *node.outputs):
        edge = circuit.edges[e]
        op = _operand(edge.format, edge.rows_at(rows, dims), edge.dim_value)
        if op is None:
            return {"status": "declined", "source": SOURCE,
                    "reason": f"operand `{edge.id}` is stored as {edge.format.name()}, which has "
                              "no single-dtype spelling; approximating it would ask for a "
                              "different kernel"}
        operands.append(op)
    return {"status": "request", "fused_op": fused, "backend": backend, "operands": operands,
            "source": SOURCE}
