"""``fuel judge``: the Judge's measured latencies — show, export, import, clear, profile."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from fuel.cli.app import app

judge_app = typer.Typer(help="The Judge: measured kernel latencies on this machine.", no_args_is_help=True)
app.add_typer(judge_app, name="judge")

_STORE_HELP = "The Judge store (default: $FUEL_CACHE_DIR/judge.sqlite or ~/.cache/fuel/judge.sqlite)."


def _store_path(store: Path | None) -> Path:
    from fuel.cost.paths import default_store_path

    return store if store is not None else default_store_path()


@judge_app.command("show")
def show(
    store: Path | None = typer.Option(None, "--store", help=_STORE_HELP),
    everything: bool = typer.Option(False, "--all", help="Include rows measured on other machines or libraries."),
) -> None:
    """List the measurements (this machine's by default)."""
    from fuel.cost import JudgeStore, device_fingerprint, library_versions

    path = _store_path(store)
    console = Console(soft_wrap=False, width=200)
    if not path.exists():
        console.print(f"no measurements yet ({path} does not exist); run `fuel judge profile`")
        return
    with JudgeStore.open(path, create=False) as judge:
        rows = judge.rows()
    if not everything:
        here = {device_fingerprint("cpu")}
        rows = [r for r in rows if r.device_fingerprint in here and r.library_versions == library_versions()]
    table = Table(title=f"Judge measurements ({path})")
    for column in ("op", "dtype", "size class", "backend", "kernel", "median us", "spread us", "n"):
        table.add_column(column, justify="right" if column in ("median us", "spread us", "n") else "left")
    for r in rows:
        table.add_row(
            r.op, r.dtype, r.size_class, r.backend, r.kernel_source,
            f"{r.median_ns / 1000:,.2f}", f"{r.spread_ns / 1000:,.2f}", str(r.samples),
        )
    console.print(table)
    console.print(f"{len(rows)} measurement(s)")


@judge_app.command("export")
def export(
    file: Path = typer.Argument(..., help="JSON file to write."),
    store: Path | None = typer.Option(None, "--store", help=_STORE_HELP),
) -> None:
    """Write every measurement to a JSON file a team can share."""
    from fuel.cost import JudgeStore
    from fuel.inputs import check_output_path, write_atomically

    check_output_path(file, "FILE")
    with JudgeStore.open(_store_path(store), create=False) as judge:
        text = judge.export_json()
        count = judge.count()
    write_atomically(file, text, "FILE")
    typer.echo(f"exported {count} measurement(s) to {file}")


@judge_app.command("import")
def import_(
    file: Path = typer.Argument(..., help="JSON file written by `fuel judge export`."),
    store: Path | None = typer.Option(None, "--store", help=_STORE_HELP),
) -> None:
    """Merge a shared JSON file: new keys are added, a key keeps the lower median."""
    from fuel.cost import JudgeStore
    from fuel.cost.store import parse_export
    from fuel.errors import InputError
    from fuel.inputs import read_text

    # The whole file is read and validated before the store is opened (or created): a bad
    # file changes nothing.
    rows = parse_export(read_text(file, lambda detail: InputError(str(file), None, detail)),
                        file=str(file))
    with JudgeStore.open(_store_path(store)) as judge:
        report = judge.record_many(rows)
    typer.echo(f"imported {file}: {report.added} added, {report.improved} improved, {report.kept} kept")


@judge_app.command("clear")
def clear(
    store: Path | None = typer.Option(None, "--store", help=_STORE_HELP),
    yes: bool = typer.Option(False, "--yes", help="Do not ask for confirmation."),
) -> None:
    """Delete every measurement in the store."""
    from fuel.cost import JudgeStore

    path = _store_path(store)
    if not path.exists():
        typer.echo(f"nothing to clear ({path} does not exist)")
        return
    if not yes and not typer.confirm(f"delete all measurements in {path}?"):
        raise typer.Abort()
    with JudgeStore.open(path, create=False) as judge:
        removed = judge.clear()
    typer.echo(f"cleared {removed} measurement(s) from {path}")


@judge_app.command("profile")
def profile(
    model: str = typer.Argument("smollm2-135m", help="Zoo model whose dims set the kernel sizes."),
    ops: str | None = typer.Option(None, "--ops", help="Comma-separated families to measure (default: all)."),
    dtype: str = typer.Option("f32", "--dtype", help="Element type of the measured kernels."),
    threads: int | None = typer.Option(None, "--threads", min=1, max=4096, help="Pin torch's CPU thread count while measuring."),
    store: Path | None = typer.Option(None, "--store", help=_STORE_HELP),
) -> None:
    """Measure the CPU kernels a model's plans use (at its dims and serving row counts) and
    store the latencies for the Judge."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fuel.circuit import zoo
    from fuel.cost import JudgeStore
    from fuel.cost.campaign import Measured, run_campaign
    from fuel.cost.workloads import ModelDims, families, workloads
    from fuel.errors import InputError
    from fuel.graph import DType

    try:
        element = DType(dtype)
    except ValueError:
        raise InputError("--dtype", None, f"unknown dtype {dtype!r}") from None
    wanted = families() if ops is None else [name.strip() for name in ops.split(",") if name.strip()]
    if not wanted:
        raise InputError("--ops", None, f"no family named in {ops!r}; known: {', '.join(families())}")
    unknown = sorted(set(wanted) - set(families()))
    if unknown:
        raise InputError("--ops", None, f"unknown family {unknown[0]!r}; known: {', '.join(families())}")
    dims = ModelDims.from_config(zoo.config(model))
    items = [w for w in workloads(dims, element) if w.family in wanted]
    if threads is not None:
        from fuel.kernels.threads import set_threads

        set_threads(threads)
    console = Console()
    skipped: list[str] = []
    with JudgeStore.open(_store_path(store)) as judge, Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task(f"profiling {model}", total=len(items))

        def done(result) -> None:
            if not isinstance(result, Measured):
                skipped.append(f"{result.workload.family} {result.workload.label}: {result.reason}")
            progress.update(task, advance=1, description=f"{result.workload.family} {result.workload.label}")

        results = run_campaign(items, judge, on_done=done)
    measured = sum(isinstance(r, Measured) for r in results)
    console.print(f"measured {measured} kernel(s) for {model} ({dims.hidden} hidden, {dtype}) into {_store_path(store)}")
    for line in skipped:
        console.print(f"skipped {line}")
