"""Loading device specifications: ``fuel/data/devices.toml`` → :class:`DeviceSpec` values.

Decided here: the file format (``schema = 1``; unknown keys refused; every number needs its
source) and the lookup ``device(name)``. The ``cpu-local`` entry carries no numbers; asking for
it returns the cached probe of this machine (:mod:`fuel.cost.probe`), probing when the cache is
empty or ``reprobe=True``.

Invariants: a malformed file raises one :class:`DeviceSpecError` naming the file, the dotted key
(``device.<name>.<field>``) and the bad value; a spec that loads has finite positive rates, a
positive memory size, a non-negative launch overhead and a source for each of
``peak_tflops``, ``bandwidth``, ``memory`` and ``launch_overhead``. The cache tier
(``cache_mb`` and ``cache_bandwidth_gb_s``) is optional but all-or-nothing: both numbers and a
``sources.cache`` line, or none of them. Devices are returned in name order, never file order.
"""

from __future__ import annotations

import math
import tomllib
from functools import cache
from importlib import resources
from pathlib import Path

from fuel.cost.spec import DeviceKind, DeviceSpec, PeakClass
from fuel.errors import FuelError, InputError

SCHEMA = 1
CPU_LOCAL = "cpu-local"

_DEVICE_KEYS = {
    "title",
    "kind",
    "memory_gb",
    "bandwidth_gb_s",
    "launch_overhead_ns",
    "vector_tflops",
    "peak_tflops",
    "sources",
    "probed",
    "cache_mb",
    "cache_bandwidth_gb_s",
}
_REQUIRED_SOURCES = ("peak_tflops", "bandwidth", "memory", "launch_overhead")
_CACHE_KEYS = ("cache_mb", "cache_bandwidth_gb_s")


class DeviceSpecError(InputError):
    """A device specification file is malformed (file, dotted key, what is wrong)."""


class UnknownDeviceError(FuelError):
    """A device name that no specification defines."""

    def __init__(self, name: str, known: list[str]):
        self.name = name
        self.known = known
        super().__init__(f"unknown device `{name}`; known devices: {', '.join(known)}")


def default_devices_path() -> Path:
    return Path(str(resources.files("fuel") / "data" / "devices.toml"))


