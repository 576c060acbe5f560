"""``fuel plan MODEL --device D``: what a model does on a device (SPEC §G).

Resolves the model (zoo name, or ``--config`` with an optional ``--circuit``), the device (the
cost stage's specs), the device's rule set and the policy, builds the report document and prints
it as rich text, ``--json``, and/or writes ``--html FILE`` (atomically: a temp file in the same
folder, then a rename, so the file is never half-written). ``--serve MODE`` makes the command
fail (exit 2, the gap named) when that mode has a tier with no plan.
"""

from __future__ import annotations

import json
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


def read_expert_load(path: Path):
    """The expert load a ``fuel run --json`` report measured; a file that is not one is an
    :class:`InputError` naming it and the key."""
    from fuel.report.build import ExpertMeasurement

    from fuel.inputs import load_json

    report = load_json(path, lambda detail: InputError(str(path), None, detail))
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
    context: Annotated[int, typer.Option("--context", min=1, max=1 << 24, help="KV tokens per sequence.")] = 4096,
    serve: Annotated[list[str], typer.Option("--serve", help="A mode that must plan at every tier (repeatable).")] = [],  # noqa: B006
    table: Annotated[list[str], typer.Option("--table", help="A verify_batch row table, e.g. \"4x2 2x3!\" (repeatable).")] = [],  # noqa: B006
    settings: Annotated[list[str], typer.Option("--set", help="Policy setting key=value (repeatable).")] = [],  # noqa: B006
    levers: Annotated[list[str], typer.Option("--lever", help="Opt in a `differs` lever (repeatable).")] = [],  # noqa: B006
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    html: Annotated[Path | None, typer.Option("--html", help="Write a self-contained HTML page.")] = None,
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel ranks (per pipeline stage).")] = 1,
    pp: Annotated[int, typer.Option("--pp", min=1, help="Pipeline-parallel stages.")] = 1,
    ep: Annotated[bool, typer.Option("--ep", help="Split the experts over the tensor-parallel ranks.")] = False,
    nodes: Annotated[int, typer.Option("--nodes", min=1, help="Servers the ranks are spread over.")] = 1,
    interconnect: Annotated[str | None, typer.Option("--interconnect", help="Link between a server's GPUs (default: the device's, see devices.toml).")] = None,
    network: Annotated[str, typer.Option("--network", help="Link between servers (with --nodes > 1).")] = "infiniband-ndr",
    utilization: Annotated[float, typer.Option("--gpu-memory-utilization", min=0.05, max=1.0, help="Share of each GPU's memory a rank may use (vLLM's default 0.9).")] = 0.9,
    dtype: Annotated[str | None, typer.Option("--dtype", help="Plan the run's dtype (bf16 | f16 | f32): weights and activations, as `fuel run --dtype` computes them.")] = None,
    weights: Annotated[str | None, typer.Option("--weights", help="The weights' stored format: a GGUF file (each tensor priced in its own format: Q4_1, Q8_0, ...) or one format spelling for every weight (e.g. f32, fp8/channel); overrides --dtype for weights.")] = None,
    experts_from: Annotated[Path | None, typer.Option(
        "--experts-from", help="A `fuel run --json` report of an MoE model: state the distinct "
                               "experts per layer it measured beside the uniform estimate.")] = None,
) -> None:
    """What MODEL does on a device: roofline, memory fit, fused plans, gaps, coverage."""
    from fuel.circuit.policy import build_policy, check_levers, parse_assignments
    from fuel.circuit.rules import BUILTIN_RULE_SETS, Mode, load_builtin_rules
    from fuel.circuit.runs import RowTable, RowTableError
    from fuel.cli.circuit import resolve_circuit
    from fuel.cost.devices import device as device_spec
    from fuel.circuit.format import BF16
    from fuel.report.build import (DEFAULT_TABLES, ReportOptions, build_report, device_info,
                                   kv_format_for, rule_set_for)

    from fuel.inputs import check_output_path, write_atomically

    if html is not None:
        check_output_path(html, "--html")
    modes = []
    for name in serve:
        mode = Mode.parse(name)
        if mode is None:
            raise InputError("--serve", name, "unknown mode (one of "
                             f"{', '.join(m.value for m in Mode)})")
        modes.append(mode)
    try:
        tables = tuple(RowTable.parse(t) for t in (table or DEFAULT_TABLES))
    except RowTableError as error:
        raise InputError("command line", "--table", str(error)) from None
    from fuel.circuit.format import FormatError, UnsizedFormat
    from fuel.circuit.format import parse as parse_format
    from fuel.report.build import in_dtype

    if dtype is not None and dtype not in ("bf16", "f16", "f32"):
        raise InputError("--dtype", dtype, "expected bf16, f16 or f32")
    # --weights names a file (a GGUF: per-tensor formats) or one format for every weight.
    weights_file = Path(weights) if weights is not None and Path(weights).is_file() else None
    try:
        weight_format = (parse_format(weights) if weights is not None and weights_file is None
                         else None)
    except FormatError as error:
        raise InputError("--weights", weights, f"{error} (nor is it a GGUF file)") from None
    run_format = parse_format(dtype) if dtype is not None else None
    spec = device_spec(device)
    circ = in_dtype(resolve_circuit(model, circuit, config),
                    weights=weight_format or run_format, activations=run_format)
    if weights_file is not None:
        from fuel.cli.circuit import planned_name, with_weights_file

        circ = with_weights_file(circ, weights_file, planned_name(model, config))
    policy = build_policy(parse_assignments(settings), levers)
    choice = rule_set_for(spec.title, spec.kind.value)
    if levers:
        check_levers(levers, [choice.rules, *(load_builtin_rules(n) for n in BUILTIN_RULE_SETS)])
    options = ReportOptions(context=context,
                            kv_format=kv_format_for(policy, run_format or BF16), tables=tables,
                            serve=tuple(modes),
                            measured_experts=read_expert_load(experts_from) if experts_from else None)
    name = model if model is not None else str(config)
    info = device_info(spec)
    try:
        doc = build_report(name, circ, info, choice, policy, options)
    except UnsizedFormat as error:
        # a group scale that does not tile a row: named where the format came from
        raise _unsized_source(error, config, weights) from None
    if tp > 1 or pp > 1 or nodes > 1:
        from fuel.cli.plan_parallel import parallel_doc

        doc["parallel"] = parallel_doc(model, circ, spec, info, choice, policy, options, tp=tp,
                                       pp=pp, ep=ep, nodes=nodes, interconnect=interconnect,
                                       network=network, utilization=utilization)

    if html is not None:
        from fuel.report.html import render_html

        write_atomically(html, render_html(doc), "--html")
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


def _unsized_source(error: Exception, config: Path | None, weights: str | None) -> Exception:
    """An :class:`~fuel.circuit.format.UnsizedFormat` as an input error naming what chose the
    format: ``--weights`` (it sets every weight's format), or else the config's
    ``quantization_config`` (its ``group_size``); unchanged when neither did (a circuit file's
    own format). ``--dtype`` is never grouped (bf16, f16 or f32)."""
    if weights is not None:
        return InputError("--weights", weights, str(error))
    if config is not None:
        try:
            quant = json.loads(Path(config).read_text(encoding="utf-8")).get("quantization_config")
        except (OSError, ValueError, AttributeError):
            quant = None
        if isinstance(quant, dict):
            key = "quantization_config.group_size" if "group_size" in quant else "quantization_config"
            return InputError(str(config), key, str(error))
    return error
