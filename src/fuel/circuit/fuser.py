"""The fuser: cover a circuit's nodes with rule groups for one mode and row count (SPEC §A7).

Greedy and deterministic. Applicable rules are tried by priority (highest first, then id; file
order never matters), and each rule scans the in-scope nodes in execution order; a node joins at
most one group. A rule is not applicable when its mode or rows do not apply, a kernel is absent,
a capability is missing, a policy setting it names differs, its ``differs`` lever is not opted
in, or (for a rule with run selectors) some run of the row table is unserved.

Invariants:
- Every node of the mode's section ends in exactly one group, or ``fuse`` raises
  :class:`Uncovered`; no node is left to an implicit kernel.
- A policy must state every setting any rule reads (:class:`PolicyMissing`), applicable or not,
  so a plan never depends on a default nobody wrote down.
- Stored formats are the circuit's, overridden by matched elements' ``writes``; every element
  with ``input`` must then find its node's first input stored in exactly that format
  (:class:`FormatConflict`).
- The plan is a pure function of its inputs; ``FusionPlan.digest`` changes exactly when what the
  plan runs changes (see :mod:`fuel.circuit.digest`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

from fuel.circuit.format import Format
from fuel.circuit.fuser_match import ChainMiss, CircuitIndex, execution_order
from fuel.circuit.ir import Circuit, Section
from fuel.circuit.rules import Mode, Numerics, NumericsClass, Repeat, RepeatKind, Rule, RuleSet, rules_from
from fuel.circuit.runs import KernelId, RowTable, RunLaunches, resolve_runs
from fuel.errors import FuelError
from fuel.pickling import fast_pickle


@dataclass(frozen=True, slots=True)
class AvailableKernels:
    """The kernels and capabilities a target provides (a probe's answer)."""

    kernels: frozenset[KernelId] = frozenset()
    caps: frozenset[str] = frozenset()

    @classmethod
    def all_named_by(cls, rules: RuleSet | Iterable[Rule]) -> AvailableKernels:
        """Every kernel and capability any rule names: the offline view used when no target is
        probed (``fuel circuit show``)."""
        rule_list = rules_from(rules) if isinstance(rules, RuleSet) else tuple(rules)
        return cls(frozenset(k for r in rule_list for k in r.all_kernels()),
                   frozenset(c for r in rule_list for c in r.requires))


@dataclass(frozen=True, slots=True)
class Policy:
    """What the deployment decides: opt-in levers for ``differs`` rules and the settings
    (``kv_cache_dtype``, ``row_tiers`` ...) that ``when`` clauses read, all stated explicitly."""

    opt_in_levers: frozenset[str] = frozenset()
    settings: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Sorted copies: the policy renders and compares the same however it was built.
        object.__setattr__(self, "opt_in_levers", frozenset(self.opt_in_levers))
        object.__setattr__(self, "settings", dict(sorted(self.settings.items())))


@fast_pickle
@dataclass(frozen=True, slots=True)
class EdgeState:
    """Whether an edge is written to memory (``Materialized``) or produced and consumed inside
    one group only (``Fused(group)``). ``group`` is ``None`` for a materialized edge."""

    group: int | None = None

    MATERIALIZED: ClassVar[EdgeState]

    @classmethod
    def fused(cls, group: int) -> EdgeState:
        return cls(group)

    @property
    def is_fused(self) -> bool:
        return self.group is not None

    def code(self) -> str:
        """``M`` or ``F<g>``: the spelling the digest and the renderer use."""
        return "M" if self.group is None else f"F{self.group}"

    def __str__(self) -> str:
        return "Materialized" if self.group is None else f"Fused({self.group})"


EdgeState.MATERIALIZED = EdgeState()


@fast_pickle
@dataclass(frozen=True, slots=True)
class Group:
    """One launch group: the rule that formed it, what it launches, and its member nodes in
    pattern order. ``runs`` holds a ``per_run`` group's launches per run of the row table, in
    batch order; it is empty for any other repeat."""

    rule: str
    kernels: tuple[KernelId, ...]
    repeat: Repeat
    copies: Repeat | None
    emitter: str
    numerics: Numerics
    nodes: tuple[int, ...]
    runs: tuple[RunLaunches, ...] = ()

    def launch_count(self, rows: int) -> int:
        """Kernel launches per step at ``rows`` rows (for ``per_run``: the runs' launches)."""
        count = self.repeat.count(rows)
        if count is None:
            return sum(r.launch_count() for r in self.runs)
        return len(self.kernels) * count

    def copy_count(self, rows: int) -> int:
        """Copy-engine transfers per step at ``rows`` rows."""
        if self.repeat.kind is RepeatKind.PER_RUN:
            return sum(r.copy_count() for r in self.runs)
        if self.copies is None:
            return 0
        return self.copies.count(rows) or 0


@dataclass(frozen=True, slots=True)
class FusionPlan:
    """The fused plan of one circuit for one mode and row count. ``edge_states[e]`` is ``None``
    for an edge outside the mode's section; ``edge_formats[e]`` is the format it is stored in
    under this plan."""

    arch: str
    mode: Mode
    rows: int
    table: RowTable | None
    groups: tuple[Group, ...]
    edge_states: tuple[EdgeState | None, ...]
    edge_formats: tuple[Format, ...]
    digest: str = ""

    def launches(self) -> int:
        return sum(g.launch_count(self.rows) for g in self.groups)

    def copies(self) -> int:
        return sum(g.copy_count(self.rows) for g in self.groups)

    def owner_of(self) -> dict[int, int]:
        """Node index -> the group that holds it."""
        return {n: g for g, group in enumerate(self.groups) for n in group.nodes}


class FuseError(FuelError):
    """Why no plan was produced."""


class Uncovered(FuseError):
    def __init__(self, node: str, op: str, mode: str, rows: int):
        self.node, self.op, self.mode, self.rows = node, op, mode, rows
        super().__init__(f"no applicable rule covers node `{node}` ({op}) in {mode} at {rows} rows")


class PolicyMissing(FuseError):
    def __init__(self, rule: str, key: str):
        self.rule, self.key = rule, key
        super().__init__(f"rule `{rule}` reads setting `{key}`, which the policy does not state")


class FormatConflict(FuseError):
    def __init__(self, edge: str, stored: str, rule: str, expected: str):
        self.edge, self.stored, self.rule, self.expected = edge, stored, rule, expected
        super().__init__(f"edge `{edge}` is stored as {stored} but rule `{rule}` reads it as {expected}")


class EmptySection(FuseError):
    def __init__(self, section: str):
        self.section = section
        super().__init__(f"the circuit has no {section} nodes")


class Cycle(FuseError):
    def __init__(self, n: int):
        self.n = n
        super().__init__(f"the {n} groups formed do not have an execution order")


class ZeroRows(FuseError):
    def __init__(self) -> None:
        super().__init__("a plan needs at least one row")


class RowTableMismatch(FuseError):
    """The seed's ``FuseError::RowTable``: a ``verify_batch`` plan without a row table, or a
    table in another mode."""

    def __init__(self, msg: str):
        self.msg = msg
        super().__init__(msg)


def section_of(mode: Mode) -> Section:
    """The section a mode runs."""
    return Section.DRAFT if mode is Mode.DRAFT else Section.MAIN


def fuse(circuit: Circuit, rules: RuleSet | Sequence[Rule], available: AvailableKernels,
         policy: Policy, mode: Mode, rows: int) -> FusionPlan:
    """Fuse ``circuit`` for ``mode`` at ``rows`` padded rows. A ``verify_batch`` plan is fused
    for a row table: :func:`fuse_table`."""
    if mode is Mode.VERIFY_BATCH:
        raise RowTableMismatch("a verify_batch plan is fused for a row table (`fuse_table`)")
    return _fuse(circuit, rules_from(rules), available, policy, mode, rows, None)


def fuse_table(circuit: Circuit, rules: RuleSet | Sequence[Rule], available: AvailableKernels,
               policy: Policy, table: RowTable) -> FusionPlan:
    """Fuse ``circuit`` for a batched verify of ``table``."""
    return _fuse(circuit, rules_from(rules), available, policy, Mode.VERIFY_BATCH, table.rows(), table)


@dataclass(frozen=True, slots=True)
class NotApplicable:
    """Why a rule does not apply at all to this mode, rows, target, policy and table.
    ``condition`` is one of ``mode``, ``rows``, ``kernel``, ``capability``, ``policy``,
    ``lever``, ``runs``; ``detail`` names the value."""

    condition: str
    detail: str

    def describe(self) -> str:
        return f"not applicable ({self.condition}): {self.detail}"


def check_policy(rules: Sequence[Rule], policy: Policy) -> None:
    """Raise :class:`PolicyMissing` for the first rule (file order) reading an unstated setting."""
    for rule in rules:
        for key, _ in rule.when:
            if key not in policy.settings:
                raise PolicyMissing(rule.id, key)


def applicability(rule: Rule, available: AvailableKernels, policy: Policy, mode: Mode, rows: int,
                  table: RowTable | None) -> NotApplicable | tuple[RunLaunches, ...]:
    """Whether ``rule`` applies; when it does, the resolved runs (empty unless per-run)."""
    if mode not in rule.modes:
        return NotApplicable("mode", f"serves {', '.join(sorted(m.value for m in rule.modes))}")
    lo, hi = rule.rows
    if not lo <= rows <= hi:
        return NotApplicable("rows", f"serves rows {lo}..{hi}, not {rows}")
    for kernel in rule.all_kernels():
        if kernel not in available.kernels:
            return NotApplicable("kernel", f"`{kernel}` is not available")
    for cap in sorted(rule.requires):
        if cap not in available.caps:
            return NotApplicable("capability", f"`{cap}` is not present")
    for key, want in rule.when:
        have = policy.settings.get(key)
        if have != want:
            return NotApplicable("policy", f"needs {key}={want}, policy has {key}={have}")
    if rule.numerics.kind is NumericsClass.DIFFERS and rule.numerics.lever not in policy.opt_in_levers:
        return NotApplicable("lever", f"`differs` rule needs lever `{rule.numerics.lever}` opted in")
    if not rule.runs:
        return ()
    resolved = resolve_runs(table, rule.runs) if table is not None else None
    if resolved is None:
        return NotApplicable("runs", "no row table" if table is None
                             else f"a run of `{table}` has no selector")
    return resolved


def ordered_rules(rules: Sequence[Rule]) -> list[Rule]:
    """Priority descending, then id ascending: file order never matters."""
    return sorted(rules, key=lambda r: (-r.priority, r.id))


def _fuse(circuit: Circuit, rules: tuple[Rule, ...], available: AvailableKernels, policy: Policy,
          mode: Mode, rows: int, table: RowTable | None) -> FusionPlan:
    if rows <= 0:
        raise ZeroRows()
    check_policy(rules, policy)
    section = section_of(mode)
    index = CircuitIndex(circuit, section)
    if not any(index.in_scope):
        raise EmptySection(section.value)
    order: list[tuple[Rule, tuple[RunLaunches, ...]]] = []
    for rule in ordered_rules(rules):
        verdict = applicability(rule, available, policy, mode, rows, table)
        if not isinstance(verdict, NotApplicable):
            order.append((rule, verdict))

    owner: list[int | None] = [None] * len(circuit.nodes)
    found: list[tuple[Rule, tuple[RunLaunches, ...], list[int]]] = []
    for rule, runs in order:
        # Only nodes of element 0's op can start a chain; scanning them (in index order) is the
        # seed's scan over every node, minus the nodes that would fail the first test.
        for s in index.by_kind.get(rule.pattern[0].op, ()):
            if owner[s] is not None:
                continue
            chain = index.chain_at(rule, s, owner)
            if isinstance(chain, ChainMiss):
                continue
            for n in chain:
                owner[n] = len(found)
            found.append((rule, runs, chain))
    for n, node in enumerate(circuit.nodes):
        if index.in_scope[n] and owner[n] is None:
            raise Uncovered(node.id, node.op.name(), mode.value, rows)

    exec_order = execution_order(index, owner, len(found))
    if len(exec_order) != len(found):
        raise Cycle(len(found))
    remap = [0] * len(found)
    for new, old in enumerate(exec_order):
        remap[old] = new
    owner = [None if g is None else remap[g] for g in owner]
    matched = [found[old] for old in exec_order]
    groups = tuple(Group(rule=rule.id, kernels=rule.kernels, repeat=rule.repeat, copies=rule.copies,
                         emitter=rule.emitter, numerics=rule.numerics, nodes=tuple(chain), runs=runs)
                   for rule, runs, chain in matched)

    formats = [e.format for e in circuit.edges]
    for rule, _, chain in matched:
        for p, n in zip(rule.pattern, chain):
            if p.writes is not None:
                for e in circuit.nodes[n].outputs:
                    formats[e] = p.writes
    for rule, _, chain in matched:
        for p, n in zip(rule.pattern, chain):
            inputs = circuit.nodes[n].inputs
            if p.input is not None and inputs and formats[inputs[0]] != p.input:
                e = inputs[0]
                raise FormatConflict(circuit.edges[e].id, formats[e].name(), rule.id, p.input.name())

    # Outputs an element marks `stored` stay in memory even when every reader is inside.
    stored = {e for rule, _, chain in matched for p, n in zip(rule.pattern, chain) if p.stored
              for e in circuit.nodes[n].outputs}
    states = _edge_states(circuit, index.in_scope, owner, stored)
    plan = FusionPlan(arch=circuit.arch, mode=mode, rows=rows, table=table, groups=groups,
                      edge_states=states, edge_formats=tuple(formats))
    from fuel.circuit.digest import plan_digest  # digest reads FusionPlan; import here avoids a cycle

    return replace(plan, digest=plan_digest(circuit, plan))


def _edge_states(circuit: Circuit, in_scope: list[bool], owner: list[int | None],
                 stored: set[int]) -> tuple[EdgeState | None, ...]:
    out: list[EdgeState | None] = []
    for i, edge in enumerate(circuit.edges):
        p = edge.producer
        producer_in = p is not None and in_scope[p]
        if not producer_in and not any(in_scope[c] for c in edge.consumers):
            out.append(None)
            continue
        g = owner[p] if producer_in else None
        internal = (g is not None and not edge.is_output and i not in stored and bool(edge.consumers)
                    and all(owner[c] == g for c in edge.consumers))
        out.append(EdgeState.fused(g) if internal else EdgeState.MATERIALIZED)
    return tuple(out)


def group_io(circuit: Circuit, plan: FusionPlan, g: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The edges group ``g`` reads from outside itself and the materialized edges it writes, each
    in edge order. Used by the renderer and the buffer planner."""
    members = set(plan.groups[g].nodes)
    ins: set[int] = set()
    outs: set[int] = set()
    for n in members:
        node = circuit.nodes[n]
        for e in node.inputs:
            producer = circuit.edges[e].producer
            if producer is None or producer not in members:
                ins.add(e)
        for e in node.outputs:
            if plan.edge_states[e] == EdgeState.MATERIALIZED:
                outs.add(e)
    return tuple(sorted(ins)), tuple(sorted(outs))
