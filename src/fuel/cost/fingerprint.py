"""Who measured: the device fingerprint and library versions a measurement is keyed by.

Decided here: a measurement is only ever served back on the same hardware (CPU model, logical
core count, architecture; for CUDA also the GPU name and driver) running the same kernel
libraries (torch, numpy versions) and the same kernels of fuel's own (the digest of their
sources, C and Python: :func:`kernel_sources_digest`). Both are plain strings so they key a
SQLite row and survive a JSON export. This module reads the machine (an edge); nothing in the planning core calls it.

Reading versions uses package metadata, never an import, so ``fuel judge show`` stays fast.
"""

from __future__ import annotations

import hashlib
import os
import platform
from functools import cache
from importlib import metadata
from pathlib import Path

# The libraries whose versions change what a kernel costs.
KERNEL_LIBRARIES = ("torch", "numpy")


def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown-cpu"


@cache
def library_versions() -> str:
    """``torch=2.13.0;numpy=2.1.0;fuel-kernels=<digest>`` (a missing library is spelled
    ``name=absent``; fuel's own kernels by their sources' digest)."""
    parts = []
    for name in KERNEL_LIBRARIES:
        try:
            parts.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name}=absent")
    parts.append(f"fuel-kernels={kernel_sources_digest()}")
    return ";".join(parts)


KERNEL_SOURCES = (("kernels", "**/*.py"), ("kernels", "native/*.c"), ("jit", "*.py"))
"""The sources of the kernels fuel itself contributes to a measurement, as (folder under the
package, glob): the torch bindings and weight conversions (``fuel/kernels``), the native C
library, and the synthesizers and the runners of what they answer (``fuel/jit``)."""


@cache
def kernel_sources_digest(root: str | None = None) -> str:
    """The first 12 hex of SHA-256 over fuel's kernel sources (:data:`KERNEL_SOURCES`, under the
    package folder, or ``root``): a measurement stands only for the code that was measured, so
    a changed kernel, in C or in Python, is measured again (fuel's own library, versioned by its
    sources; torch and numpy by their versions)."""
    import hashlib
    from pathlib import Path

    base = Path(root) if root is not None else Path(__file__).resolve().parent.parent
    paths = sorted({path for folder, pattern in KERNEL_SOURCES
                    for path in (base / folder).glob(pattern) if "__pycache__" not in path.parts})
    digest = hashlib.sha256()
    for path in paths:
        digest.update(str(path.relative_to(base)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def _cuda_identity() -> str:
    import torch  # only a CUDA fingerprint needs torch; a CPU one never imports it

    if not torch.cuda.is_available():
        return "cuda=unavailable"
    name = torch.cuda.get_device_name(0)
    driver = getattr(torch.version, "cuda", None) or "unknown"
    return f"gpu={name};cuda={driver}"


@cache
def device_fingerprint(backend: str = "cpu") -> str:
    """A stable identity for the hardware ``backend`` runs on here.

    The CPU part always appears (host-side launch cost depends on it); the CUDA part is added for
    the ``cuda`` backend.
    """
    parts = [
        f"backend={backend}",
        f"cpu={cpu_model()}",
        f"arch={platform.machine()}",
        f"cores={os.cpu_count()}",
    ]
    if backend == "cuda":
        parts.append(_cuda_identity())
    return ";".join(parts)


def short_hash(text: str) -> str:
    """12 hex digits naming ``text`` (for cache file names)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
