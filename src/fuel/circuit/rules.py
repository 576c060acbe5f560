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
The file's schema is stated as pydantic models (``_File``, ``_Rule``, ... at the end; see
:mod:`fuel.schema`); only the rule id is checked by hand, first, since it names the rule in
every later error.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from fuel.circuit.format import Format, FormatError
from fuel.circuit.format import parse as parse_format
from fuel.circuit.ir import LINEAR_ROLES, LayerKind, OpKind
from fuel.circuit.runs import KernelId, RunLaunch, RunSelect, Times
from fuel.errors import InputError
from fuel.schema import Invalid, Schema, Text, validate

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

    def fail(key: str | None, detail: str) -> RuleError:
        return RuleError(file, None, key, detail)

    text = data if isinstance(data, str) else decode_utf8(data, lambda detail: fail(None, detail))
    doc = validate(_File, parse_toml(text, lambda detail: fail(None, detail)), fail)
    rules: list[Rule] = []
    seen: set[str] = set()
    for position, entry in enumerate(doc.rule):
        # The id names the rule in every later error, so it is checked first, by hand.
        rule_id = entry.get("id")
        if not isinstance(rule_id, str) or not rule_id.strip():
            raise fail(f"rule[{position}].id", f"every rule needs a non-empty string `id`, got {rule_id!r}")
        if rule_id in seen:
            raise RuleError(file, rule_id, "id", "duplicate rule id")
        seen.add(rule_id)
        rules.append(validate(_Rule, entry, partial(RuleError, file, rule_id)).rule())
    return RuleSet(tuple(rules), file, rules_digest(data))


# --------------------------------------------------------------------------- the file's schema

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


def _format(edge: bool) -> AfterValidator:
    def check(text: str) -> Format:
        try:
            parsed = parse_format(text)
        except FormatError as error:
            raise Invalid(str(error)) from None
        if edge and not parsed.edge_legal:
            raise Invalid(f"`{text}` is a weight layout; an edge cannot be stored in it")
        return parsed
    return AfterValidator(check)


def _repeat(per_run: bool) -> AfterValidator:
    def check(text: str) -> Repeat:
        parsed = Repeat.parse(text)
        if parsed is None or (parsed.kind is RepeatKind.PER_RUN and not per_run):
            choices = "once | per_row | chunk<n> | per_row_but_last" + (" | per_run" if per_run else "")
            raise Invalid(f"unknown repeat `{text}` (expected {choices})")
        return parsed
    return AfterValidator(check)


def _name(value: Any) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise Invalid(f"expected a dotted identifier, got {value!r}")
    return value


def _range(value: Any) -> tuple[int, int]:
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            or not 1 <= value[0] <= value[1]):
        raise Invalid(f"expected [lo, hi] with 1 <= lo <= hi, got {value!r}")
    return value[0], value[1]


def _role(role: str) -> str:
    if role not in LINEAR_ROLES:
        raise Invalid(f"unknown role {role!r} (one of {', '.join(sorted(LINEAR_ROLES))}): "
                      "it would never match")
    return role


def _enum(kind: type[Enum]) -> Any:
    return Annotated[kind, Field(strict=False)]


_Required = Field(default=None, validate_default=True)  # a missing value gets the check's message
Name = Annotated[str, BeforeValidator(_name)]
Range = Annotated[tuple[int, int], BeforeValidator(_range)]
Role = Annotated[str, AfterValidator(_role)]
EdgeFormat = Annotated[str, _format(edge=True)]


class _File(Schema):
    schema_: Literal[1] = Field(alias="schema")
    rule: list[dict[str, Any]] = []


class _Kernel(Schema):
    module: Name = _Required
    func: Name = _Required


class _Launch(_Kernel):
    times: _enum(Times) = _Required


class _Run(Schema):
    k: Range = _Required
    n: Range = _Required
    contiguous: bool | None = None
    carried: bool | None = None
    launches: Annotated[list[_Launch], Field(min_length=1)]
    copies: _enum(Times) | None = None

    def select(self) -> RunSelect:
        launches = tuple(RunLaunch(KernelId(a.module, a.func), a.times) for a in self.launches)
        return RunSelect(self.k, self.n, self.contiguous, self.carried, launches, self.copies)


