"""Fusion rule files (SPEC §A5): which op chains a target's kernels run, where each applies, and
how its numerics relate to the unfused reference.

A rule names a pattern (an op chain), the kernels its emitter launches, how often they launch
(``repeat``), the modes and rows it serves, the capabilities and policy settings it needs, its
numerics class, a priority (higher wins) and a ``cite`` saying why it exists.

Invariants of a loaded :class:`Rule` (every violation is a :class:`RuleError` naming the file,
the rule id and the field):
- ids are unique in a file; ``rows`` is ``[lo, hi]`` with ``1 <= lo <= hi``; ``modes`` is
  non-empty; ``cite`` is non-empty; the pattern is non-empty and its first element is not a
  ``sibling``.
- ``bit_identical`` names a ``microtest`` and no ``lever``; ``differs`` names a ``lever`` and no
  ``microtest``; ``reference`` names neither.
- ``role`` / ``roles`` appear only on ``linear`` elements and never together, and name roles of
  the closed set :data:`~fuel.circuit.ir.LINEAR_ROLES` (an unknown role would silently never
  match, so it is a load error); ``format`` only on
  ``act_quant``; ``input`` and ``writes`` are edge-legal formats.
- ``repeat = "per_run"`` if and only if the rule has ``[[rule.run]]`` selectors, and such a rule
  serves only ``verify_batch`` (a row table exists only there).

A ``linear`` element without ``role``/``roles`` matches every linear, and an ``act_quant``
element without ``format`` every act_quant: the role-less catch-all form the built-in rule sets
use for their single-op defaults (``cpu.toml``'s and ``cuda.toml``'s "any role" linear rules),
which make a rule set total. A rule that means "every linear" omits the role; it never spells
one.

Loading (``load_rules``, ``parse_rules``) is the edge; everything else here is plain values.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from fuel.circuit.format import Format, FormatError
from fuel.circuit.format import parse as parse_format
from fuel.circuit.ir import LINEAR_ROLES, LayerKind, OpKind
from fuel.circuit.runs import KernelId, RunLaunch, RunSelect, Times
from fuel.errors import InputError

SCHEMA = 1


class Mode(Enum):
    """Which forward a plan is for. ``draft`` runs the draft section; every other mode runs the
    main section. ``prefill`` runs a prompt chunk (rows = chunk length)."""

    DRAFT = "draft"
    DECODE = "decode"
    MULTI_SEQ = "multi_seq"
    VERIFY = "verify"
    VERIFY_BATCH = "verify_batch"
    PREFILL = "prefill"

    @classmethod
    def parse(cls, text: str) -> Mode | None:
        return next((m for m in cls if m.value == text), None)

    @property
    def default_rows(self) -> int | None:
        """Rows a plan for this mode has when none are given: one for decode and draft; the
        other modes must say."""
        return 1 if self in (Mode.DECODE, Mode.DRAFT) else None


class RepeatKind(Enum):
    ONCE = "once"
    PER_ROW = "per_row"
    CHUNK = "chunk"
    PER_ROW_BUT_LAST = "per_row_but_last"
    PER_RUN = "per_run"


_CHUNK = re.compile(r"^chunk([1-9][0-9]*)$")


@dataclass(frozen=True, slots=True)
class Repeat:
    """How often a group's kernels (or copies) launch per step."""

    kind: RepeatKind
    chunk: int = 0

    @classmethod
    def parse(cls, text: str) -> Repeat | None:
        if m := _CHUNK.match(text):
            return cls(RepeatKind.CHUNK, int(m.group(1)))
        kind = next((k for k in RepeatKind if k.value == text and k is not RepeatKind.CHUNK), None)
        return None if kind is None else cls(kind)

    def name(self) -> str:
        return f"chunk{self.chunk}" if self.kind is RepeatKind.CHUNK else self.kind.value

    def count(self, rows: int) -> int | None:
        """Launches per kernel at ``rows`` rows; ``None`` for ``per_run`` (the runs decide)."""
        match self.kind:
            case RepeatKind.ONCE:
                return 1
            case RepeatKind.PER_ROW:
                return rows
            case RepeatKind.CHUNK:
                return -(-rows // self.chunk)
            case RepeatKind.PER_ROW_BUT_LAST:
                return max(rows - 1, 0)
            case RepeatKind.PER_RUN:
                return None
        raise AssertionError(self)

    def __str__(self) -> str:
        return self.name()


ONCE = Repeat(RepeatKind.ONCE)
PER_RUN = Repeat(RepeatKind.PER_RUN)


class NumericsClass(Enum):
    REFERENCE = "reference"
    BIT_IDENTICAL = "bit_identical"
    DIFFERS = "differs"


@dataclass(frozen=True, slots=True)
class Numerics:
    """How a rule's output relates to the reference: ``reference``, ``bit_identical`` (proven
    byte-identical by ``microtest``) or ``differs`` (selected only when ``lever`` is opted in)."""

    kind: NumericsClass
    microtest: str | None = None
    lever: str | None = None

    def name(self) -> str:
        match self.kind:
            case NumericsClass.BIT_IDENTICAL:
                return f"bit_identical({self.microtest})"
            case NumericsClass.DIFFERS:
                return f"differs({self.lever})"
        return self.kind.value

    def __str__(self) -> str:
        return self.name()


REFERENCE = Numerics(NumericsClass.REFERENCE)


@dataclass(frozen=True, slots=True)
class PatternElement:
    """One element of a rule's op chain. ``roles`` empty means any role (for ``linear``);
    ``format`` ``None`` means any format (for ``act_quant``)."""

    op: OpKind
    roles: frozenset[str] = frozenset()
    format: Format | None = None
    layer_kind: LayerKind | None = None
    local: str | None = None
    weight: Format | None = None
    input: Format | None = None
    writes: Format | None = None
    keep: bool = False
    sibling: bool = False
    stored: bool = False

    def describe(self) -> str:
        """The element as a rule file would spell its op (``linear:{q,k,v}``)."""
        if self.roles:
            roles = sorted(self.roles)
            return f"linear:{roles[0]}" if len(roles) == 1 else "linear:{" + ",".join(roles) + "}"
        if self.format is not None:
            return f"{self.op.value}:{self.format.name()}"
        return self.op.value


@dataclass(frozen=True, slots=True)
class Rule:
    """One fusion rule, as loaded. ``when`` is sorted by key."""

    id: str
    pattern: tuple[PatternElement, ...]
    kernels: tuple[KernelId, ...]
    repeat: Repeat
    emitter: str
    rows: tuple[int, int]
    modes: frozenset[Mode]
    numerics: Numerics
    priority: int
    cite: str
    copies: Repeat | None = None
    requires: frozenset[str] = frozenset()
    when: tuple[tuple[str, str], ...] = ()
    runs: tuple[RunSelect, ...] = ()

    def all_kernels(self) -> tuple[KernelId, ...]:
        """The rule's kernels and every kernel a run selector launches, deduplicated, sorted:
        all of them must be present for the rule to apply."""
        named = set(self.kernels)
        named.update(launch.kernel for select in self.runs for launch in select.launches)
        return tuple(sorted(named))


@dataclass(frozen=True, slots=True)
class RuleSet:
    """The rules of one file in file order, with where they came from and the SHA-256 of the
    file's bytes (:func:`rules_digest`)."""

    rules: tuple[Rule, ...]
    source: str = "<rules>"
    digest: str = ""

    def __iter__(self):
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)


