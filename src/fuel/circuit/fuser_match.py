"""Pattern matching and group ordering for the fuser.

Decides whether a node fits a pattern element, which chain a rule forms from a start node, and
the execution order of the groups formed.

Invariants:
- A chain element after the first joins by reading an output of an earlier member or, when
  marked ``sibling``, by sitting in the first member's block. Among candidates the lowest node
  index wins; there is no backtracking, so matching is deterministic.
- A chain is refused when a member other than the last has an output that leaves the group
  (read outside it, or a declared output) and its element lacks ``keep``, or when an outside
  node lies on a path from one member to another (fusing would need a cycle).
- Groups execute in a topological order of the group graph (Kahn); among ready groups the one
  with the lowest member index goes first, then the lower group id. A node with no outputs (a
  KV-cache write) orders before later readers of its inputs, so attention reads a written cache.
- A match failure is a value (:class:`ChainMiss`) saying which element and which field, so the
  explainer reuses the very code the fuser runs.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from enum import Enum

from fuel.circuit.format import Format
from fuel.circuit.ir import Circuit, OpKind, Section
from fuel.circuit.rules import PatternElement, Rule


class RefusalReason(Enum):
    """Why a chain that matched every element was still refused."""

    KEEP = "keep"  # a member's output leaves the group and its element has no `keep`
    CYCLE = "cycle"  # an outside node lies between two members


@dataclass(frozen=True, slots=True)
class ChainMiss:
    """Why ``chain_at`` formed no chain from a start node.

    ``element`` is the pattern element that failed. ``field`` names the element's field that
    did not fit (``op``, ``role``, ``format``, ``local``, ``weight``, ``input``, ``layer_kind``)
    when the start node did not fit element 0; for a later element ``field`` is ``None``: no
    free node among the candidates fit. ``refusal`` is set when every element matched but the
    chain was refused (``element`` is then the offending member for ``keep``)."""

    element: int
    field: str | None = None
    refusal: RefusalReason | None = None

    def describe(self) -> str:
        if self.refusal is RefusalReason.KEEP:
            return (f"chain refused: element {self.element}'s output leaves the group and the "
                    "element has no `keep`")
        if self.refusal is RefusalReason.CYCLE:
            return "chain refused: an outside node lies between two members (fusing would need a cycle)"
        if self.element == 0:
            return f"element 0 did not fit: `{self.field}` differs"
        return f"chain broke at element {self.element}: no free node fits among the candidates"


class CircuitIndex:
    """Per-circuit, per-section lookup tables built once per fuse (never per rule): the in-scope
    mask, nodes by op kind, and flat per-node attributes the matcher reads in its inner loop."""

    __slots__ = ("circuit", "in_scope", "by_kind", "kinds", "roles", "formats", "locals",
                 "weights", "layer_kinds", "quantized_input", "outputs", "inputs", "consumers",
                 "block_range", "is_output")

    def __init__(self, circuit: Circuit, section: Section):
        self.circuit = circuit
        block_in = [b.section is section for b in circuit.blocks]
        nodes = circuit.nodes
        edges = circuit.edges
        self.in_scope = [block_in[n.block] for n in nodes]
        self.by_kind: dict[OpKind, list[int]] = {}
        for i, node in enumerate(nodes):
            if self.in_scope[i]:
                self.by_kind.setdefault(node.op.kind, []).append(i)
        self.kinds = [n.op.kind for n in nodes]
        self.roles = [n.op.role for n in nodes]
        self.formats = [n.op.format for n in nodes]
        self.locals = [n.local for n in nodes]
        self.weights = [n.weight_format for n in nodes]
        self.layer_kinds = [n.layer_kind for n in nodes]
        # Only a quantized first input constrains matching; a plain one is every kernel's default.
        self.quantized_input: list[Format | None] = []
        for n in nodes:
            fmt = edges[n.inputs[0]].format if n.inputs else None
            self.quantized_input.append(fmt if fmt is not None and fmt.is_quantized else None)
        self.outputs = [n.outputs for n in nodes]
        self.inputs = [n.inputs for n in nodes]
        self.consumers = [e.consumers for e in edges]
        self.is_output = [e.is_output for e in edges]
        self.block_range = [(circuit.blocks[n.block].first, circuit.blocks[n.block].end) for n in nodes]

    def misfit(self, p: PatternElement, n: int) -> str | None:
        """The first field of ``p`` that node ``n`` does not fit, or ``None`` when it fits."""
        if p.op is not self.kinds[n]:
            return "op"
        if p.roles and self.roles[n] not in p.roles:
            return "role"
        if p.format is not None and self.formats[n] != p.format:
            return "format"
        if p.local is not None and self.locals[n] != p.local:
            return "local"
        if p.weight is not None and self.weights[n] != p.weight:
            return "weight"
        wanted = p.input if p.input is not None and p.input.is_quantized else None
        if self.quantized_input[n] != wanted:
            return "input"
        if p.layer_kind is not None and self.layer_kinds[n] is not p.layer_kind:
            return "layer_kind"
        return None

    def chain_at(self, rule: Rule, s: int, owner: list[int | None]) -> list[int] | ChainMiss:
        """The chain ``rule`` forms starting at node ``s``, or why it forms none."""
        pattern = rule.pattern
        field = self.misfit(pattern[0], s)
        if field is not None:
            return ChainMiss(0, field)
        chain = [s]
        for i in range(1, len(pattern)):
            p = pattern[i]
            if p.sibling:
                first, end = self.block_range[s]
                candidates: list[int] | range = range(first, end)
            else:
                readers: set[int] = set()
                for m in chain:
                    for e in self.outputs[m]:
                        readers.update(self.consumers[e])
                candidates = sorted(readers)
            found = None
            for n in candidates:
                if (self.in_scope[n] and owner[n] is None and n not in chain
                        and self.misfit(p, n) is None):
                    found = n
                    break
            if found is None:
                return ChainMiss(i)
            chain.append(found)
        leaking = self._leaking_member(rule, chain)
        if leaking is not None:
            return ChainMiss(leaking, refusal=RefusalReason.KEEP)
        if self._needs_cycle(chain):
            return ChainMiss(len(chain) - 1, refusal=RefusalReason.CYCLE)
        return chain

    def _leaking_member(self, rule: Rule, chain: list[int]) -> int | None:
        members = set(chain)
        last = len(chain) - 1
        for j, m in enumerate(chain):
            if j == last or rule.pattern[j].keep:
                continue
            for e in self.outputs[m]:
                if self.is_output[e] or not members.issuperset(self.consumers[e]):
                    return j
        return None

    def _needs_cycle(self, chain: list[int]) -> bool:
        members = set(chain)
        hi = max(chain)
        seen: set[int] = set()
        queue: deque[int] = deque()
        for m in chain:
            for e in self.outputs[m]:
                queue.extend(self.consumers[e])
        while queue:
            n = queue.popleft()
            if n > hi or n in seen:
                continue
            seen.add(n)
            if n in members:
                # A member reading a member directly is the chain itself.
                continue
            for e in self.outputs[n]:
                if any(x in members for x in self.consumers[e]):
                    return True
                queue.extend(self.consumers[e])
        return False


def execution_order(index: CircuitIndex, owner: list[int | None], groups: int) -> list[int]:
    """Group indices in execution order; shorter than ``groups`` when the groups have no
    topological order (a cycle)."""
    first = [len(owner)] * groups
    for n, g in enumerate(owner):
        if g is not None and n < first[g]:
            first[g] = n
    successors: list[set[int]] = [set() for _ in range(groups)]
    in_scope = index.in_scope
    circuit = index.circuit

    def link(a: int | None, b: int | None) -> None:
        if a is not None and b is not None and a != b:
            successors[a].add(b)

    for edge in circuit.edges:
        p = edge.producer
        if p is None or not in_scope[p]:
            continue
        for r in edge.consumers:
            if in_scope[r]:
                link(owner[p], owner[r])
    # A node with no outputs (a cache write) precedes later readers of its inputs.
    for s, node in enumerate(circuit.nodes):
        if not in_scope[s] or node.outputs:
            continue
        for e in node.inputs:
            for r in circuit.edges[e].consumers:
                if r > s and in_scope[r]:
                    link(owner[s], owner[r])
    indegree = [0] * groups
    for targets in successors:
        for b in targets:
            indegree[b] += 1
    ready = [(first[g], g) for g in range(groups) if indegree[g] == 0]
    heapq.heapify(ready)
    out: list[int] = []
    while ready:
        _, g = heapq.heappop(ready)
        out.append(g)
        for b in successors[g]:
            indegree[b] -= 1
            if indegree[b] == 0:
                heapq.heappush(ready, (first[b], b))
    return out
