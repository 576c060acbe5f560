"""Lowering: a fusion plan's groups become tensor-graph nodes bound to checkpoint weights.

Decides, for one step of one mode, what graph computes the plan: each group of the plan is
built by the *construction* its rule's kernel names, over the circuit edges the group reads,
and writes the circuit edges it produces. The graph's leaves are the checkpoint's tensors
(``Weight(binding path)``) and the step's inputs (``Input``: token ids, positions, KV slots,
per-run block tables and context lengths, the per-layer K/V caches).

The construction table (kernel ``fuel.kernels.cpu::<func>`` → what the graph gets):

=========================  ==================================================================
kernel func                graph construction
=========================  ==================================================================
embed                      ``index_select(Weight(embed), tokens)``
rms_norm, final_norm       ``Fused RMS_NORM(x, Weight(gain))``
qk_norm                    per head: reshape ``[rows, H, D]`` → ``Fused RMS_NORM`` → reshape
residual_add               ``add(x, y)``
residual_add_rms_norm      one ``Fused RESIDUAL_ADD_RMS_NORM(x, y, gain)``; ``select 0`` is the
                           normed value, ``select 1`` the new stream (the kept output)
linear, lm_head            ``Fused FUSED_LINEAR(x, W[, bias])``; several weight bindings (the
                           gate_up projection) are one weight concatenated once at bind time
qkv_projection             one ``Fused FUSED_LINEAR`` over ``[Wq; Wk; Wv]`` (concatenated once),
                           then column slices for q, k, v
silu_mul                   column slices gate/up of ``gate_up_out`` → ``Fused SILU_MUL``
rope                       ``Fused ROPE`` over q and k (``[rows, heads, D]``; one node over both
                           when they are adjacent column slices of one projection) with cos/sin rows
                           gathered by position from tables built once per rope params
                           (default RoPE, or Llama 3.1's ``llama3`` frequency scaling)
kv_write                   ``kv_cache_write(cache, rows, slots)`` for K and V (the written caches
                           are what this block's attention reads)
paged_attention            per row-table run: ``Fused PAGED_ATTN(q [n, Hq, k, D], K, V,
                           block_table u32 [n, M], context_lens u32 [n])``
argmax                     ``argmax(logits, dim=-1, keepdim=True)`` (i64)
all_reduce, ep_reduce      ``all_reduce(x, ranks)`` (a rank circuit's partial sums)
all_gather                 ``all_gather(x, dim, ranks)`` (the logits' vocabulary slices)
rope_kv_write              rope, then kv_write
silu_mul_linear            silu_mul, then linear
final_norm_lm_head_argmax  final_norm, then lm_head, then argmax
router, top_k, expert_*,   the MoE constructions of :mod:`fuel.runtime.moe` (routing, experts
blend, moe                 grouped by expert, the fused ``MOE`` op), registered below
=========================  ==================================================================

Invariants:
- Strict: a group whose kernel has no construction here (another module's kernel, or an op fuel
  cannot run yet: act_quant, gelu) raises :class:`NoConstruction` naming the rule
  and the kernel; a group whose members are not the ops its construction expects raises
  :class:`ConstructionMismatch`. Nothing is silently skipped or substituted.
- Fused nodes are emitted as fused nodes even where the backend has no kernel for them
  (``paged_attn``, ``residual_add_rms_norm`` on the CPU); giving them their decomposed arm 0 and
  picking arms is ``fuel.optimize.optimize_graph``'s job, not lowering's.
- Weights bind by the circuit's binding paths. A weight built from several tensors (a
  concatenation, a RoPE table) is a :class:`DerivedWeight` named after its parts; the program
  builds it once and every program of the engine shares it.
- The graph depends only on (plan, circuit, weight shapes and dtype, step geometry): the same
  inputs give the same graph, node for node.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from fuel.circuit.fuser import FusionPlan, Group
from fuel.circuit.ir import Circuit, Node as CircuitNode, OpKind as CircuitOp, Section
from fuel.circuit.rules import Mode
from fuel.errors import FuelError
from fuel.graph.dtype import DType
from fuel.graph.ir import Graph, NodeId, Prim
from fuel.graph.ops import OpKind
from fuel.graph.registry import FusedOpParams, FusedOps
from fuel.runtime import moe as _moe

CPU_KERNEL_MODULE = "fuel.kernels.cpu"
"""The module every CPU rule's kernels name (``fuel/data/rules/cpu.toml``)."""


class LowerError(FuelError):
    """Base of lowering's errors."""


class NoConstruction(LowerError):
    """A rule names a kernel that lowering has no graph construction for."""

    def __init__(self, rule: str, kernel: str):
        self.rule, self.kernel = rule, kernel
        super().__init__(f"rule `{rule}` names kernel `{kernel}`, which has no graph "
                         f"construction in fuel.runtime.lower (the CPU backend cannot run it)")


class ConstructionMismatch(LowerError):
    """A group's member ops are not those its kernel's construction expects."""

    def __init__(self, rule: str, kernel: str, expected: str, got: str):
        self.rule, self.kernel, self.expected, self.got = rule, kernel, expected, got
        super().__init__(f"rule `{rule}` (kernel `{kernel}`) groups [{got}], but the construction "
                         f"expects [{expected}]")


class UnsupportedParam(LowerError):
    """A node param lowering cannot honour (a RoPE scaling type fuel does not implement)."""

    def __init__(self, node: str, key: str, value: str):
        self.node, self.key, self.value = node, key, value
        super().__init__(f"node `{node}`: {key} = {value!r} is not supported by the CPU runtime")


class StepShapeError(LowerError):
    def __init__(self, detail: str):
        super().__init__(f"step shape: {detail}")


# -------------------------------------------------------------------------------- step shape


