"""Representative kernel workloads of a model: what ``fuel judge profile`` measures.

Decided here: for a model's dims (hidden, heads, kv heads, head dim, intermediate), one small
graph per (kernel family, size) holding the node to measure, at the row counts the serving modes
use (decode: 1 row, multi-sequence/verify: 8, prefill chunks: 64) and, for attention, two
context lengths. These are the kernels a model's plans dispatch; until lowered plans carry their
own node list, the families are enumerated here from the model's dims.

Invariants: pure (graphs only, no torch); the list order is fixed (family order, then size), so
a profile run and the benchmark see the same workloads in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from fuel.graph import DType, FusedOpParams, FusedOps, Graph, NodeId, OpKind

ROWS = (1, 8, 64)
CONTEXTS = (256, 1024)


@dataclass(frozen=True, slots=True)
class ModelDims:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelDims:
        config = config.get("text_config", config)
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            hidden=hidden,
            intermediate=int(config["intermediate_size"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or hidden // heads),
        )


@dataclass(frozen=True, slots=True)
class Workload:
    """One node to measure: ``family`` (the Judge's op name), a label for its size, the graph."""

    family: str
    label: str
    graph: Graph
    node: NodeId


def _one(family: str, label: str, build) -> Workload:
    graph = Graph()
    node = build(graph)
    return Workload(family, label, graph, node)


def workloads(dims: ModelDims, dtype: DType = DType.F32) -> list[Workload]:
    """Every family at every representative size for ``dims``."""
    h, d = dims.hidden, dims.head_dim
    out: list[Workload] = []
    for rows in ROWS:
        out.append(_one("add", f"{rows}x{h}", lambda g: g.prim(
            OpKind.ADD, g.input("a", [rows, h], dtype), g.input("b", [rows, h], dtype))))
    for rows in ROWS:
        out.append(_one("exp", f"{rows}x{dims.intermediate}", lambda g: g.prim(
            OpKind.EXP, g.input("x", [rows, dims.intermediate], dtype))))
    for rows in ROWS:
        out.append(_one("sum", f"{rows}x{h}", lambda g: g.prim(
            OpKind.SUM, g.input("x", [rows, h], dtype), dim=-1, keepdim=True)))
    for rows in ROWS:
        out.append(_one("matmul", f"{dims.heads}x{rows}x{d}@{d}x{rows}", lambda g: g.prim(
            OpKind.MATMUL, g.input("q", [dims.heads, rows, d], dtype),
            g.input("k", [dims.heads, d, rows], dtype))))
    for rows in ROWS:
        out.append(_one("fused_linear", f"{rows}x{h}@{h}x{h}", lambda g: g.fused(
            FusedOps.FUSED_LINEAR, FusedOpParams.FusedLinear(),
            g.input("x", [rows, h], dtype), g.weight("w", [h, h], dtype))))
        out.append(_one("fused_linear", f"{rows}x{h}@{h}x{dims.intermediate}", lambda g: g.fused(
            FusedOps.FUSED_LINEAR, FusedOpParams.FusedLinear(),
            g.input("x", [rows, h], dtype), g.weight("w", [dims.intermediate, h], dtype))))
    for rows in ROWS:
        out.append(_one("rms_norm", f"{rows}x{h}", lambda g: g.fused(
            FusedOps.RMS_NORM, FusedOpParams.RmsNorm(eps=1e-5),
            g.input("x", [rows, h], dtype), g.weight("g", [h], dtype))))
    for rows in ROWS:
        out.append(_one("layer_norm", f"{rows}x{h}", lambda g: g.fused(
            FusedOps.LAYER_NORM, FusedOpParams.LayerNorm(eps=1e-5), g.input("x", [rows, h], dtype),
            g.weight("g", [h], dtype), g.weight("b", [h], dtype))))
    for rows in ROWS:
        for keys in CONTEXTS:
            out.append(_one("softmax_last_dim", f"{dims.heads * rows}x{keys}", lambda g: g.fused(
                FusedOps.SOFTMAX_LAST_DIM, FusedOpParams.SoftmaxLastDim(),
                g.input("s", [dims.heads * rows, keys], dtype))))
    for rows in ROWS:
        out.append(_one("rope", f"{dims.heads}x{rows}x{d}", lambda g: g.fused(
            FusedOps.ROPE, FusedOpParams.Rope(), g.input("x", [1, dims.heads, rows, d], dtype),
            g.input("cos", [rows, d], dtype), g.input("sin", [rows, d], dtype))))
    for rows in ROWS:
        out.append(_one("silu_mul", f"{rows}x{dims.intermediate}", lambda g: g.fused(
            FusedOps.SILU_MUL, FusedOpParams.SiluMul(),
            g.input("gate", [rows, dims.intermediate], dtype),
            g.input("up", [rows, dims.intermediate], dtype))))
    for rows in ROWS:
        for keys in CONTEXTS:
            out.append(_one("flash_attn", f"q{rows}xk{keys}", lambda g: g.fused(
                FusedOps.FLASH_ATTN,
                FusedOpParams.FlashAttn(softmax_scale=d**-0.5, causal=False),
                g.input("q", [1, dims.heads, rows, d], dtype),
                g.input("k", [1, dims.kv_heads, keys, d], dtype),
                g.input("v", [1, dims.kv_heads, keys, d], dtype))))
    return out


def families() -> list[str]:
    """The family names :func:`workloads` produces, in order."""
    return [
        "add", "exp", "sum", "matmul", "fused_linear", "rms_norm", "layer_norm",
        "softmax_last_dim", "rope", "silu_mul", "flash_attn",
    ]