class _Element(Schema):
    op: _enum(OpKind)
    role: Role | None = None
    roles: Annotated[list[Role], Field(min_length=1)] | None = None
    format: EdgeFormat | None = None
    layer_kind: _enum(LayerKind) | None = None
    local: str | None = None
    weight: Annotated[str, _format(edge=False)] | None = None
    input: EdgeFormat | None = None
    writes: EdgeFormat | None = None
    keep: bool = False
    sibling: bool = False
    stored: bool = False

    @model_validator(mode="after")
    def _placed(self) -> _Element:
        if self.role is not None and self.roles is not None:
            raise Invalid("give `role` or `roles`, not both", "roles")
        for key in ("role", "roles"):
            if getattr(self, key) is not None and self.op is not OpKind.LINEAR:
                raise Invalid(f"only a linear has a role, not `{self.op.value}`", key)
        if self.format is not None and self.op is not OpKind.ACT_QUANT:
            raise Invalid(f"only an act_quant has a format, not `{self.op.value}`", "format")
        return self

    def element(self) -> PatternElement:
        roles = frozenset(self.roles or ([self.role] if self.role else []))
        return PatternElement(
            op=self.op, roles=roles, format=self.format, layer_kind=self.layer_kind,
            local=self.local, weight=self.weight, input=self.input, writes=self.writes,
            keep=self.keep, sibling=self.sibling, stored=self.stored)


class _Rule(Schema):
    """One ``[[rule]]`` table. Fields are in the order a file is checked: with several
    faults, the first one here is reported."""

    id: str
    modes: Annotated[list[_enum(Mode)], Field(min_length=1)]
    rows: Range
    repeat: Annotated[str, _repeat(per_run=True)]
    copies: Annotated[str, _repeat(per_run=False)] | None = None
    pattern: Annotated[list[_Element], Field(min_length=1)]
    kernels: list[_Kernel]
    emitter: Text
    requires: list[Text] = []
    when: dict[str, str] = {}
    numerics: Literal["reference", "bit_identical", "differs"]
    microtest: Text | None = None
    lever: Text | None = None
    priority: int
    cite: Text
    run: list[_Run] = []

    @model_validator(mode="after")
    def _consistent(self) -> _Rule:
        if self.pattern[0].sibling:
            raise Invalid("the first pattern element cannot be a sibling", "pattern[0].sibling")
        needs = {"bit_identical": "microtest", "differs": "lever"}.get(self.numerics)
        for key in ("microtest", "lever"):
            if getattr(self, key) is not None and key != needs:
                raise Invalid(f"a `{self.numerics}` rule takes no {key}", key)
        if needs and getattr(self, needs) is None:
            what = "name the microtest that proves it" if needs == "microtest" else "name its opt-in lever"
            raise Invalid(f"a `{self.numerics}` rule must {what}", needs)
        per_run = self.repeat.kind is RepeatKind.PER_RUN
        if per_run != bool(self.run):
            if self.run:
                raise Invalid('run selectors need `repeat = "per_run"`', "run")
            raise Invalid("`per_run` needs at least one `[[rule.run]]` selector", "repeat")
        if self.run and set(self.modes) != {Mode.VERIFY_BATCH}:
            raise Invalid("a rule with run selectors serves only `verify_batch` "
                          "(a row table exists only there)", "modes")
        if self.run and self.copies is not None:
            raise Invalid("a per-run rule states copies per selector", "copies")
        return self

    def rule(self) -> Rule:
        kind = NumericsClass(self.numerics)
        return Rule(
            id=self.id, pattern=tuple(e.element() for e in self.pattern),
            kernels=tuple(KernelId(k.module, k.func) for k in self.kernels), repeat=self.repeat,
            emitter=self.emitter, rows=self.rows, modes=frozenset(self.modes),
            numerics=REFERENCE if kind is NumericsClass.REFERENCE else Numerics(
                kind, microtest=self.microtest, lever=self.lever),
            priority=self.priority, cite=self.cite, copies=self.copies,
            requires=frozenset(self.requires), when=tuple(sorted(self.when.items())),
            runs=tuple(r.select() for r in self.run))


def rules_from(rules: RuleSet | Sequence[Rule]) -> tuple[Rule, ...]:
    """The rules of a :class:`RuleSet` or a plain sequence."""
    return rules.rules if isinstance(rules, RuleSet) else tuple(rules)
