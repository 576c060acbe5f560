"""``fuel serve``: an OpenAI-compatible HTTP server (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``) over fuel's
continuous-batching scheduler, on 127.0.0.1 unless told otherwise.

Bad options (a missing model, an out-of-range number, a missing ``serve`` extra) are one error
line and exit status 2 (the app's error boundary).
"""

from __future__ import annotations

from typing import Annotated

import typer

from fuel.cli.app import app
from fuel.cli.run import ContextOpt, DtypeOpt, JitOpt, ModelArg, ProgramCacheOpt, ThreadsOpt
from fuel.errors import InputError


@app.command("serve")
def serve_command(
    model: ModelArg = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (default: loopback only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port (0: any free port).")] = 8000,
    max_batch: Annotated[int, typer.Option("--max-batch", min=1, help="Sequences decoded together; the KV cache holds this many full contexts.")] = 8,
    max_context: ContextOpt = 2048,
    token_budget: Annotated[int, typer.Option("--token-budget", min=1, help="Tokens per scheduler step (decode rows plus prompt chunks).")] = 256,
    speculate: Annotated[int, typer.Option("--speculate", "-k", min=0, help="Draft K tokens per verify step (0: plain decode).")] = 0,
    drafter: Annotated[str, typer.Option("--drafter", help="prompt-lookup or early-exit (with --speculate).")] = "prompt-lookup",
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="FUEL_API_KEY", help="Require Authorization: Bearer KEY on every route but /health.")] = None,
    served_model_name: Annotated[str | None, typer.Option("--served-model-name", help="The model id clients send (default: the model argument).")] = None,
    default_max_tokens: Annotated[int, typer.Option("--default-max-tokens", min=1, help="max_tokens of a chat request that names none.")] = 256,
    dtype: DtypeOpt = "stored",
    threads: ThreadsOpt = None,
    jit: JitOpt = None,
    program_cache: ProgramCacheOpt = True,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API with continuous batching."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as missing:
        raise InputError("fuel serve", None, f"{missing.name} is not installed: pip install 'fuel[serve]'") from None
    from fuel.console import startup_done
    from fuel.jit.session import numba_available
    from fuel.runtime.model import DRAFTERS, load_model, set_threads
    from fuel.serve import ServeOptions, serve_forever

    if drafter not in DRAFTERS:
        raise InputError("--drafter", "drafter", f"{drafter!r} is not one of {', '.join(DRAFTERS)}")
    set_threads(threads)
    from fuel.cli.progress import TerminalProgress
    from fuel.progress import listening

    # The conversion and the machine probe draw a bar on a terminal's stderr before serving;
    # programs built while serving do not (the server's log owns the terminal then).
    with listening(TerminalProgress()):
        loaded = load_model(model, dtype=dtype, max_context=max_context,
                            max_sequences=max_batch, jit=numba_available() if jit is None else jit,
                            program_cache=program_cache)
    startup_done()  # the collector, held off while the process started (fuel.console)
    options = ServeOptions(max_batch=max_batch, token_budget=token_budget, speculate=speculate,
                           drafter=drafter, api_key=api_key, model_name=served_model_name,
                           default_max_tokens=default_max_tokens)
    typer.echo(f"fuel serve: {options.model_name or loaded.name} on http://{host}:{port} "
               f"(max batch {max_batch}, context {max_context}, budget {token_budget} tokens/step)")
    serve_forever(loaded, options, host, port)
