"""Golden plans: the fixed matrix of (model, rule set, mode, rows | table) whose rendered plans
are checked into ``tests/circuit/golden/`` and compared byte for byte.

Decides the matrix and each case's file name; ``scripts/regen_golden.py`` writes the files and
``tests/circuit/test_golden.py`` compares them. Rendering is the ordinary renderer with the
documented default policy, no levers, and the offline kernel view of each rule set.

Invariant: a case's text depends only on the circuit, the rule set, the policy defaults and the
code, never on paths or the machine (the rule set is labelled by name only).
"""

from __future__ import annotations

from dataclasses import dataclass

from fuel.circuit.rules import Mode

MODELS = ("smollm2-135m", "llama-3.1-8b", "qwen2.5-7b", "mixtral-8x7b")
RULE_SETS = {"smollm2-135m": ("cpu", "cuda"), "llama-3.1-8b": ("cuda",), "qwen2.5-7b": ("cuda",),
             "mixtral-8x7b": ("cuda",)}
ROWS = {Mode.DECODE: (1,), Mode.DRAFT: (1,), Mode.MULTI_SEQ: (2, 8, 32), Mode.VERIFY: (2, 3, 4),
        Mode.PREFILL: (4096,)}
TABLES = ("4x3 3x1!", "2x8", "uncarried: 3x2 1x4 2x1!")


@dataclass(frozen=True, slots=True)
class GoldenCase:
    model: str
    rules: str
    mode: Mode
    rows: int | None = None
    table: str | None = None

    @property
    def path(self) -> str:
        """Relative path under the golden folder."""
        if self.table is not None:
            slug = self.table.replace("uncarried: ", "u-").replace("!", "f").replace(" ", "_")
            return f"{self.model}/{self.rules}/{self.mode.value}-{slug}.txt"
        return f"{self.model}/{self.rules}/{self.mode.value}-{self.rows}.txt"


def cases() -> tuple[GoldenCase, ...]:
    out = []
    for model in MODELS:
        for rules in RULE_SETS[model]:
            for mode, rows in ROWS.items():
                out.extend(GoldenCase(model, rules, mode, rows=r) for r in rows)
            out.extend(GoldenCase(model, rules, Mode.VERIFY_BATCH, table=t) for t in TABLES)
    return tuple(out)


def render_case(case: GoldenCase) -> str:
    """The rendered plan of ``case`` (loads the zoo model and the built-in rule set)."""
    from fuel.circuit import zoo
    from fuel.circuit.fuser import AvailableKernels, fuse, fuse_table
    from fuel.circuit.policy import build_policy
    from fuel.circuit.render import render_plan
    from fuel.circuit.rules import load_builtin_rules
    from fuel.circuit.runs import RowTable

    circuit = zoo.load(case.model)
    rules = load_builtin_rules(case.rules)
    policy = build_policy()
    available = AvailableKernels.all_named_by(rules)
    if case.table is not None:
        plan = fuse_table(circuit, rules, available, policy, RowTable.parse(case.table))
    else:
        plan = fuse(circuit, rules, available, policy, case.mode, case.rows)
    return render_plan(circuit, plan, policy, case.rules)