@dataclass(frozen=True, slots=True)
class StepShape:
    """The geometry of one step: ``runs`` of ``(k, n)`` (n sequences with k rows each, in batch
    order), the cache's block size and block count, ``max_blocks`` block-table entries per
    sequence (so ``max_blocks * block_size`` is the longest context this step may attend: the
    engine buckets it so attention work follows the context), and ``positions``, the length of
    the RoPE tables (the engine's longest sequence)."""

    runs: tuple[tuple[int, int], ...]
    block_size: int
    num_blocks: int
    max_blocks: int
    positions: int
    logit_rows: int | None = None
    """How many rows' logits the step computes: None, every row's; ``n``, the ``n`` rows the
    :data:`LOGIT_ROWS` input names (their indices, fed each step), picked before the final norm
    so the LM head multiplies only them. A prompt chunk a generation feeds needs one row (its
    last real one): the LM head is a fifth of a SmolLM2 prompt chunk's work and, as a 41-row
    GEMM, slower than the whole 1-row GEMV it becomes."""

    def __post_init__(self) -> None:
        if not self.runs or any(k < 1 or n < 1 for k, n in self.runs):
            raise StepShapeError(f"runs {self.runs} need at least one run of k >= 1, n >= 1")
        if min(self.block_size, self.num_blocks, self.max_blocks, self.positions) < 1:
            raise StepShapeError("block size, block count, table width and positions must be positive")
        if self.logit_rows is not None and not 1 <= self.logit_rows <= self.rows:
            raise StepShapeError(f"logits of {self.logit_rows} rows of a {self.rows}-row step")

    @property
    def rows(self) -> int:
        return sum(k * n for k, n in self.runs)

    @property
    def sequences(self) -> int:
        return sum(n for _, n in self.runs)



# -------------------------------------------------------------------------- derived weights


class DerivedKind(Enum):
    CONCAT = "concat"
    """Checkpoint tensors concatenated along dim 0 (output features)."""
    ROPE_COS = "rope_cos"
    ROPE_SIN = "rope_sin"
    """``[positions, head_dim]`` rotate-half RoPE tables (``cat(freqs, freqs)``)."""
    EXPERT_STACK = "expert_stack"
    """``[experts, rows, in]``: each expert's ``group`` tensors concatenated, experts stacked
    (``fuel.runtime.moe.stack_experts``; ``sources`` is expert-major)."""


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling (``rope_type = "llama3"``): wavelengths beyond
    ``original_max_position_embeddings / low_freq_factor`` are stretched by ``factor``, those
    below ``original / high_freq_factor`` kept, and the band between interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: float

    KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True, slots=True)
class DerivedWeight:
    """A weight the graph reads that the checkpoint does not hold as one tensor."""

    name: str
    kind: DerivedKind
    sources: tuple[str, ...] = ()
    theta: float = 0.0
    head_dim: int = 0
    positions: int = 0
    scaling: Llama3RopeScaling | None = None
    """A RoPE table's frequency scaling (``None``: Hugging Face's default RoPE)."""
    group: int = 1
    """An expert stack's tensors per expert (gate and up: 2)."""


def rope_inverse_frequencies(theta: float, head_dim: int, scaling: Llama3RopeScaling | None):
    """``[head_dim / 2]`` f32 inverse frequencies, as transformers computes them
    (``modeling_rope_utils``: ``_compute_default_rope_parameters`` and, for llama3,
    ``_compute_llama3_parameters``; the same float32 operations in the same order)."""
    import math

    import torch

    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    stretched = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * stretched / scaling.factor + smooth * stretched
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, stretched)


def rope_table(spec: DerivedWeight, dtype):
    """The ``[positions, head_dim]`` cos or sin table of a RoPE :class:`DerivedWeight`:
    angle = position * inv_freq, rotate-half layout ``cat(angles, angles)``, computed in
    float32 and stored in ``dtype``."""
    import torch

    inv_freq = rope_inverse_frequencies(spec.theta, spec.head_dim, spec.scaling)
    angles = torch.outer(torch.arange(spec.positions, dtype=torch.float32), inv_freq)
    table = torch.cat((angles, angles), dim=-1)
    return (table.cos() if spec.kind is DerivedKind.ROPE_COS else table.sin()).to(dtype)


def concat_name(sources: Sequence[str]) -> str:
    return "+".join(sources)


# ------------------------------------------------------------------------------- the result


@dataclass(frozen=True, slots=True)
class CacheRef:
    """One attention block's K/V cache inputs: ``section`` says which block tables index it."""

    key: str
    section: Section
    k_input: str
    v_input: str


@dataclass(frozen=True, slots=True)
class StepGraph:
    """A lowered step: the graph, its roots (``logits`` ``[rows, vocab]`` and ``tokens``
    ``[rows, 1]`` i64), the inputs it needs, and the weights it binds."""

    graph: Graph
    logits: NodeId
    tokens: NodeId
    plan: FusionPlan
    shape: StepShape
    dtype: DType
    inputs: tuple[str, ...]
    weights: tuple[str, ...]
    derived: tuple[DerivedWeight, ...]
    caches: tuple[CacheRef, ...]
    group_nodes: tuple[tuple[NodeId, ...], ...] = field(default=())
    routing: tuple[Any, ...] = field(default=())
    """One :class:`fuel.runtime.moe.RoutingProbe` per MoE layer (its chosen expert ids)."""

    @property
    def roots(self) -> tuple[NodeId, ...]:
        """``logits``, ``tokens``, then each routing probe's ids."""
        return (self.logits, self.tokens, *(probe.node for probe in self.routing))


# Input names (one spelling, shared with the engine that feeds them).
TOKENS = "tokens"
POSITIONS = "positions"
SLOTS = "slots"
LOGIT_ROWS = "logit_rows"
"""The rows whose logits a step with ``StepShape.logit_rows`` computes (indices into its rows)."""


def block_table_input(run: int) -> str:
    return f"block_table.r{run}"


def context_lens_input(run: int) -> str:
    return f"context_lens.r{run}"


