"""Circuit files (SPEC §A2): TOML text -> a validated :class:`CircuitTemplate`.

Decides what a circuit file may say and refuses everything else at load time, naming the file
and the key. A template is still generic: dims are names, bindings still hold ``{L}``, params
still hold ``{placeholders}``; :func:`fuel.circuit.instantiate.instantiate` fixes them for one
model.

File layout (``schema = 1``; unknown keys are refused at every level)::

    schema = 1
    arch = "dense_gqa"
    description = "..."
    dims = ["hidden", "q_heads", ...]        # the dim names templates may use (``n`` is implicit)
    include = ["gqa_blocks"]                  # block libraries: <this file's folder>/<name>.toml
    prologue = ["embed"]                      # block (or slot) names, in order
    epilogue = ["head"]
    draft = ["embed", "attn", "mlp", "head"]  # optional draft section
    layer_module = "model.layers.{i}"         # what ``{L}`` becomes in a layer's bindings
    draft_module = "model.layers.0"           # ... and in the draft's

    [layout]
    kind = "interval"                         # or "list": kinds come from the ArchShape
    period = 1                                # every period-th layer is full_attention
    other = "sliding_attention"               # the remaining layers' kind (period > 1)
    [layout.blocks]
    full_attention = ["attn", "mlp"]

    [variant.attn]                            # a slot whose template a shape param selects
    param = "attention_block"
    cases = { plain = "attn", bias = "attn_bias" }

    [block.attn]
    stream_in = "x"                           # local name bound to the running stream edge
    stream_out = "out"                        # local edge that becomes the running stream
    outputs = []                              # local edges declared circuit outputs
    [[block.attn.node]]
    id = "q"
    op = "linear"
    role = "q"
    in = ["h"]
    out = [{ edge = "q_out", format = "bf16", shape = "n x q_heads*head_dim" }]
    binding = ["{L}.self_attn.q_proj.weight"]
    params = { heads = "{q_heads}" }

A block library holds only ``schema``, ``description`` and ``[block.*]`` tables. Each table's
format is a pydantic model (``_Circuit``, ``_Block``, ``_Node``...; :mod:`fuel.schema`); what
spans tables or files (includes, duplicate and unused blocks, references) is checked by hand.

Invariants of a loaded template:
- Every op is one of the closed set; ``role`` appears exactly on linear nodes, ``format``
  exactly on act_quant nodes; every weight-reading op has a binding.
- Every dim name in a shape is declared; every rows expression mentions ``n``; every edge
  format is edge-legal.
- Every block template is reachable from the prologue, epilogue, draft, layout or a variant
  case; every name those reference resolves to a block or a variant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, Field, ValidationInfo, model_validator

from fuel.circuit.dims import DimError, DimExpr, parse_dim, parse_shape
from fuel.circuit.format import Format, FormatError, parse as parse_format
from fuel.circuit.ir import WEIGHT_OPS, LayerKind, Op, OpKind
from fuel.errors import InputError
from fuel.schema import Invalid, Schema, validate

M = TypeVar("M", bound=Schema)

SCHEMA = 1

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class CircuitLoadError(InputError):
    """A circuit file or block library that does not follow §A2."""


class LayoutKind(Enum):
    INTERVAL = "interval"
    LIST = "list"


@dataclass(frozen=True, slots=True)
class OutTemplate:
    """One output edge of a node template: a block-local name, its format and shape."""

    edge: str
    format: Format
    rows: DimExpr
    dim: DimExpr


@dataclass(frozen=True, slots=True)
class NodeTemplate:
    """One node of a block template. ``key`` is where it sits in its file
    (``block.attn.node[3]``), for error messages at instantiation."""

    local: str
    op: Op
    inputs: tuple[str, ...]
    outputs: tuple[OutTemplate, ...]
    bindings: tuple[str, ...]
    params: tuple[tuple[str, str], ...]
    key: str


@dataclass(frozen=True, slots=True)
class BlockTemplate:
    name: str
    stream_in: str | None
    stream_out: str | None
    outputs: tuple[str, ...]
    nodes: tuple[NodeTemplate, ...]
    file: str


@dataclass(frozen=True, slots=True)
class Variant:
    """A slot whose block template is chosen by the value of shape param ``param``."""

    slot: str
    param: str
    cases: tuple[tuple[str, str], ...]

    def template_for(self, value: str) -> str | None:
        for case, template in self.cases:
            if case == value:
                return template
        return None


@dataclass(frozen=True, slots=True)
class Layout:
    kind: LayoutKind
    period: int
    other: LayerKind | None
    blocks: tuple[tuple[LayerKind, tuple[str, ...]], ...]

    def blocks_for(self, kind: LayerKind) -> tuple[str, ...] | None:
        for k, names in self.blocks:
            if k is kind:
                return names
        return None


@dataclass(frozen=True, slots=True)
class CircuitTemplate:
    """A loaded circuit file with its libraries merged in. ``blocks`` maps name -> template in
    file order (libraries first, in ``include`` order)."""

    file: str
    arch: str
    description: str
    dims: frozenset[str]
    prologue: tuple[str, ...]
    epilogue: tuple[str, ...]
    draft: tuple[str, ...]
    layer_module: str | None
    draft_module: str | None
    layout: Layout
    variants: tuple[Variant, ...]
    blocks: tuple[BlockTemplate, ...]

    def block(self, name: str) -> BlockTemplate | None:
        for b in self.blocks:
            if b.name == name:
                return b
        return None

    def variant(self, slot: str) -> Variant | None:
        for v in self.variants:
            if v.slot == slot:
                return v
        return None


# --------------------------------------------------------------------------- the file's schema
# One pydantic model per table (fuel.schema): types, unknown keys, closed choices and the checks
# within one table. What spans tables or files (includes, duplicate blocks, references, unused
# blocks) is checked by hand below, on the loaded values.


def _edge_format(text: str) -> Format:
    try:
        fmt = parse_format(text)
    except FormatError as error:
        raise Invalid(str(error)) from None
    if not fmt.edge_legal:
        raise Invalid(f"`{text}` is a weight-only layout and cannot be stored on an edge")
    return fmt


def _shape(text: str, info: ValidationInfo) -> tuple[DimExpr, DimExpr]:
    try:
        return parse_shape(text, info.context["dims"])
    except DimError as error:
        raise Invalid(error.reason) from None


def _dim_name(name: str) -> str:
    try:
        parse_dim(name)
    except DimError:
        raise Invalid(f"`{name}` is not a dim name") from None
    if name == "n":
        raise Invalid("`n` is the step's rows and always declared")
    return name


EdgeFormat = Annotated[str, AfterValidator(_edge_format)]


class _Out(Schema):
    edge: str
    format: EdgeFormat
    shape: Annotated[str, AfterValidator(_shape)]


class _Node(Schema):
    id: str
    op: Annotated[OpKind, Field(strict=False)]
    role: str | None = None
    format: EdgeFormat | None = None
    in_: list[str] = Field(default=[], alias="in")
    out: list[_Out] = []
    binding: list[str] = []
    params: dict[str, str] = {}

    @model_validator(mode="after")
    def _fits_the_op(self) -> _Node:
        op = self.op.value
        if self.op is OpKind.LINEAR and not self.role:
            raise Invalid("a linear node needs a role (q, k, v, o, gate_up, ...)", "role")
        if self.op is not OpKind.LINEAR and self.role is not None:
            raise Invalid(f"only linear nodes take a role, not `{op}`", "role")
        if self.op is OpKind.ACT_QUANT and self.format is None:
            raise Invalid("an act_quant node needs the format it quantizes to", "format")
        if self.op is not OpKind.ACT_QUANT and self.format is not None:
            raise Invalid(f"only act_quant nodes take a format, not `{op}`", "format")
        if self.op in WEIGHT_OPS and not self.binding:
            raise Invalid(f"`{op}` reads weights and needs a binding", "binding")
        return self

    def template(self, key: str) -> NodeTemplate:
        outputs = tuple(OutTemplate(o.edge, o.format, *o.shape) for o in self.out)
        return NodeTemplate(self.id, Op(self.op, self.role, self.format), tuple(self.in_), outputs,
                            tuple(self.binding), tuple(sorted(self.params.items())), key)


class _Block(Schema):
    stream_in: str | None = None
    stream_out: str | None = None
    outputs: list[str] = []
    node: Annotated[list[_Node], Field(min_length=1)]

    @model_validator(mode="after")
    def _streams_are_produced(self) -> _Block:
        produced = {out.edge for node in self.node for out in node.out}
        if self.stream_out is not None and self.stream_out not in produced:
            raise Invalid(f"`{self.stream_out}` is not an edge this block produces", "stream_out")
        for i, edge in enumerate(self.outputs):
            if edge not in produced:
                raise Invalid(f"`{edge}` is not an edge this block produces", f"outputs[{i}]")
        return self

    def template(self, name: str, file: str) -> BlockTemplate:
        nodes = tuple(n.template(f"block.{name}.node[{i}]") for i, n in enumerate(self.node))
        return BlockTemplate(name, self.stream_in, self.stream_out, tuple(self.outputs), nodes, file)


class _Layout(Schema):
    kind: Annotated[LayoutKind, Field(strict=False)]
    period: Annotated[int, Field(ge=1)] | None = None
    other: Annotated[LayerKind, Field(strict=False)] | None = None
    blocks: Annotated[dict[Annotated[LayerKind, Field(strict=False)], list[str]], Field(min_length=1)]

    @model_validator(mode="after")
    def _fits_the_kind(self) -> _Layout:
        if self.kind is LayoutKind.LIST:
            for key in ("period", "other"):
                if getattr(self, key) is not None:
                    raise Invalid("only an interval layout takes this key", key)
        elif self.period is None:
            raise Invalid("missing (an interval layout needs its period)", "period")
        elif self.period > 1 and self.other is None:
            raise Invalid("an interval layout with period > 1 needs the other layers' kind", "other")
        return self

    def layout(self) -> Layout:
        return Layout(self.kind, self.period or 1, self.other,
                      tuple((kind, tuple(names)) for kind, names in self.blocks.items()))


class _Variant(Schema):
    param: str
    cases: Annotated[dict[str, str], Field(min_length=1)]


class _Library(Schema):
    """A block library: ``schema``, ``description`` and at least one ``[block.*]``."""

    schema_: Literal[1] = Field(alias="schema")
    description: str = ""
    block: Annotated[dict[str, _Block], Field(min_length=1)]


class _Circuit(Schema):
    schema_: Literal[1] = Field(alias="schema")
    arch: str
    description: str = ""
    dims: list[Annotated[str, AfterValidator(_dim_name)]]
    include: list[str] = []
    prologue: list[str] = []
    epilogue: list[str] = []
    draft: list[str] = []
    layer_module: str | None = None
    draft_module: str | None = None
    layout: _Layout
    variant: dict[str, _Variant] = {}
    block: dict[str, _Block] = {}


def _load(model: type[M], path: Path, dims: Any) -> M:
    """``path``'s TOML as ``model``; shapes are checked against ``dims`` (names)."""
    from fuel.inputs import parse_toml, read_text

    def fail(key: str | None, detail: str) -> CircuitLoadError:
        return CircuitLoadError(str(path), key, detail)

    raw = parse_toml(read_text(path, lambda detail: fail(None, detail)), lambda detail: fail(None, detail))
    if dims is None:  # a circuit file declares its own dims; a wrong list fails on `dims` first
        listed = raw.get("dims")
        dims = frozenset(d for d in listed if isinstance(d, str)) if isinstance(listed, list) else frozenset()
    return validate(model, raw, fail, context={"dims": dims})


