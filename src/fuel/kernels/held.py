"""Packed weights converted once into a torch kernel's own layout, shared while kernels hold them.

Decides how a variant arm that needs its weight in another layout (torch's int4pack and int8pack
kernels: :mod:`fuel.kernels.int4pack`, :mod:`fuel.kernels.int8pack`) gets it: converted at the
kernel's first call, shared by every kernel that reads the same tensor, and dropped with the last
of them, so a losing arm (measured by the Judge, then discarded) leaves no copy resident.

Invariants:
- A conversion is keyed by the tensor's identity and the conversion's arguments, and checked
  against the tensor itself (the conversion's ``serves``: a weak reference and the version
  counter), so a freed tensor whose id is reused, or a weight updated in place, is converted
  again, never read stale.
- Conversions are held weakly here; the kernels (:func:`converted_kernel`) hold them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


class Converted:
    """What every conversion carries: ``source`` (a weak reference to the packed tensor it was
    made from) and ``version`` (that tensor's version counter then). :meth:`origin` makes the
    pair, :meth:`serves` checks it, :meth:`f32_rows` flattens a kernel's activations."""

    source: Any
    version: int

    @staticmethod
    def origin(packed: Any) -> tuple[weakref.ref, int]:
        return weakref.ref(packed), packed._version

    def serves(self, packed: Any) -> bool:
        return self.source() is packed and self.version == packed._version

    @staticmethod
    def f32_rows(x: Any, cols: int) -> tuple[tuple[int, ...], Any]:
        """``(leading dims, x as contiguous f32 [rows, cols])``."""
        import torch

        rows = x.reshape(-1, cols)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        return tuple(x.shape[:-1]), rows


class HeldConversions:
    """Each packed weight's conversion by ``convert(packed, *args)`` (an object with
    ``serves(packed)``, ``nbytes()`` and ``matmul(x)``), shared while any kernel holds it."""

    def __init__(self, convert: Callable[..., Any]):
        self._convert = convert
        self._held: dict[tuple, weakref.ref] = {}

    def get(self, packed: Any, *args: Any) -> Any:
        key = (id(packed), *args)
        ref = self._held.get(key)
        held = ref() if ref is not None else None
        if held is not None and held.serves(packed):
            return held
        held = self._convert(packed, *args)

        def forget(dead: weakref.ref, key=key) -> None:
            if self._held.get(key) is dead:
                del self._held[key]

        self._held[key] = weakref.ref(held, forget)
        return held

    def resident_bytes(self) -> int:
        """Bytes of the conversions alive now."""
        return sum(held.nbytes() for held in (ref() for ref in list(self._held.values()))
                   if held is not None)

    def __len__(self) -> int:
        return sum(ref() is not None for ref in list(self._held.values()))


def converted_kernel(conversions: HeldConversions, *args: Any) -> Callable[[Any, Any], Any]:
    """A kernel ``run(x, w)`` = ``conversions.get(w, *args).matmul(x)``: the weight converted at
    the first call and held by this kernel (converted again for another or an updated weight)."""
    held = None

    def run(x, w):
        nonlocal held
        if held is None or not held.serves(w):
            held = conversions.get(w, *args)
        return held.matmul(x)
    return run


__all__ = ["Converted", "HeldConversions", "converted_kernel"]