class RuleError(InputError):
    """A rule file that does not load. ``rule`` is the rule id (``None`` for file-level errors)
    and ``field`` the offending field in dotted form."""

    def __init__(self, file: str, rule: str | None, field_name: str | None, detail: str):
        self.rule = rule
        self.field = field_name
        # The key reads `rule[<id>].<field>` so one message names file, rule and field.
        if rule is None:
            key = field_name
        else:
            key = f"rule[{rule}]" + (f".{field_name}" if field_name else "")
        super().__init__(file, key, detail)


def rules_digest(data: bytes | str) -> str:
    """Lower-case hex SHA-256 of a rule file's bytes."""
    raw = data.encode() if isinstance(data, str) else data
    return hashlib.sha256(raw).hexdigest()


def load_rules(path: str | Path) -> RuleSet:
    """Load a rule file. Raises :class:`RuleError` naming file, rule and field."""
    from fuel.inputs import read_bytes

    path = Path(path)
    raw = read_bytes(path, lambda detail: RuleError(str(path), None, None, detail))
    return parse_rules(raw, str(path))


BUILTIN_RULE_SETS = ("cpu", "cuda")
"""Rule sets shipped under ``fuel/data/rules/``."""


def builtin_rules_path(name: str) -> Path:
    """The path of a built-in rule set (``cpu``, ``cuda``)."""
    if name not in BUILTIN_RULE_SETS:
        raise RuleError(name, None, None, f"no built-in rule set `{name}` (built in: "
                                          f"{', '.join(BUILTIN_RULE_SETS)})")
    return Path(__file__).resolve().parent.parent / "data" / "rules" / f"{name}.toml"


