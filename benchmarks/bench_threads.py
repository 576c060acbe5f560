"""Two thread pools on the same cores: a numba ``prange`` kernel called between torch kernels,
against the same kernel compiled serial (the evidence behind ``fuel.kernels.threads``).

Each iteration runs a torch matmul on torch's OpenMP pool (``--threads``, default 2), then times
one call of a small attention-like numba kernel (96 rows x 64 keys x 64 dims, ~80-100 us of
work), interleaving the two variants. It prints the median, p90 and worst call per variant: a
median or p90 near a scheduler time slice (milliseconds) means the pools fight. Usage::

    .venv/bin/python benchmarks/bench_threads.py [--threads 2] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

KERNEL = '''
def attend(out, q, k):
    for t in {loop}(q.shape[0]):
        acc = np.float32(0.0)
        for j in range(k.shape[0]):
            for d in range(k.shape[1]):
                acc += q[t, d] * k[j, d]
        out[t] = acc
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()

    import numba
    import numpy as np
    import torch

    from fuel.kernels.threads import set_threads

    set_threads(args.threads)
    variants = {}
    for name, parallel in (("numba prange", True), ("numba serial", False)):
        namespace = {"np": np, "prange": numba.prange}
        exec(KERNEL.format(loop="prange" if parallel else "range"), namespace)  # noqa: S102
        variants[name] = numba.njit(parallel=parallel, fastmath=True)(namespace["attend"])
    q = np.random.rand(96, 64).astype(np.float32)
    k = np.random.rand(64, 64).astype(np.float32)
    out = np.empty(96, np.float32)
    for kernel in variants.values():
        kernel(out, q, k)  # compile
    weight, x = torch.randn(1536, 576), torch.randn(32, 576)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.calls):
        for name, kernel in variants.items():
            torch.nn.functional.linear(x, weight)
            started = time.perf_counter()
            kernel(out, q, k)
            times[name].append(time.perf_counter() - started)
    print(f"torch threads {torch.get_num_threads()}; numba layer {numba.threading_layer()}, "
          f"{numba.get_num_threads()} threads; {args.calls} calls each, interleaved")
    for name, samples in times.items():
        samples.sort()
        print(f"  {name:<13} median {statistics.median(samples) * 1e6:9.1f} us   "
              f"p90 {samples[int(len(samples) * 0.9)] * 1e6:9.1f} us   "
              f"worst {samples[-1] * 1e6:9.1f} us")


if __name__ == "__main__":
    main()
