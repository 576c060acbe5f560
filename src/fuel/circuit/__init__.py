"""The circuit stage: config.json -> ArchShape -> Circuit -> FusionPlan.

Pure: text and values in, plans out. Loading functions read files; nothing else here touches the
file system, the environment or a clock.
"""

from fuel.circuit.dims import DimError, DimExpr, parse_dim, parse_shape
from fuel.circuit.format import (Format, FormatError, FormatKind, Scale, ScaleKind, UnsizedFormat,
                                 parse as parse_format)
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
    "UnsizedFormat",
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

# Rule files, the fuser, digests, buffers and rendering (issue 3).
from fuel.circuit.buffers import BufferPlan, BufferSlot, plan_buffers
from fuel.circuit.digest import plan_canonical_text, plan_digest
from fuel.circuit.explain import explain, render_explanation
from fuel.circuit.fuser import (
    AvailableKernels,
    Cycle,
    EdgeState,
    EmptySection,
    FormatConflict,
    FuseError,
    FusionPlan,
    Group,
    Policy,
    PolicyMissing,
    RowTableMismatch,
    Uncovered,
    ZeroRows,
    fuse,
    fuse_table,
    group_io,
    section_of,
)
from fuel.circuit.policy import build_policy, load_policy_settings
from fuel.circuit.render import plan_to_json, render_plan
from fuel.circuit.rules import (
    Mode,
    Numerics,
    Repeat,
    Rule,
    RuleError,
    RuleSet,
    load_builtin_rules,
    load_rules,
    parse_rules,
    rules_digest,
)
from fuel.circuit.runs import KernelId, RowTable, RowTableError, resolve_runs

__all__ += [
    "AvailableKernels", "BufferPlan", "BufferSlot", "Cycle", "EdgeState", "EmptySection",
    "FormatConflict", "FuseError", "FusionPlan", "Group", "KernelId", "Mode", "Numerics", "Policy",
    "PolicyMissing", "Repeat", "RowTable", "RowTableError", "RowTableMismatch", "Rule", "RuleError",
    "RuleSet", "Uncovered", "ZeroRows", "build_policy", "explain", "fuse", "fuse_table", "group_io",
    "load_builtin_rules", "load_policy_settings", "load_rules", "parse_rules", "plan_buffers",
    "plan_canonical_text", "plan_digest", "plan_to_json", "render_explanation", "render_plan",
    "resolve_runs", "rules_digest", "section_of",
]

# Per-rank circuits (SPEC §I).
from fuel.circuit.parallel import Parallel, ParallelError, SplitRefused, rank_circuit, rank_circuits

__all__ += ["Parallel", "ParallelError", "SplitRefused", "rank_circuit", "rank_circuits"]