def load_library(path: Path, dims: frozenset[str]) -> list[BlockTemplate]:
    """Load a block library: ``schema``, ``description`` and ``[block.*]`` only."""
    library = _load(_Library, path, dims)
    return [block.template(name, str(path)) for name, block in library.block.items()]


def load_circuit(path: str | Path) -> CircuitTemplate:
    """Load and validate a circuit file and its included block libraries."""
    path = Path(path)
    root = _load(_Circuit, path, None)
    dims = frozenset(root.dims)
    blocks: list[BlockTemplate] = []
    for i, name in enumerate(root.include):
        library = path.parent / f"{name}.toml"
        if not library.is_file():
            raise CircuitLoadError(str(path), f"include[{i}]", f"no block library `{name}` (looked for {library})")
        blocks.extend(load_library(library, dims))
    blocks.extend(block.template(name, str(path)) for name, block in root.block.items())
    seen: dict[str, str] = {}
    for b in blocks:
        if b.name in seen:
            raise CircuitLoadError(b.file, f"block.{b.name}",
                                   f"block `{b.name}` is already defined in {seen[b.name]}")
        seen[b.name] = b.file
    template = CircuitTemplate(
        file=str(path), arch=root.arch, description=root.description, dims=dims,
        prologue=tuple(root.prologue), epilogue=tuple(root.epilogue), draft=tuple(root.draft),
        layer_module=root.layer_module, draft_module=root.draft_module, layout=root.layout.layout(),
        variants=tuple(Variant(slot, v.param, tuple(v.cases.items())) for slot, v in root.variant.items()),
        blocks=tuple(blocks),
    )
    _check_references(template)
    return template


