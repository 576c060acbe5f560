"""The decision record: what optimize_graph decided at each branch, with the numbers it saw.

Decides the vocabulary of explanations. Every branch the bake meets yields one
:class:`Decision` (its kind, every arm with its cost and where that cost came from, the winner
and the reason); every fused node lowered to its recipe because no kernel could run it yields a
:class:`Lowering`; every pathfinder offer or refusal yields an :class:`Offer`. ``fuel explain``
prints these and nothing else, so what it shows is exactly what was decided.

Invariants: values are frozen; costs are integer nanoseconds or ``None`` (unknown, never 0 as a
stand-in); a decision's ``winner`` is an arm index that exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from fuel.graph.dtype import Device
from fuel.graph.ir import NodeId
from fuel.pickling import fast_pickle


class BranchKind(Enum):
    """What a branch's arms differ in."""

    VARIANT = "variant"
    """Every arm on one device: different implementations, baked at optimize time by cost."""
    PLACEMENT = "placement"
    """Arms on two or more devices: left live for the runtime route picker."""
    UNSTAMPED = "unstamped"
    """An arm exit without a backend stamp: nothing is known about where it runs; skipped."""


class Reason(Enum):
    """Why a branch ended where it did."""

    CHEAPER = "cheaper"
    """The unique variant strictly cheaper than arm 0 (by more than the margin) won."""
    NOT_CHEAPER = "arm 0 cheapest"
    """No variant beat arm 0."""
    TIE = "tie"
    """A variant tied arm 0, or two variants tied for cheapest: arm 0 (the oracle) stands."""
    UNKNOWN_COST = "unknown cost"
    """No variant could be priced: arm 0 stands."""
    KERNEL_UNAVAILABLE = "kernel unavailable"
    """The variants that could win have no kernel on the placed device: arm 0 stands."""
    WITHIN_MARGIN = "within margin"
    """The cheapest variant beat arm 0 by no more than ``min_margin``: arm 0 stands."""
    BELOW_PRECISION = "below required precision"
    """The cheaper variant's precision guarantee is weaker than the policy requires."""
    ARM0_UNPRICED = "arm 0 unpriceable"
    """Arm 0 itself could not be priced: the branch is left exactly as it is."""
    PLACEMENT_LIVE = "placement left live"
    """A placement branch: the route picker chooses at run time."""
    UNSTAMPED = "unstamped"
    """Not every arm is stamped with a backend: the branch is left as it is."""


class CostSource(Enum):
    """Where an arm's nanoseconds came from."""

    LAYER1 = "layer1"
    JUDGE = "judge"
    MIXED = "judge+layer1"
    """Some interior nodes measured by the Judge, the rest priced by Layer 1."""
    GIVEN = "given"
    """An opaque cost function (``bake_variant_branches``' ``arm_cost``)."""


@fast_pickle
@dataclass(frozen=True, slots=True)
class ArmRecord:
    """One arm as the bake saw it: its exit, device, price (or why it has none)."""

    arm: int
    exit: NodeId
    label: str
    device: Device | None
    cost_ns: int | None
    source: CostSource | None
    declined: str | None = None
    """Why the arm has no usable price (unknown cost, kernel unavailable, ...), else None."""
    dispatch_ns: int = 0
    """Of ``cost_ns``, the host calls the arm costs the program by taking away its one-call
    step list (``optimize.dispatch_charges``); 0 when it does not."""


@fast_pickle
@dataclass(frozen=True, slots=True)
class Decision:
    """One branch: its kind, its arms, the winner and why."""

    branch: NodeId
    kind: BranchKind
    arms: tuple[ArmRecord, ...]
    winner: int
    reason: Reason
    margin: float | None = None
    """The winner's (or best variant's) relative saving over arm 0, where both were priced."""
    collapsed: bool = False
    """True when the graph was mutated: the branch now routes only to ``winner``."""
    retained: bool = False
    """Pareto retention kept the arms live; ``winner`` is the default route, not a bake."""


@fast_pickle
@dataclass(frozen=True, slots=True)
class Lowering:
    """A fused node with no kernel on the pinned backend, replaced by its recipe (arm 0)."""

    node: NodeId
    op: str
    root: NodeId | None
    """The emitted region's root, or None when the recipe could not be emitted."""
    reason: str
    jit_request: object | None = None
    """The carrier's :class:`~fuel.jit.JitRequest` for the node, or None when it declined."""


@fast_pickle
@dataclass(frozen=True, slots=True)
class Offer:
    """A pathfinder's answer at one node: the branch it built, or why it declined."""

    pathfinder: str
    node: NodeId
    branch: NodeId | None
    detail: str
