"""``fuel run --tp N``: the same greedy generation, tensor-parallel over N local processes.

Decides what the command does with ``--tp`` above 1: load the model once in the parent (to
tokenize and to refuse a split that does not divide before any process starts), hand the
prompt to :func:`fuel.runtime.distributed.run_tensor_parallel`, and print the text, the group's
backend and every rank's plan digests (``--json``: one object). Options a tensor-parallel run
does not serve (speculation, batches) are refused by name.
"""

from __future__ import annotations

import json
import time
from typing import Any

import typer
from rich.console import Console

from fuel.errors import InputError


def run_parallel(model: str | None, prompt: str, *, max_new_tokens: int, tp: int, dtype: str,
                 max_context: int, chat: bool, as_json: bool, speculate: int = 0,
                 batch: int = 1) -> dict[str, Any]:
    from fuel.runtime.distributed import run_tensor_parallel
    from fuel.runtime.model import DEFAULT_MODEL_NAME
    from fuel.runtime.tokenizer import load_tokenizer
    from fuel.runtime.weights import load_weights

    if speculate:
        raise InputError("--speculate", "speculate", "a tensor-parallel run (--tp) decodes plainly; "
                                                     "drop --speculate")
    if batch != 1:
        raise InputError("--batch", "batch", "a tensor-parallel run (--tp) serves one sequence")
    source = None if model in (None, DEFAULT_MODEL_NAME) else model
    if source is None:
        # The default model's published config is in the zoo: refuse a bad split before the
        # weights are converted or loaded.
        from fuel.circuit import zoo
        from fuel.circuit.parallel import Parallel, split_shape

        split_shape(zoo.shape(zoo.DEFAULT_MODEL), Parallel(tp=tp))
    # Packed (stored-format) weights are not split by rank yet: a tensor-parallel run computes
    # dequantized, and its report says so.
    note = None
    if dtype in ("stored", "bf16", "f16"):
        note = (f"{dtype} weights are held as packed rows, which are not split by rank: "
                "weights dequantized to f32")
        dtype = "f32"
    weights = load_weights(source, dtype=dtype)
    tokenizer = load_tokenizer(weights.source.folder)
    ids = tokenizer.encode(tokenizer.format_prompt(prompt) if chat else prompt)
    started = time.perf_counter()
    result = run_tensor_parallel(weights, ids, max_new_tokens, tp, max_context=max_context)
    seconds = time.perf_counter() - started
    out = {"model": model or DEFAULT_MODEL_NAME, "tp": tp, "backend": result.backend,
           "prompt": prompt, "output": tokenizer.decode(list(result.tokens)),
           "tokens": list(result.tokens), "seconds": seconds,
           "dtype": weights.dtype.value, "dtype_note": note,
           "ranks": [{"rank": r, "digests": dict(d)} for r, d in enumerate(result.digests)]}
    if as_json:
        typer.echo(json.dumps(out, indent=2))
        return out
    console = Console(highlight=False)
    console.print(f"[dim]{prompt}[/]\n{out['output']}\n", markup=True)
    console.print(f"tensor parallel: {tp} ranks on torch.distributed ({result.backend}, "
                  f"127.0.0.1), {len(result.tokens)} tokens in {seconds:.1f} s (process start, "
                  "weight load and program builds included)")
    if note:
        console.print(f"dtype: {weights.dtype.value} ({note})")
    for rank in out["ranks"]:
        for digest, what in rank["digests"].items():
            console.print(f"  rank {rank['rank']}  {what:<18} {digest[:16]}")
    return out
