"""Interconnects and the Layer-1 price of a collective (SPEC §I).

Decides (1) what ``[interconnect.<name>]`` tables in ``fuel/data/devices.toml`` may say — unknown
keys refused, every number with its source — and which interconnect a device's GPUs use by
default; (2) how long one collective takes: NCCL's own cost model (``src/graph/tuning.cc``:
time = latency + bytes / algorithm bandwidth), for the low-latency protocol decode-sized
messages use:

- ring ``all_reduce`` of ``B`` bytes per rank over ``p`` ranks: ``2(p-1)`` steps, each
  ``B/p`` bytes on the slowest link, so ``2(p-1)/p * B / bw``; latency ``base_ring +
  steps x hop`` (steps across servers at the network's hop latency);
- tree ``all_reduce``: ``2B / bw`` (NCCL converts tree bus bandwidth at 0.5), latency
  ``base_tree + 2((p/nodes - 1) hop_intra + log2(nodes) hop_inter)``; the cheaper of ring and
  tree is taken, as NCCL's tuner does;
- ``all_gather`` of a ``B``-byte slice and ``reduce_scatter`` of a ``B``-byte buffer: ``p-1``
  steps moving ``(p-1) B`` and ``(p-1)/p B`` bytes;
- ``send``/``recv`` of ``B`` bytes: one hop, ``B / bw``, plus the ring base latency.

Invariants: every price is finite and non-negative; one rank costs nothing; a collective over
servers (``nodes > 1``) without an inter-node interconnect is a :class:`NoInterconnect` value,
never a guess. Pure except :func:`load_interconnects` (the loading edge).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from enum import Enum
from functools import cache
from pathlib import Path

from fuel.errors import InputError

BASE_LATENCY_NS = {"ring": 6600.0, "tree": 6800.0}
BASE_LATENCY_SOURCE = ("NVIDIA NCCL src/graph/tuning.cc baseLat, LL protocol: Ring 6.6 us, "
                       "Tree 6.8 us (v2.19.4, as copied into aws-ofi-nccl's tuner model)")

_KEYS = {"title", "scope", "bandwidth_gb_s", "hop_latency_us", "devices", "sources"}
_SOURCES = ("bandwidth", "latency")


class InterconnectError(InputError):
    """A malformed ``[interconnect.*]`` table (file, dotted key, what is wrong)."""


class Scope(Enum):
    INTRA_NODE = "intra_node"
    INTER_NODE = "inter_node"


@dataclass(frozen=True, slots=True)
class Interconnect:
    name: str
    title: str
    scope: Scope
    bandwidth_bytes_per_s: float
    hop_latency_ns: float
    devices: tuple[str, ...]
    sources: dict[str, str]


@dataclass(frozen=True, slots=True)
class NoInterconnect:
    """Why a collective has no price (decline-as-value)."""

    reason: str


@dataclass(frozen=True, slots=True)
class CollectiveCost:
    """One collective's price: the algorithm chosen, its fixed latency and its transfer time."""

    op: str
    bytes: int
    ranks: int
    algorithm: str
    latency_ns: float
    transfer_ns: float

    @property
    def ns(self) -> float:
        return self.latency_ns + self.transfer_ns


def _parse(file: str, name: str, body: object) -> Interconnect:
    key = f"interconnect.{name}"
    if not isinstance(body, dict):
        raise InterconnectError(file, key, "expected a table")
    unknown = sorted(set(body) - _KEYS)
    if unknown:
        raise InterconnectError(file, f"{key}.{unknown[0]}", "unknown key")
    try:
        scope = Scope(body.get("scope"))
    except ValueError:
        raise InterconnectError(file, f"{key}.scope", f"expected intra_node or inter_node, got "
                                                      f"{body.get('scope')!r}") from None
    numbers = {}
    for field in ("bandwidth_gb_s", "hop_latency_us"):
        value = body.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value > 0):
            raise InterconnectError(file, f"{key}.{field}", f"expected a finite positive number, "
                                                            f"got {value!r}")
        numbers[field] = float(value)
    devices = body.get("devices", [])
    if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
        raise InterconnectError(file, f"{key}.devices", "expected a list of device names")
    sources = body.get("sources")
    if not isinstance(sources, dict):
        raise InterconnectError(file, f"{key}.sources", "expected a table naming each number's source")
    for field in _SOURCES:
        if not isinstance(sources.get(field), str) or not sources[field].strip():
            raise InterconnectError(file, f"{key}.sources.{field}", "missing source")
    stray = sorted(set(sources) - set(_SOURCES))
    if stray:
        raise InterconnectError(file, f"{key}.sources.{stray[0]}", "unknown key")
    title = body.get("title")
    if not isinstance(title, str) or not title:
        raise InterconnectError(file, f"{key}.title", f"expected a non-empty string, got {title!r}")
    return Interconnect(name, title, scope, numbers["bandwidth_gb_s"] * 1e9,
                        numbers["hop_latency_us"] * 1e3, tuple(devices), dict(sources))


