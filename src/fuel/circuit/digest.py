"""The plan digest (SPEC §A8): lower-case hex SHA-256 of a canonical text of what a plan runs.

The canonical text is one labelled record per line in a fixed order:

    fuel-plan schema=1
    plan arch=<arch> mode=<mode> rows=<rows>
    rank <placement> shards=[binding=dimD[a:b],...]            (per-rank circuits only)
    table <row table text>                                   (verify_batch only)
    group <i> kernels=[m::f,...] repeat=<r> [copies=<r>] emitter=<e> numerics=<n> nodes=[ids]
    run <i>.<j> run=<k>x<n>[!] launches=[m::f*<times>,...] [copies=<times>]   (per_run groups)
    edge <id> stored=<fmt> rows=<expr> dim=<expr>=<value> state=M|F<g>   (in-scope edges, edge order)

Invariants:
- The same plan gives the same bytes in any process under any hash seed: every list is in plan
  or circuit order, never set or dict order.
- Rule ids, cites and priorities are names and choices, not content: they are not hashed. The
  digest changes exactly when what the plan runs changes (groups, kernels, repeat, copies,
  emitter, numerics, membership, rows, stored formats, edge states).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from fuel.circuit.rules import rules_digest

if TYPE_CHECKING:
    from fuel.circuit.fuser import FusionPlan
    from fuel.circuit.ir import Circuit

DIGEST_SCHEMA = 1

__all__ = ["DIGEST_SCHEMA", "plan_canonical_text", "plan_digest", "rules_digest"]


def plan_canonical_text(circuit: Circuit, plan: FusionPlan) -> str:
    """The text the digest is taken over; diff two of them to see what two plans run
    differently."""
    lines = [f"fuel-plan schema={DIGEST_SCHEMA}",
             f"plan arch={plan.arch} mode={plan.mode.value} rows={plan.rows}"]
    if circuit.rank is not None:
        # A rank's plan runs on its own slice of the weights: two ranks of one split have the
        # same groups and edges but never the same digest.
        shards = ",".join(f"{name}={shard.text()}" for name, shard in circuit.rank.shards)
        lines.append(f"rank {circuit.rank.text()} shards=[{shards}]")
    if plan.table is not None:
        lines.append(f"table {plan.table.text()}")
    nodes = circuit.nodes
    for i, g in enumerate(plan.groups):
        copies = f" copies={g.copies.name()}" if g.copies is not None else ""
        lines.append(f"group {i} kernels=[{','.join(map(str, g.kernels))}] repeat={g.repeat.name()}"
                     f"{copies} emitter={g.emitter} numerics={g.numerics.name()} "
                     f"nodes=[{','.join(nodes[n].id for n in g.nodes)}]")
        for j, run in enumerate(g.runs):
            run_copies = f" copies={run.copies.value}" if run.copies is not None else ""
            lines.append(f"run {i}.{j} run={run.run.text()} "
                         f"launches=[{','.join(launch.text() for launch in run.launches)}]{run_copies}")
    for e, edge in enumerate(circuit.edges):
        state = plan.edge_states[e]
        if state is None:
            continue
        lines.append(f"edge {edge.id} stored={plan.edge_formats[e].name()} rows={edge.rows.text} "
                     f"dim={edge.dim.text}={edge.dim_value} state={state.code()}")
    return "\n".join(lines) + "\n"


def plan_digest(circuit: Circuit, plan: FusionPlan) -> str:
    """Lower-case hex SHA-256 of :func:`plan_canonical_text`."""
    return hashlib.sha256(plan_canonical_text(circuit, plan).encode()).hexdigest()
