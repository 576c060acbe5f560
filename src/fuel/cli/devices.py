"""``fuel devices``: the device spec table the roofline prices against, with sources."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from fuel.cli.app import app

_CLASSES = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp4")


def _row(spec) -> list[str]:
    from fuel.cost import PeakClass

    peaks = []
    for name in _CLASSES:
        value = spec.peak_flops.get(PeakClass(name))
        peaks.append(f"{value / 1e12:,.1f}" if value else "-")
    return [
        spec.name,
        spec.title,
        f"{spec.memory_bytes / 1e9:,.0f}",
        f"{spec.bandwidth_bytes_per_s / 1e9:,.0f}",
        *peaks,
        f"{spec.launch_overhead_ns / 1000:,.2f}",
    ]


@app.command("devices")
def devices_command(
    probe: bool = typer.Option(False, "--probe", help="Measure this machine now (cpu-local) and cache it."),
    as_json: bool = typer.Option(False, "--json", help="Print the specs as JSON."),
    sources: bool = typer.Option(True, "--sources/--no-sources", help="List where each number came from."),
) -> None:
    """Show the device specs (dense peaks, bandwidth, memory, launch overhead) and their sources."""
    from fuel.cost import load_devices
    from fuel.cost.probe import cache_path, cpu_local_spec

    specs = list(load_devices().values())
    local = None
    if probe or cache_path().exists():
        from fuel.cli.progress import TerminalProgress
        from fuel.progress import listening

        with listening(TerminalProgress(enabled=not as_json)):
            local = cpu_local_spec(reprobe=probe)
        specs.append(local)
    if as_json:
        document = [
            {
                "name": s.name, "title": s.title, "kind": s.kind.value,
                "memory_bytes": s.memory_bytes, "bandwidth_bytes_per_s": s.bandwidth_bytes_per_s,
                "vector_flops": s.vector_flops,
                "peak_flops": {k.value: v for k, v in sorted(s.peak_flops.items(), key=lambda kv: kv[0].value)},
                "launch_overhead_ns": s.launch_overhead_ns, "probed": s.probed, "sources": s.sources,
            }
            for s in specs
        ]
        typer.echo(json.dumps(document, indent=1, sort_keys=True))
        return
    console = Console(soft_wrap=False, width=200)
    table = Table(title="Device specs (dense TFLOPS)", show_lines=False)
    for column in ("device", "title", "mem GB", "GB/s", *_CLASSES, "launch us"):
        table.add_column(column, justify="left" if column in ("device", "title") else "right")
    for spec in specs:
        table.add_row(*_row(spec))
    console.print(table)
    if local is None:
        console.print("cpu-local: not probed yet on this machine (run `fuel devices --probe`).")
    if sources:
        console.print("\n[bold]Sources[/]")
        for spec in specs:
            console.print(f"[bold]{spec.name}[/]")
            for field, text in spec.sources.items():
                console.print(f"  {field}: {text}", markup=False)
