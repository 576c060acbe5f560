"""``fuel jit MODEL --device cpu``: the JIT requests a model's decode step makes, what each
synthesizer answered, and, for kernels, the verification error and measured speed.

The graph is the model's real lowered decode step (planned offline and lowered with the
circuit's weight shapes, as ``fuel explain`` does; no checkpoint is read). The carrier is asked
about every fused node: those with a kernel on the device decline there (counted per op);
the requests are grouped by structure key and shapes (every layer repeats the same regions),
and each goes to the synthesizers for the device and each kernel through adoption (verify
against the decomposition, then the cost gate).
"""

from __future__ import annotations

import json

import typer
from rich.console import Console

from fuel.cli.app import app

GRAPH_NOTE = ("graph: the model's lowered decode step (planned offline, lowered with the "
              "circuit's weight shapes); requests grouped by structure key and shapes")


@app.command("jit")
def jit_command(
    model: str = typer.Argument(..., help="A zoo model name (see `fuel models`)."),
    device: str = typer.Option("cpu", "--device", help="cpu (numba) or cuda (Triton)."),
    context: int = typer.Option(1024, "--context", min=1, max=1 << 20, help="Cached tokens for paged attention."),
    dtype: str = typer.Option("f32", "--dtype", help="Activation dtype: f32 or bf16."),
    budget_ms: int = typer.Option(300_000, "--budget-ms", min=1, max=86_400_000, help="Compile budget per kernel."),
    as_json: bool = typer.Option(False, "--json", help="Print the records as JSON."),
) -> None:
    """List the JIT requests of MODEL's decode step and what each synthesizer made of them."""
    from collections import Counter

    from fuel.circuit.rules import Mode
    from fuel.cli.explain import offline_step
    from fuel.errors import InputError
    from fuel.graph import BackendId, Device, RuntimeFusedRegistry
    from fuel.graph.branch import lower
    from fuel.graph.ir import Fused
    from fuel.graph.registry import fused_name
    from fuel.jit import ArchSku, JitBudget
    from fuel.jit.session import requests_of

    try:
        target = Device.parse(device)
    except ValueError:
        raise InputError("--device", None, f"`{device}` is not a device (cpu or cuda[:N])")
    if dtype not in ("f32", "bf16"):
        raise InputError("--dtype", None, f"`{dtype}` is not f32 or bf16")
    step = offline_step(model, Mode.DECODE, 1, context, dtype, target.backend)
    rows = []
    if target.backend is BackendId.CPU:
        from fuel.jit.adopt import adopt
        from fuel.jit.numba_synth import NumbaSynthesizer
        from fuel.kernels import cpu_table

        table, arch, synths = cpu_table(), ArchSku.CPU, [NumbaSynthesizer()]
    else:
        from fuel.jit.triton_synth import TritonSynthesizer
        from fuel.kernels import torch_table

        # Binding the CUDA table needs no GPU (kernels run only when called), so a failure
        # here is a bug to see, never "no kernel".
        table = torch_table(BackendId.CUDA)
        arch, synths, adopt = ArchSku.SM90, [TritonSynthesizer()], None
    registry = RuntimeFusedRegistry()
    g = step.graph
    requests = requests_of(g, step.roots, table, target.backend, arch, JitBudget(budget_ms))
    asking = {n for _, _, nodes in requests for n in nodes}
    declined = Counter(fused_name(g.node(n).op.id) for n in lower(g, step.roots).order
                       if isinstance(g.node(n).op, Fused) and n not in asking)
    for name, count in sorted(declined.items()):
        rows.append({"region": name, "nodes": count, "output": None, "request": None,
                     "answer": f"carrier declined: a {target.backend.value} kernel exists "
                               "(or the region is not describable)"})
    for name, request, nodes in requests:
        operands = ", ".join(map(str, request.operands))
        for synth in synths:
            row = {"region": name, "nodes": len(nodes), "output": str(request.output),
                   "request": operands, "synthesizer": synth.name}
            if adopt is None:
                answer = synth.synthesize(request)
                row["answer"] = getattr(answer, "reason", None) or \
                    f"kernel {answer.entry_point} (adoption needs a {target.backend.value} device)"
            else:
                record = adopt(synth, request, target.backend, table=table, registry=registry)
                row.update(answer=f"{record.outcome.value}: {record.reason}",
                           max_abs_error=record.max_abs_error, kernel_ns=record.kernel_ns,
                           decomposed_ns=record.decomposed_ns, speedup=record.speedup,
                           compile_ms=record.compile_ms, from_cache=record.from_cache)
            rows.append(row)
    if as_json:
        typer.echo(json.dumps({"model": model, "device": str(target), "note": GRAPH_NOTE,
                               "records": rows}, indent=1))
        return
    console = Console(highlight=False, soft_wrap=True)
    console.print(f"fuel jit {model} --device {target} (context {context}, {dtype})")
    console.print(GRAPH_NOTE)
    for row in rows:
        if row["request"] is None:
            console.print(f"\n{row['region']} x{row['nodes']}: {row['answer']}")
            continue
        console.print(f"\n{row['region']} x{row['nodes']} -> {row['output']}")
        console.print(f"  request: {row['request']}")
        console.print(f"  {row['synthesizer']}: {row['answer']}")
        if row.get("max_abs_error") is not None:
            console.print(f"  verification: max abs error {row['max_abs_error']:.2e}")
        if row.get("kernel_ns"):
            console.print(f"  speed: kernel {row['kernel_ns'] / 1e3:,.1f} us vs decomposed "
                          f"{row['decomposed_ns'] / 1e3:,.1f} us ({row['speedup']:.2f}x); "
                          f"compile {row['compile_ms']:,.0f} ms"
                          f"{' (disk cache)' if row['from_cache'] else ''}")
