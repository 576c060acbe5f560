"""Decode tokens/s of ``fuel run`` against transformers' eager ``generate``, same weights, dtype
and thread count, measured in one process; and the machine's memory-bandwidth floor.

For each dtype (f32 and bf16 by default) it prints fuel's decode rate (the decode steps of a
``fuel run`` generation, after a warm-up run that builds the programs), transformers'
(``LlamaForCausalLM`` built from the very tensors fuel loaded, ``attn_implementation="eager"``,
greedy ``generate``; decode time = time for N tokens minus time for 1), their ratio (target
>= 2x), and the bandwidth floor: the weight bytes a decode step must read (every distinct
tensor once; the tied embedding is read whole as the LM head) over the streaming bandwidth the
``cpu-local`` probe measured with the same thread count, with fuel's distance from it (target
within 3x at bf16). Usage::

    .venv/bin/python benchmarks/bench_run.py [--tokens 64] [--threads N] [--dtype f32 --dtype bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time

PROMPT = "Write a short paragraph about the history of the bicycle."


def transformers_model(weights, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = {k: v for k, v in weights.config.items() if k not in ("torch_dtype", "dtype")}
    llama = LlamaConfig(**config)
    llama._attn_implementation = "eager"
    with torch.device("meta"):
        model = LlamaForCausalLM(llama)
    model.load_state_dict({n: t.to(dtype) for n, t in weights.tensors.items()}, strict=False, assign=True)
    if weights.tied_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = LlamaRotaryEmbedding(config=llama)
    return model.eval()


def transformers_decode_rate(model, ids, tokens: int, repeats: int) -> float:
    import torch

    inputs = torch.tensor([ids])
    mask = torch.ones_like(inputs)

    def timed(count: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(inputs, attention_mask=mask, max_new_tokens=count, min_new_tokens=count,
                                 do_sample=False, pad_token_id=0)
        assert out.shape[1] == len(ids) + count
        return time.perf_counter() - started

    timed(2)  # warm-up
    full = statistics.median(timed(tokens) for _ in range(repeats))
    first = statistics.median(timed(1) for _ in range(repeats))
    return (tokens - 1) / (full - first)


def fuel_decode_rate(model, tokens: int, repeats: int) -> tuple[float, dict]:
    from fuel.runtime.model import run_generation

    run_generation(model, [PROMPT], max_new_tokens=tokens, stop_at_eos=False)  # builds programs
    reports = [run_generation(model, [PROMPT], max_new_tokens=tokens, stop_at_eos=False)
               for _ in range(repeats)]
    return statistics.median(r["decode_tokens_per_s"] for r in reports), reports[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", action="append", choices=["f32", "bf16"])
    args = parser.parse_args()

    from fuel.cost.probe import cpu_local_spec
    from fuel.runtime.model import load_model, set_threads

    threads = set_threads(args.threads)
    spec = cpu_local_spec(threads=threads)
    bandwidth = spec.bandwidth_bytes_per_s
    print(f"threads: {threads}; measured streaming bandwidth: {bandwidth / 1e9:.2f} GB/s "
          f"({spec.sources.get('bandwidth', 'cpu-local probe')})")
    for dtype in args.dtype or ["f32", "bf16"]:
        model = load_model(None, dtype=dtype, max_context=512, progress=False)
        ids = model.tokenizer.encode(model.tokenizer.format_prompt(PROMPT))
        fuel_rate, report = fuel_decode_rate(model, args.tokens, args.repeats)
        reference = transformers_model(model.weights, model.weights.dtype.torch)
        hf_rate = transformers_decode_rate(reference, ids, args.tokens, args.repeats)
        weight_bytes = model.weights.nbytes()
        floor_rate = bandwidth / weight_bytes
        decode = report["steps"]["decode"]
        print(f"\n[{dtype}] {args.tokens} new tokens, prompt {len(ids)} tokens")
        print(f"  fuel run decode:            {fuel_rate:8.2f} tokens/s "
              f"({decode['launches_per_step']} launches, {decode['kernel_calls_per_step']} kernel calls per step)")
        print(f"  transformers eager generate: {hf_rate:8.2f} tokens/s")
        print(f"  ratio fuel / transformers:   {fuel_rate / hf_rate:8.2f}x (target >= 2x)")
        print(f"  bandwidth floor: {weight_bytes / 1e6:.1f} MB of weights per token / "
              f"{bandwidth / 1e9:.2f} GB/s = {1e3 / floor_rate:.1f} ms/token ({floor_rate:.1f} tokens/s)")
        print(f"  fuel is {floor_rate / fuel_rate:.2f}x from the floor (target within 3x at bf16)")
        del reference


if __name__ == "__main__":
    main()
