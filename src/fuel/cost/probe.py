"""The ``cpu-local`` device: this machine's roofline numbers, measured and cached.

Decided here: what is measured and how it becomes a :class:`DeviceSpec`. Every rate is taken
from the kernels fuel's CPU backend really calls, the way it calls them:

- Matrix peaks (fp32, bf16, fp16): the CPU backend's linear kernel as a step calls it
  (:func:`_linear_kernel`: f32 activations; f32 weights through the bound ``fused_linear``
  entry, oneDNN on the checkpoint layout; a bf16/f16 prompt chunk through the GEMM the
  runtime's 16-bit matrices run) at M=256, K=N=512 — a prefill-shaped GEMM (2·M·K·N FLOP per
  call).
- Matrix rates by rows (``gemm_rows_flops``, per dtype): the same kernel, K=N=512, at each
  row count a CPU prompt chunk runs (``_GEMM_ROWS``: 16 to 256, the sizes
  ``fuel.runtime.generate`` pads a chunk to), each timed pass calling it once on each of a set
  of distinct weights (``_ROWS_SET_BYTES`` of them, twice the LLC the VM reports),
  so every call reads a weight no earlier call of the pass read, as a step's projections do.
  A CPU GEMM's rate grows with its rows (each weight block is loaded and packed once per call
  and that cost is shared by the rows): measured here in f32, 128 rows ran at ~0.9 of the
  256-row rate, 64 rows at ~0.75, 16 rows at ~0.4, and a 128-row prompt chunk's products ran
  at ~0.75 of the (cache-hot) 256-row peak they were priced at, so ``fuel plan`` predicted the
  chunk ~25% too fast (a 64-row one ~45%). A dtype whose pass would take over
  ``_ROWS_BUDGET_NS`` (fp16 here: no fast CPU path) keeps its single dense peak.
- Fixed cost per call (``gemm_rows_fit``, ``attention_rows_fit``): at each row count a second
  call a quarter as wide (N of the product, heads of the attention) splits a call's time into a
  fixed part and a rate (:func:`call_fit`): a prompt chunk's GEMM and attention pay per call
  (converting activations, gathering the cache, the threads' fork and join), so a narrow one
  runs well below a wide one's rate. ``fuel plan`` charges each call the fixed part.
- Attention rates by rows (``attention_rows_flops``): the prompt-chunk attention a CPU run
  calls (``fuel.jit.paged.prefill_attention``: the native flash attention over the paged
  cache, or where it declines one causal ``scaled_dot_product_attention`` over the rows gathered
  through the block table), f32 (the CPU attention computes in f32 whatever
  the model's dtype), at each of ``_GEMM_ROWS`` rows over a context of as many positions, for
  ``_ATTENTION_LAYOUT`` (query heads, kv heads, head_dim); FLOPs counted as the report counts
  them (``4 x heads x head_dim x attended positions``, causal). It is not a packed GEMM:
  measured here, 128 rows ran at 30-45 GFLOP/s where the linear kernel ran at ~160, so pricing
  a prompt chunk's attention at the matrix peak made it ~6x too cheap. Nothing to measure
  (the module gone): no curve, and attention is priced at the matrix peak as before.
- Matrix-vector rates (``gemv_flops``, per dtype): the same kernel at M=1 on a 4096 x 4096
  weight (64 MiB in f32: twice this machine's last-level cache), as every decode step calls it:
  that rate is what a one-row product achieves, bandwidth and all.
- Bandwidth: the bytes the f32 matrix-vector kernel reads per second streaming a weight set
  twice the size of the last-level cache (sysfs; 64 MiB slices one after the other, as a decode
  step reads its layers), so the rate is memory's, not the cache's: one 64 MiB weight read over
  and over stays in a large LLC (480 MiB on this VM's host) and measured 50 GB/s where a decode
  step of SmolLM2 in f32 (540 MB) reads at ~20. The streaming ``copy_`` rate (read + write) is
  recorded in the source line; writes cost more than reads on this hardware, so the copy rate
  would understate a read-dominated step. **By size** (``bandwidth_by_bytes``): the same
  kernel streaming distinct weights of 1, 4 and 16 MiB (twice the LLC of each), less a call's
  fixed cost: each call's read starts cold (the prefetchers ramp up again, the threads fork and
  join), so a decode step of small matrices reads slower than 64 MiB slices do (here ~22-29
  GB/s at 1-4 MiB against ~40 at 64 MiB); a weight is priced at the rate of its size.
- Vector rate: in-cache ``torch.addcmul`` (2 FLOP per element) — elementwise work at its best —
  as the slope between two sizes, so the fixed per-call cost (priced separately, as launch
  overhead) is not folded into the rate.
- Cache tier: streaming ``copy_`` calls whose working set (source + target) is a fraction of
  the L2 size the OS reports (sysfs) times the thread count (each thread streams through its
  own core's L2). The cache bandwidth is the slope between the two smallest working sets
  (1/16 and 1/4 of that size), so the fixed per-call cost drops out; the tier's size is the
  largest swept working set (1/16, 1/4, 1/2, 3/4, 1 of it) whose copy, less that fixed cost,
  still streams within a factor of two of the cache bandwidth (:func:`cache_tier`) — real
  caches stop holding a stream before their nominal size. It is compared with the DRAM copy
  rate (like with like). No L2 size from the OS, an in-cache rate that is not faster than DRAM,
  or a slope that does not resolve: no tier, and the source line says which.
- Per-call overhead: what a one-element ``torch.add`` costs when sixteen of them follow each
  streamed slice, clocked around the calls themselves (the median over the slices of three
  passes) — the fixed host cost every CPU kernel call pays (Python dispatch, the framework's op
  launch) *in a step*, where each call finds the caches just flushed by a weight stream
  (measured here: ~1 us back to back, a little more after a stream). It is both the launch
  overhead and the host cost of a view (``host_call_ns``): on the CPU backend both are one
  torch call.
- Memory size: physical RAM.

The probe takes a few seconds on a quiet machine (each rate is a handful of timed calls). The
16-bit dtypes' prompt-chunk curves (their rows rates and fits, and the by-size stream rate of
16-bit weights) are sections of their own, measured the first time a run or plan asks for that
dtype (:func:`cpu_local_spec`'s ``halves``) and added to the cache: they were about half of a
cold probe, which a run of f32 or stored weights never reads.
The result is cached as JSON under ``$FUEL_CACHE_DIR`` (default ``~/.cache/fuel``) in
``devices/cpu-local-<hash>-v<format version>.json``, keyed by the device fingerprint and library versions, so a
new CPU or a new torch probes afresh. ``reprobe=True`` measures again and overwrites. A cache
file that cannot be read is reported (a warning naming the file) and replaced by a new probe.

This module reads the clock and the machine: an edge, never imported by the planning core.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path

from fuel.cost.paths import cache_dir
from fuel.cost.fingerprint import device_fingerprint, library_versions, short_hash
from fuel.cost.profile import profile_kernel
from fuel.cost.spec import DeviceKind, DeviceSpec, PeakClass

CACHE_FORMAT = "fuel-cpu-local-probe"
CACHE_VERSION = 12  # 12: dense weight rows streamed one at a time (matrix-vector rates ~15% higher), the 16-bit chunk curves probed per dtype on demand; 11: prompt-chunk attention through prefill_attention (native flash attention), f16 chunks on the native GEMM; 10: 16-bit matrices' products timed on f32 activations, chunks as the runtime runs them; a chunk GEMM's and attention's fixed cost per call; 9: the per-call overhead clocked around the calls; 8: 16-bit weights' bandwidth by size; 7: bandwidth by matrix size; 6: f32 prompt chunks on oneDNN; 5: matrix rates by rows; 4: bandwidth beyond the LLC, per-call overhead in a step
_BANDWIDTH_BYTES = 64 * 1024 * 1024
_GEMV_SHAPE = (4096, 4096)  # (N, K) of one matrix-vector weight slice: 64 MiB in f32
_STREAM_MIN_BYTES = 256 * 1024 * 1024  # the streamed weight set: at least this, 2x the LLC
_CALLS_PER_SLICE = 16
_GEMM_SHAPE = (256, 512, 512)  # (M, K, N) of the prefill-shaped product
_GEMM_ROWS = (16, 32, 64, 128, 256)
"""Row counts of the matrix-rate curve: the powers of two a CPU prompt chunk runs at
(``fuel.runtime.generate.bucket``, ``MIN_BUCKET`` to ``DEFAULT_CHUNK``); the half-steps between
them (24, 48, 96, 192) are priced by interpolating in log2 between two measured neighbours."""
_NARROW = 4
"""The fixed-cost fits' second call is this many times narrower (N of a product, heads of the
attention): see :func:`_linear_rows_rates` and :func:`_attention_rows_rates`."""
_ROWS_SET_BYTES = 64 * 1024 * 1024
"""Bytes of distinct weights a rows pass reads (64 512x512 f32 weights, 128 in bf16): twice the
LLC this VM reports, so the pass's weights are not all cache-resident, as a step's are not."""
_ATTENTION_LAYOUT = (16, 4, 64)
"""(query heads, kv heads, head_dim) of the attention probe: head_dim 64 and a 4:1 GQA group,
between the small models fuel runs on a CPU (SmolLM2-135M: 9/3/64) and 8B-class ones
(32/8/128). The rate depends on the layout (measured here at 128 rows: 30-50 GFLOP/s across
those), so it is one stated layout, not the model's."""
_ATTENTION_BLOCK = 16
"""Positions per cache block (the engine's ``DEFAULT_BLOCK_SIZE``)."""
_ROWS_BUDGET_NS = 250_000_000
"""A dtype whose 256-row pass (weights x one call, both widths) would take longer has no rows
curve. Measured here: f32 and bf16 ~0.03 s, f16 ~0.5 s (its chunk GEMM runs ~40 GFLOP/s, and
the bake keeps the f32 recipe for f16 chunks anyway); f16's curve took ~4 s of a cold first
token's probe."""
_SLOW_CALL_NS = 20_000_000
"""A call slower than this is compute-bound far from the bandwidth (torch's f16 GEMM here: ~67
ms a 256x512x512 call, at ~2 GFLOP/s): it is timed on an eighth of the rows (0.5 -> 0.15 s of
a cold first token's probe)."""
_DTYPES = (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"))
_CACHE_FRACTIONS = (1 / 16, 1 / 4, 1 / 2, 3 / 4, 1)
_CACHE_SLOWDOWN = 2.0  # a working set belongs to the tier while it streams within this factor


def cache_path(threads: int | None = None) -> Path:
    """The cache file for this machine and libraries (and an explicit torch thread count)."""
    key = short_hash(device_fingerprint("cpu") + "|" + library_versions())
    suffix = "" if threads is None else f"-t{threads}"
    # The format version is in the name: processes running another fuel (another cache
    # format) on the same machine keep their own files instead of replacing each other's.
    return cache_dir() / "devices" / f"cpu-local-{key}-v{CACHE_VERSION}{suffix}.json"


def _physical_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _os_caches() -> list[tuple[int, str, int]] | None:
    """``(level, type, bytes)`` of each cache of CPU 0 as Linux reports it (sysfs), or None."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    caches = []
    try:
        for index in sorted(root.glob("index*")):
            text = (index / "size").read_text().strip().upper()
            scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
            caches.append((int((index / "level").read_text().strip()),
                           (index / "type").read_text().strip(), int(text.rstrip("KMG")) * scale))
    except (OSError, ValueError):
        return None
    return caches


def _l2_bytes_per_core() -> int | None:
    """The level-2 cache size of CPU 0 as Linux reports it (sysfs), or None when unknown."""
    return next((size for level, kind, size in _os_caches() or ()
                 if level == 2 and kind in ("Unified", "Data")), None)


def _llc_bytes() -> int | None:
    """The largest cache the OS reports for CPU 0 (sysfs), or None."""
    return max((size for _, _, size in _os_caches() or ()), default=None)


def cache_tier(
    samples: list[tuple[int, float]], dram_bytes_per_s: float
) -> tuple[int, float] | str:
    """The cache tier from in-cache copy timings: ``(cache_bytes, cache_bytes_per_s)``, or the
    reason there is none.

    ``samples`` are ``(working_set_bytes, median_ns)`` of streaming copies in ascending size;
    a copy moves its whole working set once (reads the source half, writes the target half).
    The bandwidth is the slope between the first two samples and ``fixed`` the intercept;
    the tier holds the leading samples whose rate ``bytes / (ns - fixed)`` is within
    ``_CACHE_SLOWDOWN`` of that bandwidth. Pure: the measuring is done by the caller.
    """
    if len(samples) < 2:
        return "fewer than two in-cache copy timings"
    (small, small_ns), (large, large_ns) = samples[0], samples[1]
    if large_ns <= small_ns or large <= small:
        return f"copy time did not grow from {small} to {large} bytes: the in-cache slope did not resolve"
    bandwidth = (large - small) / ((large_ns - small_ns) * 1e-9)
    if bandwidth <= dram_bytes_per_s:
        return f"in-cache copy ({bandwidth / 1e9:.1f} GB/s) is not faster than DRAM"
    fixed_ns = small_ns - small / bandwidth * 1e9
    tier = 0
    for working_set, ns in samples:
        streaming_ns = ns - fixed_ns
        if streaming_ns <= 0 or working_set / (streaming_ns * 1e-9) * _CACHE_SLOWDOWN < bandwidth:
            break
        tier = working_set
    if tier == 0:
        return "no swept working set streamed at the in-cache rate"
    return tier, bandwidth


def _measure_cache_tier(torch, threads: int, dram_bytes_per_s: float) -> tuple[int | None, float | None, str]:
    """(cache_bytes, cache_bytes_per_s, note) for this machine; (None, None, why) when no tier."""
    l2 = _l2_bytes_per_core()
    if l2 is None:
        return None, None, "no tier: the OS reports no L2 cache size"
    nominal = l2 * max(1, min(threads, os.cpu_count() or 1))
    samples = []
    for fraction in _CACHE_FRACTIONS:
        elements = max(1, int(nominal * fraction) // 8)  # two f32 buffers of `elements` each
        source = torch.ones(elements)
        target = torch.empty_like(source)
        measured = profile_kernel(lambda: target.copy_(source), warmup=5, repeats=9)
        samples.append((2 * 4 * elements, float(measured.median_ns)))
    tier = cache_tier(samples, dram_bytes_per_s)
    sweep = ", ".join(f"{size} B {ns:.0f} ns" for size, ns in samples)
    if isinstance(tier, str):
        return None, None, f"no tier: {tier} (L2 {l2} B x {threads} threads; copies {sweep})"
    size, bandwidth = tier
    return size, bandwidth, (
        f"L2 {l2} B per core (sysfs) x {threads} threads; slope of streaming copy_ over working "
        f"sets {samples[0][0]} and {samples[1][0]} B; tier = largest working set within "
        f"{_CACHE_SLOWDOWN:g}x of that rate (copies {sweep})"
    )


def _stream_bytes(llc: int, at_least: int) -> int:
    """Bytes a streamed weight set spans: twice the LLC, at least ``_STREAM_MIN_BYTES``, at most
    an eighth of RAM (never below ``at_least``)."""
    total = max(_STREAM_MIN_BYTES, 2 * llc)
    memory = _physical_memory_bytes()
    if memory:
        total = min(total, max(at_least, memory // 8))
    return total


def _stream_slices(torch) -> tuple[list, int]:
    """f32 ``[4096, 4096]`` weight slices whose total is twice the LLC (at least
    ``_STREAM_MIN_BYTES``, at most an eighth of RAM), and the LLC size used (0: unknown)."""
    rows, cols = _GEMV_SHAPE
    slice_bytes = rows * cols * 4
    llc = _llc_bytes() or 0
    count = max(1, -(-_stream_bytes(llc, slice_bytes) // slice_bytes))
    return [torch.full((rows, cols), 0.01) for _ in range(count)], llc


def _stream_rates(torch, linear) -> tuple[float, float, int, int]:
    """(bytes/s the f32 linear kernel reads streaming the slices, ns one tiny call costs right
    after a stream, slices, LLC bytes): see the module docstring."""
    import statistics
    import time

    slices, llc = _stream_slices(torch)
    rows, cols = _GEMV_SHAPE
    x = torch.randn(1, cols)
    one_a, one_b, one_out = torch.ones(1), torch.ones(1), torch.empty(1)
    for w in slices:
        linear(x, w)  # prepares each weight once, as a run does

    def stream() -> None:
        for w in slices:
            linear(x, w)

    # A pass reads every slice from memory (the set is twice the cache, read in one order), so
    # no warm-up pass is needed; three keep a cold start's probe short.
    plain = profile_kernel(stream, warmup=0, repeats=3, min_sample_ns=0)
    bandwidth = len(slices) * rows * cols * 4 / (plain.median_ns * 1e-9)
    # The calls are clocked themselves, right after each slice's stream: the median over every
    # slice of three passes. (Taking it as the difference of two passes' times, with and without
    # the calls, divided a few microseconds out of tens of milliseconds that the machine's load
    # moves by more: one probe on a shared host read 31 us a call where the calls take ~2.)
    per_call = []
    for _ in range(3):
        for w in slices:
            linear(x, w)
            started = time.perf_counter_ns()
            for _ in range(_CALLS_PER_SLICE):
                torch.add(one_a, one_b, out=one_out)
            per_call.append((time.perf_counter_ns() - started) / _CALLS_PER_SLICE)
    return bandwidth, statistics.median(per_call), len(slices), llc


_SIZED_STREAMS = (256, 1024, 4096)
"""Rows of the ``[rows, 1024]`` f32 weights (1, 4 and 16 MiB) :func:`_stream_by_size` streams:
a decode step's matrices (SmolLM2's are 1.3-3.5 MiB in f32), not the 64 MiB slices."""


def _stream_by_size(torch, linear, llc: int, large: tuple[int, float] | None = None,
                    dtype=None) -> list[tuple[int, float]]:
    """``(bytes of one weight, bytes/s)`` of the linear kernel streaming distinct weights of each
    size in :data:`_SIZED_STREAMS` (a set as large as :func:`_stream_bytes`, read in order), then
    ``large`` (the 64 MiB slices' point). A small weight streams slower than a large one: each
    call's read starts cold (the prefetchers ramp up again, the threads fork and join), which a
    decode step of small matrices pays at every product. The fixed cost of a call (its host
    dispatch, priced apart as the per-call overhead) is taken out: the same call on a 16-row
    weight the caches hold. ``dtype`` (default f32): the weights' (a 16-bit weight's kernel
    widens it in registers: its own curve); ``large`` None: no 64 MiB point, and no cap."""
    dtype = dtype or torch.float32
    element = torch.empty((), dtype=dtype).element_size()
    cols = 1024
    x = torch.randn(1, cols)
    tiny = torch.full((16, cols), 0.01, dtype=dtype)
    for _ in range(3):
        linear(x, tiny)
    fixed = profile_kernel(lambda: linear(x, tiny), warmup=10, repeats=9).median_ns
    points = []
    total = _stream_bytes(llc, _SIZED_STREAMS[-1] * cols * element)
    memory = torch.full((total // element,), 0.01, dtype=dtype)  # cut into weights of each size
    for rows in _SIZED_STREAMS:
        size = rows * cols * element
        weights = [memory[i * rows * cols:(i + 1) * rows * cols].view(rows, cols)
                   for i in range(total // size)]
        for w in weights:
            linear(x, w)

        def stream() -> None:
            for w in weights:
                linear(x, w)

        timed = profile_kernel(stream, warmup=0, repeats=3, min_sample_ns=0).median_ns
        per_weight = timed / len(weights) - fixed
        if per_weight > 0:
            rate = size / (per_weight * 1e-9)
            points.append((size, rate if large is None else min(rate, large[1])))
    return points if large is None else [*points, large]


def _vector_flops_per_s(torch) -> float:
    """In-cache addcmul rate: the slope between 8 Ki and 32 Ki elements (3 x 128 KiB at most,
    inside L2, so this is arithmetic, not DRAM); the larger size's plain rate, a lower bound,
    when noise hides the slope."""
    timings = []
    for elements in (8 * 1024, 32 * 1024):
        x, y, z = torch.randn(elements), torch.randn(elements), torch.randn(elements)
        measured = profile_kernel(lambda: z.addcmul_(x, y), warmup=3, repeats=9)
        timings.append((2 * elements, measured.median_ns))
    (small, small_ns), (large, large_ns) = timings
    if large_ns <= small_ns:
        return large / (large_ns * 1e-9)
    return (large - small) / ((large_ns - small_ns) * 1e-9)


def _linear_kernel(torch, dtype):
    """The CPU backend's linear kernel for weights of ``dtype`` as a step's projections call it,
    on f32 activations (the CPU runtime's activations are f32 whatever its weights): the bound
    ``fused_linear`` entry; for a 16-bit matrix's prompt chunk (more rows than the native
    kernel streams) :func:`fuel.kernels.torch_kernels.half_chunk_linear`, which the runtime's
    bf16/f16 matrices run (``fuel.jit.native_synth``), not the oneDNN-packed layout the entry
    would prepare (measured 1.3-1.7x faster, so a chunk was priced that much too fast)."""
    from fuel.graph import BackendId, DType, FusedOpParams, FusedOps, Graph
    from fuel.kernels import cpu_table

    graph_dtype = {torch.float32: DType.F32, torch.bfloat16: DType.BF16,
                   torch.float16: DType.F16}[dtype]
    graph = Graph()
    x = graph.input("x", [1, 8], graph_dtype)
    w = graph.input("w", [8, 8], graph_dtype)
    node_id = graph.fused(FusedOps.FUSED_LINEAR, FusedOpParams.FusedLinear(), x, w)
    entry = cpu_table().find(FusedOps.FUSED_LINEAR, (graph_dtype,) * 3, BackendId.CPU)
    assert entry is not None, "the CPU table binds fused_linear for every float dtype"
    bound = entry.kernel(graph.node(node_id))
    if dtype == torch.float32:
        return bound
    from fuel.kernels.native import STREAM_ROWS
    from fuel.kernels.torch_kernels import half_chunk_linear

    def linear(x, w):
        return bound(x, w) if x.shape[0] <= STREAM_ROWS else half_chunk_linear(x, w)

    return linear


def _linear_rate(torch, dtype, m: int, k: int, n: int, *, shrink: bool = True) -> tuple[float, int]:
    """(FLOP/s, median ns per call of that shape) of the CPU linear kernel on an [m, k] x
    [n, k]^T product.

    A dtype the CPU computes slowly (one call over ``_SLOW_CALL_NS``: compute-bound, far from
    the bandwidth) is timed on an eighth of the rows (M, or N for a one-row product) instead, so the probe stays fast; the rate
    of a compute-bound kernel does not depend on where its operands live."""
    import time

    linear = _linear_kernel(torch, dtype)
    x = torch.randn(m, k)  # f32 activations, as the runtime's (see _linear_kernel)
    w = torch.randn(n, k).to(dtype)
    linear(x, w)  # prepares (transposes or packs) the weight once, as a real run does
    started = time.perf_counter_ns()
    linear(x, w)
    once = time.perf_counter_ns() - started
    scale = 1
    if shrink and once > _SLOW_CALL_NS and max(m, n) >= 64:
        if m >= 64:
            m //= 8
            x = x[:m].contiguous()
        else:
            n //= 8
            w = w[:n].contiguous()
        scale = 8
        linear(x, w)
        measured = profile_kernel(lambda: linear(x, w), warmup=0, repeats=3, min_sample_ns=0)
    else:
        measured = profile_kernel(lambda: linear(x, w), warmup=1, repeats=5,
                                  min_sample_ns=2_000_000)
    # The ns of a call of the shape asked for (the rows budget prices a full pass with it).
    return 2 * m * k * n / (measured.median_ns * 1e-9), measured.median_ns * scale


def _linear_rows_rates(torch, dtype, call_ns: float
                       ) -> tuple[list[list[float]], list[list[float]]] | None:
    """``([[rows, FLOP/s], ...], [[rows, fixed ns, FLOP/s], ...])`` of the CPU linear kernel at
    each of ``_GEMM_ROWS`` (see the module docstring), or None when a pass would exceed
    ``_ROWS_BUDGET_NS`` (``call_ns``: one 256-row call, as timed for the dense peak).

    The first list is the rate of the K=N=512 product. The second splits a call's time into a
    fixed part and a rate (:func:`call_fit` of that product and one a quarter as wide): a
    prompt chunk's GEMM pays a fixed cost per call (converting and packing its activations,
    the threads' fork and join) that a narrow product (a 192-wide k/v projection) feels far more
    than a 512-wide one. Measured here for bf16 at 128 rows: ~50 us a call plus ~540 GFLOP/s,
    where 576-wide and 192-wide matrices ran at 400 and 270 GFLOP/s."""
    linear = _linear_kernel(torch, dtype)
    _, k, n = _GEMM_SHAPE
    narrow = n // _NARROW
    count = max(2, _ROWS_SET_BYTES // (k * n * torch.empty((), dtype=dtype).element_size()))
    if call_ns * count * (1 + 1 / _NARROW) > _ROWS_BUDGET_NS:
        return None
    # distinct copies of one random weight per width (drawing each anew took ~0.2 s a dtype)
    bases = {width: torch.randn(width, k).to(dtype) for width in (n, narrow)}
    weights = {width: [base.clone() for _ in range(count)] for width, base in bases.items()}
    rates, fits = [], []
    for rows in _GEMM_ROWS:
        x = torch.randn(rows, k)
        per_call = {}
        for width, set_ in weights.items():
            def one_pass(set_=set_) -> None:
                for w in set_:
                    linear(x, w)

            one_pass()  # prepares each weight's layout for this row count once, as a run does
            per_call[width] = profile_kernel(one_pass, warmup=0, repeats=3, min_sample_ns=0).median_ns / count
        rates.append([rows, 2 * rows * k * n / (per_call[n] * 1e-9)])
        fixed, rate = call_fit((2 * rows * k * narrow, per_call[narrow]), (2 * rows * k * n, per_call[n]))
        fits.append([rows, fixed, rate])
    return rates, fits


def call_fit(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """``(fixed ns, FLOP/s)`` of ``time = fixed + flops / rate`` through two calls' ``(FLOPs,
    ns)``; where the slope does not resolve (the larger call not slower, or a negative fixed
    part: noise), ``(0, the larger call's plain rate)``. Pure."""
    (small_flops, small_ns), (large_flops, large_ns) = small, large
    plain = large_flops / (large_ns * 1e-9)
    if large_ns <= small_ns or large_flops <= small_flops:
        return 0.0, plain
    rate = (large_flops - small_flops) / ((large_ns - small_ns) * 1e-9)
    fixed = small_ns - small_flops / rate * 1e9
    return (fixed, rate) if fixed > 0 else (0.0, plain)


def attention_flops(heads: int, head_dim: int, rows: int, context: int) -> int:
    """FLOPs of causal attention of ``rows`` query rows ending a ``context``-position sequence,
    as Layer 1 counts them (QK^T and PV: ``4 x heads x head_dim`` per attended position)."""
    attended = rows * (context - rows) + rows * (rows + 1) // 2
    return 4 * heads * head_dim * attended


def _attention_rows_rates(torch) -> tuple[list[list[float]], list[list[float]]] | None:
    """``([[rows, FLOP/s], ...], [[rows, fixed ns, FLOP/s], ...])`` of the CPU's prompt-chunk
    attention at each of ``_GEMM_ROWS`` (see the module docstring), or None when this fuel has
    no such kernel to call. The second splits a call (:func:`call_fit`) through the layout and
    one with a quarter of its heads: gathering the cache and building the causal mask cost per
    call, so a model with fewer heads (SmolLM2: 9) runs below the 16-head rate (measured at 128
    rows: 34 GFLOP/s against 44)."""
    try:
        from fuel.jit.paged import prefill_attention
    except ImportError:
        return None
    heads, kv_heads, head_dim = _ATTENTION_LAYOUT
    largest = max(_GEMM_ROWS)
    blocks = -(-largest // _ATTENTION_BLOCK)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    caches = {h: (torch.randn(blocks, _ATTENTION_BLOCK, kv, head_dim),
                  torch.randn(blocks, _ATTENTION_BLOCK, kv, head_dim))
              for h, kv in ((heads, kv_heads), (heads // _NARROW, kv_heads // _NARROW))}
    rates, fits = [], []
    for rows in _GEMM_ROWS:
        lens = torch.tensor([rows], dtype=torch.int32)
        timed = {}
        for h, (k_cache, v_cache) in caches.items():
            q = torch.randn(1, h, rows, head_dim)
            measured = profile_kernel(
                lambda: prefill_attention(q, k_cache, v_cache, table, lens, head_dim ** -0.5,
                                          torch.float32),
                warmup=2, repeats=5, min_sample_ns=2_000_000)
            timed[h] = (attention_flops(h, head_dim, rows, rows), measured.median_ns)
        flops, ns = timed[heads]
        rates.append([rows, flops / (ns * 1e-9)])
        fits.append([rows, *call_fit(timed[heads // _NARROW], timed[heads])])
    return rates, fits


HALVES = ("bf16", "fp16")
"""The 16-bit dtypes whose prompt-chunk curves (rows rates and fits) and by-size stream rates
are probed only when a run or plan asks for that dtype (:func:`cpu_local_spec`)."""


def halves_for(dtype: str) -> tuple[str, ...]:
    """The 16-bit sections a run of ``dtype`` weights (``f32``, ``bf16``, ``f16``, ``stored``)
    prices with: its own 16-bit dtype's; none for f32 or stored weights (their products
    compute in f32)."""
    return {"bf16": ("bf16",), "f16": ("fp16",)}.get(dtype, ())


_PROBING = "probing this machine (cpu-local, once)"


def _describer(task):
    """``step(what)``: the probe's progress bar names the measurement under way."""
    return lambda what: task.update(description=f"{_PROBING}: {what}")


def measure_cpu_local(threads: int | None = None, halves: tuple[str, ...] = HALVES
                      ) -> dict[str, float | int | str]:
    """Run the probes (with ``threads`` torch threads, else torch's default); return the raw
    numbers (see the module docstring): every dtype's peaks and matrix-vector rate, f32's
    rows curve, and the 16-bit sections of ``halves`` (:func:`_measure_halves`)."""
    import torch

    if threads is not None:
        from fuel.kernels.threads import set_threads

        set_threads(threads)

    from fuel.progress import current

    numbers: dict[str, float | int | str] = {}
    m, k, n = _GEMM_SHAPE
    rows, cols = _GEMV_SHAPE
    total = len(_DTYPES) + 5 + len(halves)  # one a dtype, five after them, one a 16-bit section
    with current().task(_PROBING, total=total) as task:
        step = _describer(task)

        llc = _llc_bytes() or 0  # the streamed sets' size (twice it), whatever the dtype order
        for name, torch_name in _DTYPES:
            dtype = getattr(torch, torch_name)
            step(f"{name} matrix product")
            numbers[f"{name}_flops"], gemm_ns = _linear_rate(torch, dtype, m, k, n)
            if name == "fp32":
                step(f"{name} matrix product by rows")
                measured = _linear_rows_rates(torch, dtype, gemm_ns)
                numbers[f"{name}_gemm_rows_flops"] = measured[0] if measured else None
                numbers[f"{name}_gemm_rows_fit"] = measured[1] if measured else None
            # The f32 product is the bandwidth probe: always timed on the full, DRAM-sized weight.
            step(f"{name} matrix-vector product")
            rate, _ = _linear_rate(torch, dtype, 1, cols, rows, shrink=name != "fp32")
            numbers[f"{name}_gemv_flops"] = rate
            if name == "fp32":
                step("weight stream (bandwidth, per-call overhead)")
                kernel = _linear_kernel(torch, dtype)
                bandwidth, per_call, slices, llc = _stream_rates(torch, kernel)
                numbers["bandwidth_bytes_per_s"] = bandwidth
                numbers["bandwidth_by_bytes"] = _stream_by_size(
                    torch, kernel, llc, (_GEMV_SHAPE[0] * _GEMV_SHAPE[1] * 4, bandwidth))
                numbers["launch_overhead_ns"] = per_call
                numbers["stream_note"] = (f"{slices} slices of {rows}x{cols} f32 (LLC "
                                          f"{llc / 2**20:.0f} MiB from sysfs)" if llc else
                                          f"{slices} slices of {rows}x{cols} f32 (LLC unknown)")
            task.advance()

        step("vector rate")
        numbers["vector_flops"] = _vector_flops_per_s(torch)
        task.advance()

        step("prompt-chunk attention by rows")
        measured = _attention_rows_rates(torch)
        numbers["attention_rows_flops"] = measured[0] if measured else None
        numbers["attention_rows_fit"] = measured[1] if measured else None
        task.advance()

        step("streaming copy")
        source = torch.ones(_BANDWIDTH_BYTES // 4)
        target = torch.empty_like(source)
        copy = profile_kernel(lambda: target.copy_(source), warmup=1, repeats=5,
                              min_sample_ns=20_000_000)
        numbers["copy_bytes_per_s"] = 2 * _BANDWIDTH_BYTES / (copy.median_ns * 1e-9)
        task.advance()
        step("cache tier")
        cache_bytes, cache_bandwidth, note = _measure_cache_tier(
            torch, torch.get_num_threads(), float(numbers["copy_bytes_per_s"])
        )
        numbers["cache_bytes"] = cache_bytes
        numbers["cache_bandwidth_bytes_per_s"] = cache_bandwidth
        numbers["cache_note"] = note
        task.advance()

        step("back-to-back call")
        one_a, one_b, one_out = torch.ones(1), torch.ones(1), torch.empty(1)
        tiny = profile_kernel(lambda: torch.add(one_a, one_b, out=one_out), warmup=100, repeats=15)
        numbers["hot_call_ns"] = tiny.median_ns
        # In a step a call costs at least what it costs back to back (a stream that leaves the
        # call's code and data cached adds nothing, and then its difference is noise).
        numbers["launch_overhead_ns"] = max(float(numbers["launch_overhead_ns"]), tiny.median_ns)
        task.advance()
        numbers.update(_measure_halves(torch, halves, llc, step, task.advance))
    numbers["memory_bytes"] = _physical_memory_bytes()
    numbers["torch_threads"] = torch.get_num_threads()
    return numbers


def _half_keys(name: str) -> tuple[str, ...]:
    """The cached numbers a 16-bit dtype's section holds."""
    return (f"{name}_gemm_rows_flops", f"{name}_gemm_rows_fit", "half_bandwidth_by_bytes")


def _measure_halves(torch, halves: tuple[str, ...], llc: int, step=None, advance=None,
                    have: Mapping[str, object] | None = None) -> dict[str, object]:
    """The 16-bit sections: per dtype of ``halves``, the prompt-chunk rows curve and fit
    (:func:`_linear_rows_rates`); once for any, the by-size stream rate of 16-bit weights
    (bf16's kernel, as both 16-bit formats' matrix-vector kernel widens in registers), unless
    ``have`` (the numbers cached already) holds it: a section added later never changes what
    an earlier one measured. They take most of a cold probe (~2 s of ~4 here), and a run of f32
    or stored weights never reads them, so :func:`cpu_local_spec` measures a section the first
    time a run asks for its dtype."""
    m, k, n = _GEMM_SHAPE
    numbers: dict[str, object] = {}
    if have is not None and "half_bandwidth_by_bytes" in have:
        numbers["half_bandwidth_by_bytes"] = have["half_bandwidth_by_bytes"]
    names = dict(_DTYPES)
    for name in halves:
        dtype = getattr(torch, names[name])
        if step is not None:
            step(f"{name} matrix product by rows")
        _, gemm_ns = _linear_rate(torch, dtype, m, k, n)  # the budget check's one call
        measured = _linear_rows_rates(torch, dtype, gemm_ns)
        numbers[f"{name}_gemm_rows_flops"] = measured[0] if measured else None
        numbers[f"{name}_gemm_rows_fit"] = measured[1] if measured else None
        if "half_bandwidth_by_bytes" not in numbers:
            numbers["half_bandwidth_by_bytes"] = _stream_by_size(
                torch, _linear_kernel(torch, torch.bfloat16), llc, dtype=torch.bfloat16)
        if advance is not None:
            advance()
    return numbers


def _spec_from(numbers: dict, fingerprint: str, halves: tuple[str, ...] = HALVES) -> DeviceSpec:
    classes = {"fp32": PeakClass.FP32, "bf16": PeakClass.BF16, "fp16": PeakClass.FP16}
    peaks = {cls: float(numbers[f"{name}_flops"]) for name, cls in classes.items()}
    gemv = {cls: float(numbers[f"{name}_gemv_flops"]) for name, cls in classes.items()}
    curved = {name: cls for name, cls in classes.items() if name == "fp32" or name in halves}
    rows_curves = {cls: tuple((int(r), float(v)) for r, v in numbers[f"{name}_gemm_rows_flops"])
                   for name, cls in curved.items() if numbers.get(f"{name}_gemm_rows_flops")}
    rows_fits = {cls: tuple((int(r), float(f), float(v)) for r, f, v in numbers[f"{name}_gemm_rows_fit"])
                 for name, cls in curved.items() if numbers.get(f"{name}_gemm_rows_fit")}
    attention = tuple((int(r), float(v)) for r, v in numbers.get("attention_rows_flops") or ())
    attention_fit = tuple((int(r), float(f), float(v))
                          for r, f, v in numbers.get("attention_rows_fit") or ())
    by_bytes = tuple((int(b), float(v)) for b, v in numbers.get("bandwidth_by_bytes") or ())
    half_by_bytes = tuple((int(b), float(v))
                          for b, v in (numbers.get("half_bandwidth_by_bytes") if halves else None) or ())
    fits_text = "; ".join(
        f"{c.value} at {r} rows {f / 1e3:.0f} us + {v / 1e9:.0f} GFLOP/s"
        for c, fit in sorted(rows_fits.items(), key=lambda kv: kv[0].value)
        for r, f, v in fit if r == 128) or "not measured"
    heads, kv_heads, head_dim = _ATTENTION_LAYOUT
    probe = f"probed on this machine ({fingerprint}; torch threads={numbers['torch_threads']})"
    m, k, n = _GEMM_SHAPE
    rows, cols = _GEMV_SHAPE
    return DeviceSpec(
        name="cpu-local",
        title="This machine's CPU (probed)",
        kind=DeviceKind.CPU,
        peak_flops=peaks,
        vector_flops=float(numbers["vector_flops"]),
        bandwidth_bytes_per_s=float(numbers["bandwidth_bytes_per_s"]),
        memory_bytes=int(numbers["memory_bytes"]),
        launch_overhead_ns=int(numbers["launch_overhead_ns"]),
        sources={
            "peak_tflops": f"{probe}: the CPU backend's linear kernel at M={m}, K={k}, N={n} per dtype; by rows: the same kernel at M={', '.join(map(str, _GEMM_ROWS))} over {_ROWS_SET_BYTES >> 20} MiB of distinct weights (for {', '.join(sorted(c.value for c in rows_curves)) or 'no dtype'}), and N={n // _NARROW} beside it for a call's fixed cost ({fits_text}); matrix-vector rates: the same kernel at M=1 on a {rows}x{cols} weight; vector rate: slope of in-cache addcmul_ over 8 Ki and 32 Ki elements; attention by rows: {'the prompt-chunk attention (prefill_attention, f32, ' + f'{heads}/{kv_heads} heads of {head_dim}) at as many rows as positions' if attention else 'not measured (no prompt-chunk attention kernel)'}",
            "bandwidth": f"{probe}: bytes read per second by the f32 matrix-vector product streaming {numbers['stream_note']}, twice the last-level cache (a decode step reads its weights once each); by the size of one weight: {', '.join(f'{b / 2**20:.0f} MiB {v / 1e9:.1f} GB/s' for b, v in by_bytes) or 'not measured'} (distinct f32 weights of that size streamed, less a call's fixed cost); bf16/f16 weights: {', '.join(f'{b / 2**20:.1f} MiB {v / 1e9:.1f} GB/s' for b, v in half_by_bytes) or 'not measured'} (bf16 weights, the same way); streaming copy_ of 64 MiB (read + write) runs at {float(numbers['copy_bytes_per_s']) / 1e9:.1f} GB/s",
            "memory": f"{probe}: physical RAM (sysconf)",
            "launch_overhead": f"{probe}: what a one-element torch.add costs right after each streamed weight slice (clocked around the calls, {_CALLS_PER_SLICE} a slice, median over the slices of 3 passes) (a call in a step, caches just flushed; back to back it takes {float(numbers['hot_call_ns']) / 1e3:.1f} us); also the host cost of a view",
            "cache": f"{probe}: {numbers['cache_note']}",
        },
        probed=True,
        cache_bytes=None if numbers["cache_bytes"] is None else int(numbers["cache_bytes"]),
        cache_bandwidth_bytes_per_s=(
            None if numbers["cache_bandwidth_bytes_per_s"] is None
            else float(numbers["cache_bandwidth_bytes_per_s"])
        ),
        gemv_flops=gemv,
        host_call_ns=int(numbers["launch_overhead_ns"]),
        gemm_rows_flops=rows_curves,
        gemm_rows_fit=rows_fits,
        attention_rows_flops=attention,
        attention_rows_fit=attention_fit,
        bandwidth_by_bytes=by_bytes,
        half_bandwidth_by_bytes=half_by_bytes,
    )


_REQUIRED = (
    "fp32_flops",
    "bf16_flops",
    "fp16_flops",
    "fp32_gemv_flops",
    "bf16_gemv_flops",
    "fp16_gemv_flops",
    "fp32_gemm_rows_flops",
    "fp32_gemm_rows_fit",
    "attention_rows_flops",
    "attention_rows_fit",
    "copy_bytes_per_s",
    "vector_flops",
    "bandwidth_bytes_per_s",
    "bandwidth_by_bytes",
    "launch_overhead_ns",
    "hot_call_ns",
    "stream_note",
    "memory_bytes",
    "torch_threads",
    "cache_bytes",
    "cache_bandwidth_bytes_per_s",
    "cache_note",
)


def _read_cache(path: Path, fingerprint: str) -> dict | None:
    """The cached numbers, or None when absent; an unreadable file is reported, then ignored."""
    if not path.exists():
        return None
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        if (
            document.get("format") != CACHE_FORMAT
            or document.get("version") != CACHE_VERSION
            or document.get("fingerprint") != fingerprint
        ):
            raise ValueError("format, version or fingerprint does not match")
        numbers = document["numbers"]
        missing = [key for key in _REQUIRED if key not in numbers]
        if missing:
            raise ValueError(f"missing {missing[0]}")
        return numbers
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OSError) as error:
        warnings.warn(f"{path}: ignoring unreadable cpu-local probe cache ({error}); re-probing")
        return None


def _write_cache(path: Path, text: str) -> None:
    """Cache the probe atomically (a concurrent reader sees the old or the new file). A cache
    folder that cannot be written (read-only, full) costs only the caching: the numbers are
    used for this run and the next run probes again."""
    from fuel.errors import FuelError
    from fuel.inputs import write_atomically

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, text)
    except (OSError, FuelError) as error:
        warnings.warn(f"{path}: cpu-local probe not cached ({error}); using it for this run only")


def cpu_local_spec(*, reprobe: bool = False, threads: int | None = None,
                   halves: tuple[str, ...] = HALVES) -> DeviceSpec:
    """The ``cpu-local`` spec: from the cache, or probed now (and cached) when needed.

    ``threads`` pins torch's thread count for the probe (and keys its own cache entry): a
    measurement campaign run with N threads must be predicted with a probe taken with N.
    ``halves``: the 16-bit dtypes (of :data:`HALVES`) whose prompt-chunk curves the spec
    carries: a section the cache lacks is measured now and added to it. The spec holds exactly
    those sections whatever else the cache holds, so what a run prices does not depend on which
    runs came before it (a run of f32 or stored weights asks for none: its products are f32).
    """
    unknown = [name for name in halves if name not in HALVES]
    if unknown:
        raise ValueError(f"no 16-bit probe section {unknown[0]!r} (one of {', '.join(HALVES)})")
    fingerprint = device_fingerprint("cpu") + "|" + library_versions()
    path = cache_path(threads)
    numbers = None if reprobe else _read_cache(path, fingerprint)
    if numbers is None:
        numbers = measure_cpu_local(threads, halves)
        _write_numbers(path, fingerprint, numbers)
    else:
        missing = tuple(name for name in halves
                        if any(key not in numbers for key in _half_keys(name)))
        if missing:
            numbers = {**numbers, **_measure_missing(numbers, missing)}
            _write_numbers(path, fingerprint, numbers)
    return _spec_from(numbers, fingerprint, halves)


def _write_numbers(path: Path, fingerprint: str, numbers: dict) -> None:
    document = {
        "format": CACHE_FORMAT,
        "version": CACHE_VERSION,
        "fingerprint": fingerprint,
        "numbers": numbers,
    }
    _write_cache(path, json.dumps(document, indent=2, sort_keys=True))


def _measure_missing(numbers: dict, halves: tuple[str, ...]) -> dict[str, object]:
    """The 16-bit sections ``halves`` measured now, with the thread count the cached numbers
    were probed with (the pool is put back as it was)."""
    import torch

    from fuel.kernels.threads import set_threads
    from fuel.progress import current

    before = torch.get_num_threads()
    wanted = int(numbers.get("torch_threads") or before)
    if wanted != before:
        set_threads(wanted)
    try:
        with current().task(_PROBING, total=len(halves)) as task:
            return _measure_halves(torch, halves, _llc_bytes() or 0, _describer(task),
                                   task.advance, numbers)
    finally:
        if wanted != before:
            set_threads(before)


def probe_cpu_local(*, reprobe: bool = True, threads: int | None = None) -> DeviceSpec:
    """Measure this machine now (by default ignoring the cache) and cache the result."""
    return cpu_local_spec(reprobe=reprobe, threads=threads)