def load_builtin_rules(name: str) -> RuleSet:
    return load_rules(builtin_rules_path(name))


def parse_rules(data: bytes | str, file: str = "<rules>") -> RuleSet:
    """Parse rule-file text into a :class:`RuleSet` (rules in file order)."""
    from fuel.inputs import decode_utf8, parse_toml

    def fail(detail: str) -> RuleError:
        return RuleError(file, None, None, detail)

    text = data if isinstance(data, str) else decode_utf8(data, fail)
    doc = parse_toml(text, fail)
    _only_keys(doc, {"schema", "rule"}, file, None, "")
    if doc.get("schema") != SCHEMA:
        raise RuleError(file, None, "schema", f"schema is {doc.get('schema')!r}; this build reads {SCHEMA}")
    entries = doc.get("rule", [])
    if not isinstance(entries, list):
        raise RuleError(file, None, "rule", "expected an array of tables `[[rule]]`")
    rules: list[Rule] = []
    seen: set[str] = set()
    for position, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise RuleError(file, None, f"rule[{position}]", "expected a table")
        rule_id = entry.get("id")
        if not isinstance(rule_id, str) or not rule_id.strip():
            raise RuleError(file, None, f"rule[{position}].id", "every rule needs a non-empty string `id`")
        if rule_id in seen:
            raise RuleError(file, rule_id, "id", "duplicate rule id")
        seen.add(rule_id)
        rules.append(_RuleReader(file, rule_id, entry).read())
    return RuleSet(tuple(rules), file, rules_digest(data))


_RULE_KEYS = {"id", "pattern", "kernels", "repeat", "copies", "emitter", "rows", "modes", "requires",
              "when", "numerics", "microtest", "lever", "priority", "cite", "run"}
_ELEMENT_KEYS = {"op", "role", "roles", "format", "layer_kind", "local", "weight", "input", "writes",
                 "keep", "sibling", "stored"}
