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

A block library holds only ``schema``, ``description`` and ``[block.*]`` tables.

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
import tomllib
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from fuel.circuit.dims import DimError, DimExpr, parse_dim, parse_shape
from fuel.circuit.format import Format, FormatError, parse as parse_format
from fuel.circuit.ir import WEIGHT_OPS, LayerKind, Op, OpKind
from fuel.errors import InputError

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


# --------------------------------------------------------------------------- reading helpers


class _Reader:
    """Typed access to one TOML table, refusing unknown keys. Errors name file and dotted key."""

    def __init__(self, file: str, table: dict[str, Any], prefix: str):
        self.file = file
        self.table = table
        self.prefix = prefix

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def fail(self, name: str | None, detail: str) -> CircuitLoadError:
        return CircuitLoadError(self.file, self.key(name) if name else (self.prefix or None), detail)

    def refuse_unknown(self, allowed: set[str]) -> None:
        for name in sorted(self.table):
            if name not in allowed:
                raise self.fail(name, f"unknown key (allowed: {', '.join(sorted(allowed))})")

    def get(self, name: str, kind: type | tuple[type, ...], *, required: bool = False) -> Any:
        if name not in self.table:
            if required:
                raise self.fail(name, "missing required key")
            return None
        value = self.table[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise self.fail(name, f"expected {expected}, got {type(value).__name__} `{value!r}`")
        return value

    def str_list(self, name: str, *, required: bool = False) -> tuple[str, ...]:
        value = self.get(name, list, required=required)
        if value is None:
            return ()
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise self.fail(f"{name}[{i}]", f"expected a string, got `{item!r}`")
        return tuple(value)

    def sub(self, name: str, *, required: bool = False) -> _Reader | None:
        table = self.get(name, dict, required=required)
        return None if table is None else _Reader(self.file, table, self.key(name))


def _read_toml(path: Path) -> dict[str, Any]:
    from fuel.inputs import parse_toml, read_text

    def fail(detail: str) -> CircuitLoadError:
        return CircuitLoadError(str(path), None, detail)

    return parse_toml(read_text(path, fail), fail)


# --------------------------------------------------------------------------- blocks


def _parse_out(reader: _Reader, index: int, raw: Any, dims: frozenset[str]) -> OutTemplate:
    key = f"out[{index}]"
    if not isinstance(raw, dict):
        raise reader.fail(key, f"expected a table {{edge, format, shape}}, got `{raw!r}`")
    out = _Reader(reader.file, raw, reader.key(key))
    out.refuse_unknown({"edge", "format", "shape"})
    edge = out.get("edge", str, required=True)
    format_name = out.get("format", str, required=True)
    try:
        fmt = parse_format(format_name)
    except FormatError as error:
        raise out.fail("format", str(error)) from None
    if not fmt.edge_legal:
        raise out.fail("format", f"`{format_name}` is a weight-only layout and cannot be stored "
                                 "on an edge")
    shape = out.get("shape", str, required=True)
    try:
        rows, dim = parse_shape(shape, dims)
    except DimError as error:
        raise out.fail("shape", error.reason) from None
    return OutTemplate(edge, fmt, rows, dim)


def _parse_node(block: _Reader, index: int, raw: Any, dims: frozenset[str]) -> NodeTemplate:
    key = block.key(f"node[{index}]")
    if not isinstance(raw, dict):
        raise CircuitLoadError(block.file, key, "expected a table")
    node = _Reader(block.file, raw, key)
    node.refuse_unknown({"id", "op", "role", "format", "in", "out", "binding", "params"})
    local = node.get("id", str, required=True)
    op_name = node.get("op", str, required=True)
    try:
        kind = OpKind(op_name)
    except ValueError:
        raise node.fail("op", f"unknown op `{op_name}` (the op set is closed: "
                              f"{', '.join(k.value for k in OpKind)})") from None
    role = node.get("role", str)
    format_name = node.get("format", str)
    if kind is OpKind.LINEAR and not role:
        raise node.fail("role", "a linear node needs a role (q, k, v, o, gate_up, ...)")
    if kind is not OpKind.LINEAR and role is not None:
        raise node.fail("role", f"only linear nodes take a role, not `{op_name}`")
    fmt = None
    if kind is OpKind.ACT_QUANT:
        if format_name is None:
            raise node.fail("format", "an act_quant node needs the format it quantizes to")
        try:
            fmt = parse_format(format_name)
        except FormatError as error:
            raise node.fail("format", str(error)) from None
        if not fmt.edge_legal:
            raise node.fail("format", f"`{format_name}` is a weight-only layout")
    elif format_name is not None:
        raise node.fail("format", f"only act_quant nodes take a format, not `{op_name}`")
    raw_outs = node.get("out", list) or []
    outputs = tuple(_parse_out(node, i, item, dims) for i, item in enumerate(raw_outs))
    bindings = node.str_list("binding")
    if kind in WEIGHT_OPS and not bindings:
        raise node.fail("binding", f"`{op_name}` reads weights and needs a binding")
    params_table = node.get("params", dict) or {}
    params = []
    for name in sorted(params_table):
        value = params_table[name]
        if not isinstance(value, str):
            raise node.fail(f"params.{name}", f"params are strings, got `{value!r}`")
        params.append((name, value))
    return NodeTemplate(local, Op(kind, role, fmt), node.str_list("in"), outputs, bindings,
                        tuple(params), key)


def _parse_blocks(root: _Reader, dims: frozenset[str]) -> list[BlockTemplate]:
    table = root.sub("block")
    if table is None:
        return []
    blocks = []
    for name in table.table:
        block = table.sub(name)
        assert block is not None
        if not isinstance(block.table, dict):
            raise block.fail(None, "expected a table")
        block.refuse_unknown({"stream_in", "stream_out", "outputs", "node"})
        raw_nodes = block.get("node", list, required=True)
        if not raw_nodes:
            raise block.fail("node", "a block needs at least one node")
        nodes = tuple(_parse_node(block, i, raw, dims) for i, raw in enumerate(raw_nodes))
        produced = {out.edge for node in nodes for out in node.outputs}
        stream_in, stream_out = block.get("stream_in", str), block.get("stream_out", str)
        if stream_out is not None and stream_out not in produced:
            raise block.fail("stream_out", f"`{stream_out}` is not an edge this block produces")
        outputs = block.str_list("outputs")
        for i, edge in enumerate(outputs):
            if edge not in produced:
                raise block.fail(f"outputs[{i}]", f"`{edge}` is not an edge this block produces")
        blocks.append(BlockTemplate(name, stream_in, stream_out, outputs, nodes, block.file))
    return blocks


# --------------------------------------------------------------------------- circuit file


def _layer_kind(reader: _Reader, key: str, value: str) -> LayerKind:
    try:
        return LayerKind(value)
    except ValueError:
        raise reader.fail(key, f"unknown layer kind `{value}` (one of "
                               f"{', '.join(k.value for k in LayerKind)})") from None


def _parse_layout(root: _Reader) -> Layout:
    layout = root.sub("layout", required=True)
    assert layout is not None
    layout.refuse_unknown({"kind", "period", "other", "blocks"})
    kind_name = layout.get("kind", str, required=True)
    try:
        kind = LayoutKind(kind_name)
    except ValueError:
        raise layout.fail("kind", f"unknown layout kind `{kind_name}` (interval or list)") from None
    period = 1
    other = None
    if kind is LayoutKind.INTERVAL:
        period = layout.get("period", int, required=True)
        if period < 1:
            raise layout.fail("period", f"the period must be at least 1, got {period}")
        other_name = layout.get("other", str)
        if period > 1 and other_name is None:
            raise layout.fail("other", "an interval layout with period > 1 needs the other layers' kind")
        other = _layer_kind(layout, "other", other_name) if other_name else None
    else:
        for name in ("period", "other"):
            if name in layout.table:
                raise layout.fail(name, "only an interval layout takes this key")
    blocks_reader = layout.sub("blocks", required=True)
    assert blocks_reader is not None
    blocks = []
    for name in blocks_reader.table:
        blocks.append((_layer_kind(blocks_reader, name, name), blocks_reader.str_list(name)))
    if not blocks:
        raise blocks_reader.fail(None, "map at least one layer kind to its blocks")
    return Layout(kind, period, other, tuple(blocks))


def _parse_variants(root: _Reader) -> list[Variant]:
    table = root.sub("variant")
    if table is None:
        return []
    variants = []
    for slot in table.table:
        v = table.sub(slot)
        assert v is not None
        v.refuse_unknown({"param", "cases"})
        param = v.get("param", str, required=True)
        cases_reader = v.sub("cases", required=True)
        assert cases_reader is not None
        cases = []
        for case in cases_reader.table:
            cases.append((case, cases_reader.get(case, str, required=True)))
        if not cases:
            raise cases_reader.fail(None, "a variant needs at least one case")
        variants.append(Variant(slot, param, tuple(cases)))
    return variants


def load_library(path: Path, dims: frozenset[str]) -> list[BlockTemplate]:
    """Load a block library: ``schema``, ``description`` and ``[block.*]`` only."""
    root = _Reader(str(path), _read_toml(path), "")
    root.refuse_unknown({"schema", "description", "block"})
    _check_schema(root)
    blocks = _parse_blocks(root, dims)
    if not blocks:
        raise root.fail("block", "a block library needs at least one block")
    return blocks


def _check_schema(root: _Reader) -> None:
    schema = root.get("schema", int, required=True)
    if schema != SCHEMA:
        raise root.fail("schema", f"unsupported schema {schema} (this fuel reads schema {SCHEMA})")


def load_circuit(path: str | Path) -> CircuitTemplate:
    """Load and validate a circuit file and its included block libraries."""
    path = Path(path)
    root = _Reader(str(path), _read_toml(path), "")
    root.refuse_unknown({"schema", "arch", "description", "dims", "include", "prologue", "epilogue",
                         "draft", "layer_module", "draft_module", "layout", "variant", "block"})
    _check_schema(root)
    arch = root.get("arch", str, required=True)
    description = root.get("description", str) or ""
    dim_names = root.str_list("dims", required=True)
    for i, name in enumerate(dim_names):
        try:
            parse_dim(name)
        except DimError:
            raise root.fail(f"dims[{i}]", f"`{name}` is not a dim name") from None
        if name == "n":
            raise root.fail(f"dims[{i}]", "`n` is the step's rows and always declared")
    dims = frozenset(dim_names)

    blocks: list[BlockTemplate] = []
    for i, name in enumerate(root.str_list("include")):
        library = path.parent / f"{name}.toml"
        if not library.is_file():
            raise root.fail(f"include[{i}]", f"no block library `{name}` (looked for {library})")
        blocks.extend(load_library(library, dims))
    blocks.extend(_parse_blocks(root, dims))
    seen: dict[str, str] = {}
    for b in blocks:
        if b.name in seen:
            raise CircuitLoadError(b.file, f"block.{b.name}",
                                   f"block `{b.name}` is already defined in {seen[b.name]}")
        seen[b.name] = b.file

    layout = _parse_layout(root)
    variants = _parse_variants(root)
    template = CircuitTemplate(
        file=str(path), arch=arch, description=description, dims=dims,
        prologue=root.str_list("prologue"), epilogue=root.str_list("epilogue"),
        draft=root.str_list("draft"),
        layer_module=root.get("layer_module", str), draft_module=root.get("draft_module", str),
        layout=layout, variants=tuple(variants), blocks=tuple(blocks),
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
