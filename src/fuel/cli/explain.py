"""``fuel explain MODEL``: the optimize_graph decision record of a model's step.

Plans the step offline (the rule set's named kernels, the documented policy defaults), lowers it
to the tensor graph with the circuit's weight shapes (no checkpoint is read), optimizes it for
the device with the kernel table bound there, the device spec's roofline and (unless
``--no-judge``) this machine's Judge store, and prints every decision: what was lowered to its
recipe and why, which arms were offered or declined, and per branch the arms, their costs and
sources, the winner and the reason. With ``--jit`` (CPU), numba kernels are first adopted for
the step's requests, so the branches a ``fuel run --jit`` bakes are shown; their arms are priced
from the Judge store (an arm no run has measured is "unknown cost" and keeps arm 0). Every mode
the engine runs is explained: decode, draft, multi_seq, verify, prefill (one sequence, a chunk
of ``--rows``) and verify_batch (its ``--table``). ``--json`` prints the same record as one
JSON document (``fuel/report/explain.schema.json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from fuel.cli.app import app
from fuel.errors import InputError

JIT_BUDGET_MS = 2000
"""The compile budget the shown JIT requests carry (what ``fuel run`` would allow per kernel)."""

_RUNS = {"decode": lambda rows: ((1, 1),), "draft": lambda rows: ((1, 1),),
         "multi_seq": lambda rows: ((1, rows),), "verify": lambda rows: ((rows, 1),),
         "prefill": lambda rows: ((rows, 1),)}


def offline_step(model: str, plan_mode, plan_rows: int | None, context: int, dtype: str, backend,
                 table=None, weights=None):
    """Plan ``model``'s step offline (the rule set's named kernels, the documented policy
    defaults) and lower it with the circuit's weight shapes (no checkpoint is read), or with
    ``weights`` (a GGUF's packed shapes and formats: :func:`~fuel.runtime.quant_cache.planned_weights`).
    A verify_batch step takes its runs from ``table`` (a :class:`~fuel.circuit.runs.RowTable`)."""
    from fuel.circuit.fuser import AvailableKernels, fuse, fuse_table
    from fuel.circuit.policy import build_policy
    from fuel.circuit.rules import load_builtin_rules
    from fuel.cli.circuit import resolve_circuit
    from fuel.graph import BackendId, DType
    from fuel.runtime.lower import StepShape, expected_weight_shapes, lower

    circuit = resolve_circuit(model, None, None)
    rules = load_builtin_rules("cpu" if backend is BackendId.CPU else "cuda")
    available = AvailableKernels.all_named_by(rules)
    if table is not None:
        plan = fuse_table(circuit, rules, available, build_policy(), table)
        runs = tuple((run.k, run.n) for run in table.runs)
    else:
        plan = fuse(circuit, rules, available, build_policy(), plan_mode, plan_rows)
        runs = _RUNS[plan_mode.value](plan_rows)
    block_size = 16
    max_blocks = -(-context // block_size)
    sequences = sum(n for _, n in runs)
    return lower(plan, circuit, weights if weights is not None else expected_weight_shapes(circuit),
                 StepShape(runs, block_size, max_blocks * sequences, max_blocks, context),
                 dtype=DType(dtype))


@app.command("explain")
def explain_command(
    model: Annotated[str, typer.Argument(help="A zoo model name (see `fuel models`).")],
    mode: Annotated[str, typer.Option("--mode", help="decode | multi_seq | verify | verify_batch | draft | prefill")] = "decode",
    rows: Annotated[int | None, typer.Option("--rows", min=1, max=4096, help="Padded rows of the step (default 1 for decode and draft; a prefill chunk's rows).")] = None,
    table_text: Annotated[str | None, typer.Option("--table", help="verify_batch row table, e.g. \"4x3 3x1!\".")] = None,
    device_name: Annotated[str, typer.Option("--device", help="cpu or cuda[:N].")] = "cpu",
    spec: Annotated[str | None, typer.Option("--spec", help="Device spec to price on (default: cpu-local for cpu).")] = None,
    context: Annotated[int, typer.Option("--context", min=1, max=1 << 20, help="Longest context the step may attend.")] = 1024,
    dtype: Annotated[str, typer.Option("--dtype", help="f32 or bf16.")] = "f32",
    judge: Annotated[bool, typer.Option("--judge/--no-judge", help="Use this machine's Judge store.")] = True,
    jit: Annotated[bool, typer.Option("--jit/--no-jit", help="Adopt numba kernels for the step's requests first, so the adopted branches show (priced from the Judge store that `fuel run --jit` fills).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the decision record as one JSON document.")] = False,
    weights: Annotated[Path | None, typer.Option("--weights", help="A GGUF whose stored formats the step binds (quantized matmuls show their arms).")] = None,
) -> None:
    """Which arms each branch had, what each cost (and whether the Judge measured it), who won, why."""
    from fuel.cli.circuit_show import plan_request
    from fuel.graph import BackendId, Device

    plan_mode, plan_rows, row_table = plan_request(mode, rows, table_text)
    if row_table is None and plan_mode.value not in _RUNS:
        raise InputError("command line", "--mode", f"fuel explain has no step shape for "
                                                   f"{plan_mode.value}")
    if row_table is not None:
        plan_rows = row_table.rows()
    try:
        device = Device.parse(device_name)
    except ValueError:
        raise InputError("command line", "--device", f"`{device_name}` is not cpu or cuda[:N]") from None
    if dtype not in ("f32", "bf16"):
        raise InputError("command line", "--dtype", f"`{dtype}` (expected f32 or bf16)")
    spec_name = spec or ("cpu-local" if device.backend is BackendId.CPU else None)
    if spec_name is None:
        raise InputError("command line", "--spec", "a cuda device needs a spec to price on (see `fuel devices`)")

    from fuel.cost import JudgeOracle, device as device_spec
    from fuel.cost.probe import halves_for
    from fuel.kernels import torch_table
    from fuel.optimize import OptimizeOptions, optimize_graph
    from fuel.optimize.render import render_explanation

    planned = None
    if weights is not None:
        from fuel.circuit import zoo
        from fuel.cli.circuit import planned_name, weights_file_formats
        from fuel.runtime.quant_cache import planned_weights

        weights_file_formats(zoo.circuit_for(zoo.shape(model)), weights, planned_name(model, None))
        planned, dtype = planned_weights(weights), "f32"  # packed weights compute in f32
    step = offline_step(model, plan_mode, plan_rows, context, dtype, device.backend,
                        row_table, planned)
    table = torch_table(device.backend)
    runtime, adoption_lines = None, []
    if jit:
        if device.backend is not BackendId.CPU:
            raise InputError("command line", "--jit", "fuel explain adopts numba kernels for "
                                                      "the CPU only")
        runtime, adoption_lines = _adopt_offline(step, table)
    oracle = JudgeOracle.load(backends=(device.backend.value,)) if judge else None
    if oracle is not None and oracle.problem is not None:
        typer.echo(f"judge store not used: {oracle.problem}", err=True)
    from fuel.jit import ArchSku, JitBudget

    # The CPU's requests are shown; a CUDA request needs the GPU's compute capability, which an
    # offline explain does not know.
    jit_arch = ArchSku.CPU if device.backend is BackendId.CPU else None
    options = OptimizeOptions(device=device,
                              device_spec=device_spec(spec_name, halves=halves_for(dtype)),
                              table=table, judge=oracle, jit_arch=jit_arch, runtime=runtime,
                              jit_budget=JitBudget(max_compile_ms=JIT_BUDGET_MS))
    optimized = optimize_graph(step.graph, step.roots, options)
    cells = len(oracle) if oracle is not None else 0
    if as_json:
        from fuel.optimize.render import explanation_document

        document = explanation_document(optimized, step.graph, {
            "model": model, "mode": plan_mode.value, "rows": plan_rows,
            "table": row_table.text() if row_table is not None else None,
            "device": str(device), "spec": spec_name, "dtype": dtype, "context": context,
            "judge_cells": cells, "jit": adoption_lines})
        typer.echo(json.dumps(document, indent=1, allow_nan=False))
        return
    table_note = f" table={row_table.text()}" if row_table is not None else ""
    header = (f"fuel explain {model}  mode={plan_mode.value} rows={plan_rows}{table_note} "
              f"device={device} spec={spec_name} dtype={dtype} context={context} judge={cells} "
              f"cells{' jit=on' if jit else ''}")
    for line in adoption_lines:
        header += "\n" + line
    typer.echo(render_explanation(optimized, step.graph, header), nl=False)


def _adopt_offline(step, table):
    """Adopt numba kernels for the step's requests (no arm is measured here: the bake prices
    the adopted arms from the Judge store, which ``fuel run --jit`` fills)."""
    from fuel.jit.session import JitSession, numba_available

    if not numba_available():
        return None, ["jit: declined: numba is not installed"]
    session = JitSession(table, measure_arms=False)
    lines = []
    for event in session.adopt_for(step.graph, step.roots):
        r = event.record
        speed = (f"; kernel {r.kernel_ns / 1e3:.1f} us vs decomposed {r.decomposed_ns / 1e3:.1f} us"
                 if r.kernel_ns and r.decomposed_ns else "")
        lines.append(f"jit: {event.region} x{event.nodes} -> {event.output}: {r.outcome.value}"
                     f"{speed}")
    return session.registry, lines
