"""The circuit IR: an instantiated model as nodes (ops) and edges (activation tensors).

Decides nothing; holds what instantiation (``fuel.circuit.instantiate``) produced and what the
fuser reads. All values are frozen.

Invariants (established by ``instantiate``, relied on by the fuser):
- ``nodes`` are in execution order: every input edge of a node is produced by an earlier node
  or is a circuit input (``producer is None``).
- ``blocks[b]`` owns the contiguous node range ``first..end``; every node's ``block`` is the
  index of the block that owns it.
- Edge ``consumers`` are ascending node indices; ``Node.inputs`` / ``Node.outputs`` are edge
  indices in the order the template wrote them.
- Ids are unique: ``l{i}.{block}.{local}`` in layers, ``draft.{block}.{local}`` in the draft,
  ``{block}.{local}`` in the prologue and epilogue.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from fuel.circuit.dims import DimExpr
from fuel.circuit.format import Format


class Section(Enum):
    """Which part of the circuit a mode runs: ``draft`` runs the draft head, every other mode
    the main model."""

    MAIN = "main"
    DRAFT = "draft"


class LayerKind(Enum):
    FULL_ATTENTION = "full_attention"
    SLIDING_ATTENTION = "sliding_attention"
    MOE = "moe"
    LINEAR_ATTENTION = "linear_attention"
    MAMBA = "mamba"


class OpKind(Enum):
    """The closed op set of §A2. An op not named here is a load error."""

    EMBED = "embed"
    RMS_NORM = "rms_norm"
    RESIDUAL_ADD = "residual_add"
    COPY = "copy"
    CONCAT = "concat"
    SPLIT = "split"
    LINEAR = "linear"
    ACT_QUANT = "act_quant"
    SILU_MUL = "silu_mul"
    GELU_TANH_MUL = "gelu_tanh_mul"
    QK_NORM = "qk_norm"
    ROPE = "rope"
    KV_WRITE = "kv_write"
    PAGED_ATTENTION = "paged_attention"
    ROUTER = "router"
    TOP_K = "top_k"
    EXPERT_GATE_UP = "expert_gate_up"
    EXPERT_DOWN = "expert_down"
    BLEND = "blend"
    FINAL_NORM = "final_norm"
    LM_HEAD = "lm_head"
    ARGMAX = "argmax"
    LOGIT_SOFTCAP = "logit_softcap"
    # Collectives (SPEC §I): inserted by fuel.circuit.parallel into per-rank circuits, claimed by
    # rules like any op. ``all_reduce`` / ``ep_reduce`` sum partial rows over the tensor- /
    # expert-parallel ranks, ``all_gather`` / ``reduce_scatter`` join / split the last dim,
    # ``send`` / ``recv`` move the residual stream between pipeline stages.
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    EP_REDUCE = "ep_reduce"
    SEND = "send"
    RECV = "recv"


HEAVY_OPS: frozenset[OpKind] = frozenset({
    OpKind.LINEAR, OpKind.PAGED_ATTENTION, OpKind.ROUTER, OpKind.EXPERT_GATE_UP,
    OpKind.EXPERT_DOWN, OpKind.LM_HEAD,
})
"""Opaque ops: fusion never generates them, only fuses at their edges or names a pre-written
kernel for them."""

COLLECTIVE_OPS: frozenset[OpKind] = frozenset({
    OpKind.ALL_REDUCE, OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER, OpKind.EP_REDUCE, OpKind.SEND,
    OpKind.RECV,
})
"""Ops that move data between ranks (priced by interconnect, not by the chip's roofline)."""

WEIGHT_OPS: frozenset[OpKind] = frozenset({
    OpKind.EMBED, OpKind.RMS_NORM, OpKind.LINEAR, OpKind.QK_NORM, OpKind.ROUTER,
    OpKind.EXPERT_GATE_UP, OpKind.EXPERT_DOWN, OpKind.FINAL_NORM, OpKind.LM_HEAD,
})
"""Ops that read weights and therefore need a ``binding``."""

LINEAR_ROLES: frozenset[str] = frozenset({
    "q", "k", "v", "o", "gate_up", "down", "shared_gate", "shared_gate_up", "shared_down",
})
"""The closed set of ``linear`` roles: the roles the built-in circuits give their projections. A
rule element naming another role could never match a node, so the rule loader refuses it (a
circuit that needs a new role adds it here)."""


@dataclass(frozen=True, slots=True)
class Op:
    """An op with its qualifier: ``role`` for ``linear`` (``q``, ``o``, ``gate_up`` ...),
    ``format`` for ``act_quant``. Canonical names: ``linear:q``, ``act_quant:fp8/token``."""

    kind: OpKind
    role: str | None = None
    format: Format | None = None

    def name(self) -> str:
        if self.role is not None:
            return f"{self.kind.value}:{self.role}"
        if self.format is not None:
            return f"{self.kind.value}:{self.format.name()}"
        return self.kind.value

    def __str__(self) -> str:
        return self.name()


@dataclass(frozen=True, slots=True)
class Node:
    """One op instance.

    ``bindings`` are resolved weight paths (``{L}`` replaced by the layer's module path);
    ``weight_format`` is the stored format of its weights (``None`` for ops reading none);
    ``params`` are the template's string params, sorted by key.
    """

    id: str
    op: Op
    local: str
    block: int
    layer: int | None
    layer_kind: LayerKind | None
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    bindings: tuple[str, ...] = ()
    weight_format: Format | None = None
    params: tuple[tuple[str, str], ...] = ()

    def param(self, key: str, default: str | None = None) -> str | None:
        for k, v in self.params:
            if k == key:
                return v
        return default


@dataclass(frozen=True, slots=True)
class Edge:
    """An activation tensor of ``rows x dim`` elements in ``format``.

    ``rows`` mentions ``n`` (the step's rows); ``dim`` is fixed at instantiation and
    ``dim_value`` is its value. ``is_output`` marks a declared block output that may leave the
    circuit unread (logits, sampled tokens)."""

    id: str
    format: Format
    rows: DimExpr
    dim: DimExpr
    dim_value: int
    producer: int | None
    consumers: tuple[int, ...]
    is_output: bool = False

    def rows_at(self, n: int, dims: Mapping[str, int]) -> int:
        """The edge's row count for a step of ``n`` rows."""
        return self.rows.evaluate({**dims, "n": n})


@dataclass(frozen=True, slots=True)
class BlockInstance:
    """One instantiated block: template ``name`` in ``section``, owning nodes ``first..end``.
    ``layer`` and ``layer_kind`` are ``None`` for prologue, epilogue and draft blocks (a draft
    block keeps ``layer=None``); ``module`` is the layer's checkpoint path when it has one."""

    name: str
    section: Section
    layer: int | None
    layer_kind: LayerKind | None
    first: int
    end: int
    module: str | None = None


@dataclass(frozen=True, slots=True)
class ArchShape:
    """What a config map reads from a ``config.json``: the arch, layer count and kinds, every
    dim value, and the params (rope theta, eps, tied embeddings ...) the runtime needs."""

    arch: str
    model_type: str
    layers: int
    layer_kinds: tuple[LayerKind, ...]
    dims: Mapping[str, int]
    params: Mapping[str, str] = field(default_factory=dict)
    weight_format: Format | None = None

    def __hash__(self) -> int:  # mappings are not hashable; identity of content is the tuple
        return hash((self.arch, self.model_type, self.layers, self.layer_kinds,
                     tuple(sorted(self.dims.items())), tuple(sorted(self.params.items()))))


@dataclass(frozen=True, slots=True)
class Shard:
    """The part of a checkpoint tensor one rank holds: ``[start, end)`` along ``dim``."""

    dim: int
    start: int
    end: int

    def text(self) -> str:
        return f"dim{self.dim}[{self.start}:{self.end}]"


@dataclass(frozen=True, slots=True)
class RankPlacement:
    """Where a per-rank circuit sits in a parallel layout (``fuel.circuit.parallel``): the
    world's ``tp`` x ``pp`` split, this rank's tensor- and pipeline-parallel index, ``ep``
    (1, or ``tp`` when the experts are split over the tensor-parallel ranks), its layers, and
    the slice of each checkpoint tensor it binds (bindings not named are whole)."""

    tp: int
    pp: int
    ep: int
    tp_rank: int
    pp_rank: int
    layers: tuple[int, int]
    shards: tuple[tuple[str, Shard], ...] = ()

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp + self.tp_rank

    def text(self) -> str:
        return (f"rank={self.rank} tp={self.tp_rank}/{self.tp} pp={self.pp_rank}/{self.pp} "
                f"ep={self.ep} layers={self.layers[0]}..{self.layers[1]}")

    def shard_of(self, binding: str) -> Shard | None:
        for name, shard in self.shards:
            if name == binding:
                return shard
        return None


@dataclass(frozen=True, slots=True)
class Circuit:
    """An instantiated circuit. ``dims`` holds every dim value (``n`` excluded). ``rank`` is
    ``None`` for a whole model, else where this per-rank circuit sits (its dims are the rank's:
    heads, columns, vocabulary and experts already divided)."""

    arch: str
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    blocks: tuple[BlockInstance, ...]
    dims: Mapping[str, int]
    shape: ArchShape | None = None
    rank: RankPlacement | None = None

    def __hash__(self) -> int:
        return hash((self.arch, self.nodes, self.edges, self.blocks, self.rank))

    def section_of_node(self, n: int) -> Section:
        return self.blocks[self.nodes[n].block].section

    def node_index(self, node_id: str) -> int:
        for i, node in enumerate(self.nodes):
            if node.id == node_id:
                return i
        raise KeyError(node_id)

    def edge_index(self, edge_id: str) -> int:
        for i, edge in enumerate(self.edges):
            if edge.id == edge_id:
                return i
        raise KeyError(edge_id)
