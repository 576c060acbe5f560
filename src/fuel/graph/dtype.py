"""Element types, shapes, backends and devices of the tensor graph.

Decides the closed set of element types the graph can carry and how big each one honestly is.

Invariants:
- ``DType.U32`` and ``DType.I32`` are distinct values and never compare equal: an index operand
  typed u32 stays u32 through recipes, keys and requests (widening it changes which kernel is
  being asked for).
- ``bits`` is exact for every dtype; the fp6 and fp4 families are sub-byte, so
  ``size_in_bytes()`` returns a ``Fraction`` for them rather than rounding up to a byte.
- A ``Shape`` dim is a non-negative ``int`` or a symbol (a ``str`` such as ``"k_len"``) whose
  value is known only at run time; two dims are equal only when they are the same int or the
  same symbol.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction

from fuel.pickling import fast_pickle


class DType(Enum):
    """An element type. The value is the canonical spelling."""

    BOOL = "bool"
    U8 = "u8"
    I8 = "i8"
    U32 = "u32"
    I16 = "i16"
    I32 = "i32"
    I64 = "i64"
    BF16 = "bf16"
    F16 = "f16"
    F32 = "f32"
    F64 = "f64"
    F8E4M3 = "f8e4m3"
    F8E5M2 = "f8e5m2"
    F6E2M3 = "f6e2m3"
    F6E3M2 = "f6e3m2"
    F4E2M1 = "f4e2m1"

    @property
    def bits(self) -> int:
        return _BITS[self]

    def size_in_bytes(self) -> int | Fraction:
        """Bytes per element: an ``int`` for whole-byte types, a ``Fraction`` (3/4, 1/2) for the
        sub-byte fp6/fp4 types, whose storage is packed."""
        whole, rest = divmod(self.bits, 8)
        return whole if rest == 0 else Fraction(self.bits, 8)

    def storage_bytes(self, elements: int) -> int:
        """Bytes needed to store ``elements`` packed elements (rounded up to a whole byte)."""
        return -(-elements * self.bits // 8)

    @property
    def is_float(self) -> bool:
        return self in FLOAT_DTYPES or self in LOW_PRECISION_FLOATS

    @property
    def is_integer(self) -> bool:
        return self in INTEGER_DTYPES

    @classmethod
    def parse(cls, text: str) -> DType:
        return cls(text)


_BITS = {
    DType.BOOL: 8, DType.U8: 8, DType.I8: 8, DType.U32: 32, DType.I16: 16, DType.I32: 32,
    DType.I64: 64, DType.BF16: 16, DType.F16: 16, DType.F32: 32, DType.F64: 64,
    DType.F8E4M3: 8, DType.F8E5M2: 8, DType.F6E2M3: 6, DType.F6E3M2: 6, DType.F4E2M1: 4,
}

FLOAT_DTYPES: tuple[DType, ...] = (DType.BF16, DType.F16, DType.F32, DType.F64)
"""Float types the primitive kernels compute in."""
LOW_PRECISION_FLOATS: tuple[DType, ...] = (
    DType.F8E4M3, DType.F8E5M2, DType.F6E2M3, DType.F6E3M2, DType.F4E2M1,
)
"""Storage-only float types: cast to and from, never computed in by the primitives."""
INTEGER_DTYPES: tuple[DType, ...] = (
    DType.U8, DType.I8, DType.U32, DType.I16, DType.I32, DType.I64,
)
INDEX_DTYPES: tuple[DType, ...] = (DType.U32, DType.I32, DType.I64)
"""Types an index operand (token ids, slots, block tables, context lengths) may have."""


Dim = int | str
"""A concrete extent or a run-time symbol."""


@fast_pickle
@dataclass(frozen=True, slots=True)
class Shape:
    """A tensor shape: a tuple of dims (ints or symbols)."""

    dims: tuple[Dim, ...]

    @classmethod
    def from_dims(cls, dims: Iterable[Dim]) -> Shape:
        dims = tuple(dims)
        for dim in dims:
            if isinstance(dim, bool) or not isinstance(dim, int | str):
                raise TypeError(f"a dim is an int or a symbol name, not {dim!r}")
            if isinstance(dim, int) and dim < 0:
                raise ValueError(f"a dim is non-negative, got {dim}")
        return cls(dims)

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def is_concrete(self) -> bool:
        return all(isinstance(dim, int) for dim in self.dims)

    def numel(self) -> int | None:
        """Element count, or ``None`` when a dim is symbolic."""
        total = 1
        for dim in self.dims:
            if not isinstance(dim, int):
                return None
            total *= dim
        return total

    def __len__(self) -> int:
        return len(self.dims)

    def __getitem__(self, axis: int) -> Dim:
        return self.dims[axis]

    def __str__(self) -> str:
        return "[" + ", ".join(str(dim) for dim in self.dims) + "]"


class BackendId(Enum):
    """A kernel backend. The binding table keys on it; devices name one instance of it."""

    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True, slots=True)
class Device:
    """One device: ``cpu`` or ``cuda:N``."""

    backend: BackendId
    index: int = 0

    @classmethod
    def parse(cls, text: str) -> Device:
        name, _, index = text.partition(":")
        backend = BackendId(name)
        if backend is BackendId.CPU:
            if index:
                raise ValueError(f"the cpu device takes no index: {text!r}")
            return cls(backend)
        return cls(backend, int(index or 0))

    def __str__(self) -> str:
        return "cpu" if self.backend is BackendId.CPU else f"{self.backend.value}:{self.index}"
