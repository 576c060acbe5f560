"""The JIT seam: the carrier, the synthesizers (numba for the CPU, Triton for CUDA) and
verified, cost-gated adoption (SPEC §E).

Public API: :func:`jit_request_for_unplaceable_fused` (the carrier), the protocol values
(:class:`JitRequest`, :class:`OperandDesc`, :class:`JitBudget`, :class:`ElementKind`,
:class:`ArchSku`, :class:`Synthesized`, :class:`Declined`, :class:`SynthesizedKernel`,
:class:`Synthesizer`). The synthesizers and adoption import numba/torch/triton, so they are
imported from their modules (``fuel.jit.numba_synth``, ``fuel.jit.triton_synth``,
``fuel.jit.adopt``) and never from here: importing ``fuel.jit`` stays cheap for planning code.
"""

from fuel.jit.carrier import jit_request_for_unplaceable_fused
from fuel.jit.protocol import (
    ArchSku, Declined, ElementKind, JitBudget, JitRequest, OperandDesc, SynthesisResult,
    Synthesized, SynthesizedKernel, Synthesizer, dtype_to_element_kind,
)

__all__ = [
    "ArchSku", "Declined", "ElementKind", "JitBudget", "JitRequest", "OperandDesc",
    "SynthesisResult", "Synthesized", "SynthesizedKernel", "Synthesizer", "dtype_to_element_kind",
    "jit_request_for_unplaceable_fused",
]
