"""The numba moe template vs the moe recipe (grouped torch matmuls) at MoE decode shapes.

Run: ``.venv/bin/python benchmarks/bench_moe.py [--tokens 1] [--experts 60] [--threads N]``

Builds one fused ``moe`` node (f32) at the given dims — defaults are Qwen1.5-MoE-A2.7B's per
layer routing (60 experts, 4 per token, a shared expert; ``src/fuel/data/zoo/
qwen1.5-moe-a2.7b-chat.json``) at half its hidden and expert widths so the expert stack fits a
small machine —, synthesizes the numba template for it, and times the kernel and the recipe's
decomposition (the arm the CPU runs without JIT: router softmax/top-k, two ``expert_matmul``
over the chosen experts, SwiGLU, the weighted combine) on the same inputs (median of repeated
samples, ``fuel.cost.profile_kernel``). Weights are drawn N(0, 1/fan_in) so activations stay
O(1) and the f32 comparison is meaningful. Prints the max error and decomposed / kernel.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=704)
    parser.add_argument("--experts", type=int, default=60)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)

    import torch

    from fuel.cost.profile import profile_kernel
    from fuel.graph import BackendId, DType, FusedOpParams, FusedOps, Graph, decompose
    from fuel.graph.branch import lower
    from fuel.jit import ArchSku, JitBudget, Synthesized, jit_request_for_unplaceable_fused
    from fuel.jit.numba_synth import NumbaSynthesizer
    from fuel.kernels import cpu_table
    from fuel.runtime.executor import compile_program

    if args.threads:
        torch.set_num_threads(args.threads)
    t, h, i, e, k = args.tokens, args.hidden, args.inter, args.experts, args.top_k
    g = Graph()
    shapes = [[t, h], [t, e], [e, 2 * i, h], [e, h, i], [t, h], [t, 1]]
    binds = [g.input(f"in{n}", s, DType.F32) for n, s in enumerate(shapes)]
    node = g.fused(FusedOps.MOE, FusedOpParams.Moe(k, False, shared=True), *binds)
    table = cpu_table()
    request = jit_request_for_unplaceable_fused(g, node, BackendId.CPU, table, ArchSku.CPU,
                                                JitBudget(600_000))
    synth = NumbaSynthesizer()
    answer = synth.synthesize(request)
    if not isinstance(answer, Synthesized):
        print(f"declined: {answer.reason}")
        return 1
    kernel = synth.take_kernel(answer.entry_point)
    gen = torch.Generator().manual_seed(0)
    fan_in = [1, 1, h, i, 1, 1]
    feeds = {f"in{n}": torch.randn(s, generator=gen) / fan_in[n] ** 0.5
             for n, s in enumerate(shapes)}
    root = decompose(g, node)
    program = compile_program(g, lower(g, [root]), table)
    inputs = [feeds[f"in{n}"] for n in range(len(shapes))]
    reference = program.run(feeds)[root]
    got = kernel.run(*inputs)
    error = float((got - reference).abs().max())
    kernel_ns = profile_kernel(lambda: kernel.run(*inputs), repeats=15).median_ns
    recipe_ns = profile_kernel(lambda: program.run(feeds), repeats=15).median_ns
    read = k * t if t * k < e else e
    print(f"moe T={t} H={h} I={i} E={e} k={k} (shared expert), f32, "
          f"{torch.get_num_threads()} torch threads; compile {kernel.compile_ms:.0f} ms"
          f"{' (cache)' if kernel.from_cache else ''}")
    print(f"  experts read per call: at most {read} of {e} "
          f"({read * 3 * h * i * 4 / 1e6:.1f} MB of {e * 3 * h * i * 4 / 1e6:.0f} MB)")
    print(f"  recipe (grouped torch matmuls) {recipe_ns / 1e3:9.1f} us")
    print(f"  numba moe template             {kernel_ns / 1e3:9.1f} us")
    print(f"  speedup {recipe_ns / kernel_ns:.2f}x, max abs error {error:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
