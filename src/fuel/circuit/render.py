"""The plan renderer (SPEC §A9): stable ASCII text of a fusion plan, and the same facts as JSON.

Text layout: a header (arch, mode, rows, table, policy, levers, rule set), ``digest:``, the
summary ``groups: G  launches: L  copies: C  edges: F fused, M materialized``, the arena line,
then per section and layer (in execution order) one line per group:

    gNNNN <block> [members] <kernels | (host)> [xN] [+ copy xC] <numerics> rule=<id>

Members are template-local ids; a member from another block than the group's first (a
residual add fused with the next layer's norm) is written with its full id. ``xN`` is the
launches of each kernel when not 1 (a ``per_run`` group: its total launches, its runs listed).

Invariants: the text is a pure function of (circuit, plan, policy, rules label); no clock,
path or hash-seed dependence, so golden files compare byte for byte.
"""

from __future__ import annotations

from typing import Any

from fuel.circuit.buffers import BufferPlan, plan_buffers
from fuel.circuit.fuser import EdgeState, FusionPlan, Group, Policy
from fuel.circuit.ir import Circuit, Section


def _summary(plan: FusionPlan) -> tuple[int, int]:
    fused = sum(1 for s in plan.edge_states if s is not None and s.is_fused)
    materialized = sum(1 for s in plan.edge_states if s == EdgeState.MATERIALIZED)
    return fused, materialized


def _kernels_text(group: Group) -> str:
    if group.runs:
        runs = " ".join(f"{r.run.text()}={','.join(l.text() for l in r.launches)}" for r in group.runs)
        return f"per_run{{{runs}}}"
    return ", ".join(map(str, group.kernels)) if group.kernels else "(host)"


def group_weight_formats(circuit: Circuit, group: Group) -> list[str]:
    """The stored formats of the weights a group's nodes read, in node order, once each."""
    return list(dict.fromkeys(circuit.nodes[n].weight_format.name() for n in group.nodes
                              if circuit.nodes[n].weight_format is not None))


def group_line(circuit: Circuit, plan: FusionPlan, g: int, weights: bool = False) -> str:
    """One group as ``render_plan`` prints it; ``weights``: with the stored formats of the
    weights it reads (``weights=gguf/q4_1``)."""
    group = plan.groups[g]
    first = circuit.nodes[group.nodes[0]]
    block = circuit.blocks[first.block]
    members = ", ".join(circuit.nodes[n].local if circuit.nodes[n].block == first.block else circuit.nodes[n].id
                        for n in group.nodes)
    parts = [f"g{g:04d}", block.name, f"[{members}]", _kernels_text(group)]
    count = group.repeat.count(plan.rows)
    if count is None:
        parts.append(f"x{group.launch_count(plan.rows)}")
    elif count != 1:
        parts.append(f"x{count}")
    copies = group.copy_count(plan.rows)
    if copies:
        parts.append(f"+ copy x{copies}")
    parts.append(group.numerics.name())
    parts.append(f"rule={group.rule}")
    formats = group_weight_formats(circuit, group) if weights else []
    if formats:
        parts.append(f"weights={','.join(formats)}")
    return " ".join(parts)


def render_plan(circuit: Circuit, plan: FusionPlan, policy: Policy | None = None,
                rules_label: str | None = None, buffers: BufferPlan | None = None,
                weights: bool = False) -> str:
    """The plan as stable text (ends with a newline); ``weights``: each group with the stored
    formats of the weights it reads (``fuel circuit show --weights``)."""
    buffers = buffers or plan_buffers(circuit, plan)
    fused, materialized = _summary(plan)
    lines = [f"arch: {plan.arch}  mode: {plan.mode.value}  rows: {plan.rows}"]
    if plan.table is not None:
        lines.append(f"table: {plan.table.text()}")
    if policy is not None:
        settings = " ".join(f"{k}={v}" for k, v in policy.settings.items()) or "(none)"
        lines.append(f"policy: {settings}")
        lines.append(f"levers: {', '.join(sorted(policy.opt_in_levers)) or '(none)'}")
    if rules_label is not None:
        lines.append(f"rules: {rules_label}")
    lines.append(f"digest: {plan.digest}")
    lines.append(f"groups: {len(plan.groups)}  launches: {plan.launches()}  copies: {plan.copies()}  "
                 f"edges: {fused} fused, {materialized} materialized")
    lines.append(f"arena: {buffers.arena_bytes} bytes  materialized: {buffers.materialized_bytes} bytes")
    heading = None
    seen_layer = False
    for g, group in enumerate(plan.groups):
        block = circuit.blocks[circuit.nodes[group.nodes[0]].block]
        if block.layer is not None:
            seen_layer = True
            place = f"layer {block.layer}" + (f" {block.layer_kind.value}" if block.layer_kind else "")
        elif block.section is Section.DRAFT:
            place = "draft"
        else:
            place = "epilogue" if seen_layer else "prologue"
        section_heading = f"[{block.section.value}] {place}"
        if section_heading != heading:
            lines.append("")
            lines.append(section_heading)
            heading = section_heading
        lines.append("  " + group_line(circuit, plan, g, weights))
    return "\n".join(lines) + "\n"


def plan_to_json(circuit: Circuit, plan: FusionPlan, policy: Policy | None = None,
                 rules_label: str | None = None, buffers: BufferPlan | None = None,
                 weights: bool = False) -> dict[str, Any]:
    """The facts of :func:`render_plan` as a JSON-ready dict (lists in plan and edge order);
    ``weights``: each group with ``weight_formats``."""
    buffers = buffers or plan_buffers(circuit, plan)
    fused, materialized = _summary(plan)
    groups = []
    for g, group in enumerate(plan.groups):
        groups.append({
            "index": g, "rule": group.rule, "kernels": [str(k) for k in group.kernels],
            "repeat": group.repeat.name(), "copies": group.copies.name() if group.copies else None,
            "emitter": group.emitter, "numerics": group.numerics.name(),
            "nodes": [circuit.nodes[n].id for n in group.nodes],
            "launches": group.launch_count(plan.rows), "copy_count": group.copy_count(plan.rows),
            "runs": [{"run": r.run.text(), "launches": [l.text() for l in r.launches],
                      "copies": r.copies.value if r.copies else None} for r in group.runs],
        })
        if weights:
            groups[-1]["weight_formats"] = group_weight_formats(circuit, group)
    slots = {s.edge: s for s in buffers.slots}
    edges = []
    for e, edge in enumerate(circuit.edges):
        state = plan.edge_states[e]
        if state is None:
            continue
        entry: dict[str, Any] = {"id": edge.id, "stored": plan.edge_formats[e].name(), "state": state.code()}
        if e in slots:
            entry.update(offset=slots[e].offset, bytes=slots[e].bytes)
        edges.append(entry)
    return {
        "arch": plan.arch, "mode": plan.mode.value, "rows": plan.rows,
        "table": plan.table.text() if plan.table else None,
        "policy": dict(policy.settings) if policy else None,
        "levers": sorted(policy.opt_in_levers) if policy else None,
        "rules": rules_label, "digest": plan.digest,
        "summary": {"groups": len(plan.groups), "launches": plan.launches(), "copies": plan.copies(),
                    "fused_edges": fused, "materialized_edges": materialized,
                    "arena_bytes": buffers.arena_bytes, "materialized_bytes": buffers.materialized_bytes},
        "groups": groups, "edges": edges,
    }
