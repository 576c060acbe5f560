"""The variant bake: same-device kernel-variant branches resolved at optimize time by cost.

Decides, for every reachable branch whose arms all sit on one device, which arm the graph keeps.
Two kinds of branch share the ``Branch`` representation (seed ``000``):

- *placement* arms — the same op on different devices — stay live; the runtime route picker
  (:mod:`fuel.runtime.route_picker`) resolves them on live load and free memory;
- *kernel-variant* arms — different implementations on the same device (the decomposed region
  vs. a fused flash kernel) — are baked here, where costs, capabilities and the Judge are in
  hand, and the losers pruned (:func:`~fuel.graph.collapse_variant_branch`).

The rules (the seed's, exactly):

1. Only branches whose arm exits are all stamped and all on one device are baked. Arms on two or
   more devices are placement branches and are never touched; an unstamped arm skips the branch.
2. Arm 0 (the decomposed correctness oracle) and each variant are priced. An arm 0 that cannot be
   priced leaves the branch exactly as it is.
3. The unique variant strictly cheaper than arm 0 wins. "Unique": the cheapest variant must not
   share its cost with another variant — two equally cheap variants are a tie, and a tie keeps
   arm 0. A variant costing what arm 0 costs is a tie too.
4. An unknown cost (``None``) or a kernel not available on the placed device makes a variant
   unable to win; if no variant can win, arm 0 stands and the branch collapses to it.
5. Decide every branch first, then mutate: one branch's collapse never changes what another was
   priced at.
6. Never raises: a provider that raises declines that arm; a structural surprise from the
   collapse is skipped (the graph keeps the branch).
7. The count of branches baked to an arm > 0 is returned and added to a per-thread counter
   (:func:`variant_bakes_thread_local`).

A graph with no same-device variant branch is left unchanged (node for node, stamp for stamp).

Beyond the seed, each off by default (:class:`BakePolicy`): a relative ``min_margin`` a variant
must beat arm 0 by; a ``required_precision`` a winning arm's kernels must guarantee; and
``pareto_retention``, which records the winner but keeps the arms live for the route picker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fuel.graph.branch import BranchError, branches_in_topo_order, collapse_variant_branch
from fuel.graph.dtype import Device
from fuel.graph.ir import Branch, Graph, GraphError, NodeId
from fuel.kernels.table import Precision
from fuel.optimize.decisions import ArmRecord, BranchKind, CostSource, Decision, Reason

ArmCostFn = Callable[[Graph, NodeId, int], "int | None"]
"""``arm_cost(graph, branch, arm)``: the arm's composite nanoseconds, or ``None`` when it is
unknown or inadmissible (an unpriced op, or a kernel not available on the placed device).
``None`` means "this arm cannot win": the arm-0 oracle stands."""


@dataclass(frozen=True, slots=True)
class NodePrice:
    """One interior node's nanoseconds and where they came from."""

    node: NodeId
    ns: int
    source: CostSource


@dataclass(frozen=True, slots=True)
class ArmPrice:
    """A priced arm: total ns, the source mix, the weakest precision of its kernels (``None``
    when unknown) and the per-node breakdown (empty for an opaque cost function)."""

    ns: int
    source: CostSource
    precision: Precision | None = None
    nodes: tuple[NodePrice, ...] = ()
    dispatch_ns: int = 0
    """Of ``ns``, what the arm costs the rest of the program: the host calls it makes when the
    arm takes away its one-call step list (``optimize.dispatch_charges``); 0 otherwise."""


@dataclass(frozen=True, slots=True)
class ArmDeclined:
    """An arm that cannot win: ``reason`` is UNKNOWN_COST or KERNEL_UNAVAILABLE."""

    reason: Reason
    detail: str


ArmPricer = Callable[[Graph, NodeId, int], "ArmPrice | ArmDeclined"]
"""The detailed form of :data:`ArmCostFn` that optimize_graph's providers implement."""


