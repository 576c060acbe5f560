"""The route picker: which arm each live branch takes, from live memory and load (SPEC §D).

Decides, at dispatch time, the arm of every branch optimize_graph left live — placement branches
(arms on different devices) and Pareto-retained variants (arms on one device, kept by the bake
with ``pareto_retention``). Nothing else is decided here: baked variants are already collapsed.

For each arm a key, smallest wins:

``(pressure tier, load tier, latency ns, arm index)``

- *pressure* from :func:`would_fit` of the bytes the arm needs on its device (its interior's
  outputs plus the values copied in): won't fit → the arm is skipped; tight (the device would be
  more than 85% full) → 1; comfortable or unknown → 0.
- *load* from pending work vs capacity: idle or unknown → 0, busy → 1, saturated → 2.
- *latency*: the arm's price (the Judge per node where measured, Layer 1 otherwise, on the
  arm's device spec) plus the inbound transfer of its residency copies at the device's inbound
  bandwidth; an arm that cannot be priced sorts after every priced one.
- the arm index breaks ties toward the plan's order (arm 0, the oracle, first).

If every arm won't fit, or no device reports any signal, the branch takes arm 0. The route lists
only branches taking an arm other than 0 (an empty route = every branch at arm 0).

:class:`RoutePicker` caches the route under a key of each device's free memory bucket (powers of
16: ``floor(log16(free bytes))``) and load tier; it re-resolves only when a device moves to
another bucket or tier, and counts hits and resolves.

Signal providers (edges: they read the machine): :class:`CpuSignals` (``/proc/meminfo``'s
available memory, the load average against the core count), :class:`CudaSignals`
(``torch.cuda.mem_get_info``, only when CUDA is available) and :class:`FakeSignals` for tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Protocol

from fuel.cost.roofline import SATURATED_NS
from fuel.cost.spec import DeviceSpec
from fuel.graph.branch import arm_interiors
from fuel.graph.dtype import BackendId, Device
from fuel.graph.ir import Graph, NodeId

TIGHT_FRACTION = 0.85
"""A device more than this full after placing an arm is under pressure."""


class Fit(Enum):
    WONT_FIT = "won't fit"
    TIGHT = "tight"
    COMFORTABLE = "comfortable"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class DeviceSignals:
    """What a device reports now; any field may be unknown (None)."""

    device: Device
    free_bytes: int | None = None
    total_bytes: int | None = None
    pending: int | None = None
    """Work items queued or running."""
    capacity: int | None = None
    """Work items it runs at once (cores for the CPU, streams for a GPU)."""
    inbound_bytes_per_s: float | None = None
    """How fast values arrive on this device from another one."""

    def would_fit(self, needed: int | None) -> Fit:
        """Whether ``needed`` more bytes fit: won't fit, tight (over 85% full after), or
        comfortable; unknown when free memory or the need is unknown."""
        if self.free_bytes is None or needed is None:
            return Fit.UNKNOWN
        if needed > self.free_bytes:
            return Fit.WONT_FIT
        if self.total_bytes:
            used_after = self.total_bytes - self.free_bytes + needed
            return Fit.TIGHT if used_after > TIGHT_FRACTION * self.total_bytes else Fit.COMFORTABLE
        return Fit.TIGHT if needed > TIGHT_FRACTION * self.free_bytes else Fit.COMFORTABLE

    def load_tier(self) -> int:
        if not self.pending or not self.capacity:
            return 0
        return 2 if self.pending >= self.capacity else 1


class SignalProvider(Protocol):
    def signals(self, device: Device) -> DeviceSignals | None: ...


def would_fit(signals: DeviceSignals | None, needed: int | None) -> Fit:
    return Fit.UNKNOWN if signals is None else signals.would_fit(needed)


_PRESSURE = {Fit.TIGHT: 1, Fit.COMFORTABLE: 0, Fit.UNKNOWN: 0}


@dataclass(frozen=True, slots=True)
class ArmChoice:
    """One arm as the picker saw it (``key`` None: skipped because it won't fit)."""

    arm: int
    device: Device | None
    needed_bytes: int | None
    fit: Fit
    latency_ns: int | None
    transfer_ns: int | None
    key: tuple[int, int, int, int] | None


@dataclass(frozen=True, slots=True)
class RouteChoice:
    branch: NodeId
    arm: int
    reason: str
    arms: tuple[ArmChoice, ...]


@dataclass(frozen=True, slots=True)
class Route:
    """The arms to take (only branches not at arm 0) and how each branch was chosen."""

    arms: Mapping[NodeId, int]
    choices: tuple[RouteChoice, ...]


@dataclass(frozen=True)
class PickerPricing:
    """How the picker prices an arm: a device spec per device, the kernel table, the Judge,
    symbol capacities."""

    specs: Mapping[Device, DeviceSpec]
    table: object | None = None
    judge: object | None = None
    symbols: Mapping[str, int] = field(default_factory=dict)



def _arm_latency(graph: Graph, branch: NodeId, arm: int, device: Device | None,
                 pricing: PickerPricing | None) -> int | None:
    from fuel.optimize.providers import Pricing, price_arm
    from fuel.optimize.variant_bake import ArmPrice

    if pricing is None or device is None or device not in pricing.specs:
        return None
    priced = price_arm(graph, branch, arm, Pricing(pricing.specs[device], pricing.table,
                                                   pricing.symbols, backend=device.backend),
                       pricing.judge)
    return priced.ns if isinstance(priced, ArmPrice) else None


def pick_route(optimized, graph: Graph, signals: SignalProvider | None,
               pricing: PickerPricing | None = None) -> Route:
    """Choose an arm for every live branch of ``optimized`` (see the module docstring)."""
    from fuel.optimize.variant_bake import arm_location

    symbols = pricing.symbols if pricing is not None else {}
    arms_taken: dict[NodeId, int] = {}
    choices: list[RouteChoice] = []
    for decision in optimized.live_branches():
        branch = decision.branch
        exits = graph.node(branch).inputs
        interiors = arm_interiors(graph, branch)
        devices = [arm_location(graph, exit) for exit in exits]
        reports = {d: signals.signals(d) for d in dict.fromkeys(devices)
                   if signals is not None and d is not None}
        if not any(r is not None for r in reports.values()):
            choices.append(RouteChoice(branch, 0, "no signals: arm 0", ()))
            continue
        copies = {}
        for copy in optimized.residency:
            if copy.branch == branch:
                copies.setdefault(copy.arm, []).append(copy)
        arms: list[ArmChoice] = []
        for arm, (exit, device, interior) in enumerate(zip(exits, devices, interiors)):
            report = reports.get(device)
            inbound = [c.bytes for c in copies.get(arm, ())]
            own = [graph.value_bytes(n, symbols) for n in interior]
            parts = own + inbound
            needed = None if any(p is None for p in parts) else sum(parts)
            fit = would_fit(report, needed)
            latency = _arm_latency(graph, branch, arm, device, pricing)
            transfer = 0
            if inbound:
                rate = report.inbound_bytes_per_s if report is not None else None
                known = None not in inbound and rate
                transfer = -(-sum(inbound) * 10**9 // int(rate)) if known else None
            if fit is Fit.WONT_FIT:
                arms.append(ArmChoice(arm, device, needed, fit, latency, transfer, None))
                continue
            total = (SATURATED_NS if latency is None or transfer is None
                     else min(latency + transfer, SATURATED_NS))
            load = report.load_tier() if report is not None else 0
            arms.append(ArmChoice(arm, device, needed, fit, latency, transfer,
                                  (_PRESSURE[fit], load, total, arm)))
        candidates = [a for a in arms if a.key is not None]
        if not candidates:
            choices.append(RouteChoice(branch, 0, "no arm fits: arm 0", tuple(arms)))
            continue
        best = min(candidates, key=lambda a: a.key)
        reason = f"key {best.key} smallest"
        choices.append(RouteChoice(branch, best.arm, reason, tuple(arms)))
        if best.arm:
            arms_taken[branch] = best.arm
    return Route(dict(sorted(arms_taken.items())), tuple(choices))


def memory_bucket(free_bytes: int | None) -> int:
    """``floor(log16(free))`` exactly (-1 for unknown or zero)."""
    if not free_bytes or free_bytes < 0:
        return -1
    return (free_bytes.bit_length() - 1) // 4


class RoutePicker:
    """:func:`pick_route` behind a cache keyed on each device's memory bucket and load tier."""

    def __init__(self, optimized, graph: Graph, devices: Iterable[Device],
                 pricing: PickerPricing | None = None):
        self.optimized, self.graph, self.pricing = optimized, graph, pricing
        self.devices = tuple(dict.fromkeys(devices))
        self.hits = 0
        self.resolves = 0
        self._key: tuple | None = None
        self._route: Route | None = None

    def route(self, signals: SignalProvider | None) -> Route:
        reports = [signals.signals(d) if signals is not None else None for d in self.devices]
        key = tuple((memory_bucket(r.free_bytes), r.load_tier()) if r is not None else None
                    for r in reports)
        if self._route is not None and key == self._key:
            self.hits += 1
            return self._route
        self.resolves += 1
        self._key, self._route = key, pick_route(self.optimized, self.graph, signals, self.pricing)
        return self._route


@dataclass
class FakeSignals:
    """Injected signals for tests: set ``reports[device]`` and the picker reads it."""

    reports: dict[Device, DeviceSignals] = field(default_factory=dict)

    def signals(self, device: Device) -> DeviceSignals | None:
        return self.reports.get(device)


def _meminfo(path: Path = Path("/proc/meminfo")) -> tuple[int | None, int | None]:
    try:
        text = path.read_text()
    except OSError:
        return None, None
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[name] = int(parts[0]) * (1024 if parts[-1] == "kB" else 1)
    return values.get("MemAvailable"), values.get("MemTotal")


class CpuSignals:
    """The host: available memory from ``/proc/meminfo``, load average against the cores."""

    def __init__(self, meminfo: Path = Path("/proc/meminfo")):
        self.meminfo = meminfo

    def signals(self, device: Device) -> DeviceSignals | None:
        if device.backend is not BackendId.CPU:
            return None
        free, total = _meminfo(self.meminfo)
        try:
            pending = round(os.getloadavg()[0])
        except OSError:
            pending = None
        return DeviceSignals(device, free, total, pending, os.cpu_count())


class CudaSignals:
    """A CUDA device: free and total memory from ``torch.cuda.mem_get_info`` (None without
    CUDA). Load and inbound bandwidth are not reported (unknown)."""

    def signals(self, device: Device) -> DeviceSignals | None:
        if device.backend is not BackendId.CUDA:
            return None
        import torch

        if not torch.cuda.is_available() or device.index >= torch.cuda.device_count():
            return None
        free, total = torch.cuda.mem_get_info(device.index)
        return DeviceSignals(device, int(free), int(total))


class SystemSignals:
    """The CPU and CUDA providers together."""

    def __init__(self) -> None:
        self._providers = (CpuSignals(), CudaSignals())

    def signals(self, device: Device) -> DeviceSignals | None:
        for provider in self._providers:
            report = provider.signals(device)
            if report is not None:
                return report
        return None