# ------------------------------------------------------------------------------ constructions


Construction = Callable[["_Lowerer", Group, str], None]


def _expect(ops: Sequence[CircuitOp]) -> Callable[[Construction], Construction]:
    """Declare the member ops a construction serves (checked before it runs)."""
    def wrap(build: Construction) -> Construction:
        build.expected = tuple(ops)  # type: ignore[attr-defined]
        return build
    return wrap


def _members(low: _Lowerer, group: Group) -> list[CircuitNode]:
    return [low.circuit.nodes[n] for n in group.nodes]


@_expect([CircuitOp.EMBED])
def _embed(low: _Lowerer, group: Group, kernel: str) -> None:
    (node,) = _members(low, group)
    table = low.weight(node.bindings[0])
    shard = low.circuit.rank.shard_of(node.bindings[0]) if low.circuit.rank is not None else None
    layout = low.layout_of(node.bindings[0])
    if shard is not None:
        if layout:
            raise UnsupportedParam(node.id, "weight layout (vocabulary-parallel embedding)",
                                   f"{layout}: packed rows are not split by rank; use --dtype f32")
        low.write(node, 0, _vocab_parallel_lookup(low, table, shard.start, shard.end))
        return
    rows = low.graph.prim(OpKind.INDEX_SELECT, table, low.input_tokens(), dim=0)
    if layout:  # packed rows are gathered, then only those rows dequantized
        cols = int(low.circuit.edges[node.outputs[0]].dim_value)
        rows = low.graph.prim(OpKind.DEQUANTIZE, rows, layout=layout, cols=cols)
    low.write(node, 0, rows)


def _vocab_parallel_lookup(low: _Lowerer, table: NodeId, start: int, end: int) -> NodeId:
    """A rank's rows ``[start, end)`` of the embedding looked up (vLLM's
    VocabParallelEmbedding): ids outside the slice give zero rows, so the all_reduce that
    follows sums exactly one real row per token."""
    from fuel.graph.ops import Predicate

    g, rows = low.graph, low.rows
    local = g.prim(OpKind.SUB, low.input_tokens(), g.const(start, (rows,), DType.I64))
    zero = g.const(0, (rows,), DType.I64)
    above = g.prim(OpKind.COMPARE, local, zero, predicate=Predicate.GE)
    below = g.prim(OpKind.COMPARE, local, g.const(end - start, (rows,), DType.I64),
                   predicate=Predicate.LT)
    inside = g.prim(OpKind.WHERE, above, below, above)
    looked = g.prim(OpKind.INDEX_SELECT, table, g.prim(OpKind.WHERE, inside, local, zero), dim=0)
    keep = g.prim(OpKind.CAST, g.prim(OpKind.UNSQUEEZE, inside, dim=1), dtype=low.dtype)
    return g.prim(OpKind.MUL, looked, keep)


def _rms(low: _Lowerer, node: CircuitNode) -> None:
    x = low.read(node, 0)
    gain = low.weight(node.bindings[0])
    params = FusedOpParams.RmsNorm(eps=low.float_param(node, "eps"))
    low.write(node, 0, low.graph.fused(FusedOps.RMS_NORM, params, x, gain))


@_expect([CircuitOp.RMS_NORM])
def _rms_norm(low: _Lowerer, group: Group, kernel: str) -> None:
    _rms(low, _members(low, group)[0])


@_expect([CircuitOp.FINAL_NORM])
def _final_norm(low: _Lowerer, group: Group, kernel: str) -> None:
    _rms(low, _members(low, group)[0])


@_expect([CircuitOp.QK_NORM])
def _qk_norm(low: _Lowerer, group: Group, kernel: str) -> None:
    (node,) = _members(low, group)
    heads, head_dim = low.int_param(node, "heads"), low.int_param(node, "head_dim")
    g = low.graph
    x = g.prim(OpKind.RESHAPE, low.read(node, 0), shape=(low.rows, heads, head_dim))
    params = FusedOpParams.RmsNorm(eps=low.float_param(node, "eps"))
    normed = g.fused(FusedOps.RMS_NORM, params, x, low.weight(node.bindings[0]))
    low.write(node, 0, g.prim(OpKind.RESHAPE, normed, shape=(low.rows, heads * head_dim)))


@_expect([CircuitOp.RESIDUAL_ADD])
def _residual_add(low: _Lowerer, group: Group, kernel: str) -> None:
    (node,) = _members(low, group)
    low.write(node, 0, low.graph.prim(OpKind.ADD, low.read(node, 0), low.read(node, 1)))


@_expect([CircuitOp.RESIDUAL_ADD, CircuitOp.RMS_NORM])
def _residual_add_rms_norm(low: _Lowerer, group: Group, kernel: str) -> None:
    add, norm = _members(low, group)
    g = low.graph
    params = FusedOpParams.ResidualAddRmsNorm(eps=low.float_param(norm, "eps"))
    both = g.fused(FusedOps.RESIDUAL_ADD_RMS_NORM, params, low.read(add, 0), low.read(add, 1),
                   low.weight(norm.bindings[0]))
    low.write(norm, 0, g.prim(OpKind.SELECT, both, dim=0, index=0))
    low.write(add, 0, g.prim(OpKind.SELECT, both, dim=0, index=1))


def _split_bindings(node: CircuitNode) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A linear node's weight bindings and bias bindings (bias paths end in ``.bias``)."""
    weights = tuple(b for b in node.bindings if not b.endswith(".bias"))
    biases = tuple(b for b in node.bindings if b.endswith(".bias"))
    return weights, biases


