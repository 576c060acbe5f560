"""What a device's rule set covers: the covering fuse, gaps, and the coverage matrix.

Decides three things, all pure:

- :func:`covering_fuse`: a plan even where the rule set has gaps. The fuser is called unchanged
  with the device's rules plus one synthetic single-op ``novel`` rule per op (and per quantized
  input format the circuit has) at a priority below every real rule, so real rules claim every
  node they can first and only the nodes no rule covers fall to a ``novel`` placeholder group
  (kernel ``fuel.novel::<op>``, one launch: what a synthesized kernel would cost). The seed's
  fuser stays untouched; a plan with no novel group is exactly the plain ``fuse`` plan.
- :func:`gaps_of`: the nodes that fell to novel groups, grouped by site (block, local, op).
- :func:`coverage_matrix`: per mode and row tier, the plain fuser's answer: planned (launches)
  or the typed :class:`~fuel.circuit.fuser.FuseError`'s message. A "no" is a value here.

Invariants: novel rules never outrank a real rule; a covering plan covers every in-scope node
(the novel rules are total over the circuit's ops); tiers are listed in a fixed order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fuel.circuit.format import Format
from fuel.circuit.fuser import AvailableKernels, FuseError, FusionPlan, Policy, fuse, fuse_table
from fuel.circuit.ir import Circuit, OpKind
from fuel.circuit.rules import REFERENCE, Mode, PatternElement, Repeat, RepeatKind, Rule
from fuel.circuit.runs import KernelId, RowTable

NOVEL_MODULE = "fuel.novel"
NOVEL_PREFIX = "novel:"

MULTI_SEQ_TIERS = (2, 4, 8, 16, 32, 64, 128)
VERIFY_TIERS = (2, 3, 4, 5, 6, 7, 8)
PREFILL_CHUNKS = (512, 2048)
DEFAULT_TABLES = ("4x2 2x3", "4x3 3x1!", "2x4 3x2")


def novel_rules(circuit: Circuit, below: int) -> tuple[Rule, ...]:
    """One single-op ``novel`` rule per (op, quantized first-input format) the circuit has, at
    priority ``below - 1``."""
    keys: set[tuple[OpKind, Format | None]] = set()
    for node in circuit.nodes:
        first = circuit.edges[node.inputs[0]].format if node.inputs else None
        keys.add((node.op.kind, first if first is not None and first.is_quantized else None))
    rules = []
    for kind, fmt in sorted(keys, key=lambda k: (k[0].value, k[1].name() if k[1] else "")):
        suffix = f"@{fmt.name()}" if fmt else ""
        rules.append(Rule(
            id=f"{NOVEL_PREFIX}{kind.value}{suffix}",
            pattern=(PatternElement(op=kind, input=fmt),),
            kernels=(KernelId(NOVEL_MODULE, kind.value),),
            repeat=Repeat(RepeatKind.ONCE), emitter="novel", rows=(1, 2**62),
            modes=frozenset(m for m in Mode), numerics=REFERENCE, priority=below - 1,
            cite="report placeholder: no rule of the device's rule set covers this op"))
    return tuple(rules)


def covering_fuse(circuit: Circuit, rules: Sequence[Rule], available: AvailableKernels,
                  policy: Policy, mode: Mode, rows: int, table: RowTable | None = None
                  ) -> FusionPlan:
    """Fuse with novel placeholders for uncovered nodes. Raises only the errors a covering fuse
    cannot absorb (policy, format conflict, cycle, empty section, zero rows)."""
    below = min((r.priority for r in rules), default=0)
    extra = novel_rules(circuit, below)
    both = (*rules, *extra)
    avail = AvailableKernels(available.kernels | {r.kernels[0] for r in extra}, available.caps)
    if mode is Mode.VERIFY_BATCH:
        assert table is not None, "a verify_batch plan needs its row table"
        return fuse_table(circuit, both, avail, policy, table)
    return fuse(circuit, both, avail, policy, mode, rows)


def is_novel(rule_id: str) -> bool:
    return rule_id.startswith(NOVEL_PREFIX)


@dataclass(frozen=True, slots=True)
class GapSite:
    """Nodes with no rule, grouped by where they sit: ``count`` of them (one per layer)."""

    op: str
    block: str
    local: str
    nodes: tuple[int, ...]


def gaps_of(circuit: Circuit, plan: FusionPlan) -> tuple[GapSite, ...]:
    """The sites of a covering plan's novel groups, in first-node order."""
    sites: dict[tuple[str, str, str], list[int]] = {}
    for group in plan.groups:
        if not is_novel(group.rule):
            continue
        for n in group.nodes:
            node = circuit.nodes[n]
            key = (node.op.name(), circuit.blocks[node.block].name, node.local)
            sites.setdefault(key, []).append(n)
    ordered = sorted(sites.items(), key=lambda kv: min(kv[1]))
    return tuple(GapSite(op, block, local, tuple(sorted(nodes)))
                 for (op, block, local), nodes in ordered)


