"""Dim expressions (SPEC §A2): sums of products of dim names and non-zero integers.

``q_heads*head_dim+kv_heads*head_dim*2`` parses to terms ``[(1, (q_heads, head_dim)),
(2, (kv_heads, head_dim))]``. Evaluation checks for overflow past the signed 64-bit range (a
shape no device holds, and the bound every consumer of a dim can represent).

Invariants: ``DimExpr.text`` is the expression as written with whitespace removed, so it is the
canonical text the plan digest hashes; ``names`` is every dim the expression mentions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from fuel.errors import FuelError

MAX_DIM = 2**63 - 1

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_INT = re.compile(r"^[0-9]+$")


class DimError(FuelError):
    """A malformed, undeclared or overflowing dim expression. ``reason`` is the bare cause;
    callers wrap it with the file and key."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True, slots=True)
class DimExpr:
    """A parsed dim expression: ``terms`` are (coefficient, factor names)."""

    text: str
    terms: tuple[tuple[int, tuple[str, ...]], ...]

    @property
    def names(self) -> frozenset[str]:
        return frozenset(name for _, factors in self.terms for name in factors)

    def mentions(self, name: str) -> bool:
        return name in self.names

    def evaluate(self, values: Mapping[str, int]) -> int:
        """The expression's value; raises :class:`DimError` on an unknown name or overflow."""
        total = 0
        for coefficient, factors in self.terms:
            product = coefficient
            for name in factors:
                if name not in values:
                    raise DimError(f"dim `{name}` in `{self.text}` has no value")
                product *= values[name]
                if product > MAX_DIM:
                    raise DimError(f"`{self.text}` overflows 64 bits")
            total += product
            if total > MAX_DIM:
                raise DimError(f"`{self.text}` overflows 64 bits")
        return total

    def __str__(self) -> str:
        return self.text


def parse_dim(text: str, declared: frozenset[str] | set[str] | None = None) -> DimExpr:
    """Parse ``text``; with ``declared``, every name must be one of them."""
    compact = "".join(text.split())
    if not compact:
        raise DimError("empty dim expression")
    terms = []
    for term_text in compact.split("+"):
        if not term_text:
            raise DimError(f"malformed dim expression `{text}` (empty term)")
        coefficient = 1
        factors: list[str] = []
        for factor in term_text.split("*"):
            if _INT.match(factor):
                value = int(factor)
                if value == 0:
                    raise DimError(f"malformed dim expression `{text}` (zero factor)")
                coefficient *= value
                if coefficient > MAX_DIM:
                    raise DimError(f"`{text}` overflows 64 bits")
            elif _NAME.match(factor):
                if declared is not None and factor not in declared:
                    raise DimError(f"undeclared dim `{factor}` in `{text}`")
                factors.append(factor)
            else:
                raise DimError(f"malformed dim expression `{text}` (bad factor `{factor}`)")
        terms.append((coefficient, tuple(factors)))
    return DimExpr(compact, tuple(terms))


def parse_shape(text: str, declared: frozenset[str] | set[str]) -> tuple[DimExpr, DimExpr]:
    """Parse an edge shape ``"<rows expr> x <dim expr>"``; the rows expression must mention
    ``n`` (the step's rows), the dim expression must not."""
    parts = re.split(r"\s+x\s+", text.strip())
    if len(parts) != 2:
        raise DimError(f"shape `{text}` is not `<rows> x <dim>`")
    rows = parse_dim(parts[0], set(declared) | {"n"})
    if not rows.mentions("n"):
        raise DimError(f"rows expression `{parts[0]}` of shape `{text}` does not mention `n`")
    dim = parse_dim(parts[1], declared)
    return rows, dim