_RUN_KEYS = {"k", "n", "contiguous", "carried", "launches", "copies"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


def _only_keys(table: Mapping[str, Any], allowed: set[str], file: str, rule: str | None,
               prefix: str) -> None:
    for key in table:  # reports the first unknown key in file order
        if key not in allowed:
            raise RuleError(file, rule, f"{prefix}{key}",
                            f"unknown key (expected one of {', '.join(sorted(allowed))})")


@dataclass
class _RuleReader:
    """Reads one ``[[rule]]`` table; every error names the file, this rule and the field."""

    file: str
    rule_id: str
    entry: dict[str, Any]
    _pattern: list[PatternElement] = field(default_factory=list)

    def fail(self, field_name: str, detail: str) -> RuleError:
        return RuleError(self.file, self.rule_id, field_name, detail)

    def required(self, key: str, kind: type | tuple[type, ...], what: str) -> Any:
        if key not in self.entry:
            raise self.fail(key, f"missing (expected {what})")
        return self.typed(key, self.entry[key], kind, what)

    def typed(self, key: str, value: Any, kind: type | tuple[type, ...], what: str) -> Any:
        # bool is an int in Python; a `true` where a number belongs is still a type error.
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(key, f"expected {what}, got {value!r}")
        return value

    def format(self, key: str, text: Any, edge: bool) -> Format:
        self.typed(key, text, str, "a format name")
        try:
            parsed = parse_format(text)
        except FormatError as error:
            raise self.fail(key, str(error)) from None
        if edge and not parsed.edge_legal:
            raise self.fail(key, f"`{text}` is a weight layout; an edge cannot be stored in it")
        return parsed

    def read(self) -> Rule:
        _only_keys(self.entry, _RULE_KEYS, self.file, self.rule_id, "")
        modes = self.modes()
        rows = self.rows()
        repeat = self.repeat("repeat", self.required("repeat", str, "a repeat"), allow_per_run=True)
        copies = None
        if "copies" in self.entry:
            copies = self.repeat("copies", self.typed("copies", self.entry["copies"], str, "a repeat"),
                                 allow_per_run=False)
        pattern = self.pattern()
        kernels = tuple(self.kernel(f"kernels[{i}]", k, {"module", "func"})[0]
                        for i, k in enumerate(self.required("kernels", list, "an array of {module, func}")))
        emitter = self.required("emitter", str, "an emitter id")
        if not emitter.strip():
            raise self.fail("emitter", "empty emitter id")
        requires = self.required_list("requires")
        when = self.when()
        numerics = self.numerics()
        priority = self.required("priority", int, "an integer")
        cite = self.required("cite", str, "a sentence saying why this rule exists")
        if not cite.strip():
            raise self.fail("cite", "empty cite (say why this rule exists)")
        runs = self.runs()
        if (repeat.kind is RepeatKind.PER_RUN) != bool(runs):
            if runs:
                raise self.fail("run", "run selectors need `repeat = \"per_run\"`")
            raise self.fail("repeat", "`per_run` needs at least one `[[rule.run]]` selector")
        if runs and modes != frozenset({Mode.VERIFY_BATCH}):
            raise self.fail("modes", "a rule with run selectors serves only `verify_batch` "
                                     "(a row table exists only there)")
        if runs and copies is not None:
            raise self.fail("copies", "a per-run rule states copies per selector")
        return Rule(id=self.rule_id, pattern=pattern, kernels=kernels, repeat=repeat, emitter=emitter,
                    rows=rows, modes=modes, numerics=numerics, priority=priority, cite=cite,
                    copies=copies, requires=frozenset(requires), when=when, runs=runs)

    def modes(self) -> frozenset[Mode]:
        names = self.required("modes", list, "a list of modes")
        if not names:
            raise self.fail("modes", "empty modes (the rule would never apply)")
        modes = set()
        for name in names:
            mode = Mode.parse(name) if isinstance(name, str) else None
            if mode is None:
                raise self.fail("modes", f"unknown mode {name!r} (expected one of "
                                         f"{', '.join(m.value for m in Mode)})")
            modes.add(mode)
        return frozenset(modes)

    def rows(self) -> tuple[int, int]:
        rows = self.required("rows", list, "[lo, hi]")
        if (len(rows) != 2 or not all(isinstance(r, int) and not isinstance(r, bool) for r in rows)
                or not 1 <= rows[0] <= rows[1]):
            raise self.fail("rows", f"rows must be [lo, hi] with 1 <= lo <= hi, got {rows!r}")
        return rows[0], rows[1]

    def repeat(self, key: str, text: str, allow_per_run: bool) -> Repeat:
        parsed = Repeat.parse(text)
        if parsed is None or (parsed.kind is RepeatKind.PER_RUN and not allow_per_run):
            choices = "once | per_row | chunk<n> | per_row_but_last" + (" | per_run" if allow_per_run else "")
            raise self.fail(key, f"unknown repeat `{text}` (expected {choices})")
        return parsed

    def required_list(self, key: str) -> list[str]:
        values = self.typed(key, self.entry.get(key, []), list, "a list of names")
        for value in values:
            if not isinstance(value, str) or not value.strip():
                raise self.fail(key, f"expected non-empty names, got {value!r}")
        return values

    def when(self) -> tuple[tuple[str, str], ...]:
        table = self.typed("when", self.entry.get("when", {}), dict, "a table of setting = value")
        for key, value in table.items():
            if not isinstance(value, str):
                raise self.fail(f"when.{key}", f"expected a string value, got {value!r}")
        return tuple(sorted(table.items()))

    def numerics(self) -> Numerics:
        text = self.required("numerics", str, "reference | bit_identical | differs")
        microtest = self.entry.get("microtest")
        lever = self.entry.get("lever")
        for key, value in (("microtest", microtest), ("lever", lever)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise self.fail(key, f"expected a non-empty name, got {value!r}")
        match text:
            case "reference":
                if microtest is not None:
                    raise self.fail("microtest", "a `reference` rule takes no microtest")
                if lever is not None:
                    raise self.fail("lever", "a `reference` rule takes no lever")
                return REFERENCE
            case "bit_identical":
                if lever is not None:
                    raise self.fail("lever", "a `bit_identical` rule takes no lever")
                if microtest is None:
                    raise self.fail("microtest", "a `bit_identical` rule must name the microtest "
                                                 "that proves it")
                return Numerics(NumericsClass.BIT_IDENTICAL, microtest=microtest)
            case "differs":
                if microtest is not None:
                    raise self.fail("microtest", "a `differs` rule takes no microtest")
                if lever is None:
                    raise self.fail("lever", "a `differs` rule must name its opt-in lever")
                return Numerics(NumericsClass.DIFFERS, lever=lever)
        raise self.fail("numerics", f"unknown numerics class `{text}` "
                                    "(expected reference | bit_identical | differs)")

    def kernel(self, key: str, table: Any, allowed: set[str]) -> tuple[KernelId, dict[str, Any]]:
        self.typed(key, table, dict, "a table {module, func}")
        _only_keys(table, allowed, self.file, self.rule_id, f"{key}.")
        parts = []
        for part in ("module", "func"):
            value = table.get(part)
            if not isinstance(value, str) or not _NAME.match(value):
                raise self.fail(f"{key}.{part}", f"expected a dotted identifier, got {value!r}")
            parts.append(value)
        return KernelId(parts[0], parts[1]), table

    def pattern(self) -> tuple[PatternElement, ...]:
        elements = self.required("pattern", list, "an array of pattern elements")
        if not elements:
            raise self.fail("pattern", "empty pattern")
        out = []
        for i, element in enumerate(elements):
            out.append(self.element(f"pattern[{i}]", element))
        if out[0].sibling:
            raise self.fail("pattern[0].sibling", "the first pattern element cannot be a sibling")
        return tuple(out)

    def element(self, key: str, table: Any) -> PatternElement:
        self.typed(key, table, dict, "a table")
        _only_keys(table, _ELEMENT_KEYS, self.file, self.rule_id, f"{key}.")
        op_text = table.get("op")
        op = next((o for o in OpKind if o.value == op_text), None)
        if op is None:
            raise self.fail(f"{key}.op", f"unknown op {op_text!r}")
        if "role" in table and "roles" in table:
            raise self.fail(f"{key}.roles", "give `role` or `roles`, not both")
        roles: set[str] = set()
        for role_key in ("role", "roles"):
            if role_key not in table:
                continue
            if op is not OpKind.LINEAR:
                raise self.fail(f"{key}.{role_key}", f"only a linear has a role, not `{op.value}`")
            values = table[role_key] if role_key == "roles" else [table[role_key]]
            if not isinstance(values, list) or not values:
                raise self.fail(f"{key}.{role_key}", "expected a non-empty list of roles")
            for role in values:
                if not isinstance(role, str) or not _NAME.match(role):
                    raise self.fail(f"{key}.{role_key}", f"malformed role {role!r}")
                if role not in LINEAR_ROLES:
                    raise self.fail(f"{key}.{role_key}", f"unknown role {role!r} (one of "
                                    f"{', '.join(sorted(LINEAR_ROLES))}): it would never match")
                roles.add(role)
        fmt = None
        if "format" in table:
            if op is not OpKind.ACT_QUANT:
                raise self.fail(f"{key}.format", f"only an act_quant has a format, not `{op.value}`")
            fmt = self.format(f"{key}.format", table["format"], edge=True)
        layer_kind = None
        if "layer_kind" in table:
            text = table["layer_kind"]
            layer_kind = next((k for k in LayerKind if k.value == text), None)
            if layer_kind is None:
                raise self.fail(f"{key}.layer_kind", f"unknown layer kind {text!r}")
        local = table.get("local")
        if local is not None:
            self.typed(f"{key}.local", local, str, "a template-local node id")
        flags = {}
        for flag in ("keep", "sibling", "stored"):
            flags[flag] = self.typed(f"{key}.{flag}", table.get(flag, False), bool, "true or false")
        return PatternElement(
            op=op, roles=frozenset(roles), format=fmt, layer_kind=layer_kind, local=local,
            weight=self.format(f"{key}.weight", table["weight"], edge=False) if "weight" in table else None,
            input=self.format(f"{key}.input", table["input"], edge=True) if "input" in table else None,
            writes=self.format(f"{key}.writes", table["writes"], edge=True) if "writes" in table else None,
            **flags)

    def runs(self) -> tuple[RunSelect, ...]:
        selectors = self.typed("run", self.entry.get("run", []), list, "an array of `[[rule.run]]` tables")
        out = []
        for i, table in enumerate(selectors):
            key = f"run[{i}]"
            self.typed(key, table, dict, "a table")
            _only_keys(table, _RUN_KEYS, self.file, self.rule_id, f"{key}.")
            ranges = []
            for axis in ("k", "n"):
                value = table.get(axis)
                if (not isinstance(value, list) or len(value) != 2
                        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
                        or not 1 <= value[0] <= value[1]):
                    raise self.fail(f"{key}.{axis}", f"expected [lo, hi] with 1 <= lo <= hi, got {value!r}")
                ranges.append((value[0], value[1]))
            conditions = []
            for flag in ("contiguous", "carried"):
                value = table.get(flag)
                if value is not None:
                    self.typed(f"{key}.{flag}", value, bool, "true or false")
                conditions.append(value)
            launches_table = table.get("launches")
            if not isinstance(launches_table, list) or not launches_table:
                raise self.fail(f"{key}.launches", "expected a non-empty array of {module, func, times}")
            launches = []
            for j, launch in enumerate(launches_table):
                lkey = f"{key}.launches[{j}]"
                kernel, raw = self.kernel(lkey, launch, {"module", "func", "times"})
                launches.append(RunLaunch(kernel, self.times(f"{lkey}.times", raw.get("times"))))
            copies = self.times(f"{key}.copies", table["copies"]) if "copies" in table else None
            out.append(RunSelect(ranges[0], ranges[1], conditions[0], conditions[1], tuple(launches), copies))
        return tuple(out)

    def times(self, key: str, text: Any) -> Times:
        times = next((t for t in Times if t.value == text), None)
        if times is None:
            raise self.fail(key, f"unknown times {text!r} (expected once | per_seq | per_row | "
                                 "per_seq_row_but_last)")
        return times


def rules_from(rules: RuleSet | Sequence[Rule]) -> tuple[Rule, ...]:
    """The rules of a :class:`RuleSet` or a plain sequence."""
    return rules.rules if isinstance(rules, RuleSet) else tuple(rules)
