"""The fused ops of one decode step of a zoo model, as a tensor graph at the model's real dims.

Decides what ``fuel jit`` and the JIT benchmark ask the carrier about until the lowered model
graph is wired into them: for one sequence and one query row, each kind of fused node a dense
GQA decode step contains — residual_add_rms_norm and rms_norm over ``[1, hidden]``, rope over
``[1, heads, 1, head_dim]``, silu_mul over ``[1, intermediate]``, paged attention through a u32
block table of ``context`` tokens (block size 16), the output projection as fused_linear — with
the dims read from the model's config. One node per kind (every layer repeats the same
structures, so their requests share structure keys).

Pure: builds a graph from a config mapping.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fuel.graph import DType, FusedOpParams, FusedOps, Graph, NodeId

BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class DecodeStep:
    graph: Graph
    nodes: tuple[tuple[str, NodeId], ...]
    """(region name, fused node) in step order."""


def decode_step(config: Mapping[str, Any], context: int = 1024,
                dtype: DType = DType.F32) -> DecodeStep:
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    intermediate = int(config["intermediate_size"])
    eps = float(config.get("rms_norm_eps", 1e-5))
    g = Graph()
    x, r = g.input("x", [1, hidden], dtype), g.input("residual", [1, hidden], dtype)
    gain = g.weight("norm.weight", [hidden], dtype)
    nodes = [("residual_add_rms_norm", g.fused(
        FusedOps.RESIDUAL_ADD_RMS_NORM, FusedOpParams.ResidualAddRmsNorm(eps), x, r, gain))]
    nodes.append(("rms_norm", g.fused(FusedOps.RMS_NORM, FusedOpParams.RmsNorm(eps), x, gain)))
    q = g.input("q", [1, heads, 1, head_dim], dtype)
    cos, sin = g.input("cos", [1, head_dim], dtype), g.input("sin", [1, head_dim], dtype)
    nodes.append(("rope", g.fused(FusedOps.ROPE, FusedOpParams.Rope(), q, cos, sin)))
    per_seq = -(-context // BLOCK_SIZE)
    blocks = 2 * per_seq  # a cache with room for other sequences
    cache = [blocks, BLOCK_SIZE, kv_heads, head_dim]
    k, v = g.input("k_cache", cache, dtype), g.input("v_cache", cache, dtype)
    table = g.input("block_table", [1, per_seq], DType.U32)
    lens = g.input("context_lens", [1], DType.U32)
    nodes.append(("paged_attn", g.fused(
        FusedOps.PAGED_ATTN, FusedOpParams.PagedAttn(head_dim ** -0.5, BLOCK_SIZE), q, k, v,
        table, lens)))
    gate, up = g.input("gate", [1, intermediate], dtype), g.input("up", [1, intermediate], dtype)
    nodes.append(("silu_mul", g.fused(FusedOps.SILU_MUL, FusedOpParams.SiluMul(), gate, up)))
    attn = g.input("attn", [1, heads * head_dim], dtype)
    o_proj = g.weight("o_proj.weight", [hidden, heads * head_dim], dtype)
    nodes.append(("o_proj", g.fused(FusedOps.FUSED_LINEAR, FusedOpParams.FusedLinear(), attn,
                                    o_proj)))
    return DecodeStep(g, tuple(nodes))
