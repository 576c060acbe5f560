"""Per-rank circuits (SPEC §I): one model split over ``tp`` x ``pp`` ranks, as a circuit
transformation.

Decides, for a :class:`Parallel` layout and one rank, the circuit that rank runs:

- **Tensor parallel** (``tp``): query heads, MLP columns (``gate_up``) and rows (``down``), the
  shared expert's, each routed expert's intermediate columns and the vocabulary (embedding rows
  and LM-head rows) are divided by ``tp``. KV heads are divided when ``kv_heads >= tp`` and
  otherwise *replicated*: each KV head serves ``tp / kv_heads`` ranks, rank ``r`` holding head
  ``r * kv_heads // tp`` (vLLM's ``QKVParallelLinear``). Norm gains, the router and the
  shared-expert gate are whole on every rank.
- **Collectives** are circuit nodes the fuser sees and rules claim: ``all_reduce`` after the
  attention output projection, the MLP down projection and a TP-split MoE block's blend, and
  after the vocabulary-parallel embedding (each rank looks up the ids in its rows, zeros
  elsewhere); ``all_gather`` of the LM head's vocabulary slices; ``ep_reduce`` after the blend
  when the experts are split over the ranks (``ep = tp``, vLLM's ``--enable-expert-parallel``).
- **Pipeline parallel** (``pp``): stage ``s`` runs layers ``[s*L/pp, (s+1)*L/pp)``; stage 0 also
  the embedding, the last stage the head; a ``recv`` node opens every stage but the first and a
  ``send`` node closes every stage but the last. A split model has no draft section.
- Each rank's circuit carries its :class:`~fuel.circuit.ir.RankPlacement` (which slice of each
  checkpoint tensor it binds), so each rank's plan has its own digest.

Invariants:
- A split that does not divide is refused with :class:`SplitRefused`, naming the dim, its
  value and the split; nothing is padded or rounded.
- ``tp = pp = 1`` is the identity: :func:`rank_circuit` returns exactly ``instantiate``'s
  circuit (no placement), so every single-device plan and digest is unchanged.
- The rank circuit keeps the IR invariants (:mod:`fuel.circuit.ir`): execution order, contiguous
  blocks, ascending consumers, unique ids. Pure: values in, values out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from fuel.circuit.dims import parse_dim
from fuel.circuit.ir import (
    ArchShape,
    BlockInstance,
    Circuit,
    Edge,
    Node,
    Op,
    OpKind,
    RankPlacement,
    Section,
    Shard,
)
from fuel.errors import InputError

__all__ = [
    "Parallel", "ParallelError", "SplitRefused", "collective_bytes", "parallel_from",
    "rank_circuit", "rank_circuits", "split_instantiate", "split_shape",
]


class ParallelError(InputError):
    """A parallel layout that is not well formed (a non-positive size, an unsupported ep)."""


class SplitRefused(InputError):
    """A dim of the model that the layout does not divide: names the dim, value and split."""

    def __init__(self, model: str, dim: str, value: int, split: str, ways: int, detail: str = ""):
        self.dim, self.value, self.split, self.ways = dim, value, split, ways
        reason = detail or f"{value} does not divide into {ways} equal parts"
        super().__init__(model, dim, f"`{dim}` = {value} cannot be split over {split} = {ways}: "
                                     f"{reason}")


@dataclass(frozen=True, slots=True)
class Parallel:
    """A layout: ``tp`` tensor-parallel ranks per pipeline stage, ``pp`` stages, and ``ep``
    expert-parallel ranks (1: experts are tensor-split; ``tp``: each rank holds
    ``experts / tp`` whole experts). ``world = tp * pp`` processes; rank ``= stage * tp + t``."""

    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParallelError("--" + name, name, f"must be a positive integer, got {value!r}")
        if self.ep not in (1, self.tp):
            raise ParallelError("--ep", "ep", f"expert parallelism spans the tensor-parallel ranks "
                                              f"(ep = 1 or ep = tp = {self.tp}), got {self.ep}")

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def trivial(self) -> bool:
        return self.world == 1

    def placement(self, rank: int) -> tuple[int, int]:
        """``(tp_rank, pp_rank)`` of global ``rank``."""
        if not 0 <= rank < self.world:
            raise ParallelError("--rank", "rank", f"rank {rank} is outside 0..{self.world - 1}")
        return rank % self.tp, rank // self.tp

    def text(self) -> str:
        return f"tp={self.tp} pp={self.pp} ep={self.ep}"


# ------------------------------------------------------------------------------ the rank shape


def _kv_split(model: str, kv_heads: int, tp: int) -> int:
    """KV heads per rank: divided when there are at least ``tp`` of them, else one replicated
    head per rank (``tp`` must then be a multiple of ``kv_heads``)."""
    if kv_heads >= tp:
        if kv_heads % tp:
            raise SplitRefused(model, "kv_heads", kv_heads, "tp", tp)
        return kv_heads // tp
    if tp % kv_heads:
        raise SplitRefused(model, "kv_heads", kv_heads, "tp", tp,
                           f"fewer KV heads than ranks are replicated, which needs tp to be a "
                           f"multiple of {kv_heads}")
    return 1


def split_shape(shape: ArchShape, parallel: Parallel) -> ArchShape:
    """The shape one rank instantiates: every split dim divided (the same on every rank).
    Raises :class:`SplitRefused` for the first dim that does not divide."""
    model, dims, tp = f"{shape.model_type} config", dict(shape.dims), parallel.tp
    if shape.layers % parallel.pp:
        raise SplitRefused(model, "layers", shape.layers, "pp", parallel.pp)

    def divide(name: str, ways: int, split: str) -> None:
        value = dims.get(name)
        if value is None or ways == 1 or value == 0:
            return
        if value % ways:
            raise SplitRefused(model, name, value, split, ways,
                               f"{value} {_what(name)} do not divide into {ways} ranks")
        dims[name] = value // ways

    divide("q_heads", tp, "tp")
    if "kv_heads" in dims and tp > 1:
        dims["kv_heads"] = _kv_split(model, dims["kv_heads"], tp)
    divide("intermediate", tp, "tp")
    divide("shared_intermediate", tp, "tp")
    if parallel.ep > 1:
        divide("experts", parallel.ep, "ep")
    else:
        divide("expert_intermediate", tp, "tp")
    divide("vocab", tp, "tp")
    return replace(shape, dims=dims)


def _what(dim: str) -> str:
    return {"q_heads": "heads", "kv_heads": "KV heads", "vocab": "vocabulary rows",
            "experts": "experts"}.get(dim, "columns")


# ------------------------------------------------------------------------------ weight shards


def _shards(circuit: Circuit, full: ArchShape, parallel: Parallel, tp_rank: int
            ) -> tuple[tuple[str, Shard], ...]:
    """The slice of each checkpoint tensor this rank binds, from the rank circuit's dims (per
    rank) and the full shape's. Projections are ``[out, in]``; expert stacks ``[E, out, in]``."""
    if parallel.tp == 1:
        return ()
    d, head_dim, r = circuit.dims, circuit.dims.get("head_dim", 0), tp_rank
    kv_full = full.dims.get("kv_heads", 0)
    kv_first = (r * d["kv_heads"] if kv_full >= parallel.tp else r * kv_full // parallel.tp)

    def rows(count: int, first: int | None = None) -> Shard:
        start = (r * count if first is None else first)
        return Shard(0, start, start + count)

    def columns(count: int) -> Shard:
        return Shard(1, r * count, (r + 1) * count)

    out: dict[str, Shard] = {}
    for node in circuit.nodes:
        kind, role = node.op.kind, node.op.role
        shard: Shard | None = None
        if kind in (OpKind.EMBED, OpKind.LM_HEAD):
            shard = rows(d["vocab"])
        elif kind is OpKind.LINEAR and role == "q":
            shard = rows(d["q_heads"] * head_dim)
        elif kind is OpKind.LINEAR and role in ("k", "v"):
            shard = rows(d["kv_heads"] * head_dim, kv_first * head_dim)
        elif kind is OpKind.LINEAR and role == "o":
            shard = columns(d["q_heads"] * head_dim)
        elif kind is OpKind.LINEAR and role == "gate_up":
            shard = rows(d["intermediate"])
        elif kind is OpKind.LINEAR and role == "down":
            shard = columns(d["intermediate"])
        elif kind is OpKind.LINEAR and role == "shared_gate_up":
            shard = rows(d["shared_intermediate"])
        elif kind is OpKind.LINEAR and role == "shared_down":
            shard = columns(d["shared_intermediate"])
        elif kind in (OpKind.EXPERT_GATE_UP, OpKind.EXPERT_DOWN):
            if parallel.ep > 1:
                shard = Shard(0, r * d["experts"], (r + 1) * d["experts"])
            else:
                width = d["expert_intermediate"]
                dim = 1 if kind is OpKind.EXPERT_GATE_UP else 2
                shard = Shard(dim, r * width, (r + 1) * width)
        if shard is None:
            continue
        for binding in node.bindings:
            if binding.endswith(".bias") and shard.dim != 0:
                continue  # a row-parallel bias is added once, after the reduce: whole
            out.setdefault(binding, shard)
    return tuple(sorted(out.items()))


# ----------------------------------------------------------------------------- the rebuild


@dataclass(slots=True)
class _Rebuild:
    """Append-only copy of a circuit with nodes dropped and collective nodes inserted."""

    source: Circuit
    nodes: list[Node]
    edges: list[Edge]
    consumers: list[list[int]]
    blocks: list[BlockInstance]
    edge_map: dict[int, int]

    @classmethod
    def of(cls, source: Circuit) -> _Rebuild:
        return cls(source, [], [], [], [], {})

    def new_edge(self, edge: Edge, *, id: str | None = None, dim_text: str | None = None,
                 dim_value: int | None = None) -> int:
        dim = parse_dim(dim_text) if dim_text is not None else edge.dim
        self.edges.append(Edge(id or edge.id, edge.format, edge.rows, dim,
                               edge.dim_value if dim_value is None else dim_value,
                               producer=len(self.nodes), consumers=(), is_output=edge.is_output))
        self.consumers.append([])
        return len(self.edges) - 1

    def add(self, node: Node, inputs: tuple[int, ...], outputs: tuple[int, ...]) -> int:
        index = len(self.nodes)
        for e in inputs:
            if index not in self.consumers[e]:
                self.consumers[e].append(index)
        self.nodes.append(replace(node, block=len(self.blocks), inputs=inputs, outputs=outputs))
        return index

    def circuit(self, dims: Mapping[str, int], shape: ArchShape, rank: RankPlacement) -> Circuit:
        edges = tuple(replace(e, consumers=tuple(sorted(self.consumers[i])))
                      for i, e in enumerate(self.edges))
        return Circuit(self.source.arch, tuple(self.nodes), edges, tuple(self.blocks), dict(dims),
                       shape, rank)


def _collective_after(node: Node, parallel: Parallel) -> OpKind | None:
    """The collective a node's output needs in a tensor-parallel rank, if any."""
    if parallel.tp == 1:
        return None
    kind, role = node.op.kind, node.op.role
    if kind is OpKind.LINEAR and role in ("o", "down"):
        return OpKind.ALL_REDUCE
    if kind is OpKind.EMBED:
        return OpKind.ALL_REDUCE
    if kind is OpKind.BLEND:
        return OpKind.EP_REDUCE if parallel.ep > 1 else OpKind.ALL_REDUCE
    if kind is OpKind.LM_HEAD:
        return OpKind.ALL_GATHER
    return None


def _collective_node(rb: _Rebuild, node: Node, produced: int, op: OpKind, parallel: Parallel,
                     layer_kind) -> int:
    """Append the collective reading edge ``produced`` (new index); returns its output edge."""
    edge = rb.edges[produced]
    local = f"{node.local}_{op.value}"
    prefix = node.id[: -len(node.local)]
    params: list[tuple[str, str]] = [("group", "ep" if op is OpKind.EP_REDUCE else "tp"),
                                     ("ranks", str(parallel.tp))]
    if op is OpKind.ALL_GATHER:
        if "+" in edge.dim.text:
            raise ParallelError(node.id, "out.shape", f"cannot gather `{edge.dim.text}` (a sum) "
                                                      "over ranks")
        # The gathered edge keeps the id (``head.logits`` stays the step's logits); the rank's
        # slice is renamed.
        out = rb.new_edge(edge, dim_text=f"{edge.dim.text}*{parallel.tp}",
                          dim_value=edge.dim_value * parallel.tp)
        edge = replace(edge, id=f"{edge.id}_slice")
        params.append(("dim", "-1"))
    else:
        out = rb.new_edge(edge, id=f"{edge.id}_reduced")
    rb.edges[produced] = replace(edge, is_output=False)  # only the collective's result leaves
    rb.add(Node(prefix + local, Op(op), local, 0, node.layer, layer_kind, (), (), (),
                None, tuple(sorted(params))), (produced,), (out,))
    return out


def rank_circuit(full: Circuit, parallel: Parallel, rank: int = 0) -> Circuit:
    """The circuit ``rank`` of ``parallel`` runs for the whole-model circuit ``full`` of a
    built-in arch (its ``shape`` set). ``tp = pp = 1`` returns ``full`` itself."""
    if parallel.trivial:
        return full
    if full.shape is None:
        raise ParallelError(full.arch, "shape", "a circuit without its ArchShape cannot be split")
    from fuel.circuit import zoo

    has_draft = any(b.section is Section.DRAFT for b in full.blocks)
    return split_instantiate(zoo.builtin_circuit(full.arch), full.shape, parallel, rank,
                             draft=has_draft)


def split_instantiate(template: Any, shape: ArchShape, parallel: Parallel, rank: int, *,
                      draft: bool = True) -> Circuit:
    """Instantiate ``template`` for rank ``rank`` of ``parallel`` (what
    ``instantiate(..., parallel=, rank=)`` does for a non-trivial layout)."""
    from fuel.circuit.instantiate import instantiate

    tp_rank, pp_rank = parallel.placement(rank)
    rank_shape = split_shape(shape, parallel)
    split = instantiate(template, rank_shape, draft=draft and parallel.pp == 1)
    per_stage = shape.layers // parallel.pp
    lo, hi = pp_rank * per_stage, (pp_rank + 1) * per_stage
    first_layer = next((i for i, b in enumerate(split.blocks) if b.layer is not None), 0)
    last_of_stage = max((i for i, b in enumerate(split.blocks) if b.layer == hi - 1), default=-1)

    def kept(index: int, block: BlockInstance) -> bool:
        if block.section is Section.DRAFT:
            return True
        if block.layer is not None:
            return lo <= block.layer < hi
        return pp_rank == 0 if index < first_layer else pp_rank == parallel.pp - 1

    rb = _Rebuild.of(split)
    opened = False
    for b, block in enumerate(split.blocks):
        if not kept(b, block):
            continue
        if block.layer is not None and pp_rank > 0 and not opened:
            _open_stage(rb, split, block)
            opened = True
        first = len(rb.nodes)
        for n in range(block.first, block.end):
            node = split.nodes[n]
            inputs = tuple(rb.edge_map[e] for e in node.inputs)
            outputs = []
            routes_all = node.op.kind is OpKind.ROUTER and parallel.ep > 1
            for e in node.outputs:
                edge = split.edges[e]
                if routes_all:
                    # Every rank routes each token over all experts; it runs only its own.
                    rb.edge_map[e] = rb.new_edge(edge, dim_text=f"{edge.dim.text}*{parallel.ep}",
                                                 dim_value=edge.dim_value * parallel.ep)
                else:
                    rb.edge_map[e] = rb.new_edge(edge)
                outputs.append(rb.edge_map[e])
            if routes_all:
                node = replace(node, params=tuple(
                    (k, str(shape.dims["experts"]) if k == "experts" else v) for k, v in node.params))
            rb.add(node, inputs, tuple(outputs))
            op = _collective_after(node, parallel)
            if op is not None and node.outputs:
                rb.edge_map[node.outputs[0]] = _collective_node(
                    rb, node, outputs[0], op, parallel, block.layer_kind)
        rb.blocks.append(replace(block, first=first, end=len(rb.nodes)))
        if b == last_of_stage and pp_rank < parallel.pp - 1:
            _close_stage(rb, split, block)
    placement = RankPlacement(parallel.tp, parallel.pp, parallel.ep, tp_rank, pp_rank, (lo, hi),
                              _shards(split, shape, parallel, tp_rank))
    return rb.circuit(split.dims, rank_shape, placement)


def _stream_edge(split: Circuit, block: BlockInstance) -> int:
    """The residual-stream edge ``block`` reads from before it (its first node's first input
    produced outside the block)."""
    for n in range(block.first, block.end):
        for e in split.nodes[n].inputs:
            producer = split.edges[e].producer
            if producer is None or producer < block.first:
                return e
    raise ParallelError(split.arch, f"block.{block.name}", "the block reads no stream edge")


def _open_stage(rb: _Rebuild, split: Circuit, block: BlockInstance) -> int:
    """A ``recv`` block producing the stream the stage's first layer reads."""
    stream = _stream_edge(split, block)
    edge = split.edges[stream]
    out = rb.new_edge(edge, id="recv.x")
    rb.add(Node("recv.recv", Op(OpKind.RECV), "recv", 0, None, None, (), (), (), None,
                (("from_stage", "previous"),)), (), (out,))
    rb.edge_map[stream] = out
    rb.blocks.append(BlockInstance("recv", Section.MAIN, None, None, len(rb.nodes) - 1,
                                   len(rb.nodes)))
    return out


def _close_stage(rb: _Rebuild, split: Circuit, block: BlockInstance) -> None:
    """A ``send`` block handing the stage's last stream edge to the next stage."""
    last = split.nodes[block.end - 1]
    stream = rb.edge_map[last.outputs[0]]
    rb.add(Node("send.send", Op(OpKind.SEND), "send", 0, None, None, (), (), (), None,
                (("to_stage", "next"),)), (stream,), ())
    rb.blocks.append(BlockInstance("send", Section.MAIN, None, None, len(rb.nodes) - 1,
                                   len(rb.nodes)))


def rank_circuits(full: Circuit, parallel: Parallel) -> tuple[Circuit, ...]:
    """Every rank's circuit, in rank order."""
    return tuple(rank_circuit(full, parallel, r) for r in range(parallel.world))


def collective_bytes(circuit: Circuit, index: int, rows: int) -> int:
    """Bytes one rank contributes to collective node ``index`` at ``rows`` step rows: its input
    edge in the edge's format (for ``all_gather``, the rank's slice; for ``recv``, what it
    receives)."""
    node = circuit.nodes[index]
    edge = circuit.edges[node.inputs[0] if node.inputs else node.outputs[0]]
    return edge.format.bytes(edge.rows_at(rows, circuit.dims), edge.dim_value)


def parallel_from(values: Mapping[str, Any]) -> Parallel:
    """A layout from CLI-style values (``tp``, ``pp``, ``ep`` as a flag: experts over the tp
    ranks)."""
    tp = int(values.get("tp", 1))
    return Parallel(tp=tp, pp=int(values.get("pp", 1)), ep=tp if values.get("ep") else 1)
