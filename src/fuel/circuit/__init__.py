"""The circuit stage: config.json -> ArchShape -> Circuit -> FusionPlan.

Pure: text and values in, plans out. Loading functions read files; nothing else here touches the
file system, the environment or a clock.
"""

from fuel.circuit.dims import DimError, DimExpr, parse_dim, parse_shape
from fuel.circuit.format import Format, FormatError, FormatKind, Scale, ScaleKind, parse as parse_format
from fuel.circuit.ir import (
    HEAVY_OPS,
    WEIGHT_OPS,
    ArchShape,
    BlockInstance,
    Circuit,
    Edge,
    LayerKind,
    Node,
    Op,
    OpKind,
    Section,
)

__all__ = [
    "HEAVY_OPS", "WEIGHT_OPS", "ArchShape", "BlockInstance", "Circuit", "DimError", "DimExpr",
    "Edge", "Format", "FormatError", "FormatKind", "LayerKind", "Node", "Op", "OpKind", "Scale",
    "ScaleKind", "Section", "parse_dim", "parse_format", "parse_shape",
]