def _quant_linear_node(low: _Lowerer, node: CircuitNode, weights: tuple[str, ...],
                       biases: tuple[str, ...]) -> None:
    """A linear over packed weights: one ``Fused QUANT_LINEAR`` per weight (packed tensors are
    never concatenated: that would copy them), outputs joined along the features."""
    g = low.graph
    x = low.read(node, 0)
    parts = [low.quant_linear(x, name) for name in weights]
    out = parts[0] if len(parts) == 1 else g.prim(OpKind.CONCAT, *parts, dim=1)
    if biases:
        out = g.prim(OpKind.ADD, out, low.weight_concat(biases))
    low.write(node, 0, out)


def _linear_node(low: _Lowerer, node: CircuitNode) -> None:
    weights, biases = _split_bindings(node)
    if any(low.layout_of(name) for name in weights):
        _quant_linear_node(low, node, weights, biases)
        return
    w = low.weight_concat(weights)
    operands = [low.read(node, 0), w]
    if biases:
        operands.append(low.weight_concat(biases))
    params = FusedOpParams.FusedLinear(has_bias=bool(biases))
    low.write(node, 0, low.graph.fused(FusedOps.FUSED_LINEAR, params, *operands))


@_expect([CircuitOp.LINEAR])
def _linear(low: _Lowerer, group: Group, kernel: str) -> None:
    _linear_node(low, _members(low, group)[0])


@_expect([CircuitOp.LM_HEAD])
def _lm_head(low: _Lowerer, group: Group, kernel: str) -> None:
    _linear_node(low, _members(low, group)[0])


@_expect([CircuitOp.LINEAR, CircuitOp.LINEAR, CircuitOp.LINEAR])
def _qkv_projection(low: _Lowerer, group: Group, kernel: str) -> None:
    members = _members(low, group)
    source = members[0].inputs[0]
    if any(m.inputs[0] != source for m in members):
        raise ConstructionMismatch(group.rule, kernel, "linears reading one input",
                                   ", ".join(m.id for m in members))
    split = [_split_bindings(m) for m in members]
    has_bias = all(b for _, b in split)
    if any(b for _, b in split) and not has_bias:
        raise ConstructionMismatch(group.rule, kernel, "q, k, v all with or all without bias",
                                   ", ".join(m.id for m in members))
    if any(low.layout_of(name) for ws, _ in split for name in ws):
        for member in members:  # packed weights: one quantized matmul per projection
            _linear_node(low, member)
        return
    w = low.weight_concat(tuple(name for ws, _ in split for name in ws))
    operands = [low.read(members[0], 0), w]
    if has_bias:
        operands.append(low.weight_concat(tuple(name for _, bs in split for name in bs)))
    g = low.graph
    both = g.fused(FusedOps.FUSED_LINEAR, FusedOpParams.FusedLinear(has_bias=has_bias), *operands)
    start = 0
    for member in members:
        width = low.circuit.edges[member.outputs[0]].dim_value
        low.write(member, 0, g.prim(OpKind.SLICE, both, dim=1, start=start, end=start + width))
        start += width


def _silu_mul_node(low: _Lowerer, node: CircuitNode) -> None:
    g = low.graph
    gate_up = low.read(node, 0)
    width = low.circuit.edges[node.outputs[0]].dim_value
    gate = g.prim(OpKind.SLICE, gate_up, dim=1, start=0, end=width)
    up = g.prim(OpKind.SLICE, gate_up, dim=1, start=width, end=2 * width)
    low.write(node, 0, g.fused(FusedOps.SILU_MUL, FusedOpParams.SiluMul(), gate, up))


@_expect([CircuitOp.SILU_MUL])
def _silu_mul(low: _Lowerer, group: Group, kernel: str) -> None:
    _silu_mul_node(low, _members(low, group)[0])


def _rope_scaling(node: CircuitNode) -> Llama3RopeScaling | None:
    """The node's RoPE scaling from its ``rope_type`` and ``rope_scaling`` params (the config
    map writes the type's sub-keys as ``key=value,…``); a type fuel does not implement, or a
    llama3 scaling missing a key or with a non-number, raises :class:`UnsupportedParam`."""
    rope_type = node.param("rope_type", "default") or "default"
    text = node.param("rope_scaling") or ""
    if rope_type == "default" and not text:
        return None
    if rope_type != "llama3":
        raise UnsupportedParam(node.id, "rope_type", f"{rope_type} {text}".strip())
    values: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        try:
            values[key.strip()] = float(value)
        except ValueError:
            raise UnsupportedParam(node.id, f"rope_scaling.{key.strip()}", value) from None
    missing = [key for key in Llama3RopeScaling.KEYS if key not in values]
    if missing:
        raise UnsupportedParam(node.id, "rope_scaling", f"llama3 {text} (missing {', '.join(missing)})")
    if values["high_freq_factor"] == values["low_freq_factor"] or values["factor"] == 0:
        raise UnsupportedParam(node.id, "rope_scaling", f"llama3 {text} (degenerate: division by zero)")
    return Llama3RopeScaling(*(values[key] for key in Llama3RopeScaling.KEYS))


def _adjacent_columns(graph: Graph, first: NodeId, second: NodeId) -> tuple[NodeId, int, int] | None:
    """``(source, start, end)`` when ``first`` and ``second`` are column slices of one value
    with ``second`` starting where ``first`` ends (q and k cut from one qkv projection)."""
    a, b = graph.node(first), graph.node(second)
    if not (isinstance(a.op, Prim) and isinstance(b.op, Prim)
            and a.op.kind is OpKind.SLICE and b.op.kind is OpKind.SLICE
            and a.inputs[0] == b.inputs[0]):
        return None
    sa, sb = a.op.attr_dict(), b.op.attr_dict()
    if sa["dim"] != 1 or sb["dim"] != 1 or sa["end"] != sb["start"]:
        return None
    return a.inputs[0], sa["start"], sb["end"]


