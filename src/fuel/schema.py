"""Declarative input schemas: pydantic models whose failures become fuel's typed errors.

Decided here: how a file's schema is stated (a :class:`Schema` model: strict types, unknown keys
refused, NaN and infinity refused) and how a :class:`pydantic.ValidationError` becomes ONE of the
project's typed errors. :func:`validate` reports the first failure (an unknown key before any
other, since a misspelt key also makes its intended key "missing"); its key is the failure's
location in dotted form (``device.x.peak_tflops.bf17``, ``pattern[2].roles``) and its detail
names the bad value.

A validator that checks several fields together raises :class:`Invalid` with the (relative)
key at fault, so the error names that field instead of the table holding it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

from fuel.errors import FuelError

M = TypeVar("M", bound=BaseModel)
Fail = Callable[[str | None, str], FuelError]
"""Builds the caller's error from (dotted key or None, detail)."""


class Schema(BaseModel):
    """Base of every input schema: exact types (no ``"1"`` for 1, no ``true`` for 1), unknown
    keys refused, only finite floats."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True,
                              defer_build=True)


class Invalid(ValueError):
    """Raised inside a validator: ``detail`` (naming the value) at ``key``, dotted, relative to
    the model being validated (``None``: the model itself)."""

    def __init__(self, detail: str, key: str | None = None):
        super().__init__(detail)
        self.detail, self.key = detail, key


def _non_blank(text: str) -> str:
    if not text.strip():
        raise Invalid(f"expected a non-empty string, got {text!r}")
    return text


Text = Annotated[str, AfterValidator(_non_blank)]
"""A string with something in it (not empty, not only blanks)."""


_EXPECTED = {
    "int_type": "an integer", "string_type": "a string", "bool_type": "true or false",
    "float_type": "a number", "list_type": "a list", "tuple_type": "a list", "dict_type": "a table",
    "model_type": "a table", "finite_number": "a finite number", "literal_error": None, "enum": None,
}


_BOUNDS = {"greater_than": ("more than", "gt"), "greater_than_equal": ("at least", "ge"),
           "less_than": ("less than", "lt"), "less_than_equal": ("at most", "le")}


def dotted(loc: Sequence[str | int], prefix: str = "") -> str | None:
    """``("device", "x", "modes", 2)`` -> ``device.x.modes[2]``; ``prefix`` goes in front."""
    key = prefix
    for part in loc:
        if part == "[key]":  # pydantic's marker for a dict key (the key itself names it)
            continue
        if isinstance(part, int) or str(part).startswith("["):
            key += f"[{part}]" if isinstance(part, int) else part
        else:
            key += f".{part}" if key else part
    return key or None


class _Shown:
    """A bad value as the message shows it: its repr, cut to 200 characters."""

    def __init__(self, value: Any):
        text = repr(value)
        self.text = text if len(text) <= 200 else text[:197] + "..."

    def __repr__(self) -> str:
        return self.text


def _detail(error: dict[str, Any]) -> str:
    kind, value, ctx = error["type"], _Shown(error.get("input")), error.get("ctx") or {}
    if kind == "missing":
        return "missing"
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "value_error":
        return str(ctx["error"])
    if kind in ("literal_error", "enum"):
        return f"expected {ctx['expected']}, got {value!r}"
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {value!r}"
    if kind in _BOUNDS:
        relation, name = _BOUNDS[kind]
        bound = ctx[name]
        return f"expected {relation} {f'{bound:g}' if isinstance(bound, float) else bound}, got {value!r}"
    if kind in ("too_short", "string_too_short"):
        raw = error.get("input")
        what = "string" if isinstance(raw, str) else "table" if isinstance(raw, dict) else "list"
        return f"expected a non-empty {what}, got {value!r}"
    message = error["msg"]
    return f"{message[0].lower()}{message[1:]}, got {value!r}"


def schema_error(error: ValidationError, fail: Fail, prefix: str = "") -> FuelError:
    """The first failure of ``error`` (an unknown key first) as the caller's typed error."""
    errors = error.errors(include_url=False)
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = list(first["loc"])
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, Invalid) and cause.key:
        loc.append(cause.key)
    return fail(dotted(loc, prefix), _detail(first))


def validate(model: type[M], data: Any, fail: Fail, prefix: str = "",
             context: dict[str, Any] | None = None) -> M:
    """``data`` as a ``model``; any failure is ONE ``fail(key, detail)`` (keys under ``prefix``).
    ``context`` reaches validators as ``info.context``."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as error:
        raise schema_error(error, fail, prefix) from None
