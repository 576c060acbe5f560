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

    with JudgeStore.open(_store_path(store), create=False) as judge:
        text = judge.export_json()
        count = judge.count()
    file.write_text(text, encoding="utf-8")
    typer.echo(f"exported {count} measurement(s) to {file}")


@judge_app.command("import")
def import_(
    file: Path = typer.Argument(..., help="JSON file written by `fuel judge export`."),
    store: Path | None = typer.Option(None, "--store", help=_STORE_HELP),
) -> None:
    """Merge a shared JSON file: new keys are added, a key keeps the lower median."""
    from fuel.cost import JudgeStore
    from fuel.errors import InputError

    try:
        text = file.read_text(encoding="utf-8")
    except OSError as error:
        raise InputError(str(file), None, f"cannot read: {error.strerror}") from None
    with JudgeStore.open(_store_path(store)) as judge:
        report = judge.import_json(text, file=str(file))
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
