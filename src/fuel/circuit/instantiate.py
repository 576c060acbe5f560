"""Instantiation (SPEC §A3): a circuit template and one model's ArchShape -> a :class:`Circuit`.

Decides the order of blocks (prologue; per layer the blocks its kind maps to; epilogue; then the
draft blocks in section ``draft``), the ids (``l{i}.{block}.{local}`` in layers,
``draft.{block}.{local}`` in the draft, ``{block}.{local}`` elsewhere; edges alike), how the
residual stream threads through blocks, and which template a variant slot takes.

Invariants of the returned circuit (the fuser relies on them; see :mod:`fuel.circuit.ir`):
- nodes are in execution order and every input edge has an earlier producer;
- each block owns a contiguous node range; edge consumers are ascending node indices;
- ids are unique; every produced edge is read or declared an output;
- every dim an edge uses has a value, and every ``{placeholder}`` of a param or binding was
  filled from the shape.

Errors are :class:`InstantiateError` subclasses naming the circuit file and the template key
(``block.attn.node[3].in``) plus the instance id; nothing here reads files.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fuel.circuit.dims import DimError
from fuel.circuit.ir import (
    WEIGHT_OPS,
    ArchShape,
    BlockInstance,
    Circuit,
    Edge,
    LayerKind,
    Node,
    Section,
)
from fuel.circuit.template import BlockTemplate, CircuitTemplate, LayoutKind, placeholders, substitute
from fuel.errors import InputError


class InstantiateError(InputError):
    """A template that cannot be instantiated for this shape."""


class DanglingInput(InstantiateError):
    """A node reads an edge no earlier node produced."""

    def __init__(self, file: str, key: str, node: str, edge: str):
        self.node, self.edge = node, edge
        super().__init__(file, key, f"node `{node}` reads `{edge}`, which no earlier node produces "
                                    "in its block (and it is not the block's stream_in)")


class UnreadEdge(InstantiateError):
    """An edge nobody reads that is not declared an output."""

    def __init__(self, file: str, key: str, edge: str):
        self.edge = edge
        super().__init__(file, key, f"edge `{edge}` is never read and not declared in the block's "
                                    "outputs")


class DuplicateId(InstantiateError):
    def __init__(self, file: str, key: str, id: str, what: str):
        self.id, self.what = id, what
        super().__init__(file, key, f"duplicate {what} id `{id}`")


class MissingDim(InstantiateError):
    """A dim the template uses has no value in the shape (or overflows)."""

    def __init__(self, file: str, key: str, dim: str, detail: str):
        self.dim = dim
        super().__init__(file, key, detail)


class MissingParam(InstantiateError):
    """A ``{placeholder}`` or a variant's selecting param has no value in the shape."""

    def __init__(self, file: str, key: str, param: str, detail: str):
        self.param = param
        self.value: str | None = None
        """For a variant with no case for the shape's value: that value (else None)."""
        self.cases: tuple[str, ...] = ()
        super().__init__(file, key, detail)


class LayoutMismatch(InstantiateError):
    """The shape's layer kinds do not fit the circuit's layout."""


