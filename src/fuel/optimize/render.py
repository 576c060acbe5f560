"""Text rendering of an optimize_graph result: what ``fuel explain`` prints.

Decides nothing; shows exactly the recorded values (the lowerings, the offers and their
declines, every branch decision with each arm's cost, source, winner and reason). Stable: the
same result renders to the same text (counts sorted by name, decisions in graph order).
"""

from __future__ import annotations

from collections import Counter

from fuel.graph.ir import Graph
from fuel.optimize.decisions import Decision
from fuel.optimize.optimize import OptimizedGraph


def _ns(value: int | None) -> str:
    return "?" if value is None else f"{value:,} ns"


def render_decision(decision: Decision) -> list[str]:
    action = ("kept live (Pareto), routes to" if decision.retained
              else "baked to" if decision.collapsed else "left at")
    if decision.kind.value != "variant":
        action = "left live, default"
    margin = f", saves {decision.margin:.1%}" if decision.margin is not None and decision.margin > 0 else ""
    lines = [f"branch %{decision.branch} [{decision.kind.value}] {action} arm {decision.winner} "
             f"({decision.reason.value}{margin})"]
    for arm in decision.arms:
        mark = "  <- winner" if arm.arm == decision.winner else ""
        source = arm.source.value if arm.source is not None else "-"
        where = str(arm.device) if arm.device is not None else "unstamped"
        declined = f"  ({arm.declined})" if arm.declined else ""
        lines.append(f"    arm {arm.arm} %{arm.exit:<6} {arm.label:<24} {where:<7} "
                     f"{_ns(arm.cost_ns):>16} {source:<12}{mark}{declined}")
    return lines


def render_explanation(optimized: OptimizedGraph, graph: Graph, header: str = "") -> str:
    lines = [header] if header else []
    declined = [o for o in optimized.offers if o.branch is None]
    lines.append(f"graph: {len(graph)} nodes, dispatch {len(optimized.order)}; "
                 f"branches {len(optimized.decisions)}, baked {optimized.bakes}, "
                 f"live {len(optimized.live_branches())}; lowered {len(optimized.lowerings)}; "
                 f"offers {len(optimized.offers) - len(declined)} made, {len(declined)} declined; "
                 f"jit requests {len(optimized.jit_requests)}")
    if optimized.lowerings:
        lines.append("lowered to their recipe (arm 0):")
        counts = Counter((low.op, low.reason) for low in optimized.lowerings)
        for (op, reason), count in sorted(counts.items()):
            lines.append(f"  {op:<24} x{count:<4} {reason}")
    if declined:
        lines.append("offers declined:")
        counts = Counter((o.pathfinder, o.detail) for o in declined)
        for (pathfinder, detail), count in sorted(counts.items()):
            lines.append(f"  {pathfinder:<15} x{count:<4} {detail}")
    if optimized.decisions:
        lines.append("decisions:")
        for decision in optimized.decisions:
            lines.extend("  " + line for line in render_decision(decision))
    else:
        lines.append("decisions: none (no branch in the graph)")
    for copy in optimized.residency:
        lines.append(f"  residency: branch %{copy.branch} arm {copy.arm} copies %{copy.value} "
                     f"{copy.source} -> {copy.target} ({copy.bytes if copy.bytes is not None else '?'} bytes)")
    return "\n".join(lines) + "\n"
