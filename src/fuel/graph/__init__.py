"""The tensor graph: IR, primitive ops, branch arms, recipes as data and the fused-op registry.

Pure planning code: no torch, no files, no clock. Kernels live in ``fuel.kernels``; running a
graph is ``fuel.runtime.executor``.
"""

from fuel.graph.branch import (
    BranchBuilder, BranchError, Lowered, arm_interiors, branch_fused_over_recipe, branches_in_topo_order, collapse_variant_branch,
    effective_roots, lower, open_branch,
)
from fuel.graph.dtype import (
    FLOAT_DTYPES, INDEX_DTYPES, INTEGER_DTYPES, LOW_PRECISION_FLOATS, BackendId, Device, Dim, DType,
    Shape,
)
from fuel.graph.ir import Branch, Const, Fused, Graph, GraphError, Input, Node, NodeId, Op, Prim, Weight
from fuel.graph.ops import OpKind, Predicate, ShapeError, infer
from fuel.graph.recipe import (
    Bind, DimOf, EmitRefused, NoMatch, PatternNode, PatternOp, Quot, RegionMatch, Slot,
    canonical_text, emit, fill_slots, match_region, structural_hash,
)
from fuel.graph.registry import (
    RUNTIME_FUSED_BASE, SPECS, FusedOpParams, FusedOps, FusedOpSpec, RegionRefused,
    RuntimeFusedOp, RuntimeFusedParams, RuntimeFusedRegistry, decompose, fused_name, infer_fused,
    recipe_for,
)

__all__ = [
    "FLOAT_DTYPES", "INDEX_DTYPES", "INTEGER_DTYPES", "LOW_PRECISION_FLOATS", "RUNTIME_FUSED_BASE",
    "SPECS", "BackendId", "Bind", "Branch", "BranchBuilder", "BranchError", "Const", "DType",
    "Device", "Dim", "DimOf", "EmitRefused", "Fused", "FusedOpParams", "FusedOpSpec", "FusedOps",
    "Graph", "GraphError", "Input", "Lowered", "NoMatch", "Node", "NodeId", "Op", "OpKind",
    "PatternNode", "PatternOp", "Predicate", "Prim", "Quot", "RegionMatch", "RegionRefused",
    "RuntimeFusedOp", "RuntimeFusedParams", "RuntimeFusedRegistry", "Shape", "ShapeError", "Slot",
    "Weight", "arm_interiors", "branch_fused_over_recipe", "branches_in_topo_order", "canonical_text", "collapse_variant_branch",
    "decompose", "effective_roots", "emit", "fill_slots", "fused_name", "infer", "infer_fused",
    "lower", "match_region", "open_branch", "recipe_for", "structural_hash",
]