@dataclass(frozen=True, slots=True)
class Tier:
    """One column of the coverage matrix: a mode at a row count (or a row table)."""

    mode: Mode
    label: str
    rows: int
    table: RowTable | None = None


@dataclass(frozen=True, slots=True)
class CoverageCell:
    """The fuser's answer for one tier: ``launches`` when planned, else the error's message."""

    tier: Tier
    launches: int | None
    reason: str | None
    error_kind: str | None = None

    @property
    def planned(self) -> bool:
        return self.launches is not None


def tiers(tables: Sequence[RowTable]) -> tuple[Tier, ...]:
    """The matrix's tiers in fixed order: decode 1; multi_seq 2..128; verify 2..8;
    verify_batch per table; draft 1; prefill chunks."""
    out = [Tier(Mode.DECODE, "1", 1)]
    out += [Tier(Mode.MULTI_SEQ, str(n), n) for n in MULTI_SEQ_TIERS]
    out += [Tier(Mode.VERIFY, str(k), k) for k in VERIFY_TIERS]
    out += [Tier(Mode.VERIFY_BATCH, t.text(), t.rows(), t) for t in tables]
    out.append(Tier(Mode.DRAFT, "1", 1))
    out += [Tier(Mode.PREFILL, str(c), c) for c in PREFILL_CHUNKS]
    return tuple(out)


def plan_tier(circuit: Circuit, rules: Sequence[Rule], available: AvailableKernels,
              policy: Policy, tier: Tier) -> FusionPlan | FuseError:
    """The plain fuser's plan for a tier, or its typed error as a value."""
    try:
        if tier.table is not None:
            return fuse_table(circuit, rules, available, policy, tier.table)
        return fuse(circuit, rules, available, policy, tier.mode, tier.rows)
    except FuseError as error:
        return error


def coverage_matrix(circuit: Circuit, rules: Sequence[Rule] | None, available: AvailableKernels,
                    policy: Policy, tier_list: Sequence[Tier], no_rules_reason: str = ""
                    ) -> tuple[CoverageCell, ...]:
    """Every tier's answer. With no rule set (``rules is None``) every tier says why."""
    cells = []
    for tier in tier_list:
        if rules is None:
            cells.append(CoverageCell(tier, None, no_rules_reason, "NoRuleSet"))
            continue
        result = plan_tier(circuit, rules, available, policy, tier)
        if isinstance(result, FuseError):
            cells.append(CoverageCell(tier, None, str(result), type(result).__name__))
        else:
            cells.append(CoverageCell(tier, result.launches(), None))
    return tuple(cells)


def unserved(cells: Sequence[CoverageCell], modes: Sequence[Mode]) -> dict[str, list[str]]:
    """Per requested mode, the tiers with no plan (empty list = servable at every tier)."""
    return {m.value: [c.tier.label for c in cells if c.tier.mode is m and not c.planned]
            for m in modes}