@dataclass(slots=True)
class _Builder:
    template: CircuitTemplate
    shape: ArchShape
    values: dict[str, str]
    nodes: list[Node] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    edge_keys: list[str] = field(default_factory=list)
    consumers: list[list[int]] = field(default_factory=list)
    blocks: list[BlockInstance] = field(default_factory=list)
    node_ids: set[str] = field(default_factory=set)
    edge_ids: set[str] = field(default_factory=set)
    stream: int | None = None

    def resolve(self, slot: str, key: str) -> BlockTemplate:
        variant = self.template.variant(slot)
        if variant is None:
            block = self.template.block(slot)
            assert block is not None, "load_circuit checked every reference"
            return block
        value = self.shape.params.get(variant.param)
        if value is None:
            raise MissingParam(self.template.file, f"variant.{slot}.param", variant.param,
                               f"slot `{slot}` (used by {key}) is chosen by shape param "
                               f"`{variant.param}`, which the shape does not set")
        name = variant.template_for(value)
        if name is None:
            cases = ", ".join(c for c, _ in variant.cases)
            error = MissingParam(self.template.file, f"variant.{slot}.cases", variant.param,
                                 f"no case for {variant.param} = `{value}` (cases: {cases})")
            error.value, error.cases = value, tuple(c for c, _ in variant.cases)
            raise error
        block = self.template.block(name)
        assert block is not None
        return block

    def fill(self, block: BlockTemplate, key: str, text: str, extra: Mapping[str, str]) -> str:
        values = {**self.values, **extra}
        for name in placeholders(text):
            if name not in values:
                raise MissingParam(block.file, key, name,
                                   f"`{{{name}}}` in `{text}` has no value (neither a dim nor a "
                                   "param of the shape)")
        return substitute(text, values)

    def add_block(self, slot: str, block: BlockTemplate, section: Section, layer: int | None,
                  kind: LayerKind | None, module: str | None) -> None:
        if layer is not None:
            prefix = f"l{layer}.{slot}"
        elif section is Section.DRAFT:
            prefix = f"draft.{slot}"
        else:
            prefix = slot
        first = len(self.nodes)
        local_edges: dict[str, int] = {}
        if block.stream_in is not None:
            if self.stream is None:
                raise DanglingInput(block.file, f"block.{block.name}.stream_in", prefix,
                                    block.stream_in)
            local_edges[block.stream_in] = self.stream
        bindings_extra = {"L": module} if module is not None else {}
        for template in block.nodes:
            node_id = f"{prefix}.{template.local}"
            if node_id in self.node_ids:
                raise DuplicateId(block.file, f"{template.key}.id", node_id, "node")
            self.node_ids.add(node_id)
            index = len(self.nodes)
            inputs = []
            for name in template.inputs:
                if name not in local_edges:
                    raise DanglingInput(block.file, f"{template.key}.in", node_id, name)
                edge = local_edges[name]
                inputs.append(edge)
                if index not in self.consumers[edge]:
                    self.consumers[edge].append(index)
            outputs = []
            for j, out in enumerate(template.outputs):
                out_key = f"{template.key}.out[{j}]"
                edge_id = f"{prefix}.{out.edge}"
                if edge_id in self.edge_ids or out.edge in local_edges:
                    raise DuplicateId(block.file, f"{out_key}.edge", edge_id, "edge")
                self.edge_ids.add(edge_id)
                dims = self.shape.dims
                for name in sorted(out.rows.names | out.dim.names - {"n"}):
                    if name != "n" and name not in dims:
                        raise MissingDim(block.file, f"{out_key}.shape", name,
                                         f"dim `{name}` of edge `{edge_id}` has no value for "
                                         f"{self.shape.model_type} (declared in the circuit, "
                                         "but the config map does not set it)")
                try:
                    dim_value = out.dim.evaluate(dims)
                except DimError as error:
                    raise MissingDim(block.file, f"{out_key}.shape", out.dim.text,
                                     error.reason) from None
                local_edges[out.edge] = len(self.edges)
                outputs.append(len(self.edges))
                self.edges.append(Edge(edge_id, out.format, out.rows, out.dim, dim_value,
                                       producer=index, consumers=(),
                                       is_output=out.edge in block.outputs))
                self.edge_keys.append(f"{out_key}.edge")
                self.consumers.append([])
            bindings = tuple(self.fill(block, f"{template.key}.binding", b, bindings_extra)
                             for b in template.bindings)
            params = tuple((k, self.fill(block, f"{template.key}.params.{k}", v, {}))
                           for k, v in template.params)
            weight_format = self.shape.weight_format if template.op.kind in WEIGHT_OPS else None
            self.nodes.append(Node(node_id, template.op, template.local, len(self.blocks), layer,
                                   kind, tuple(inputs), tuple(outputs), bindings, weight_format,
                                   params))
        if block.stream_out is not None:
            self.stream = local_edges[block.stream_out]
        self.blocks.append(BlockInstance(slot, section, layer, kind, first, len(self.nodes), module))


