"""Why each node ended in its group: per node, every rule tried and why each did not claim it.

A separate pass so :func:`fuel.circuit.fuser.fuse` stays fast. It replays the fuser's greedy
cover over every in-scope node (no op-kind shortcut) with the same matcher, and records one
:class:`Attempt` per (node, rule) until a rule claims the node.

Invariants:
- The claims recorded are exactly the fuser's groups (same rules, same members): the replay runs
  the same ``applicability`` and ``chain_at`` in the same order.
- A rule that does not apply is listed only for nodes whose op one of its elements names.
- Outcomes are values: ``NotApplicable`` (which condition), ``ChainMiss`` (element 0 did not
  fit: which field; chain broke at element i; accepted chain refused: keep or cycle) and
  ``Claimed`` (as which element of whose chain). A node taken as a later element of another
  node's chain shows the rules tried on it before that claim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fuel.circuit.fuser import AvailableKernels, NotApplicable, Policy, applicability, check_policy, ordered_rules, section_of
from fuel.circuit.fuser_match import ChainMiss, CircuitIndex
from fuel.circuit.ir import Circuit
from fuel.circuit.rules import Mode, Rule, RuleSet, rules_from
from fuel.circuit.runs import RowTable


@dataclass(frozen=True, slots=True)
class Claimed:
    """This rule's chain starting at ``start`` took the node as pattern element ``element``."""

    start: str
    element: int
    members: tuple[str, ...]

    def describe(self) -> str:
        return f"claimed as element {self.element} of the chain at `{self.start}`: [{', '.join(self.members)}]"


Outcome = NotApplicable | ChainMiss | Claimed


@dataclass(frozen=True, slots=True)
class Attempt:
    rule: str
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class NodeExplanation:
    node: str
    op: str
    attempts: tuple[Attempt, ...]

    @property
    def claimed_by(self) -> str | None:
        last = self.attempts[-1] if self.attempts else None
        return last.rule if last is not None and isinstance(last.outcome, Claimed) else None


def explain(circuit: Circuit, rules: RuleSet | Sequence[Rule], available: AvailableKernels,
            policy: Policy, mode: Mode, rows: int, table: RowTable | None = None) -> tuple[NodeExplanation, ...]:
    """Per in-scope node (index order), the rules tried in the fuser's order and each outcome.
    Raises what ``fuse`` raises for a missing policy setting."""
    rule_list = rules_from(rules)
    check_policy(rule_list, policy)
    index = CircuitIndex(circuit, section_of(mode))
    nodes = circuit.nodes
    attempts: dict[int, list[Attempt]] = {n: [] for n in range(len(nodes)) if index.in_scope[n]}
    owner: list[int | None] = [None] * len(nodes)
    claims: list[tuple[str, int]] = []  # group -> (rule id, start node)
    for rule in ordered_rules(rule_list):
        verdict = applicability(rule, available, policy, mode, rows, table)
        for n in attempts:
            if attempts[n] and isinstance(attempts[n][-1].outcome, Claimed):
                continue
            if isinstance(verdict, NotApplicable):
                # Only where the rule could have taken this node (some element names its op).
                if any(p.op is index.kinds[n] for p in rule.pattern):
                    attempts[n].append(Attempt(rule.id, verdict))
                continue
            chain = index.chain_at(rule, n, owner)
            if isinstance(chain, ChainMiss):
                attempts[n].append(Attempt(rule.id, chain))
                continue
            members = tuple(nodes[m].id for m in chain)
            for element, m in enumerate(chain):
                owner[m] = len(claims)
                attempts[m].append(Attempt(rule.id, Claimed(nodes[n].id, element, members)))
            claims.append((rule.id, n))
    return tuple(NodeExplanation(nodes[n].id, nodes[n].op.name(), tuple(a)) for n, a in attempts.items())


def render_explanation(explanations: Sequence[NodeExplanation], verbose: bool = False) -> str:
    """Plain text: one paragraph per node, one line per rule tried. Rules whose first element
    names another op are counted, not listed, unless ``verbose``."""
    lines = []
    for node in explanations:
        verdict = f"-> {node.claimed_by}" if node.claimed_by else "-> UNCOVERED"
        lines.append(f"{node.node} ({node.op}) {verdict}")
        other_ops = 0
        for attempt in node.attempts:
            outcome = attempt.outcome
            if not verbose and isinstance(outcome, ChainMiss) and outcome.element == 0 and outcome.field == "op":
                other_ops += 1
                continue
            lines.append(f"  {attempt.rule}: {outcome.describe()}")
        if other_ops:
            lines.append(f"  ({other_ops} rules for other ops)")
    return "\n".join(lines) + "\n"