@dataclass(frozen=True, slots=True)
class BakePolicy:
    """Options beyond the seed; the defaults are the seed's behaviour."""

    min_margin: float = 0.0
    """A variant must beat arm 0 by more than this fraction of arm 0's cost (0: strictly)."""
    required_precision: Precision | None = None
    """When set, an arm whose kernels guarantee less than this cannot win."""
    pareto_retention: bool = False
    """Keep same-device arms live (record the winner as the default route) instead of pruning."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_margin < 1.0:
            raise ValueError(f"min_margin must be in [0, 1), got {self.min_margin!r}")


@dataclass(frozen=True, slots=True)
class BakeOutcome:
    """What one bake did: the count baked to an arm > 0 and one decision per branch met."""

    baked: int
    decisions: tuple[Decision, ...]


_STRENGTH = {Precision.EXACT: 1, Precision.RECIPE_TOLERANCE: 0, Precision.STATED_BOUND: -1}


def _weaker(a: Precision | None, b: Precision | None) -> Precision | None:
    if a is None or b is None:
        return None
    return a if _STRENGTH[a] <= _STRENGTH[b] else b


def meets(precision: Precision | None, required: Precision | None) -> bool:
    """Whether an arm of ``precision`` may win under ``required`` (unknown meets only None)."""
    if required is None:
        return True
    return precision is not None and _STRENGTH[precision] >= _STRENGTH[required]


class _Counter(threading.local):
    count = 0


_COUNTER = _Counter()


def variant_bakes_thread_local() -> int:
    """This thread's cumulative count of branches baked to an arm > 0. Diff it around an
    ``optimize_graph`` call to learn how many variants that pass baked."""
    return _COUNTER.count


def arm_location(graph: Graph, exit: NodeId) -> Device | None:
    """Where an arm runs: its exit's placement, else its backend stamp; None if unstamped."""
    backend = graph.target_backend.get(exit)
    if backend is None:
        return None
    placed = graph.placement.get(exit)
    return placed if placed is not None and placed.backend is backend else Device(backend)


def _label(graph: Graph, exit: NodeId) -> str:
    return str(graph.node(exit).op)


def _price(pricer: ArmPricer, graph: Graph, branch: NodeId, arm: int) -> ArmPrice | ArmDeclined:
    try:
        return pricer(graph, branch, arm)
    except Exception as error:  # noqa: BLE001 — never raises: a failing provider declines the arm
        return ArmDeclined(Reason.UNKNOWN_COST, f"cost provider raised {type(error).__name__}: {error}")


def _record(graph: Graph, arm: int, exit: NodeId, device: Device | None,
            price: ArmPrice | ArmDeclined | None) -> ArmRecord:
    if isinstance(price, ArmPrice):
        return ArmRecord(arm, exit, _label(graph, exit), device, price.ns, price.source,
                         dispatch_ns=price.dispatch_ns)
    if isinstance(price, ArmDeclined):
        return ArmRecord(arm, exit, _label(graph, exit), device, None, None,
                         f"{price.reason.value}: {price.detail}")
    return ArmRecord(arm, exit, _label(graph, exit), device, None, None)


def _choose(arm0: int, prices: list[ArmPrice | ArmDeclined],
            policy: BakePolicy) -> tuple[int, Reason, float | None]:
    """Pick among variants 1.. (``prices[0]`` is variant arm 1); returns (winner, reason, margin)."""
    priced = [(p.ns, arm) for arm, p in enumerate(prices, start=1) if isinstance(p, ArmPrice)]
    eligible = [(ns, arm) for ns, arm in priced if meets(prices[arm - 1].precision,
                                                         policy.required_precision)]
    cheaper = sorted((ns, arm) for ns, arm in eligible if ns < arm0)
    if not cheaper:
        if any(ns == arm0 for ns, _ in eligible):
            return 0, Reason.TIE, 0.0
        if any(ns < arm0 for ns, _ in priced):
            return 0, Reason.BELOW_PRECISION, None
        if eligible:
            best = min(ns for ns, _ in eligible)
            return 0, Reason.NOT_CHEAPER, _saving(arm0, best)
        declined = [p for p in prices if isinstance(p, ArmDeclined)]
        if any(p.reason is Reason.KERNEL_UNAVAILABLE for p in declined):
            return 0, Reason.KERNEL_UNAVAILABLE, None
        return 0, Reason.UNKNOWN_COST, None
    best_ns, best_arm = cheaper[0]
    margin = _saving(arm0, best_ns)
    if len(cheaper) > 1 and cheaper[1][0] == best_ns:
        return 0, Reason.TIE, margin
    if (arm0 - best_ns) <= policy.min_margin * arm0:
        return 0, Reason.WITHIN_MARGIN, margin
    return best_arm, Reason.CHEAPER, margin