def layer_kinds(template: CircuitTemplate, shape: ArchShape) -> tuple[LayerKind, ...]:
    """Each layer's kind: computed by an interval layout, read from the shape by a list one."""
    layout = template.layout
    if layout.kind is LayoutKind.INTERVAL:
        kinds = tuple(LayerKind.FULL_ATTENTION if (i + 1) % layout.period == 0 else layout.other
                      for i in range(shape.layers))
        if shape.layer_kinds and tuple(shape.layer_kinds) != kinds:
            raise LayoutMismatch(template.file, "layout",
                                 f"the config's layer kinds do not follow this interval layout "
                                 f"(period {layout.period})")
        return kinds  # type: ignore[return-value]
    if len(shape.layer_kinds) != shape.layers:
        raise LayoutMismatch(template.file, "layout.kind",
                             f"a list layout needs one kind per layer: {shape.layers} layers, "
                             f"{len(shape.layer_kinds)} kinds")
    return tuple(shape.layer_kinds)


def instantiate(template: CircuitTemplate, config: ArchShape | Mapping[str, Any], *,
                draft: bool = True, parallel: Any = None, rank: int = 0) -> Circuit:
    """Instantiate ``template`` for ``config`` (an ArchShape, or a parsed ``config.json`` that
    a built-in config map reads). ``draft=False`` leaves out the draft section.
    ``parallel`` (a :class:`fuel.circuit.parallel.Parallel`) makes it rank ``rank``'s circuit
    of that layout; a trivial layout (tp = pp = 1) changes nothing."""
    if isinstance(config, ArchShape):
        shape = config
    else:
        from fuel.circuit.config_map import shape_from_config

        shape = shape_from_config(config)
    if parallel is not None and not parallel.trivial:
        from fuel.circuit.parallel import split_instantiate

        return split_instantiate(template, shape, parallel, rank, draft=draft)
    if shape.arch != template.arch:
        raise InstantiateError(template.file, "arch",
                               f"circuit `{template.arch}` cannot instantiate a `{shape.arch}` "
                               f"shape ({shape.model_type})")
    values = {name: str(value) for name, value in shape.dims.items()}
    values.update(shape.params)
    builder = _Builder(template, shape, values)

    def run(names: tuple[str, ...], key: str, section: Section, layer: int | None,
            kind: LayerKind | None, module: str | None) -> None:
        for slot in names:
            builder.add_block(slot, builder.resolve(slot, key), section, layer, kind, module)

    run(template.prologue, "prologue", Section.MAIN, None, None, None)
    for i, kind in enumerate(layer_kinds(template, shape)):
        names = template.layout.blocks_for(kind)
        if names is None:
            raise LayoutMismatch(template.file, f"layout.blocks.{kind.value}",
                                 f"layer {i} is {kind.value}, which the layout maps to no blocks")
        module = template.layer_module.replace("{i}", str(i)) if template.layer_module else None
        run(names, f"layout.blocks.{kind.value}", Section.MAIN, i, kind, module)
    run(template.epilogue, "epilogue", Section.MAIN, None, None, None)
    if draft and template.draft:
        builder.stream = None  # the draft starts from its own embedding, never the main stream
        run(template.draft, "draft", Section.DRAFT, None, None, template.draft_module)

    edges = []
    for i, edge in enumerate(builder.edges):
        consumers = tuple(sorted(builder.consumers[i]))
        if not consumers and not edge.is_output:
            raise UnreadEdge(template.file, builder.edge_keys[i], edge.id)
        edges.append(Edge(edge.id, edge.format, edge.rows, edge.dim, edge.dim_value, edge.producer,
                          consumers, edge.is_output))
    dims = {name: shape.dims[name] for name in sorted(template.dims) if name in shape.dims}
    return Circuit(template.arch, tuple(builder.nodes), tuple(edges), tuple(builder.blocks), dims,
                   shape)