def _rope_node(low: _Lowerer, node: CircuitNode) -> None:
    head_dim = low.int_param(node, "head_dim")
    cos, sin = low.rope_tables(low.float_param(node, "theta"), head_dim, _rope_scaling(node))
    g = low.graph
    heads = [low.int_param(node, key) for key in ("q_heads", "kv_heads")]
    joint = _adjacent_columns(g, low.read(node, 0), low.read(node, 1))
    if joint is not None:
        # q and k are adjacent columns of one projection: rotate all their heads in one call
        # (RoPE is per head, cos/sin broadcast over heads), then take each side's heads.
        source, start, end = joint
        qk = g.prim(OpKind.SLICE, source, dim=1, start=start, end=end)
        x = g.prim(OpKind.RESHAPE, qk, shape=(low.rows, sum(heads), head_dim))
        rotated = g.fused(FusedOps.ROPE, FusedOpParams.Rope(), x, cos, sin)
        parts = (g.prim(OpKind.SLICE, rotated, dim=1, start=0, end=heads[0]),
                 g.prim(OpKind.SLICE, rotated, dim=1, start=heads[0], end=sum(heads)))
    else:
        parts = tuple(
            g.fused(FusedOps.ROPE, FusedOpParams.Rope(),
                    g.prim(OpKind.RESHAPE, low.read(node, index), shape=(low.rows, count, head_dim)),
                    cos, sin)
            for index, count in enumerate(heads))
    for index, (count, rotated) in enumerate(zip(heads, parts)):
        low.write(node, index, g.prim(OpKind.RESHAPE, rotated, shape=(low.rows, count * head_dim)))
        low.per_head[node.outputs[index]] = rotated


@_expect([CircuitOp.ROPE])
def _rope(low: _Lowerer, group: Group, kernel: str) -> None:
    _rope_node(low, _members(low, group)[0])


def _kv_write_node(low: _Lowerer, node: CircuitNode) -> None:
    kv_heads, head_dim = low.int_param(node, "kv_heads"), low.int_param(node, "head_dim")
    cache = low.cache_for(node)
    g = low.graph
    written = []
    for index, name in ((0, cache.k_input), (1, cache.v_input)):
        rows = low.read_heads(node, index, kv_heads, head_dim)
        if low.kv_dtype != low.dtype:  # rounded to the cache's precision as it is written
            rows = g.prim(OpKind.CAST, rows, dtype=low.kv_dtype)
        stored = low.input_cache(name, kv_heads, head_dim)
        written.append(g.prim(OpKind.KV_CACHE_WRITE, stored, rows, low.input_slots()))
    low.written[node.block] = (written[0], written[1])


@_expect([CircuitOp.KV_WRITE])
def _kv_write(low: _Lowerer, group: Group, kernel: str) -> None:
    _kv_write_node(low, _members(low, group)[0])


@_expect([CircuitOp.PAGED_ATTENTION])
def _paged_attention(low: _Lowerer, group: Group, kernel: str) -> None:
    (node,) = _members(low, group)
    if node.block not in low.written:
        raise ConstructionMismatch(group.rule, kernel, "a kv_write earlier in the block",
                                   f"{node.id} with no cache write before it")
    k_cache, v_cache = low.written[node.block]
    q_heads, head_dim = low.int_param(node, "q_heads"), low.int_param(node, "head_dim")
    params = FusedOpParams.PagedAttn(
        softmax_scale=low.float_param(node, "softmax_scale"), block_size=low.shape.block_size,
        kv_dtype=low.kv_dtype if low.kv_dtype != low.dtype else None)
    g = low.graph
    # Rope's per-head output when there is one (no reshape round trip), else the flat edge.
    q_all = low.per_head.get(node.inputs[0], low.read(node, 0))
    outputs, start = [], 0
    for run, (k, n) in enumerate(low.shape.runs):
        q = q_all
        if len(low.shape.runs) > 1:
            q = g.prim(OpKind.SLICE, q_all, dim=0, start=start, end=start + k * n)
        q = g.prim(OpKind.PERMUTE, g.prim(OpKind.RESHAPE, q, shape=(n, k, q_heads, head_dim)),
                   dims=(0, 2, 1, 3))
        attended = g.fused(FusedOps.PAGED_ATTN, params, q, k_cache, v_cache,
                           low.input_block_table(run, n), low.input_context_lens(run, n))
        back = g.prim(OpKind.PERMUTE, attended, dims=(0, 2, 1, 3))
        outputs.append(g.prim(OpKind.RESHAPE, back, shape=(k * n, q_heads * head_dim)))
        start += k * n
    out = outputs[0] if len(outputs) == 1 else g.prim(OpKind.CONCAT, *outputs, dim=0)
    low.write(node, 0, out)


def _argmax_node(low: _Lowerer, node: CircuitNode) -> None:
    low.write(node, 0, low.graph.prim(OpKind.ARGMAX, low.read(node, 0), dim=-1, keepdim=True))


@_expect([CircuitOp.ARGMAX])
def _argmax(low: _Lowerer, group: Group, kernel: str) -> None:
    _argmax_node(low, _members(low, group)[0])


def _reduce_node(low: _Lowerer, node: CircuitNode) -> None:
    low.write(node, 0, low.graph.prim(OpKind.ALL_REDUCE, low.read(node, 0),
                                      ranks=low.int_param(node, "ranks")))


@_expect([CircuitOp.ALL_REDUCE])
def _all_reduce(low: _Lowerer, group: Group, kernel: str) -> None:
    _reduce_node(low, _members(low, group)[0])


@_expect([CircuitOp.EP_REDUCE])
def _ep_reduce(low: _Lowerer, group: Group, kernel: str) -> None:
    _reduce_node(low, _members(low, group)[0])


@_expect([CircuitOp.ALL_GATHER])
def _all_gather(low: _Lowerer, group: Group, kernel: str) -> None:
    (node,) = _members(low, group)
    low.write(node, 0, low.graph.prim(OpKind.ALL_GATHER, low.read(node, 0),
                                      dim=low.int_param(node, "dim"),
                                      ranks=low.int_param(node, "ranks")))


