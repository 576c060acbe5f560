"""The root Typer app and the error boundary.

``main`` is the console script. A :class:`fuel.errors.FuelError` becomes one red line on stderr
and exit status 2; no traceback reaches the user for bad input.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

from fuel.errors import FuelError

app = typer.Typer(
    name="fuel",
    help="Plan, explain and run LLM inference: circuits, fused launch plans, costs, kernels.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Command modules register themselves on `app` when imported. One line per module.
from fuel.cli import models as _models  # noqa: E402,F401
from fuel.cli import circuit as _circuit  # noqa: E402,F401
from fuel.cli import circuit_show as _circuit_show  # noqa: E402,F401
from fuel.cli import plan as _plan  # noqa: E402,F401
from fuel.cli import devices as _devices  # noqa: E402,F401
from fuel.cli import judge as _judge  # noqa: E402,F401
from fuel.cli import run as _run  # noqa: E402,F401
from fuel.cli import explain as _explain  # noqa: E402,F401
from fuel.cli import jit as _jit  # noqa: E402,F401
from fuel.cli import serve as _serve  # noqa: E402,F401

err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return the exit status (the console script exits with it)."""
    try:
        app(args=argv, standalone_mode=False)
    except FuelError as error:
        # Escaped: messages name keys like `rule[id].field`, which rich would read as markup.
        err_console.print(f"[bold red]error:[/] {escape(str(error))}", markup=True)
        return 2
    except typer.Exit as done:
        return done.exit_code
    except typer.Abort:
        err_console.print("[bold red]aborted[/]")
        return 1
    except Exception as error:  # click usage errors arrive as ClickException
        import click

        if isinstance(error, click.exceptions.ClickException):
            error.show()
            return error.exit_code
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
