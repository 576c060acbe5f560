"""Decode tokens/s of ``fuel run`` against transformers' eager ``generate``, same weights, dtype
and thread count, measured in one process; and the machine's memory-bandwidth floor.

For each dtype (f32 and bf16 by default) it prints fuel's decode rate (the decode steps of a
``fuel run`` generation, after a warm-up run that builds the programs), transformers'
(``LlamaForCausalLM`` built from the very tensors fuel loaded, ``attn_implementation="eager"``,
greedy ``generate``; decode time = time for N tokens minus time for 1), their ratio (target
>= 2x), and the bandwidth floor: the weight bytes a decode step must read (every distinct
tensor once; the tied embedding is read whole as the LM head) over the streaming bandwidth the
``cpu-local`` probe measured with the same thread count, with fuel's distance from it (target
within 3x at bf16). fuel runs twice per dtype: ``--no-jit`` (paged attention and
residual_add_rms_norm decomposed) and ``--jit`` (adopted numba kernels where the Judge measured
them faster; the first JIT run adopts and measures, the timed runs reuse the programs). Usage::

    .venv/bin/python benchmarks/bench_run.py [--tokens 64] [--threads N] [--dtype f32 --dtype bf16] [--jit on --jit off]

``--stored`` instead runs the shipped Q4_1 file in its stored formats (:func:`stored_q4_1`):
fuel's decode rate with the quantized kernels the bake adopted, llama.cpp's on the same file,
threads and prompt ids (``--llama-python``, the peer interpreter; skipped with a note when it is
absent), and the bandwidth floor for the stored bytes (targets: >= 1.0x llama.cpp, within 2x of
the floor)::

    .venv/bin/python benchmarks/bench_run.py --stored [--llama-python /work/peer/llama/bin/python]
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


def read_bandwidth(mib: int = 512, repeats: int = 7) -> float:
    """Bytes per second of summing a buffer far larger than the caches (median of ``repeats``)."""
    import statistics
    import time

    import torch

    buffer = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    buffer.sum()  # touch every page once before timing
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - started)
    return buffer.numel() * 4 / statistics.median(times)


def stored_q4_1(args) -> None:
    """The ``--stored`` benchmark (module docs)."""
    import json
    import subprocess
    from pathlib import Path

    from fuel.runtime.model import load_model, set_threads
    from fuel.runtime.quant_cache import decode_traffic
    from fuel.runtime.weights import default_model_path

    threads = set_threads(args.threads)
    model = load_model(None, dtype="stored", max_context=512, progress=False, jit=True)
    rate, report = fuel_decode_rate(model, args.tokens, args.repeats)
    traffic = decode_traffic(model.weights)
    bandwidth = max(read_bandwidth(), traffic["bandwidth_bytes_per_s"])
    floor_rate = bandwidth / traffic["bytes_per_token"]
    size = default_model_path().stat().st_size
    print(f"[stored] {default_model_path().name} ({size / 1e6:.1f} MB), {threads} threads, "
          f"{args.tokens} new tokens")
    print("  weight formats: " + ", ".join(f"{fmt} {b / 1e6:.1f} MB" for fmt, b in traffic["formats"].items())
          + f"; resident {traffic['resident_bytes'] / 1e6:.1f} MB = "
            f"{traffic['resident_bytes'] / size:.2f}x the GGUF (target <= 1.3x)")
    decode = report["steps"]["decode"]
    print(f"  fuel run decode (stored, jit on): {rate:8.2f} tokens/s ({decode['kernel_calls_per_step']} "
          f"kernel calls per step)")
    print(f"  bandwidth floor: {traffic['bytes_per_token'] / 1e6:.1f} MB per token / {bandwidth / 1e9:.2f} GB/s "
          f"= {1e3 / floor_rate:.1f} ms/token ({floor_rate:.1f} tokens/s); fuel is "
          f"{floor_rate / rate:.2f}x from it (target within 2x)")
    python = Path(args.llama_python)
    if not python.is_file():
        print(f"  llama.cpp: --llama-python {python} is not an interpreter; peer skipped")
        return
    ids = model.tokenizer.encode(model.tokenizer.format_prompt(PROMPT))
    script = Path(__file__).with_name("llamacpp_peer.py")
    rates = []
    for _ in range(args.repeats):
        done = subprocess.run([str(python), str(script), str(default_model_path()), str(threads),
                               str(args.tokens), json.dumps([ids])], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"  llama.cpp peer failed: {done.stderr.strip()[-300:]}")
            return
        run = json.loads(done.stdout)["runs"][0]
        rates.append(run["decode_tokens"] / run["decode_s"])
    peer = statistics.median(rates)
    print(f"  llama.cpp (llama-cpp-python) decode: {peer:8.2f} tokens/s")
    print(f"  ratio fuel / llama.cpp: {rate / peer:6.2f}x (target >= 1.0x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", action="append", choices=["f32", "bf16"])
    parser.add_argument("--jit", action="append", choices=["off", "on"])
    parser.add_argument("--stored", action="store_true", help="the Q4_1 file in its stored formats")
    parser.add_argument("--llama-python", default="/work/peer/llama/bin/python")
    args = parser.parse_args()
    if args.stored:
        stored_q4_1(args)
        return

    from fuel.cost.probe import cpu_local_spec
    from fuel.runtime.model import load_model, set_threads

    threads = set_threads(args.threads)
    spec = cpu_local_spec(threads=threads)
    copy_bandwidth = spec.bandwidth_bytes_per_s
    # A decode step only reads its weights; a copy also writes (and write-allocates), so the
    # probe's copy rate understates what a weight-streaming matmul can reach. The floor uses the
    # faster of the two: the read rate measured here and the probe's copy rate.
    read = read_bandwidth()
    bandwidth = max(read, copy_bandwidth)
    print(f"threads: {threads}; read bandwidth (sum over a 512 MiB buffer): {read / 1e9:.2f} GB/s; "
          f"probed copy bandwidth: {copy_bandwidth / 1e9:.2f} GB/s "
          f"({spec.sources.get('bandwidth', 'cpu-local probe')}); the floor uses {bandwidth / 1e9:.2f} GB/s")
    for dtype in args.dtype or ["f32", "bf16"]:
        rates = {}
        for jit in args.jit or ["off", "on"]:
            model = load_model(None, dtype=dtype, max_context=512, progress=False, jit=jit == "on")
            rates[jit] = fuel_decode_rate(model, args.tokens, args.repeats)
        ids = model.tokenizer.encode(model.tokenizer.format_prompt(PROMPT))
        reference = transformers_model(model.weights, model.weights.dtype.torch)
        hf_rate = transformers_decode_rate(reference, ids, args.tokens, args.repeats)
        weight_bytes = model.weights.nbytes()
        floor_rate = bandwidth / weight_bytes
        print(f"\n[{dtype}] {args.tokens} new tokens, prompt {len(ids)} tokens")
        for jit, (fuel_rate, report) in rates.items():
            decode = report["steps"]["decode"]
            adopted = max((b["adopted_kernel_calls_per_step"] for b in report["bake_decisions"]
                           if b["mode"] == "decode"), default=0)
            print(f"  fuel run decode, jit {jit:>3}:   {fuel_rate:8.2f} tokens/s "
                  f"({decode['launches_per_step']} launches, {decode['kernel_calls_per_step']} "
                  f"kernel calls per step, {adopted} adopted-kernel calls)")
        print(f"  transformers eager generate: {hf_rate:8.2f} tokens/s")
        for jit, (fuel_rate, _) in rates.items():
            print(f"  ratio fuel (jit {jit}) / transformers: {fuel_rate / hf_rate:6.2f}x (target >= 2x)")
        best = max(rate for rate, _ in rates.values())
        print(f"  bandwidth floor: {weight_bytes / 1e6:.1f} MB of weights per token / "
              f"{bandwidth / 1e9:.2f} GB/s = {1e3 / floor_rate:.1f} ms/token ({floor_rate:.1f} tokens/s)")
        print(f"  fuel (best) is {floor_rate / best:.2f}x from the floor (target within 3x at bf16)")
        del reference


if __name__ == "__main__":
    main()
