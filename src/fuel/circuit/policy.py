"""Documented policy settings and their defaults (``fuel/data/rules/policy.toml``).

Decides what a policy built from the command line contains: every documented setting at its
default, overridden by ``--set key=value``, plus the opted-in levers. The fuser itself takes a
:class:`fuel.circuit.fuser.Policy` and never reads this file (it stays pure); this is the loading
edge.

Invariants: a setting is overridden only if documented, and only with one of its listed values
when it lists them (``row_tiers``: ascending positive ASCII integers, at most
:data:`MAX_ROW_TIER`); a lever is opted in only if a rule set names it; the error names where
the override came from, the key and the value.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from fuel.circuit.fuser import Policy
from fuel.errors import InputError

MAX_ROW_TIER = 1 << 20
"""The largest row tier ``--set row_tiers=...`` may name."""

POLICY_FILE = Path(__file__).resolve().parent.parent / "data" / "rules" / "policy.toml"


@dataclass(frozen=True, slots=True)
class PolicySetting:
    key: str
    default: str
    values: tuple[str, ...] | None
    doc: str


def load_policy_settings(path: str | Path = POLICY_FILE) -> tuple[PolicySetting, ...]:
    """The documented settings, sorted by key."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise InputError(str(path), None, f"cannot load policy settings: {error}") from None
    if doc.get("schema") != 1 or set(doc) - {"schema", "setting"}:
        raise InputError(str(path), "schema", "expected `schema = 1` and `[setting.<key>]` tables only")
    out = []
    for key, table in sorted(doc.get("setting", {}).items()):
        if not isinstance(table, dict) or set(table) - {"default", "values", "doc"}:
            raise InputError(str(path), f"setting.{key}", "expected `default`, optional `values`, `doc`")
        default, values, text = table.get("default"), table.get("values"), table.get("doc")
        if not isinstance(default, str) or not isinstance(text, str) or not text.strip():
            raise InputError(str(path), f"setting.{key}", "needs a string `default` and a non-empty `doc`")
        if values is not None and (not isinstance(values, list) or default not in values):
            raise InputError(str(path), f"setting.{key}.values", "must be a list holding the default")
        out.append(PolicySetting(key, default, tuple(values) if values is not None else None, text))
    return tuple(out)


def parse_assignments(items: Iterable[str], source: str = "--set") -> dict[str, str]:
    """``key=value`` strings to a mapping; a malformed one names ``source`` and the text."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InputError(source, item, "expected `key=value`")
        out[key.strip()] = value.strip()
    return out


def _row_tiers(value: str) -> str | None:
    parts = value.split(",")
    if not all(re.fullmatch(r"[0-9]+", part.strip(), re.ASCII) for part in parts):
        return "expected comma-separated ASCII integers, e.g. 1,2,4,8"
    tiers = [int(part) for part in parts]
    if tiers[0] < 1 or tiers[-1] > MAX_ROW_TIER:
        return f"every tier is from 1 to {MAX_ROW_TIER}"
    if any(a >= b for a, b in zip(tiers, tiers[1:])):
        return "tiers must be strictly ascending"
    return None


_VALUE_CHECKS = {"row_tiers": _row_tiers}


def check_levers(levers: Iterable[str], rule_sets: Iterable[object], source: str = "--lever") -> None:
    """Refuse a lever no rule set names (a typo would otherwise opt in nothing, silently)."""
    known = sorted({rule.numerics.lever for rules in rule_sets if rules is not None for rule in rules
                    if rule.numerics.lever})
    for lever in levers:
        if lever not in known:
            listed = ", ".join(known) if known else "none"
            raise InputError("command line", source,
                             f"`{lever}` is not a lever of the rule sets (levers: {listed})")


def build_policy(overrides: Mapping[str, str] | None = None, levers: Iterable[str] = (),
                 settings: tuple[PolicySetting, ...] | None = None, source: str = "--set") -> Policy:
    """Every documented setting at its default, with ``overrides`` applied, and ``levers``."""
    known = {s.key: s for s in (settings if settings is not None else load_policy_settings())}
    values = {key: s.default for key, s in known.items()}
    for key, value in (overrides or {}).items():
        setting = known.get(key)
        if setting is None:
            raise InputError(source, key, f"unknown policy setting (documented: {', '.join(sorted(known))})")
        if setting.values is not None and value not in setting.values:
            raise InputError(source, key, f"`{value}` is not one of {', '.join(setting.values)}")
        check = _VALUE_CHECKS.get(key)
        if check is not None:
            problem = check(value)
            if problem is not None:
                raise InputError(source, key, f"`{value}`: {problem}")
        values[key] = value
    return Policy(opt_in_levers=frozenset(levers), settings=values)
