"""Text and JSON rendering of an optimize_graph result: what ``fuel explain`` prints.

Decides nothing; shows exactly the recorded values (the lowerings, the offers and their
declines, every branch decision with each arm's cost, source, winner and reason). Stable: the
same result renders to the same text (counts sorted by name, decisions in graph order).
:func:`explanation_document` is the same record as plain data (``fuel explain --json``; its
shape is ``fuel/report/explain.schema.json``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

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
        if arm.dispatch_ns:
            declined += (f"  (with {_ns(arm.dispatch_ns).strip()} of host calls: the program "
                         "loses its one-call step list)")
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


def _decision_doc(decision: Decision) -> dict[str, Any]:
    return {
        "branch": decision.branch, "kind": decision.kind.value, "winner": decision.winner,
        "reason": decision.reason.value, "margin": decision.margin,
        "collapsed": decision.collapsed, "retained": decision.retained,
        "arms": [{"arm": a.arm, "exit": a.exit, "label": a.label,
                  "device": str(a.device) if a.device is not None else None,
                  "cost_ns": a.cost_ns, "source": a.source.value if a.source else None,
                  "declined": a.declined, "dispatch_ns": a.dispatch_ns} for a in decision.arms],
    }


def explanation_document(optimized: OptimizedGraph, graph: Graph,
                         step: dict[str, Any]) -> dict[str, Any]:
    """The decision record as plain data: ``step`` (what was explained: model, mode, rows, ...),
    the counts, every lowering and declined offer (grouped with counts, as the text shows
    them), every offer made, every decision with its arms, and the residency copies."""
    declined = [o for o in optimized.offers if o.branch is None]
    lowered = Counter((low.op, low.reason) for low in optimized.lowerings)
    refused = Counter((o.pathfinder, o.detail) for o in declined)
    return {
        "schema": "fuel-explain/1",
        "step": step,
        "graph": {"nodes": len(graph), "dispatch": len(optimized.order),
                  "branches": len(optimized.decisions), "baked": optimized.bakes,
                  "live": len(optimized.live_branches()),
                  "jit_requests": len(optimized.jit_requests)},
        "lowered": [{"op": op, "reason": reason, "count": count}
                    for (op, reason), count in sorted(lowered.items())],
        "offers_made": [{"pathfinder": o.pathfinder, "node": o.node, "branch": o.branch,
                         "detail": o.detail} for o in optimized.offers if o.branch is not None],
        "offers_declined": [{"pathfinder": pathfinder, "detail": detail, "count": count}
                            for (pathfinder, detail), count in sorted(refused.items())],
        "decisions": [_decision_doc(d) for d in optimized.decisions],
        "residency": [{"branch": c.branch, "arm": c.arm, "value": c.value,
                       "source": str(c.source), "target": str(c.target), "bytes": c.bytes}
                      for c in optimized.residency],
    }
