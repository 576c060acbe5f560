"""``fuel plan MODEL --device D``: what a model does on a device (SPEC §G).

Resolves the model (zoo name, or ``--config`` with an optional ``--circuit``), the device (the
cost stage's specs), the device's rule set and the policy, builds the report document and prints
it as rich text, ``--json``, and/or writes ``--html FILE`` (atomically: a temp file in the same
folder, then a rename, so the file is never half-written). ``--serve MODE`` makes the command
fail (exit 2, the gap named) when that mode has a tier with no plan.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from fuel.cli.app import app
from fuel.errors import FuelError, InputError


class ServeGap(FuelError):
    """A mode the user asked to serve has tiers with no plan."""

    def __init__(self, missing: dict[str, list[str]], reasons: dict[str, str]):
        self.missing = missing
        parts = [f"{mode} has no plan at {', '.join(tiers)} ({reasons[mode]})"
                 for mode, tiers in missing.items() if tiers]
        super().__init__("cannot serve: " + "; ".join(parts))


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder and a rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_expert_load(path: Path):
    """The expert load a ``fuel run --json`` report measured; a file that is not one is an
    :class:`InputError` naming it and the key."""
    from fuel.report.build import ExpertMeasurement

    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise InputError(str(path), None, f"cannot read: {error.strerror or error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(str(path), None, f"not valid JSON: {error}") from None
    load = report.get("experts") if isinstance(report, dict) else None
    if not isinstance(load, dict) or not load:
        raise InputError(str(path), "experts", "missing: not the `fuel run --json` report of an "
                                               "MoE model")
    modes = []
    for mode, row in sorted(load.items()):
        try:
            modes.append((mode, float(row["rows_per_step"]),
                          float(row["distinct_experts_per_layer"]),
                          float(row["uniform_routing_per_layer"])))
        except (KeyError, TypeError, ValueError):
            raise InputError(str(path), f"experts.{mode}", "needs rows_per_step, "
                             "distinct_experts_per_layer and uniform_routing_per_layer") from None
    return ExpertMeasurement(path.name, str(report.get("model", "?")), tuple(modes))


@app.command("plan")
def plan_command(
    model: Annotated[str | None, typer.Argument(help="A zoo model name (see `fuel models`).")] = None,
    device: Annotated[str, typer.Option("--device", "-d", help="Device name (see `fuel devices`).")] = "h100-sxm",
    config: Annotated[Path | None, typer.Option("--config", help="A config.json instead of MODEL.")] = None,
    circuit: Annotated[Path | None, typer.Option("--circuit", help="A circuit file instead of the arch's built-in one.")] = None,
    context: Annotated[int, typer.Option("--context", min=1, help="KV tokens per sequence.")] = 4096,
    serve: Annotated[list[str], typer.Option("--serve", help="A mode that must plan at every tier (repeatable).")] = [],  # noqa: B006
    table: Annotated[list[str], typer.Option("--table", help="A verify_batch row table, e.g. \"4x2 2x3!\" (repeatable).")] = [],  # noqa: B006
    settings: Annotated[list[str], typer.Option("--set", help="Policy setting key=value (repeatable).")] = [],  # noqa: B006
    levers: Annotated[list[str], typer.Option("--lever", help="Opt in a `differs` lever (repeatable).")] = [],  # noqa: B006
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    html: Annotated[Path | None, typer.Option("--html", help="Write a self-contained HTML page.")] = None,
    experts_from: Annotated[Path | None, typer.Option(
        "--experts-from", help="A `fuel run --json` report of an MoE model: state the distinct "
                               "experts per layer it measured beside the uniform estimate.")] = None,
) -> None:
    """What MODEL does on a device: roofline, memory fit, fused plans, gaps, coverage."""
    from fuel.circuit.policy import build_policy, parse_assignments
    from fuel.circuit.rules import Mode
    from fuel.circuit.runs import RowTable
    from fuel.cli.circuit import resolve_circuit
    from fuel.cost.devices import device as device_spec
    from fuel.report.build import (DEFAULT_TABLES, ReportOptions, build_report, device_info,
                                   kv_format_for, rule_set_for)

    modes = []
    for name in serve:
        mode = Mode.parse(name)
        if mode is None:
            raise InputError("--serve", name, "unknown mode (one of "
                             f"{', '.join(m.value for m in Mode)})")
        modes.append(mode)
    tables = tuple(RowTable.parse(t) for t in (table or DEFAULT_TABLES))
    spec = device_spec(device)
    circ = resolve_circuit(model, circuit, config)
    policy = build_policy(parse_assignments(settings), levers)
    choice = rule_set_for(spec.title, spec.kind.value)
    options = ReportOptions(context=context, kv_format=kv_format_for(policy), tables=tables,
                            serve=tuple(modes),
                            measured_experts=read_expert_load(experts_from) if experts_from else None)
    name = model if model is not None else str(config)
    doc = build_report(name, circ, device_info(spec), choice, policy, options)

    if html is not None:
        from fuel.report.html import render_html

        write_atomically(html, render_html(doc))
    if as_json:
        typer.echo(json.dumps(doc, indent=2, allow_nan=False))
    else:
        from fuel.report.text import render_text

        render_text(doc, Console(highlight=False, soft_wrap=False, width=160))
        if html is not None:
            typer.echo(f"wrote {html}")
    missing = {m: t for m, t in doc["serve"].items() if t}
    if missing:
        reasons = {c["mode"]: c["reason"] for c in reversed(doc["coverage"])
                   if not c["planned"] and c["mode"] in missing}
        raise ServeGap(missing, reasons)