@_expect([CircuitOp.ROPE, CircuitOp.KV_WRITE])
def _rope_kv_write(low: _Lowerer, group: Group, kernel: str) -> None:
    rope, write = _members(low, group)
    _rope_node(low, rope)
    _kv_write_node(low, write)


@_expect([CircuitOp.SILU_MUL, CircuitOp.LINEAR])
def _silu_mul_linear(low: _Lowerer, group: Group, kernel: str) -> None:
    act, down = _members(low, group)
    _silu_mul_node(low, act)
    _linear_node(low, down)


@_expect([CircuitOp.FINAL_NORM, CircuitOp.LM_HEAD, CircuitOp.ARGMAX])
def _final_norm_lm_head_argmax(low: _Lowerer, group: Group, kernel: str) -> None:
    norm, head, argmax = _members(low, group)
    _rms(low, norm)
    _linear_node(low, head)
    _argmax_node(low, argmax)


CONSTRUCTIONS: Mapping[str, Construction] = {
    "embed": _embed,
    "rms_norm": _rms_norm,
    "final_norm": _final_norm,
    "qk_norm": _qk_norm,
    "residual_add": _residual_add,
    "residual_add_rms_norm": _residual_add_rms_norm,
    "linear": _linear,
    "lm_head": _lm_head,
    "qkv_projection": _qkv_projection,
    "silu_mul": _silu_mul,
    "rope": _rope,
    "kv_write": _kv_write,
    "paged_attention": _paged_attention,
    "argmax": _argmax,
    "rope_kv_write": _rope_kv_write,
    "silu_mul_linear": _silu_mul_linear,
    "final_norm_lm_head_argmax": _final_norm_lm_head_argmax,
    "all_reduce": _all_reduce,
    "ep_reduce": _ep_reduce,
    "all_gather": _all_gather,
    # Registration hook: the MoE constructions live in fuel.runtime.moe.
    **{func: _expect(ops)(build) for func, (ops, build) in _moe.CONSTRUCTIONS.items()},
}
"""``fuel.kernels.cpu::<func>`` → its graph construction (the table in the module docstring)."""


def construction_for(group: Group) -> tuple[str, Construction]:
    """The construction of a group's kernel; :class:`NoConstruction` when there is none."""
    if len(group.kernels) != 1:
        names = ", ".join(map(str, group.kernels)) or "(no kernel: a host step)"
        raise NoConstruction(group.rule, names)
    kernel = group.kernels[0]
    build = CONSTRUCTIONS.get(kernel.func) if kernel.module == CPU_KERNEL_MODULE else None
    if build is None:
        raise NoConstruction(group.rule, str(kernel))
    return str(kernel), build


# ------------------------------------------------------------------------------- the lowerer


_GRAPH_DTYPES = {"float32": DType.F32, "bfloat16": DType.BF16, "float16": DType.F16}


