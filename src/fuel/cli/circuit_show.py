"""``fuel circuit show``: the fused launch plan of a model's circuit for one mode and row count.

Offline (no probed target), the available kernels are every kernel the rule set names
(``AvailableKernels.all_named_by``). Rows default to 1 for decode and draft and must be given
otherwise; a ``verify_batch`` plan takes ``--table`` instead. The policy starts from the
documented defaults (``fuel/data/rules/policy.toml``) with ``--set`` on top.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from fuel.cli.circuit import (CircuitOpt, ConfigOpt, JsonOpt, ModelArg, WeightsOpt, circuit_app,
                              planned_name, resolve_circuit, with_weights_file)
from fuel.errors import InputError

MAX_ROWS = 1 << 20
"""The most rows ``--rows`` may ask a plan for (far above any step)."""


def load_rule_set(rules: str):
    """A built-in rule set by name (``cpu``, ``cuda``) or a rule file by path, with the label a
    rendered plan shows (the name, or the path, and the file's SHA-256 prefix)."""
    from fuel.circuit.rules import BUILTIN_RULE_SETS, load_builtin_rules, load_rules

    loaded = load_builtin_rules(rules) if rules in BUILTIN_RULE_SETS else load_rules(Path(rules))
    return loaded, f"{rules} sha256={loaded.digest[:12]}"


def plan_request(mode_text: str, rows: int | None, table_text: str | None):
    """Mode, rows and row table from the command line; every inconsistency names the option."""
    from fuel.circuit.rules import Mode
    from fuel.circuit.runs import RowTable, RowTableError

    mode = Mode.parse(mode_text)
    if mode is None:
        raise InputError("command line", "--mode",
                         f"unknown mode `{mode_text}` (expected one of {', '.join(m.value for m in Mode)})")
    if mode is Mode.VERIFY_BATCH:
        if table_text is None:
            raise InputError("command line", "--table", "a verify_batch plan needs a row table, e.g. \"4x3 3x1!\"")
        if rows is not None:
            raise InputError("command line", "--rows", "verify_batch takes its rows from --table")
        try:
            return mode, None, RowTable.parse(table_text)
        except RowTableError as error:
            raise InputError("command line", "--table", str(error)) from None
    if table_text is not None:
        raise InputError("command line", "--table", f"only a verify_batch plan has a row table, not {mode.value}")
    if rows is None:
        rows = mode.default_rows
        if rows is None:
            raise InputError("command line", "--rows", f"a {mode.value} plan needs --rows N")
    return mode, rows, None


@circuit_app.command("show")
def show_command(
    model: ModelArg = None,
    config: ConfigOpt = None,
    circuit: CircuitOpt = None,
    mode: Annotated[str, typer.Option("--mode", help="draft | decode | multi_seq | verify | verify_batch | prefill")] = "decode",
    rows: Annotated[int | None, typer.Option("--rows", min=1, max=MAX_ROWS, help="Padded rows of the step (default 1 for decode and draft).")] = None,
    table: Annotated[str | None, typer.Option("--table", help="Row table of a verify_batch step, e.g. \"4x3 3x1!\".")] = None,
    rules: Annotated[str, typer.Option("--rules", help="Built-in rule set (cpu, cuda) or a rule file.")] = "cpu",
    settings: Annotated[list[str] | None, typer.Option("--set", help="Policy setting key=value (repeatable).")] = None,
    levers: Annotated[list[str] | None, typer.Option("--lever", help="Opt in a `differs` lever (repeatable).")] = None,
    as_json: JsonOpt = False,
    explain_plan: Annotated[bool, typer.Option("--explain", help="Per node: the rules tried and why each did not claim it.")] = False,
    weights: WeightsOpt = None,
) -> None:
    """The fused launch plan: groups in execution order, launches, copies, digest; with
    --weights, each group with the stored formats of the weights it reads."""
    from fuel.circuit.explain import explain, render_explanation
    from fuel.circuit.fuser import AvailableKernels, FuseError, fuse, fuse_table
    from fuel.circuit.policy import build_policy, check_levers, parse_assignments
    from fuel.circuit.render import plan_to_json, render_plan
    from fuel.circuit.rules import BUILTIN_RULE_SETS, load_builtin_rules

    plan_mode, plan_rows, row_table = plan_request(mode, rows, table)
    rule_set, label = load_rule_set(rules)
    policy = build_policy(parse_assignments(settings or []), levers or [])
    if levers:
        check_levers(levers, [rule_set, *(load_builtin_rules(n) for n in BUILTIN_RULE_SETS)])
    built = resolve_circuit(model, circuit, config)
    if weights is not None:
        built = with_weights_file(built, weights, planned_name(model, config))
    available = AvailableKernels.all_named_by(rule_set)
    if explain_plan:
        step_rows = row_table.rows() if row_table is not None else plan_rows
        text = render_explanation(explain(built, rule_set, available, policy, plan_mode, step_rows, row_table))
        typer.echo(text, nl=False)
    try:
        if row_table is not None:
            plan = fuse_table(built, rule_set, available, policy, row_table)
        else:
            plan = fuse(built, rule_set, available, policy, plan_mode, plan_rows)
    except FuseError as error:
        if not explain_plan:  # keep the typed error, point at the explainer
            error.args = (f"{error} (run with --explain to see every rule tried per node)",)
        raise
    if as_json:
        typer.echo(json.dumps(plan_to_json(built, plan, policy, label, weights=weights is not None),
                              indent=2))
        return
    typer.echo(render_plan(built, plan, policy, label, weights=weights is not None), nl=False)
