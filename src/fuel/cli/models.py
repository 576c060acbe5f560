"""``fuel models``: the zoo as a table (``fuel demo`` runs the default model: ``fuel.cli.run``)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from fuel.cli.app import app

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def model_rows() -> list[dict[str, Any]]:
    """One row per zoo model: its arch and main dims, and the parameter-count estimate."""
    from fuel.circuit import zoo

    rows = []
    for name in zoo.names():
        shape = zoo.shape(name)
        entry = zoo.entry(name)
        rows.append({
            "name": name,
            "hf": entry.hf,
            "arch": shape.arch,
            "model_type": shape.model_type,
            "layers": shape.layers,
            "hidden": shape.dims["hidden"],
            "q_heads": shape.dims["q_heads"],
            "kv_heads": shape.dims["kv_heads"],
            "experts": shape.dims.get("experts"),
            "top_k": shape.dims.get("top_k"),
            "params": zoo.parameter_count(shape),
        })
    return rows


def _billions(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"


@app.command("models")
def models_command(as_json: JsonOpt = False) -> None:
    """The model zoo: name, arch, layers, hidden, heads/kv heads, parameter estimate."""
    rows = model_rows()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table("name", "arch", "layers", "hidden", "heads/kv", "experts", "params",
                  title="fuel model zoo")
    for row in rows:
        experts = f"{row['top_k']} of {row['experts']}" if row["experts"] else "-"
        table.add_row(row["name"], row["arch"], str(row["layers"]), str(row["hidden"]),
                      f"{row['q_heads']}/{row['kv_heads']}", experts, _billions(row["params"]))
    Console(highlight=False).print(table)
