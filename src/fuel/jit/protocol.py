"""The JIT seam's protocol: what a request says, what a synthesizer answers, what it hands over.

Decides the vocabulary shared by the carrier (which builds requests), the synthesizers (which
answer them) and adoption (which verifies and binds what they hand over).

Invariants:
- An operand's element kind is spelled exactly (:class:`ElementKind`); a graph dtype without a
  spelling (i16, bool, the fp8/fp6/fp4 family) has none here, and :func:`dtype_to_element_kind`
  returns ``None`` for it rather than a "nearby" kind. u32 stays u32.
- Per-operand dtypes are part of :meth:`JitRequest.structure_key`: a region over float data and
  u32 indices (paged attention) is describable, and the same region over i32 indices is a
  different kernel with a different key. (Upstream the key had one dtype slot, so such regions
  were declined with ``MixedDtype``; that decline does not exist here.)
- The structure key names the region (its canonical text, slots filled), each operand's element
  kind and rank, and the target arch. Extents are *not* in it: a synthesized kernel serves every
  row count, batch and context length of one structure, so one compile serves a whole model.
- ``Synthesizer.synthesize`` never raises for an ordinary "no": it returns :class:`Declined`
  with a precise reason. ``take_kernel`` hands an artifact over once (``None`` afterwards).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, runtime_checkable

from fuel.graph.dtype import BackendId, DType
from fuel.graph.recipe import PatternNode, canonical_text


class ElementKind(Enum):
    """An operand's element type as the seam spells it (no i16, no bool, no sub-byte floats)."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    S8 = "s8"
    U8 = "u8"
    I32 = "i32"
    I64 = "i64"
    U32 = "u32"

    @property
    def size_in_bytes(self) -> int:
        return _ELEMENT_BYTES[self]

    @property
    def dtype(self) -> DType:
        """The graph dtype this kind spells (the inverse of :func:`dtype_to_element_kind`)."""
        return _DTYPE_OF[self]


_ELEMENT_BYTES = {ElementKind.F32: 4, ElementKind.F16: 2, ElementKind.BF16: 2, ElementKind.S8: 1,
                  ElementKind.U8: 1, ElementKind.I32: 4, ElementKind.I64: 8, ElementKind.U32: 4}
_KIND_OF: dict[DType, ElementKind] = {
    DType.F32: ElementKind.F32, DType.F16: ElementKind.F16, DType.BF16: ElementKind.BF16,
    DType.I8: ElementKind.S8, DType.U8: ElementKind.U8, DType.I32: ElementKind.I32,
    DType.I64: ElementKind.I64, DType.U32: ElementKind.U32,
}
_DTYPE_OF = {kind: dtype for dtype, kind in _KIND_OF.items()}


def dtype_to_element_kind(dtype: DType) -> ElementKind | None:
    """The seam spelling of ``dtype``, or ``None`` when it has none (never a substitute)."""
    return _KIND_OF.get(dtype)


class ArchSku(Enum):
    """The target a kernel is compiled for: the host CPU or a CUDA compute capability."""

    CPU = "cpu"
    SM80 = "sm80"
    SM86 = "sm86"
    SM89 = "sm89"
    SM90 = "sm90"
    SM100 = "sm100"

    @property
    def backend(self) -> BackendId:
        return BackendId.CPU if self is ArchSku.CPU else BackendId.CUDA


@dataclass(frozen=True, slots=True)
class OperandDesc:
    """One operand of a request: rank, extents, row-major strides (in elements), element kind
    and alignment in bytes (the element size: the carrier promises no more)."""

    rank: int
    shape: tuple[int | str, ...]
    strides: tuple[int | str, ...]
    dtype: ElementKind
    alignment: int

    def __str__(self) -> str:
        return f"{self.dtype.value}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True, slots=True)
class JitBudget:
    """What a synthesizer may spend: compile time in milliseconds."""

    max_compile_ms: int


@dataclass(frozen=True, slots=True)
class JitRequest:
    """A region no kernel on the target can run, described for a synthesizer.

    ``operands`` are the fused node's inputs in bind order, then its output.
    """

    region: PatternNode
    operands: tuple[OperandDesc, ...]
    arch: ArchSku
    budget: JitBudget

    @property
    def inputs(self) -> tuple[OperandDesc, ...]:
        return self.operands[:-1]

    @property
    def output(self) -> OperandDesc:
        return self.operands[-1]

    def structure_key(self) -> str:
        """Lower-case hex SHA-256 naming the kernel this request asks for (see module doc)."""
        operands = ";".join(f"{o.dtype.value}/r{o.rank}" for o in self.operands)
        text = f"fuel-jit-key v1\narch={self.arch.value}\noperands={operands}\n" \
               f"region={canonical_text(self.region)}\n"
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Synthesized:
    """The synthesizer built a kernel; ``take_kernel(entry_point)`` hands it over."""

    entry_point: str


@dataclass(frozen=True, slots=True)
class Declined:
    """The synthesizer will not build this region; ``reason`` says exactly why."""

    reason: str


SynthesisResult = Synthesized | Declined


@dataclass(frozen=True, slots=True)
class SynthesizedKernel:
    """The artifact a synthesizer hands over.

    ``run(*inputs)`` takes the fused node's input tensors (torch, bind order) and returns its
    output tensor; ``source`` is the generated code (kept for reports and the disk cache);
    ``compile_ms`` the measured compile (or cache load) time; ``kernel_source`` the stable name
    the table and the Judge record it under (``"jit.numba.cpu"``, ``"jit.triton.cuda"``).

    ``error_bound`` is for a kernel that is *not* within the recipe tolerance by design (it
    rounds on purpose, e.g. activations to 8 bits) but within a bound it states:
    ``error_bound(inputs, reference)`` returns the allowed absolute error of each output element
    (a tensor of the reference's shape, or broadcastable to it, finite and non-negative), which
    adoption adds to the dtype's recipe tolerance when it verifies the kernel. ``None`` (the
    default): the kernel must be within the recipe tolerance alone.
    """

    entry_point: str
    structure_key: str
    backend: BackendId
    kernel_source: str
    run: Callable[..., Any]
    source: str
    compile_ms: float
    from_cache: bool = False
    error_bound: Callable[[tuple[Any, ...], Any], Any] | None = None


@runtime_checkable
class Synthesizer(Protocol):
    """Answers requests with kernels or reasons."""

    name: str
    """A stable name (``"numba"``, ``"triton"``) shown in reports."""

    def synthesize(self, request: JitRequest) -> SynthesisResult: ...

    def take_kernel(self, entry_point: str) -> SynthesizedKernel | None:
        """The artifact behind ``entry_point``, the first time only; ``None`` afterwards."""
        ...

    def on_rejected(self, entry_point: str, report: str) -> None:
        """Adoption refused the kernel (wrong numbers, or slower): ``report`` says why."""
        ...
