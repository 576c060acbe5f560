"""Adopted CPU (numba) kernels vs the decomposed regions they replace, at decode shapes.

Run: ``.venv/bin/python benchmarks/bench_jit.py [--context 1024] [--dtype f32]``

For each model (dims read from the zoo configs: ``src/fuel/data/zoo/<model>.json``) it builds the
decode-step fused nodes the CPU has no kernel for — residual_add_rms_norm over ``[1, hidden]``
and paged attention for one sequence (one query row, ``context`` cached tokens, block size 16;
see ``fuel.jit.decode_step``) —
asks the carrier for each request, and runs adoption, which verifies the numba kernel against
the decomposition and profiles both on the same inputs in the same run (median of repeated
samples, ``fuel.cost.profile_kernel``). The speedup is decomposed / kernel; the target is >= 2x.
"""

from __future__ import annotations

import argparse
import sys

from fuel.circuit import zoo
from fuel.graph import BackendId, DType, RuntimeFusedRegistry
from fuel.jit import ArchSku, JitBudget, jit_request_for_unplaceable_fused
from fuel.jit.adopt import adopt
from fuel.jit.decode_step import decode_step
from fuel.jit.numba_synth import NumbaSynthesizer
from fuel.kernels import cpu_table

MODELS = ("smollm2-135m", "llama-3.1-8b")
REGIONS = ("residual_add_rms_norm", "paged_attn")
TARGET = 2.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    dtype = DType(args.dtype)
    synth = NumbaSynthesizer()
    print(f"{'model':<14} {'region':<22} {'first inputs':<34} {'kernel':>10} {'decomposed':>11} "
          f"{'speedup':>8}  verdict")
    below = 0
    for model in MODELS:
        step = decode_step(zoo.config(model), args.context, dtype)
        g = step.graph
        for name, node in step.nodes:
            if name not in REGIONS:
                continue
            shape = ", ".join(str(g.node(i).shape) for i in g.node(node).inputs[:2])
            request = jit_request_for_unplaceable_fused(g, node, BackendId.CPU, cpu_table(),
                                                        ArchSku.CPU, JitBudget(300_000))
            assert request is not None, f"{name} must be a CPU gap"
            record = adopt(synth, request, BackendId.CPU, table=cpu_table(),
                           registry=RuntimeFusedRegistry(), profile_repeats=args.repeats)
            if record.kernel_ns is None:
                print(f"{model:<14} {name:<22} {shape:<34} {record.outcome.value}: "
                      f"{record.reason}")
                below += 1
                continue
            speedup = record.speedup
            below += speedup < TARGET
            print(f"{model:<14} {name:<22} {shape:<34} {record.kernel_ns / 1e3:>8.1f}us "
                  f"{record.decomposed_ns / 1e3:>9.1f}us {speedup:>7.2f}x  "
                  f"{'>= 2x' if speedup >= TARGET else 'below 2x'} "
                  f"(max err {record.max_abs_error:.1e}, {record.outcome.value})")
    return 0 if below == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