class _Lowerer:
    def __init__(self, circuit: Circuit, plan: FusionPlan, weight_shapes: Mapping[str, tuple[int, ...]],
                 dtype: DType, shape: StepShape, layouts: Mapping[str, str] | None = None,
                 kv_dtype: DType | None = None):
        self.circuit, self.plan, self.dtype, self.shape = circuit, plan, dtype, shape
        self.kv_dtype = kv_dtype or dtype
        """The KV caches' element dtype: the step's own, or a half-precision cache (rows rounded
        to it as they are written, widened as attention reads them)."""
        self.weight_shapes = weight_shapes
        self.layouts: Mapping[str, str] = layouts or {}
        self.rows = shape.rows
        self.graph = Graph()
        self.edges: dict[int, NodeId] = {}
        self.per_head: dict[int, NodeId] = {}
        """Edges also held as ``[rows, heads, head_dim]`` (rope's output before it is flattened),
        so the cache write and attention read that node instead of reshaping the flat edge back:
        the flattening reshape is then read by nobody and never dispatched."""
        self.written: dict[int, tuple[NodeId, NodeId]] = {}
        self._inputs: dict[str, NodeId] = {}
        self._picked: dict[NodeId, NodeId] = {}
        """Values the final norm reads, at the rows whose logits are wanted (``logit_rows``)."""
        self._weights: dict[str, NodeId] = {}
        self._derived: dict[str, DerivedWeight] = {}
        self._rope: dict[tuple[float, int], tuple[NodeId, NodeId]] = {}
        self._caches: dict[str, CacheRef] = {}
        self.routing: list[Any] = []
        """Each MoE layer's :class:`fuel.runtime.moe.RoutingProbe` (extra roots of the step)."""

    def members(self, group: Group) -> list[CircuitNode]:
        return _members(self, group)

    # Params are strings in the circuit; a malformed one is the circuit's error, named here.
    def float_param(self, node: CircuitNode, key: str) -> float:
        value = node.param(key)
        try:
            return float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise UnsupportedParam(node.id, key, str(value)) from None

    def int_param(self, node: CircuitNode, key: str) -> int:
        value = node.param(key)
        try:
            return int(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise UnsupportedParam(node.id, key, str(value)) from None

    # Edges.
    def read(self, node: CircuitNode, index: int) -> NodeId:
        value = self.edges[node.inputs[index]]
        if self.shape.logit_rows is not None and node.op.kind is CircuitOp.FINAL_NORM:
            # Only the rows whose logits are wanted go on to the final norm and the LM head.
            picked = self._picked.get(value)
            if picked is None:
                rows = self._input(LOGIT_ROWS, (self.shape.logit_rows,), DType.I64)
                picked = self._picked[value] = self.graph.prim(OpKind.INDEX_SELECT, value, rows,
                                                               dim=0)
            return picked
        return value

    def write(self, node: CircuitNode, index: int, value: NodeId) -> None:
        self.edges[node.outputs[index]] = value

    def read_heads(self, node: CircuitNode, index: int, heads: int, head_dim: int) -> NodeId:
        """Input ``index`` of ``node`` as ``[rows, heads, head_dim]``."""
        edge = node.inputs[index]
        held = self.per_head.get(edge)
        if held is not None and self.graph.node(held).shape.dims == (self.rows, heads, head_dim):
            return held
        return self.graph.prim(OpKind.RESHAPE, self.edges[edge], shape=(self.rows, heads, head_dim))

    # Leaves.
    def _input(self, name: str, dims: tuple[int, ...], dtype: DType) -> NodeId:
        if name not in self._inputs:
            self._inputs[name] = self.graph.input(name, dims, dtype)
        return self._inputs[name]

    def input_tokens(self) -> NodeId:
        return self._input(TOKENS, (self.rows,), DType.I64)

    def input_slots(self) -> NodeId:
        return self._input(SLOTS, (self.rows,), DType.I64)

    def input_block_table(self, run: int, n: int) -> NodeId:
        return self._input(block_table_input(run), (n, self.shape.max_blocks), DType.U32)

    def input_context_lens(self, run: int, n: int) -> NodeId:
        return self._input(context_lens_input(run), (n,), DType.U32)

    def input_cache(self, name: str, kv_heads: int, head_dim: int) -> NodeId:
        dims = (self.shape.num_blocks, self.shape.block_size, kv_heads, head_dim)
        return self._input(name, dims, self.kv_dtype)

    def cache_for(self, node: CircuitNode) -> CacheRef:
        block = self.circuit.blocks[node.block]
        key = f"l{block.layer}" if block.layer is not None else f"{block.section.value}.{block.name}"
        if key not in self._caches:
            self._caches[key] = CacheRef(key, block.section, f"kv.{key}.k", f"kv.{key}.v")
        return self._caches[key]

    def weight(self, name: str) -> NodeId:
        if name not in self._weights:
            dtype = DType.U8 if self.layout_of(name) else self.dtype
            self._weights[name] = self.graph.weight(name, self.weight_shapes[name], dtype)
        return self._weights[name]

    def layout_of(self, name: str) -> str:
        """The packed-row layout of a packed weight (``q4_1``, ``int8_channel``), empty for a
        plain one."""
        return self.layouts.get(name, "")

    def quant_linear(self, x: NodeId, name: str) -> NodeId:
        """``x @ dequantize(W).T`` over the packed weight ``name`` (in f32)."""
        packed = self.weight(name)
        cols = self.graph.node(x).shape.dims[-1]
        params = FusedOpParams.QuantLinear(layout=self.layout_of(name), cols=int(cols))
        return self.graph.fused(FusedOps.QUANT_LINEAR, params, x, packed)

    def weight_concat(self, sources: tuple[str, ...]) -> NodeId:
        if len(sources) == 1:
            return self.weight(sources[0])
        name = concat_name(sources)
        if name not in self._weights:
            first = self.weight_shapes[sources[0]]
            rows = sum(self.weight_shapes[s][0] for s in sources)
            self._derived[name] = DerivedWeight(name, DerivedKind.CONCAT, sources)
            self._weights[name] = self.graph.weight(name, (rows, *first[1:]), self.dtype)
        return self._weights[name]

    def derived_weight(self, spec: DerivedWeight, dims: tuple[int, ...]) -> NodeId:
        """A weight built from checkpoint tensors (``spec``), one graph leaf per name."""
        if spec.name not in self._weights:
            self._derived[spec.name] = spec
            self._weights[spec.name] = self.graph.weight(spec.name, dims, self.dtype)
        return self._weights[spec.name]

    def rope_tables(self, theta: float, head_dim: int,
                    scaling: Llama3RopeScaling | None = None) -> tuple[NodeId, NodeId]:
        """cos/sin rows for this step's positions, ``[rows, 1, head_dim]`` (one pair per rope
        params, shared by every layer)."""
        key = (theta, head_dim, scaling)
        if key not in self._rope:
            g, positions = self.graph, self._input(POSITIONS, (self.rows,), DType.I64)
            pair = []
            scaled = "" if scaling is None else ",llama3=" + "/".join(
                f"{getattr(scaling, k):g}" for k in Llama3RopeScaling.KEYS)
            for kind in (DerivedKind.ROPE_COS, DerivedKind.ROPE_SIN):
                name = (f"rope.{kind.value[5:]}[theta={theta:g},dim={head_dim},"
                        f"positions={self.shape.positions}{scaled}]")
                self._derived[name] = DerivedWeight(name, kind, (), theta, head_dim,
                                                    self.shape.positions, scaling)
                table = self.graph.weight(name, (self.shape.positions, head_dim), self.dtype)
                self._weights[name] = table
                rows = g.prim(OpKind.INDEX_SELECT, table, positions, dim=0)
                pair.append(g.prim(OpKind.UNSQUEEZE, rows, dim=1))
            self._rope[key] = (pair[0], pair[1])
        return self._rope[key]

    def run(self) -> StepGraph:
        group_nodes = []
        for group in self.plan.groups:
            kernel, build = construction_for(group)
            expected = build.expected  # type: ignore[attr-defined]
            got = tuple(self.circuit.nodes[n].op.kind for n in group.nodes)
            if got != expected:
                raise ConstructionMismatch(group.rule, kernel, ", ".join(o.value for o in expected),
                                           ", ".join(o.value for o in got))
            first = len(self.graph)
            build(self, group, kernel)
            group_nodes.append(tuple(range(first, len(self.graph))))
        logits = tokens = None
        for e, edge in enumerate(self.circuit.edges):
            if edge.is_output and self.plan.edge_states[e] is not None and e in self.edges:
                if edge.id.endswith("logits"):
                    logits = self.edges[e]
                elif edge.id.endswith("tokens"):
                    tokens = self.edges[e]
        if logits is None or tokens is None:
            raise LowerError(f"the {self.plan.mode.value} plan produces no logits/tokens outputs")
        if self.shape.logit_rows is not None and not self._picked:
            # No final norm to pick the rows at (a circuit without one): the outputs' rows.
            rows = self._input(LOGIT_ROWS, (self.shape.logit_rows,), DType.I64)
            logits = self.graph.prim(OpKind.INDEX_SELECT, logits, rows, dim=0)
            tokens = self.graph.prim(OpKind.INDEX_SELECT, tokens, rows, dim=0)
        return StepGraph(
            graph=self.graph, logits=logits, tokens=tokens, plan=self.plan, shape=self.shape,
            dtype=self.dtype, inputs=tuple(self._inputs),
            weights=tuple(n for n in self._weights if n not in self._derived),
            derived=tuple(self._derived.values()), caches=tuple(self._caches.values()),
            group_nodes=tuple(group_nodes), routing=tuple(self.routing))


def lower(plan: FusionPlan, circuit: Circuit, weights: Mapping[str, Any], shape: StepShape,
          *, dtype: DType | None = None, kv_dtype: DType | None = None) -> StepGraph:
    """Lower ``plan`` (of ``circuit``) for one step of geometry ``shape``.

    ``weights`` maps binding paths to tensors (only shapes and dtype are read: the graph binds
    by name). ``dtype`` defaults to the weights' dtype; ``kv_dtype`` (the KV caches' element
    dtype) to ``dtype``. Raises :class:`NoConstruction`,
    :class:`ConstructionMismatch`, :class:`UnsupportedParam` or :class:`StepShapeError`.
    """
    if plan.rows != shape.rows:
        raise StepShapeError(f"the {plan.mode.value} plan has {plan.rows} rows, the step {shape.rows}")
    if plan.mode in (Mode.DECODE,) and shape.runs != ((1, 1),):
        raise StepShapeError(f"decode runs one sequence one row, not {shape.runs}")
    shapes = _ShapeView(weights)
    if dtype is None:
        dtype = _dtype_of(weights)
    return _Lowerer(circuit, plan, shapes, dtype, shape, packed_layouts(weights), kv_dtype).run()


def packed_layouts(weights: Mapping[str, Any]) -> dict[str, str]:
    """Binding path → packed-row layout of every packed weight (``Weights.formats`` or a
    :class:`~fuel.runtime.program.WeightStore` over one; empty for plain weights)."""
    from fuel.circuit.format import row_layout

    format_of = getattr(weights, "format_of", None)
    if format_of is None:
        return {}
    layouts = {}
    for name in weights:
        layout = row_layout(format_of(name))
        if layout:
            layouts[name] = layout
    aliases = getattr(weights, "aliases", None) or getattr(getattr(weights, "_tensors", None), "aliases", {})
    for alias in aliases or {}:
        layout = row_layout(format_of(alias))
        if layout:
            layouts[alias] = layout
    return layouts


class _ShapeView(Mapping[str, tuple[int, ...]]):
    """Weight shapes by name, read lazily from a mapping of tensors (or of shapes)."""

    def __init__(self, weights: Mapping[str, Any]):
        self._weights = weights

    def __getitem__(self, name: str) -> tuple[int, ...]:
        value = self._weights[name]
        return tuple(value.shape) if hasattr(value, "shape") else tuple(value)

    def __iter__(self):
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


def _dtype_of(weights: Mapping[str, Any]) -> DType:
    dtype = getattr(weights, "dtype", None)
    if dtype is not None and hasattr(dtype, "compute"):
        return DType.F32  # loaded weights (fuel.runtime.weights.DType) always compute in f32
    for value in weights.values():
        return _GRAPH_DTYPES.get(str(getattr(value, "dtype", "")).removeprefix("torch."), DType.F32)
    return DType.F32


def expected_weight_shapes(circuit: Circuit, section: Section | None = None) -> dict[str, tuple[int, ...]]:
    """Every binding path the circuit reads (in ``section``, or all) and the shape it must have,
    derived from the edges of the nodes that read it (``[out, in]`` for projections, ``[dim]``
    for gains and biases, ``[vocab, hidden]`` for the embedding)."""
    expected: dict[str, tuple[int, ...]] = {}
    for index, node in enumerate(circuit.nodes):
        if section is not None and circuit.section_of_node(index) is not section:
            continue
        kind = node.op.kind
        out = circuit.edges[node.outputs[0]].dim_value if node.outputs else None
        if kind is CircuitOp.EMBED:
            expected[node.bindings[0]] = (int(node.param("vocab") or 0), int(out or 0))
        elif kind in (CircuitOp.RMS_NORM, CircuitOp.FINAL_NORM):
            expected[node.bindings[0]] = (int(out or 0),)
        elif kind is CircuitOp.QK_NORM:
            expected[node.bindings[0]] = (int(node.param("head_dim") or 0),)
        elif kind in (CircuitOp.LINEAR, CircuitOp.LM_HEAD):
            width = circuit.edges[node.inputs[0]].dim_value
            weights, biases = _split_bindings(node)
            for name in weights:
                expected[name] = (int(out or 0) // len(weights), width)
            for name in biases:
                expected[name] = (int(out or 0) // len(biases),)
        elif (moe_weights := _moe.expected_shapes(circuit, node)) is not None:
            expected.update(moe_weights)
        elif node.bindings:
            raise NoConstruction(f"binding check of {node.id}", node.op.name())
    return expected


__all__ = [
    "CONSTRUCTIONS", "CPU_KERNEL_MODULE", "POSITIONS", "SLOTS", "TOKENS", "CacheRef",
    "ConstructionMismatch", "DerivedKind", "DerivedWeight", "Llama3RopeScaling", "LowerError",
    "NoConstruction", "StepGraph", "StepShape", "StepShapeError", "UnsupportedParam",
    "block_table_input", "concat_name", "construction_for", "context_lens_input",
    "expected_weight_shapes", "lower", "packed_layouts", "rope_inverse_frequencies", "rope_table",
]