def _number(file: str, key: str, value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DeviceSpecError(file, key, f"expected a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        raise DeviceSpecError(file, key, f"expected a finite positive number, got {value!r}")
    return number


def _parse_device(file: str, name: str, body: object) -> DeviceSpec | None:
    """One ``[device.<name>]`` table; None for the probed ``cpu-local`` placeholder."""
    prefix = f"device.{name}"
    if not isinstance(body, dict):
        raise DeviceSpecError(file, prefix, "expected a table")
    unknown = sorted(set(body) - _DEVICE_KEYS)
    if unknown:
        raise DeviceSpecError(file, f"{prefix}.{unknown[0]}", "unknown key")
    title = body.get("title")
    if not isinstance(title, str) or not title:
        raise DeviceSpecError(file, f"{prefix}.title", f"expected a non-empty string, got {title!r}")
    try:
        kind = DeviceKind(body.get("kind"))
    except ValueError:
        choices = ", ".join(k.value for k in DeviceKind)
        raise DeviceSpecError(
            file, f"{prefix}.kind", f"expected one of {choices}, got {body.get('kind')!r}"
        ) from None
    if body.get("probed", False) is True:
        extra = sorted(set(body) - {"title", "kind", "probed"})
        if extra:
            raise DeviceSpecError(
                file, f"{prefix}.{extra[0]}", "a probed device takes its numbers from the probe"
            )
        return None
    for required in ("memory_gb", "bandwidth_gb_s", "launch_overhead_ns", "vector_tflops"):
        if required not in body:
            raise DeviceSpecError(file, f"{prefix}.{required}", "missing")
    memory_gb = _number(file, f"{prefix}.memory_gb", body["memory_gb"])
    bandwidth = _number(file, f"{prefix}.bandwidth_gb_s", body["bandwidth_gb_s"])
    overhead = _number(file, f"{prefix}.launch_overhead_ns", body["launch_overhead_ns"], allow_zero=True)
    vector = _number(file, f"{prefix}.vector_tflops", body["vector_tflops"])
    peaks_body = body.get("peak_tflops")
    if not isinstance(peaks_body, dict) or not peaks_body:
        raise DeviceSpecError(file, f"{prefix}.peak_tflops", "expected a non-empty table")
    peaks: dict[PeakClass, float] = {}
    for klass, value in sorted(peaks_body.items()):
        try:
            peak = PeakClass(klass)
        except ValueError:
            choices = ", ".join(p.value for p in PeakClass)
            raise DeviceSpecError(
                file, f"{prefix}.peak_tflops.{klass}", f"unknown class; expected one of {choices}"
            ) from None
        peaks[peak] = _number(file, f"{prefix}.peak_tflops.{klass}", value) * 1e12
    sources = body.get("sources")
    if not isinstance(sources, dict):
        raise DeviceSpecError(file, f"{prefix}.sources", "expected a table naming each number's source")
    for required in _REQUIRED_SOURCES:
        text = sources.get(required)
        if not isinstance(text, str) or not text.strip():
            raise DeviceSpecError(file, f"{prefix}.sources.{required}", "missing source")
    cache_bytes, cache_bandwidth = _cache_tier(file, prefix, body, sources)
    stray = sorted(set(sources) - set(_REQUIRED_SOURCES) - {"cache"})
    if stray:
        raise DeviceSpecError(file, f"{prefix}.sources.{stray[0]}", "unknown key")
    return DeviceSpec(
        name=name,
        title=title,
        kind=kind,
        peak_flops=peaks,
        vector_flops=vector * 1e12,
        bandwidth_bytes_per_s=bandwidth * 1e9,
        memory_bytes=int(memory_gb * 1e9),
        launch_overhead_ns=int(round(overhead)),
        sources={key: sources[key] for key in (*_REQUIRED_SOURCES, "cache") if key in sources},
        cache_bytes=cache_bytes,
        cache_bandwidth_bytes_per_s=cache_bandwidth,
    )


def _cache_tier(file: str, prefix: str, body: dict, sources: dict) -> tuple[int | None, float | None]:
    """The optional cache tier: (bytes, byte/s), or (None, None) when the device declares none."""
    given = [key for key in _CACHE_KEYS if key in body]
    if not given:
        if "cache" in sources:
            raise DeviceSpecError(file, f"{prefix}.sources.cache", "a source for a cache tier the device does not declare")
        return None, None
    missing = [key for key in _CACHE_KEYS if key not in body]
    if missing:
        raise DeviceSpecError(file, f"{prefix}.{missing[0]}", f"missing (a cache tier needs both {' and '.join(_CACHE_KEYS)})")
    text = sources.get("cache")
    if not isinstance(text, str) or not text.strip():
        raise DeviceSpecError(file, f"{prefix}.sources.cache", "missing source")
    size_mb = _number(file, f"{prefix}.cache_mb", body["cache_mb"])
    bandwidth = _number(file, f"{prefix}.cache_bandwidth_gb_s", body["cache_bandwidth_gb_s"])
    return int(size_mb * 1e6), bandwidth * 1e9


def parse_devices(text: str, file: str) -> tuple[dict[str, DeviceSpec], list[str]]:
    """Parse a devices file: (specs with numbers, names of probed placeholders), both by name."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise DeviceSpecError(file, None, f"not valid TOML: {error}") from None
    # `interconnect` tables are read by fuel.cost.interconnect (links between ranks).
    unknown = sorted(set(document) - {"schema", "device", "interconnect"})
    if unknown:
        raise DeviceSpecError(file, unknown[0], "unknown key")
    if document.get("schema") != SCHEMA:
        raise DeviceSpecError(file, "schema", f"expected {SCHEMA}, got {document.get('schema')!r}")
    devices = document.get("device")
    if not isinstance(devices, dict) or not devices:
        raise DeviceSpecError(file, "device", "expected at least one [device.<name>] table")
    specs: dict[str, DeviceSpec] = {}
    probed: list[str] = []
    for name in sorted(devices):
        spec = _parse_device(file, name, devices[name])
        if spec is None:
            probed.append(name)
        else:
            specs[name] = spec
    return specs, probed


@cache
def _load_default() -> tuple[dict[str, DeviceSpec], tuple[str, ...]]:
    path = default_devices_path()
    specs, probed = parse_devices(path.read_text(encoding="utf-8"), str(path))
    return specs, tuple(probed)


def load_devices(path: Path | None = None) -> dict[str, DeviceSpec]:
    """The datasheet devices (name → spec, in name order); ``cpu-local`` is not among them."""
    if path is None:
        return dict(_load_default()[0])
    specs, _ = parse_devices(Path(path).read_text(encoding="utf-8"), str(path))
    return specs


def device_names() -> list[str]:
    """Every device name ``device()`` accepts, sorted."""
    specs, probed = _load_default()
    return sorted([*specs, *probed])


def device(name: str, *, reprobe: bool = False) -> DeviceSpec:
    """The spec for ``name``; ``cpu-local`` comes from the (cached) probe of this machine."""
    specs, probed = _load_default()
    if name == CPU_LOCAL and name in probed:
        from fuel.cost.probe import cpu_local_spec

        return cpu_local_spec(reprobe=reprobe)
    if name in specs:
        return specs[name]
    raise UnknownDeviceError(name, device_names())
