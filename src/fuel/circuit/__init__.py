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

# Circuit files, config maps, instantiation and the model zoo (issue 2).
from fuel.circuit.config_map import (
    ConfigMap,
    ConfigMapError,
    ConfigRefused,
    MissingKey,
    RequirementViolated,
    UnclassifiedKey,
    UnsupportedModelType,
    load_config,
    load_config_map,
    shape_from_config,
    shape_from_file,
)
from fuel.circuit.instantiate import InstantiateError, instantiate
from fuel.circuit.template import CircuitLoadError, CircuitTemplate, load_circuit
from fuel.circuit import zoo

__all__ += [
    "CircuitLoadError", "CircuitTemplate", "ConfigMap", "ConfigMapError", "ConfigRefused",
    "InstantiateError", "MissingKey", "RequirementViolated", "UnclassifiedKey",
    "UnsupportedModelType", "instantiate", "load_circuit", "load_config", "load_config_map",
    "shape_from_config", "shape_from_file", "zoo",
]
