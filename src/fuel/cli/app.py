"""The root Typer app and the error boundary.

``main`` is the console script. Decides what reaches the user when a command fails:

- a :class:`fuel.errors.FuelError` (bad input: a file, key or value to fix) is one red line on
  stderr and exit status 2;
- a usage error raised by typer's command-line parser (an unknown command or option, a value
  that is not an integer or is out of an option's range, a missing argument) is turned into an
  :class:`~fuel.errors.InputError` naming the option and the value given, so it prints the
  same one line and exits 2 (not click's multi-line "Usage: ... Try --help" block).

Invariants: the printed line is one physical line (a multi-line message is joined with
``; ``, control characters and undecodable command-line bytes are escaped), and nothing else is
converted: an exception that is not a ``FuelError`` or a parser usage error is a bug in fuel
and propagates with its traceback. Input-reading code turns ``OSError``/``UnicodeDecodeError``/
``RecursionError``/``MemoryError`` into ``FuelError`` where the input is read
(:mod:`fuel.inputs`), never here.
"""

from __future__ import annotations

import sys

import typer
import typer.main
from rich.console import Console
from rich.markup import escape

from fuel.errors import FuelError, InputError

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


def _usage_error_types() -> tuple[type[BaseException], ...]:
    """The parser's usage-error classes: typer >= 0.2x bundles its own click (``typer._click``),
    older typer raises click's; both are caught so neither version prints a traceback."""
    found: list[type[BaseException]] = []
    try:
        from typer._click.exceptions import ClickException as bundled
        found.append(bundled)
    except ImportError:
        pass
    try:
        import click
        found.append(click.exceptions.ClickException)
    except ImportError:
        pass
    return tuple(found)


_USAGE_ERRORS = _usage_error_types()


def one_line(text: str) -> str:
    """``text`` as one printable line: lines joined with ``; ``, control characters and lone
    surrogates (undecodable command-line bytes) escaped."""
    parts = [part.strip() for part in str(text).splitlines()]
    joined = "; ".join(part for part in parts if part).replace(": ;", ":")
    joined = joined.encode("utf-8", "backslashreplace").decode("utf-8")
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                   for ch in joined)


def _given_value(opts: list[str], argv: list[str]) -> str | None:
    """The last value given on the command line for an option with names ``opts``."""
    found = None
    for i, token in enumerate(argv):
        for name in opts:
            if token == name and i + 1 < len(argv):
                found = argv[i + 1]
            elif name.startswith("--") and token.startswith(name + "="):
                found = token[len(name) + 1:]
    return found


def usage_error(error: BaseException, argv: list[str]) -> InputError:
    """A parser usage error as an :class:`InputError` naming the option and value."""
    message = error.format_message() if hasattr(error, "format_message") else str(error)
    param = getattr(error, "param", None)
    if param is not None and getattr(error, "param_hint", None) is None:
        opts = [o for o in (getattr(param, "opts", None) or []) if o.startswith("-")]
        if opts:
            name = max(opts, key=len)
            value = _given_value(opts, argv)
            detail = getattr(error, "message", "") or message
            shown = f"`{value}`: " if value is not None else ""
            return InputError("command line", name, f"{shown}{_lower_first(detail)}")
        name = (getattr(param, "human_readable_name", None) or getattr(param, "name", None) or "").upper()
        return InputError("command line", name or None, _lower_first(message))
    option = getattr(error, "option_name", None)
    if option:
        return InputError("command line", option, _lower_first(message))
    return InputError("command line", None, _lower_first(message))


def _lower_first(text: str) -> str:
    text = text.strip().rstrip(".")
    return text[:1].lower() + text[1:] if text[:1].isupper() and not text[1:2].isupper() else text


def _report(error: FuelError) -> int:
    # Escaped: messages name keys like `rule[id].field`, which rich would read as markup.
    err_console.print(f"[bold red]error:[/] {escape(one_line(str(error)))}", markup=True)
    return 2


_built: dict[tuple[int, int], object] = {}


def _command():
    """The click command typer builds from ``app`` (built once per set of registered commands:
    building it costs ~0.1 s, which every in-process call would otherwise pay)."""
    key = (len(app.registered_commands), len(app.registered_groups))
    if key not in _built:
        _built.clear()
        _built[key] = typer.main.get_command(app)
    return _built[key]


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return the exit status (the console script exits with it)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        _command().main(args=args, prog_name="fuel", standalone_mode=False)
    except FuelError as error:
        return _report(error)
    except typer.Exit as done:
        return done.exit_code
    except typer.Abort:
        err_console.print("[bold red]aborted[/]")
        return 1
    except _USAGE_ERRORS as error:
        if type(error).__name__ == "NoArgsIsHelpError":  # `fuel` / `fuel judge` alone: help
            error.show()
            return 0
        return _report(usage_error(error, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
