"""Layer-1 prediction vs Judge measurement on this CPU, per kernel family and size.

Run:  .venv/bin/python benchmarks/bench_cost.py [--model smollm2-135m] [--threads 1] [--store PATH]

Probes ``cpu-local`` with the same torch thread count the kernels run with (the probe is cached
per thread count; ``--reprobe`` measures it again), measures every workload of the model's
kernel families through the CPU binding table (fuel.cost.campaign), prices each with the
roofline on ``cpu-local`` (one launch per operator call the bound kernel dispatches; bytes at
the cache tier when the working set fits, else DRAM — the ``tier`` column), and prints
predicted/measured per workload, then per family the median |log(pred/measured)| against the
log(2) target. ``--threads 1`` is the default because
a shared 2-core machine makes multi-threaded timings wait on descheduled threads (the spread
column shows it); pass ``--threads 0`` to keep torch's default.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="f32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reprobe", action="store_true")
    parser.add_argument("--store", default=None, help="also record the measurements in this Judge store")
    args = parser.parse_args(argv)

    from fuel.circuit import zoo
    from fuel.cost import JudgeStore, composite_ns, roofline
    from fuel.cost.campaign import Measured, log_ratio, run_campaign
    from fuel.cost.probe import cpu_local_spec
    from fuel.cost.workloads import ModelDims, workloads
    from fuel.graph import DType

    threads = None if args.threads == 0 else args.threads
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    spec = cpu_local_spec(reprobe=args.reprobe, threads=threads)
    print(f"cpu-local: fp32 {spec.peak_flops[next(iter(spec.peak_flops))] / 1e9:.0f} GFLOP/s, "
          f"vector {spec.vector_flops / 1e9:.1f} GFLOP/s, {spec.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
          f"launch {spec.launch_overhead_ns} ns, threads {threads or 'default'}")
    if spec.has_cache_tier():
        print(f"cache tier: {spec.cache_bytes / 2**20:.2f} MiB at {spec.cache_bandwidth_bytes_per_s / 1e9:.1f} GB/s")
    else:
        print(f"no cache tier: {spec.sources.get('cache', '')}")
    dims = ModelDims.from_config(zoo.config(args.model))
    store = JudgeStore.open(args.store) if args.store else None
    results = run_campaign(workloads(dims, DType(args.dtype)), store)
    if store is not None:
        store.close()

    print(f"\n{'family':18} {'size':26} {'bound':8} {'tier':5} {'calls':>5} {'pred us':>10} {'meas us':>10} "
          f"{'spread':>8} {'pred/meas':>9}")
    per_family: dict[str, list[float]] = {}
    for result in results:
        if not isinstance(result, Measured):
            print(f"{result.workload.family:18} {result.workload.label:26} skipped: {result.reason}")
            continue
        predicted = composite_ns(result.estimate, spec)
        priced = roofline(result.estimate, spec)
        bound, tier = priced.bound.value, priced.tier.value
        measured = result.measurement.median_ns
        print(f"{result.row.op:18} {result.workload.label:26} {bound:8} {tier:5} {result.estimate.launches:5} "
              f"{predicted / 1e3:10.1f} "
              f"{measured / 1e3:10.1f} {result.measurement.spread_ns / 1e3:8.1f} {predicted / measured:9.2f}")
        per_family.setdefault(result.row.op, []).append(log_ratio(predicted, measured))

    target = math.log(2)
    print(f"\n{'family':18} {'median |log(pred/meas)|':>24}  target {target:.3f}")
    misses = []
    for family, values in per_family.items():
        median = statistics.median(values)
        verdict = "ok" if median <= target else "MISS"
        if median > target:
            misses.append(family)
        print(f"{family:18} {median:24.3f}  {verdict}")
    print(f"\n{len(per_family) - len(misses)}/{len(per_family)} families within a factor of 2"
          + (f"; missed: {', '.join(misses)}" if misses else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