def _saving(arm0: int, ns: int) -> float | None:
    return (arm0 - ns) / arm0 if arm0 > 0 else None


def _decide(graph: Graph, branch: NodeId, pricer: ArmPricer, policy: BakePolicy) -> Decision | None:
    exits = graph.node(branch).inputs
    if len(exits) < 2:
        return None  # an inert (already collapsed) branch: nothing to decide
    locations = [arm_location(graph, exit) for exit in exits]
    if any(location is None for location in locations):
        arms = tuple(_record(graph, arm, exit, loc, None)
                     for arm, (exit, loc) in enumerate(zip(exits, locations)))
        return Decision(branch, BranchKind.UNSTAMPED, arms, 0, Reason.UNSTAMPED)
    if len(set(locations)) > 1:
        arms = tuple(_record(graph, arm, exit, loc, None)
                     for arm, (exit, loc) in enumerate(zip(exits, locations)))
        return Decision(branch, BranchKind.PLACEMENT, arms, 0, Reason.PLACEMENT_LIVE)
    prices = [_price(pricer, graph, branch, arm) for arm in range(len(exits))]
    arms = tuple(_record(graph, arm, exit, loc, price)
                 for arm, (exit, loc, price) in enumerate(zip(exits, locations, prices)))
    if not isinstance(prices[0], ArmPrice):
        return Decision(branch, BranchKind.VARIANT, arms, 0, Reason.ARM0_UNPRICED)
    winner, reason, margin = _choose(prices[0].ns, prices[1:], policy)
    return Decision(branch, BranchKind.VARIANT, arms, winner, reason, margin,
                    retained=policy.pareto_retention)


def bake(graph: Graph, roots: Iterable[NodeId], pricer: ArmPricer,
         policy: BakePolicy = BakePolicy()) -> BakeOutcome:
    """Decide every reachable branch, then collapse the variant ones (see the module rules).

    Returns the decisions in the order the branches' merges sit in the graph.
    """
    try:
        branches = branches_in_topo_order(graph, tuple(roots))
    except (BranchError, GraphError, IndexError) as error:
        del error  # an unreadable graph has no branch this bake can decide; never raises
        return BakeOutcome(0, ())
    decisions = [d for d in (_decide(graph, b, pricer, policy) for b in branches) if d is not None]
    final: list[Decision] = []
    baked = 0
    for decision in decisions:
        mutate = (decision.kind is BranchKind.VARIANT and decision.reason is not Reason.ARM0_UNPRICED
                  and not policy.pareto_retention)
        if mutate and isinstance(graph.node(decision.branch).op, Branch):
            try:
                collapse_variant_branch(graph, decision.branch, decision.winner)
            except (BranchError, GraphError):
                final.append(decision)  # a structural surprise: the branch stays as it was
                continue
            baked += decision.winner > 0
            decision = _collapsed(decision)
        final.append(decision)
    _COUNTER.count += baked
    return BakeOutcome(baked, tuple(final))


def _collapsed(decision: Decision) -> Decision:
    return Decision(decision.branch, decision.kind, decision.arms, decision.winner,
                    decision.reason, decision.margin, collapsed=True)


def _given(arm_cost: ArmCostFn) -> ArmPricer:
    def price(graph: Graph, branch: NodeId, arm: int) -> ArmPrice | ArmDeclined:
        ns = arm_cost(graph, branch, arm)
        if ns is None:
            return ArmDeclined(Reason.UNKNOWN_COST, "the cost function returned None")
        return ArmPrice(int(ns), CostSource.GIVEN)
    return price


def bake_variant_branches(graph: Graph, roots: Iterable[NodeId], arm_cost: ArmCostFn) -> int:
    """Bake same-device kernel-variant branches to their cost winner (the seed's entry point).

    Returns the number of branches collapsed to a variant arm (> 0); also added to
    :func:`variant_bakes_thread_local`. Never raises.
    """
    return bake(graph, roots, _given(arm_cost)).baked