def _check_references(t: CircuitTemplate) -> None:
    """Every referenced name resolves; every block template is referenced (SPEC §A3: an unused
    block template is an error, since it is almost always a typo in a layout)."""
    used: set[str] = set()
    block_names = {b.name for b in t.blocks}
    for v in t.variants:
        if v.slot in block_names:
            raise CircuitLoadError(t.file, f"variant.{v.slot}",
                                   f"slot `{v.slot}` is also a block name; a slot names a choice")
        for case, name in v.cases:
            if name not in block_names:
                raise CircuitLoadError(t.file, f"variant.{v.slot}.cases.{case}",
                                       f"no block `{name}`")
            used.add(name)

    def resolve(key: str, names: tuple[str, ...]) -> None:
        for i, name in enumerate(names):
            if name in block_names:
                used.add(name)
            elif t.variant(name) is None:
                raise CircuitLoadError(t.file, f"{key}[{i}]", f"no block or variant `{name}`")

    resolve("prologue", t.prologue)
    resolve("epilogue", t.epilogue)
    resolve("draft", t.draft)
    for kind, names in t.layout.blocks:
        resolve(f"layout.blocks.{kind.value}", names)
    if t.draft and t.draft_module is None:
        raise CircuitLoadError(t.file, "draft_module",
                               "a draft section needs draft_module (what `{L}` is in its bindings)")
    if t.layer_module is None:
        raise CircuitLoadError(t.file, "layer_module", "missing required key")
    for b in t.blocks:
        if b.name not in used:
            raise CircuitLoadError(b.file, f"block.{b.name}",
                                   "unused block template (no prologue, epilogue, draft, layout or "
                                   "variant names it)")


def placeholders(text: str) -> list[str]:
    """The ``{name}`` placeholders of a param or binding template, in order."""
    return _PLACEHOLDER.findall(text)


def substitute(text: str, values: dict[str, str]) -> str:
    """Replace every ``{name}``; the caller has checked every name has a value."""
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)
