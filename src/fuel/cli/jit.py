"""``fuel jit MODEL --device cpu``: the JIT requests a model's decode step makes, what each
synthesizer answered, and, for kernels, the verification error and measured speed.

The graph is the model's decode-step fused ops at its real dims (``fuel.jit.decode_step``: one
node per fused-op kind, since every layer repeats the same structures), not yet the lowered
model graph; the output says so. For each node the carrier answers first (a node with a kernel
on the device declines there); each request then goes to the synthesizers for the device, and
each kernel through adoption (verify against the decomposition, then the cost gate).
"""

from __future__ import annotations

import json

import typer
from rich.console import Console

from fuel.cli.app import app

GRAPH_NOTE = ("graph: the decode step's fused ops at the model's dims (fuel.jit.decode_step), "
              "one node per kind; not yet the lowered model graph")


@app.command("jit")
def jit_command(
    model: str = typer.Argument(..., help="A zoo model name (see `fuel models`)."),
    device: str = typer.Option("cpu", "--device", help="cpu (numba) or cuda (Triton)."),
    context: int = typer.Option(1024, "--context", help="Cached tokens for paged attention."),
    dtype: str = typer.Option("f32", "--dtype", help="Activation dtype: f32 or bf16."),
    budget_ms: int = typer.Option(300_000, "--budget-ms", help="Compile budget per kernel."),
    as_json: bool = typer.Option(False, "--json", help="Print the records as JSON."),
) -> None:
    """List the JIT requests of MODEL's decode step and what each synthesizer made of them."""
    from fuel.circuit import zoo
    from fuel.errors import InputError
    from fuel.graph import BackendId, Device, DType, RuntimeFusedRegistry
    from fuel.jit import ArchSku, JitBudget, jit_request_for_unplaceable_fused
    from fuel.jit.decode_step import decode_step

    try:
        target = Device.parse(device)
    except ValueError:
        raise InputError("--device", None, f"`{device}` is not a device (cpu or cuda[:N])")
    if dtype not in ("f32", "bf16"):
        raise InputError("--dtype", None, f"`{dtype}` is not f32 or bf16")
    step = decode_step(zoo.config(model), context, DType(dtype))
    rows = []
    if target.backend is BackendId.CPU:
        from fuel.jit.adopt import adopt
        from fuel.jit.numba_synth import NumbaSynthesizer
        from fuel.kernels import cpu_table

        table, arch, synths = cpu_table(), ArchSku.CPU, [NumbaSynthesizer()]
    else:
        from fuel.jit.triton_synth import TritonSynthesizer
        from fuel.kernels import KernelBindingTable, torch_table

        try:
            table = torch_table(BackendId.CUDA)
        except Exception:  # noqa: BLE001 — no CUDA here: nothing bound on it
            table = KernelBindingTable()
        arch, synths, adopt = ArchSku.SM90, [TritonSynthesizer()], None
    registry = RuntimeFusedRegistry()
    for name, node in step.nodes:
        g = step.graph
        request = jit_request_for_unplaceable_fused(g, node, target.backend, table, arch,
                                                    JitBudget(budget_ms))
        shape = str(g.node(node).shape)
        if request is None:
            rows.append({"region": name, "output": shape, "request": None,
                         "answer": f"carrier declined: a {target.backend.value} kernel exists "
                                   "(or the region is not describable)"})
            continue
        operands = ", ".join(map(str, request.operands))
        for synth in synths:
            row = {"region": name, "output": shape, "request": operands, "synthesizer": synth.name}
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
        console.print(f"\n{row['region']} -> {row['output']}")
        if row["request"] is None:
            console.print(f"  {row['answer']}")
            continue
        console.print(f"  request: {row['request']}")
        console.print(f"  {row['synthesizer']}: {row['answer']}")
        if row.get("max_abs_error") is not None:
            console.print(f"  verification: max abs error {row['max_abs_error']:.2e}")
        if row.get("kernel_ns"):
            console.print(f"  speed: kernel {row['kernel_ns'] / 1e3:,.1f} us vs decomposed "
                          f"{row['decomposed_ns'] / 1e3:,.1f} us ({row['speedup']:.2f}x); "
                          f"compile {row['compile_ms']:,.0f} ms"
                          f"{' (disk cache)' if row['from_cache'] else ''}")
