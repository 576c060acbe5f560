"""The llama.cpp side of ``bench_run.py``, run by the peer's own interpreter (a separate venv with
llama-cpp-python), so fuel's process never imports llama.cpp and CI never needs it.

Two commands, each printing one JSON object on stdout:

- ``convert SOURCE TARGET DTYPE``: ``llama_cpp.llama_model_quantize`` with requantization
  allowed turns the shipped Q4_1 GGUF into an f32, f16 or bf16 one (the same values fuel
  dequantizes from the same file).
- ``measure MODEL --threads N --prompts FILE --tokens N --t0 EPOCH``: load the model, then for
  each prompt (token ids from FILE, a JSON list of lists) reset the context, time the prompt's
  evaluation (prefill) and, for the first prompt, ``--tokens`` greedy decode steps (argmax of
  the last row's logits, one ``eval`` per token). ``ttft_s`` is the wall time from ``--t0``
  (the parent's clock before it spawned this process) to the first prompt's first token.

Needs only llama-cpp-python and numpy (both in the peer venv).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time

FTYPES = {"f32": "LLAMA_FTYPE_ALL_F32", "f16": "LLAMA_FTYPE_MOSTLY_F16",
          "bf16": "LLAMA_FTYPE_MOSTLY_BF16"}


def convert(source: str, target: str, dtype: str) -> dict:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[dtype])
    params.allow_requantize = True
    status = llama_cpp.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params))
    return {"target": target, "dtype": dtype, "status": int(status)}


def greedy(llm) -> int:
    """Argmax of the last evaluated row's logits (read from the context: with ``logits_all``
    off, llama-cpp-python 0.3.36 keeps no scores of its own)."""
    import llama_cpp
    import numpy as np

    row = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(row, shape=(llm.n_vocab(),))))


def measure(model: str, threads: int, prompts: list[list[int]], tokens: int, t0: float) -> dict:
    from llama_amx import avoid_amx
    from llama_cpp import Llama

    no_amx = avoid_amx()
    started = time.perf_counter()
    llm = Llama(model_path=model, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads,
                n_threads_batch=threads, logits_all=False, verbose=False)
    load_s = time.perf_counter() - started
    out: dict = {"engine": "llama.cpp", "version": __import__("llama_cpp").__version__,
                 "load_s": load_s, "prompts": [], "amx_off": no_amx}
    for index, ids in enumerate(prompts):
        llm.reset()
        started = time.perf_counter()
        llm.eval(ids)
        token = greedy(llm)
        prefill_s = time.perf_counter() - started
        row = {"prompt_tokens": len(ids), "prefill_s": prefill_s, "tokens": [token]}
        if index == 0:
            out["ttft_s"] = time.time() - t0
            started = time.perf_counter()
            for _ in range(tokens - 1):
                llm.eval([token])
                token = greedy(llm)
                row["tokens"].append(token)
            row["decode_s"] = time.perf_counter() - started
            row["decode_tokens"] = tokens - 1
        out["prompts"].append(row)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    conv = commands.add_parser("convert")
    conv.add_argument("source")
    conv.add_argument("target")
    conv.add_argument("dtype", choices=sorted(FTYPES))
    meas = commands.add_parser("measure")
    meas.add_argument("model")
    meas.add_argument("--threads", type=int, required=True)
    meas.add_argument("--prompts", required=True)
    meas.add_argument("--tokens", type=int, required=True)
    meas.add_argument("--t0", type=float, required=True)
    args = parser.parse_args()
    if args.command == "convert":
        result = convert(args.source, args.target, args.dtype)
    else:
        with open(args.prompts) as handle:
            prompts = json.load(handle)
        result = measure(args.model, args.threads, prompts, args.tokens, args.t0)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
