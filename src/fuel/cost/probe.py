"""The ``cpu-local`` device: this machine's roofline numbers, measured and cached.

Decided here: what is measured and how it becomes a :class:`DeviceSpec`.

- Matrix peaks (fp32, bf16, fp16): the best of a square ``torch.mm`` GEMM (2·n³ FLOP per call).
- Vector rate: an in-cache ``torch.addcmul`` (2 FLOP per element) — elementwise work at its best.
- Bandwidth: a streaming ``copy_`` of a 64 MiB buffer (read + write = 2 × 64 MiB per call),
  far larger than any cache.
- Launch overhead: a one-element ``torch.add`` — the fixed per-call cost every CPU kernel pays
  (Python dispatch, the framework's op launch).
- Memory size: physical RAM.

The result is cached as JSON under ``$FUEL_CACHE_DIR`` (default ``~/.cache/fuel``) in
``devices/cpu-local-<hash>.json``, keyed by the device fingerprint and library versions, so a
new CPU or a new torch probes afresh. ``reprobe=True`` measures again and overwrites. A cache
file that cannot be read is reported (a warning naming the file) and replaced by a new probe.

This module reads the clock and the machine: an edge, never imported by the planning core.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from fuel.cost.paths import cache_dir
from fuel.cost.fingerprint import device_fingerprint, library_versions, short_hash
from fuel.cost.profile import profile_kernel
from fuel.cost.spec import DeviceKind, DeviceSpec, PeakClass

CACHE_FORMAT = "fuel-cpu-local-probe"
CACHE_VERSION = 1
_BANDWIDTH_BYTES = 64 * 1024 * 1024


def cache_path(threads: int | None = None) -> Path:
    """The cache file for this machine and libraries (and an explicit torch thread count)."""
    key = short_hash(device_fingerprint("cpu") + "|" + library_versions())
    suffix = "" if threads is None else f"-t{threads}"
    return cache_dir() / "devices" / f"cpu-local-{key}{suffix}.json"


def _physical_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _gemm_flops_per_s(torch, dtype) -> float:
    """Best GEMM rate for ``dtype``; shrinks the problem if one call is slow (no fast path)."""
    best = 0.0
    for n in (1024, 512):
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        out = torch.empty(n, n, dtype=dtype)
        measured = profile_kernel(
            lambda: torch.mm(a, b, out=out), warmup=1, repeats=5, min_sample_ns=20_000_000
        )
        best = max(best, 2 * n**3 / (measured.median_ns * 1e-9))
        if measured.median_ns < 200_000_000:
            break  # fast enough at this size: the big GEMM is the honest peak
    return best


def measure_cpu_local(threads: int | None = None) -> dict[str, float | int | str]:
    """Run the probes (with ``threads`` torch threads, else torch's default); return the raw
    numbers (see the module docstring)."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)

    numbers: dict[str, float | int | str] = {}
    numbers["fp32_flops"] = _gemm_flops_per_s(torch, torch.float32)
    numbers["bf16_flops"] = _gemm_flops_per_s(torch, torch.bfloat16)
    numbers["fp16_flops"] = _gemm_flops_per_s(torch, torch.float16)

    elements = 32 * 1024  # 3 × 128 KiB: stays in L2, so this is arithmetic, not DRAM
    x, y, z = torch.randn(elements), torch.randn(elements), torch.randn(elements)
    vector = profile_kernel(lambda: z.addcmul_(x, y), warmup=3, repeats=9)
    numbers["vector_flops"] = 2 * elements / (vector.median_ns * 1e-9)

    source = torch.ones(_BANDWIDTH_BYTES // 4)
    target = torch.empty_like(source)
    copy = profile_kernel(lambda: target.copy_(source), warmup=2, repeats=9, min_sample_ns=50_000_000)
    numbers["bandwidth_bytes_per_s"] = 2 * _BANDWIDTH_BYTES / (copy.median_ns * 1e-9)

    one_a, one_b, one_out = torch.ones(1), torch.ones(1), torch.empty(1)
    tiny = profile_kernel(lambda: torch.add(one_a, one_b, out=one_out), warmup=100, repeats=15)
    numbers["launch_overhead_ns"] = tiny.median_ns
    numbers["memory_bytes"] = _physical_memory_bytes()
    numbers["torch_threads"] = torch.get_num_threads()
    return numbers


def _spec_from(numbers: dict, fingerprint: str) -> DeviceSpec:
    peaks = {
        PeakClass.FP32: float(numbers["fp32_flops"]),
        PeakClass.BF16: float(numbers["bf16_flops"]),
        PeakClass.FP16: float(numbers["fp16_flops"]),
    }
    probe = f"probed on this machine ({fingerprint}; torch threads={numbers['torch_threads']})"
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
            "peak_tflops": f"{probe}: best square torch.mm GEMM (n=1024, 512) per dtype",
            "bandwidth": f"{probe}: streaming copy_ of a 64 MiB buffer, 2 x 64 MiB per call",
            "memory": f"{probe}: physical RAM (sysconf)",
            "launch_overhead": f"{probe}: median one-element torch.add call",
        },
        probed=True,
    )


_REQUIRED = (
    "fp32_flops",
    "bf16_flops",
    "fp16_flops",
    "vector_flops",
    "bandwidth_bytes_per_s",
    "launch_overhead_ns",
    "memory_bytes",
    "torch_threads",
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
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        warnings.warn(f"{path}: ignoring unreadable cpu-local probe cache ({error}); re-probing")
        return None


def cpu_local_spec(*, reprobe: bool = False, threads: int | None = None) -> DeviceSpec:
    """The ``cpu-local`` spec: from the cache, or probed now (and cached) when needed.

    ``threads`` pins torch's thread count for the probe (and keys its own cache entry): a
    measurement campaign run with N threads must be predicted with a probe taken with N.
    """
    fingerprint = device_fingerprint("cpu") + "|" + library_versions()
    path = cache_path(threads)
    numbers = None if reprobe else _read_cache(path, fingerprint)
    if numbers is None:
        numbers = measure_cpu_local() if threads is None else measure_cpu_local(threads)
        path.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "format": CACHE_FORMAT,
            "version": CACHE_VERSION,
            "fingerprint": fingerprint,
            "numbers": numbers,
        }
        temporary = path.with_suffix(f".tmp{os.getpid()}")
        temporary.write_text(json.dumps(document, indent=2, sort_keys=True), encoding="utf-8")
        temporary.replace(path)  # atomic: a concurrent reader sees the old or the new file
    return _spec_from(numbers, fingerprint)


def probe_cpu_local(*, reprobe: bool = True, threads: int | None = None) -> DeviceSpec:
    """Measure this machine now (by default ignoring the cache) and cache the result."""
    return cpu_local_spec(reprobe=reprobe, threads=threads)