def parse_interconnects(text: str, file: str) -> dict[str, Interconnect]:
    document = tomllib.loads(text)
    tables = document.get("interconnect", {})
    if not isinstance(tables, dict):
        raise InterconnectError(file, "interconnect", "expected [interconnect.<name>] tables")
    out = {name: _parse(file, name, tables[name]) for name in sorted(tables)}
    seen: dict[str, str] = {}
    for link in out.values():
        for device in link.devices:
            if device in seen:
                raise InterconnectError(file, f"interconnect.{link.name}.devices",
                                        f"device `{device}` is already served by `{seen[device]}`")
            seen[device] = link.name
    return out


@cache
def _default() -> dict[str, Interconnect]:
    from fuel.cost.devices import default_devices_path

    path = default_devices_path()
    return parse_interconnects(Path(path).read_text(encoding="utf-8"), str(path))


def load_interconnects() -> dict[str, Interconnect]:
    """Every interconnect of the built-in devices file, by name."""
    return dict(_default())


def interconnect(name: str) -> Interconnect:
    links = _default()
    if name not in links:
        raise InputError("--interconnect", "interconnect",
                         f"unknown interconnect `{name}`; known: {', '.join(links)}")
    return links[name]


def default_intra_node(device: str) -> Interconnect | NoInterconnect:
    """The link between a device's GPUs in one server, where the devices file names one."""
    for link in _default().values():
        if device in link.devices:
            return link
    return NoInterconnect(f"devices.toml names no interconnect between `{device}` GPUs; pass "
                          "--interconnect (e.g. pcie4, pcie5, nvlink4)")


# ------------------------------------------------------------------------------------ pricing


def collective_cost(op: str, bytes_per_rank: int, ranks: int, intra: Interconnect,
                    inter: Interconnect | None = None, nodes: int = 1
                    ) -> CollectiveCost | NoInterconnect:
    """The price of one collective ``op`` (``all_reduce``, ``ep_reduce``, ``all_gather``,
    ``reduce_scatter``, ``send``, ``recv``) where each rank contributes ``bytes_per_rank``,
    over ``ranks`` ranks spread over ``nodes`` servers."""
    if ranks <= 1 and op not in ("send", "recv"):
        return CollectiveCost(op, bytes_per_rank, ranks, "local", 0.0, 0.0)
    if nodes > 1 and inter is None:
        return NoInterconnect(f"{op} spans {nodes} servers but no inter-node interconnect is set")
    links = [intra] + ([inter] if nodes > 1 and inter is not None else [])
    bw = min(link.bandwidth_bytes_per_s for link in links)
    hop_intra = intra.hop_latency_ns
    hop_inter = inter.hop_latency_ns if nodes > 1 and inter is not None else hop_intra
    p, b = ranks, float(bytes_per_rank)

    def ring(steps: int, inter_steps: int, moved: float) -> CollectiveCost:
        latency = BASE_LATENCY_NS["ring"] + (steps - inter_steps) * hop_intra + inter_steps * hop_inter
        return CollectiveCost(op, bytes_per_rank, ranks, "ring", latency, moved / bw * 1e9)

    if op in ("all_reduce", "ep_reduce"):
        by_ring = ring(2 * (p - 1), 2 * (nodes - 1), 2 * (p - 1) / p * b)
        per_node = max(1, p // max(nodes, 1))
        tree_latency = BASE_LATENCY_NS["tree"] + 2 * ((per_node - 1) * hop_intra
                                                      + math.log2(max(nodes, 1)) * hop_inter)
        by_tree = CollectiveCost(op, bytes_per_rank, ranks, "tree", tree_latency, 2 * b / bw * 1e9)
        return min((by_ring, by_tree), key=lambda c: (c.ns, c.algorithm))
    if op == "all_gather":
        return ring(p - 1, nodes - 1, (p - 1) * b)
    if op == "reduce_scatter":
        return ring(p - 1, nodes - 1, (p - 1) / p * b)
    if op in ("send", "recv"):
        return CollectiveCost(op, bytes_per_rank, ranks, "p2p",
                              BASE_LATENCY_NS["ring"] + hop_inter, b / bw * 1e9)
    return NoInterconnect(f"`{op}` is not a collective fuel prices")


__all__ = [
    "BASE_LATENCY_NS", "BASE_LATENCY_SOURCE", "CollectiveCost", "Interconnect",
    "InterconnectError", "NoInterconnect", "Scope", "collective_cost", "default_intra_node",
    "interconnect", "load_interconnects", "parse_interconnects",
]
