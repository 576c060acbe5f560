"""Memory fit: do the weights and the KV cache of C sequences fit on a device?

Decides, per context length and concurrency, the bytes needed (stored weights plus
``kv_bytes_per_token x context x C``) against the usable memory (device memory x 0.9: the
rest is left to the runtime, activations, the allocator and fragmentation), and states "fits"
or the shortfall. Pure.

Invariants: stored weights count every weight once (bindings shared between nodes, such as tied
embeddings or a draft head reading the main model's layers, are counted once), the whole
embedding table and every expert; ``need = weights + kv_per_token x context x concurrency``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fuel.circuit.format import Format
from fuel.circuit.ir import Circuit, OpKind
from fuel.report.roofline import _bias_bytes, _dim, _expert_shape, _weight_format

USABLE_FRACTION = 0.9
"""Share of device memory the weights and the KV cache may use."""

CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXTS = (4096, 32768)


def stored_weight_bytes(circuit: Circuit) -> int:
    """Bytes of every weight the circuit binds, each binding counted once."""
    seen: set[str] = set()
    total = 0
    for node in circuit.nodes:
        if not node.bindings or all(b in seen for b in node.bindings):
            continue
        seen.update(node.bindings)
        total += _node_weight_bytes(circuit, node)
    return total


def _node_weight_bytes(circuit: Circuit, node) -> int:
    fmt = _weight_format(circuit, node)
    kind = node.op.kind
    edges = circuit.edges
    match kind:
        case OpKind.LINEAR | OpKind.LM_HEAD | OpKind.ROUTER:
            k, n = edges[node.inputs[0]].dim_value, edges[node.outputs[0]].dim_value
            return fmt.weight_bytes(n, k) + _bias_bytes(node, n)
        case OpKind.EXPERT_GATE_UP | OpKind.EXPERT_DOWN:
            experts, top_k = _dim(circuit, node, "experts"), _dim(circuit, node, "top_k")
            k, n = _expert_shape(circuit, node, top_k)
            return experts * fmt.weight_bytes(n, k)
        case OpKind.EMBED:
            return fmt.weight_bytes(_dim(circuit, node, "vocab"), edges[node.outputs[0]].dim_value)
        case OpKind.QK_NORM:
            return len(node.bindings) * fmt.weight_bytes(1, _dim(circuit, node, "head_dim"))
        case OpKind.RMS_NORM | OpKind.FINAL_NORM:
            return fmt.weight_bytes(1, edges[node.outputs[0]].dim_value)
    return 0


@dataclass(frozen=True, slots=True)
class FitCell:
    """One (context, concurrency) point."""

    context: int
    concurrency: int
    need_bytes: int
    usable_bytes: int

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.usable_bytes

    @property
    def shortfall_bytes(self) -> int:
        return max(0, self.need_bytes - self.usable_bytes)


@dataclass(frozen=True, slots=True)
class MemoryFit:
    device_bytes: int
    usable_bytes: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_format: Format
    cells: tuple[FitCell, ...]

    def max_concurrency(self, context: int) -> int:
        """Largest C of the table that fits at ``context`` (0 if none)."""
        return max((c.concurrency for c in self.cells if c.context == context and c.fits),
                   default=0)


def memory_fit(weight_bytes: int, kv_bytes_per_token: int, kv_format: Format, device_bytes: int,
               contexts: Sequence[int] = CONTEXTS,
               concurrencies: Sequence[int] = CONCURRENCIES) -> MemoryFit:
    usable = int(device_bytes * USABLE_FRACTION)
    cells = tuple(FitCell(ctx, c, weight_bytes + kv_bytes_per_token * ctx * c, usable)
                  for ctx in contexts for c in concurrencies)
    return MemoryFit(device_bytes, usable, weight_bytes, kv_bytes_per_token, kv_format, cells)
