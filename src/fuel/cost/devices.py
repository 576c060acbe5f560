"""Loading device specifications: ``fuel/data/devices.toml`` → :class:`DeviceSpec` values.

Decided here: the file format (``schema = 1``; unknown keys refused; every number needs its
source) and the lookup ``device(name)``. The ``cpu-local`` entry carries no numbers; asking for
it returns the cached probe of this machine (:mod:`fuel.cost.probe`), probing when the cache is
empty or ``reprobe=True``. The format is stated as pydantic models (:mod:`fuel.schema`).

Invariants: a malformed file raises one :class:`DeviceSpecError` naming the file, the dotted key
(``device.<name>.<field>``) and the bad value; a spec that loads has finite positive rates, a
positive memory size, a non-negative launch overhead and a source for each of
``peak_tflops``, ``bandwidth``, ``memory`` and ``launch_overhead``. The cache tier
(``cache_mb`` and ``cache_bandwidth_gb_s``) is optional but all-or-nothing: both numbers and a
``sources.cache`` line, or none of them. Devices are returned in name order, never file order.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from fuel.cost.spec import DeviceKind, DeviceSpec, PeakClass
from fuel.errors import FuelError, InputError
from fuel.schema import Invalid, Schema, Text, validate

SCHEMA = 1
CPU_LOCAL = "cpu-local"

Positive = Annotated[float, Field(gt=0)]


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


class _Sources(Schema):
    peak_tflops: Text
    bandwidth: Text
    memory: Text
    launch_overhead: Text
    cache: Text | None = None


class _Probed(Schema):
    """The ``cpu-local`` placeholder: its numbers come from the probe."""

    title: Text
    kind: Annotated[DeviceKind, Field(strict=False)]
    probed: Literal[True]


class _Datasheet(Schema):
    title: Text
    kind: Annotated[DeviceKind, Field(strict=False)]
    probed: Literal[False] = False
    memory_gb: Positive
    bandwidth_gb_s: Positive
    launch_overhead_ns: Annotated[float, Field(ge=0)]
    vector_tflops: Positive
    peak_tflops: Annotated[dict[Annotated[PeakClass, Field(strict=False)], Positive], Field(min_length=1)]
    sources: _Sources
    cache_mb: Positive | None = None
    cache_bandwidth_gb_s: Positive | None = None

    @model_validator(mode="after")
    def _cache_tier_is_all_or_nothing(self) -> _Datasheet:
        given = [self.cache_mb is not None, self.cache_bandwidth_gb_s is not None]
        if any(given) and not all(given):
            missing = "cache_bandwidth_gb_s" if given[0] else "cache_mb"
            raise Invalid("missing (a cache tier needs both cache_mb and cache_bandwidth_gb_s)", missing)
        if any(given) and self.sources.cache is None:
            raise Invalid("missing source", "sources.cache")
        if not any(given) and self.sources.cache is not None:
            raise Invalid("a source for a cache tier the device does not declare", "sources.cache")
        return self

    def spec(self, name: str) -> DeviceSpec:
        return DeviceSpec(
            name=name, title=self.title, kind=self.kind,
            peak_flops={klass: value * 1e12 for klass, value in sorted(
                self.peak_tflops.items(), key=lambda item: item[0].value)},
            vector_flops=self.vector_tflops * 1e12,
            bandwidth_bytes_per_s=self.bandwidth_gb_s * 1e9,
            memory_bytes=int(self.memory_gb * 1e9),
            launch_overhead_ns=int(round(self.launch_overhead_ns)),
            sources=self.sources.model_dump(exclude_none=True),
            cache_bytes=None if self.cache_mb is None else int(self.cache_mb * 1e6),
            cache_bandwidth_bytes_per_s=(None if self.cache_bandwidth_gb_s is None
                                         else self.cache_bandwidth_gb_s * 1e9),
        )


class _File(Schema):
    # `interconnect` tables are read by fuel.cost.interconnect (links between ranks).
    schema_: Literal[1] = Field(alias="schema")
    device: Annotated[dict[str, dict[str, Any]], Field(min_length=1)]
    interconnect: Any = None


def parse_devices(text: str, file: str) -> tuple[dict[str, DeviceSpec], list[str]]:
    """Parse a devices file: (specs with numbers, names of probed placeholders), both by name."""
    from fuel.inputs import parse_toml

    def fail(key: str | None, detail: str) -> DeviceSpecError:
        return DeviceSpecError(file, key, detail)

    document = validate(_File, parse_toml(text, lambda detail: fail(None, detail)), fail)
    specs: dict[str, DeviceSpec] = {}
    probed: list[str] = []
    for name in sorted(document.device):
        body = document.device[name]
        if body.get("probed") is True:
            validate(_Probed, body, fail, f"device.{name}")
            probed.append(name)
        else:
            specs[name] = validate(_Datasheet, body, fail, f"device.{name}").spec(name)
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


def device(name: str, *, reprobe: bool = False, halves: tuple[str, ...] | None = None) -> DeviceSpec:
    """The spec for ``name``; ``cpu-local`` comes from the (cached) probe of this machine, with
    the prompt-chunk curves of the 16-bit dtypes in ``halves`` (``bf16``, ``fp16``; None: both),
    each probed the first time one is asked for (:func:`fuel.cost.probe.cpu_local_spec`)."""
    specs, probed = _load_default()
    if name == CPU_LOCAL and name in probed:
        from fuel.cost.probe import HALVES, cpu_local_spec

        return cpu_local_spec(reprobe=reprobe, halves=HALVES if halves is None else halves)
    if name in specs:
        return specs[name]
    raise UnknownDeviceError(name, device_names())
