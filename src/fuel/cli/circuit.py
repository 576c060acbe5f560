"""``fuel circuit``: build a model's circuit and describe it.

``resolve_circuit`` is the one way commands turn ``MODEL | --config FILE [--circuit FILE]`` into
a :class:`fuel.circuit.Circuit`; other ``fuel circuit`` commands (``show``) reuse it and
``circuit_app``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from fuel.circuit.ir import Circuit, Section
from fuel.cli.app import app
from fuel.errors import InputError

circuit_app = typer.Typer(help="Build a model's circuit and describe it.", no_args_is_help=True)
app.add_typer(circuit_app, name="circuit")

ModelArg = Annotated[str | None, typer.Argument(help="A zoo model (see `fuel models`).")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", help="A Hugging Face config.json.")]
CircuitOpt = Annotated[Path | None, typer.Option(
    "--circuit", help="A circuit file (default: the built-in circuit of the model's arch).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def resolve_circuit(model: str | None, circuit_file: Path | None, config_file: Path | None,
                    *, draft: bool = True) -> Circuit:
    """A zoo model name, or a config.json, instantiated with a circuit file or the built-in
    circuit of its arch. Exactly one of ``model`` and ``config_file``."""
    from fuel.circuit import zoo
    from fuel.circuit.config_map import load_config, shape_from_config
    from fuel.circuit.instantiate import instantiate
    from fuel.circuit.template import load_circuit

    if (model is None) == (config_file is None):
        raise InputError("command line", "MODEL | --config",
                         "name a zoo model or pass --config PATH (exactly one)")
    if circuit_file is None:
        if model is not None:
            return zoo.circuit_for(zoo.shape(model), draft=draft)
        return zoo.circuit_for_config(load_config(config_file), str(config_file), draft=draft)
    if model is not None:
        shape = zoo.shape(model)
    else:
        shape = shape_from_config(load_config(config_file), str(config_file))
    return instantiate(load_circuit(circuit_file), shape, draft=draft)


WeightsOpt = Annotated[Path | None, typer.Option(
    "--weights", help="A GGUF file or a checkpoint folder: each weight in the format it is "
                      "stored in there.")]


def with_weights_file(circuit: Circuit, path: Path, planned: str) -> Circuit:
    """``circuit`` with each weight in the format ``path`` stores it in (a GGUF's per-tensor
    types, a checkpoint's headers); see :func:`weights_file_formats`."""
    from fuel.circuit.quant_config import with_weight_formats

    return with_weight_formats(circuit, weights_file_formats(circuit, path, planned))


def weights_file_formats(circuit: Circuit, path: Path, planned: str) -> dict[str, Any]:
    """Binding path -> stored format of every tensor in ``path``. A file that lacks a tensor
    the circuit reads is another model's: one error naming the file and that tensor
    (``planned`` names the model), never a circuit with some weights in the file's formats and
    the rest in its own, or a step lowered against another model's shapes."""
    from fuel.runtime.quant_cache import stored_formats

    formats = stored_formats(path)
    read = [b for node in circuit.nodes if node.weight_format for b in node.bindings]
    missing = [b for b in dict.fromkeys(read) if b not in formats]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputError(str(path), None,
                         f"(--weights) holds no tensor `{missing[0]}`{more} that {planned} reads: "
                         "it is another model's file; name the file this model's weights are in")
    return formats


def planned_name(model: str | None, config: Path | None) -> str:
    """How an error names the planned model: the zoo name, else the config file."""
    return f"`{model}`" if model is not None else f"the model of {config}"


def describe(circuit: Circuit) -> dict[str, Any]:
    """What ``fuel circuit describe`` reports, as plain data."""
    shape = circuit.shape
    kinds = Counter(b.layer_kind.value for b in circuit.blocks
                    if b.layer_kind is not None and b.first == _first_block_node(circuit, b.layer))
    sections: dict[str, dict[str, int]] = {}
    for section in Section:
        nodes = [i for i, _ in enumerate(circuit.nodes) if circuit.section_of_node(i) is section]
        if not nodes:
            continue
        members = set(nodes)
        edges = sum(1 for e in circuit.edges if e.producer in members)
        blocks = sum(1 for b in circuit.blocks if b.section is section)
        sections[section.value] = {"blocks": blocks, "nodes": len(nodes), "edges": edges}
    ops = Counter(node.op.name() for node in circuit.nodes)
    return {
        "arch": circuit.arch,
        "model_type": shape.model_type if shape else None,
        "layers": shape.layers if shape else len({b.layer for b in circuit.blocks} - {None}),
        "layers_by_kind": dict(sorted(kinds.items())),
        "sections": sections,
        "nodes": len(circuit.nodes),
        "edges": len(circuit.edges),
        "dims": dict(circuit.dims),
        "params": dict(sorted(shape.params.items())) if shape else {},
        "weight_format": shape.weight_format.name() if shape and shape.weight_format else None,
        "ops": dict(sorted(ops.items())),
    }


def _first_block_node(circuit: Circuit, layer: int | None) -> int:
    return min(b.first for b in circuit.blocks if b.layer == layer)


@circuit_app.command("describe")
def describe_command(model: ModelArg = None, config: ConfigOpt = None, circuit: CircuitOpt = None,
                     as_json: JsonOpt = False) -> None:
    """Layers by kind, node and edge counts per section, dims and params of a model's circuit."""
    built = resolve_circuit(model, circuit, config)
    data = describe(built)
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    print_description(model or str(config), data)


def print_description(title: str, data: dict[str, Any]) -> None:
    console = Console(highlight=False)
    kinds = ", ".join(f"{count} {kind}" for kind, count in data["layers_by_kind"].items())
    console.print(f"[bold]{title}[/]: circuit [cyan]{data['arch']}[/] "
                  f"({data['model_type']}), {data['layers']} layers ({kinds})")
    sections = Table("section", "blocks", "nodes", "edges", title="sections")
    for name, counts in data["sections"].items():
        sections.add_row(name, str(counts["blocks"]), str(counts["nodes"]), str(counts["edges"]))
    console.print(sections)
    dims = Table("dim", "value", title="dims")
    for name, value in data["dims"].items():
        dims.add_row(name, str(value))
    console.print(dims)
    params = Table("param", "value", title="params")
    for name, value in data["params"].items():
        params.add_row(name, value or "(none)")
    console.print(params)
