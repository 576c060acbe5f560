"""Circuit-level roofline: FLOPs and bytes of each circuit op, and the step time of a plan.

Decides how much arithmetic and memory traffic one step of a circuit costs on a device, as a
*ceiling*: every node takes ``max(bytes / bandwidth, FLOPs / peak)``, summed over the plan's
groups, with no launch overhead (a second figure adds ``launches x launch_overhead``). Pure:
values in, values out; no files, no clock.

The model (stated, because every number in the report follows from it):

- A step is a :class:`Workload`: per sequence in the batch, the rows it adds this step and its
  KV length *after* the step (``context``). Decode at concurrency C is C sequences of one row;
  prefill of P tokens is one sequence of P rows at context P; verify of k rows is one sequence of
  k rows.
- ``linear`` / ``lm_head`` / ``router``: ``2 * rows * in * out`` FLOPs; the weight in its stored
  format (``Format.weight_bytes(out, in)``, scales included) plus the activations.
- ``paged_attention``: row ``j`` of a sequence adding ``k`` rows at context ``c`` attends
  ``c - k + j + 1`` positions (causal); FLOPs ``4 * q_heads * head_dim * positions`` (QK^T and
  PV); each pass over a sequence reads its whole cache, ``c * kv_bytes_per_token_per_layer``.
- ``kv_write`` writes ``rows * 2 * kv_heads * head_dim`` elements in the KV cache format.
- ``embed`` reads one table row per step row, not the table.
- MoE experts: ``T`` tokens each routed to ``k`` of ``E`` experts touch, in expectation,
  ``E * (1 - (1 - k/E)^T)`` distinct experts (routing assumed uniform and independent); that many
  experts' weights are read. FLOPs are ``2 * T * k * in * out`` of one expert.
- Element-wise ops (norms, residual adds, activations, rope, quantization, argmax, softcap,
  blend) cost a few FLOPs per element (constants below) and their materialized edges' bytes.
- Edges a plan keeps inside one group (``EdgeState`` fused) cost no memory traffic: that is
  what fusion buys.
- A group launched several times per step (``per_row``, ``chunk<n>``, ``per_row_but_last``) is a
  per-row loop: each pass re-reads the weights and the cache of the sequences it touches, so
  weight bytes scale with the pass count and KV bytes with the passes per sequence. FLOPs and
  activation bytes are unchanged. ``once`` and ``per_run`` groups are one pass.
- Matmul-like ops (linear, lm_head, router, experts, attention) run at the matrix peak of their
  input's dtype (fp8 when the input edge is stored fp8, fp4 for nvfp4/mxfp4, fp32 and fp16 for
  f32 and f16 edges, else bf16); a one-row product per pass (decode) runs at the device's
  measured matrix-vector rate where it has one (``cpu-local``), a product of more rows at the
  rate the device measured at its rows where it has such a curve (``cpu-local``: a CPU GEMM's
  rate grows with its rows), attention of several rows a sequence at the device's measured
  attention rate at those rows where it has one (``cpu-local``: not a packed GEMM). Element-wise
  ops at the fp32 (vector) peak. A missing peak is a :class:`MissingRate`.

Invariants: every cost is finite and non-negative; the ceiling never includes launch overhead;
the weight floor is the weight bytes read by a plan-free decode step of one row divided by the
bandwidth.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from fuel.circuit.format import Format, FormatKind
from fuel.circuit.ir import Circuit, Node, OpKind
from fuel.errors import FuelError

# FLOPs per element of the element-wise ops: mean of squares (2), rsqrt-scale (1), gain (1).
_NORM_FLOPS = 4
# silu(x) * y: exp, add, divide, multiply, multiply.
_GATED_ACT_FLOPS = 5
# rotate-half rope: two multiplies and one add per element.
_ROPE_FLOPS = 3
# amax, scale, round per element.
_QUANT_FLOPS = 3
# tanh(x / cap) * cap.
_SOFTCAP_FLOPS = 3


class ReportError(FuelError):
    """Base of the report's typed errors."""


class MissingDim(ReportError):
    """The circuit lacks a dim the cost model of an op needs."""

    def __init__(self, arch: str, node: str, dim: str):
        self.arch, self.node, self.dim = arch, node, dim
        super().__init__(f"circuit `{arch}`: node `{node}` needs dim `{dim}`, which the circuit "
                         "does not declare")


class MissingWeightFormat(ReportError):
    """A weight-reading node whose weights have no stored format."""

    def __init__(self, arch: str, node: str):
        self.arch, self.node = arch, node
        super().__init__(f"circuit `{arch}`: node `{node}` reads weights but neither it nor the "
                         "arch shape states their format")


class MissingRate(ReportError):
    """The device states no peak for a dtype the plan computes in."""

    def __init__(self, device: str, dtype: str):
        self.device, self.dtype = device, dtype
        super().__init__(f"device `{device}` states no peak FLOP/s for `{dtype}`")


class ComputeClass(Enum):
    """Which peak an op runs at."""

    VECTOR = "fp32"
    TENSOR_FP32 = "fp32-matrix"
    TENSOR_FP16 = "fp16"
    TENSOR_BF16 = "bf16"
    TENSOR_FP8 = "fp8"
    TENSOR_FP4 = "fp4"


@dataclass(frozen=True, slots=True)
class DeviceRates:
    """What the roofline needs of a device: bytes/s, FLOP/s per compute dtype (``fp32``,
    ``bf16``, ``fp8``, ``fp4``), seconds per launch, and memory. Built from the cost stage's
    device spec at the edge (:func:`fuel.report.build.rates_from_spec`)."""

    name: str
    bandwidth: float
    peaks: Mapping[str, float]
    launch_overhead_ns: float
    memory_bytes: int
    matvec_peaks: Mapping[str, float] = field(default_factory=dict)
    """Measured one-row (matrix-vector) rates per compute class, where the device has them
    (``cpu-local``); a one-row product runs at it instead of the dense peak."""
    rows_peaks: Mapping[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    """Measured ``(rows, FLOP/s)`` points per compute class where the device has them
    (``cpu-local``: its linear kernel at each prompt-chunk size, see
    :attr:`fuel.cost.spec.DeviceSpec.gemm_rows_flops`); a product of ``rows`` rows runs at the
    rate interpolated between them (:func:`fuel.cost.spec.rate_at_rows`) instead of the dense
    peak, because a CPU GEMM's rate depends on its rows."""
    attention_peaks: tuple[tuple[int, float], ...] = ()
    """Measured ``(rows, FLOP/s)`` of a prompt chunk's attention where the device has them
    (``cpu-local``, :attr:`fuel.cost.spec.DeviceSpec.attention_rows_flops`): attention of
    several rows a sequence runs at the rate interpolated at its rows, not the matrix peak."""
    bandwidth_points: tuple[tuple[int, float], ...] = ()
    """Measured ``(bytes of one weight, bytes/s)`` where the device has them (``cpu-local``,
    :attr:`fuel.cost.spec.DeviceSpec.bandwidth_by_bytes`): a node streaming a weight is priced
    at the bandwidth of that weight's size; empty, at :attr:`bandwidth`."""
    half_bandwidth_points: tuple[tuple[int, float], ...] = ()
    """The same for 16-bit weights (:attr:`fuel.cost.spec.DeviceSpec.half_bandwidth_by_bytes`)."""
    rows_fits: Mapping[str, tuple[tuple[int, float, float], ...]] = field(default_factory=dict)
    """Measured ``(rows, fixed ns, FLOP/s)`` per compute class where the device has them
    (``cpu-local``, :attr:`fuel.cost.spec.DeviceSpec.gemm_rows_fit`): a matrix-product call of
    several rows costs the fixed part plus its FLOPs at the rate (:meth:`matrix_call`)."""

    attention_fits: tuple[tuple[int, float, float], ...] = ()
    """Measured ``(rows, fixed ns, FLOP/s)`` of a prompt chunk's attention call where the device
    has them (:attr:`fuel.cost.spec.DeviceSpec.attention_rows_fit`; :meth:`attention_call`)."""

    def matrix_call(self, compute: ComputeClass, rows: int) -> tuple[float, float] | None:
        """``(fixed ns, FLOP/s)`` of one matrix-product call of ``rows`` rows (``rows`` >= 2,
        :func:`call_at_rows`), or None where the device measured no split (the call is then
        priced at :meth:`peak`)."""
        return call_at_rows(self.rows_fits.get(compute.value, ()), rows)

    def attention_call(self, rows: int) -> tuple[float, float] | None:
        """``(fixed ns, FLOP/s)`` of one prompt-chunk attention call of ``rows`` query rows
        (:func:`call_at_rows`), or None (priced at :meth:`attention_peak`)."""
        return call_at_rows(self.attention_fits, rows)

    def bandwidth_for(self, weight_bytes: float, compute: ComputeClass | None = None) -> float:
        """Bytes/s of a node whose call streams ``weight_bytes`` of weight (in the 16-bit
        curve when it computes in bf16/f16 and the device measured one)."""
        from fuel.cost.spec import bandwidth_by_size

        return bandwidth_by_size(self.bandwidth_points, self.half_bandwidth_points, self.bandwidth,
                                 weight_bytes, half=compute in (ComputeClass.TENSOR_BF16,
                                                                ComputeClass.TENSOR_FP16))

    def attention_peak(self, compute: ComputeClass, *, matvec: bool = False,
                       rows: int = 0) -> float:
        """FLOP/s of attention computing ``rows`` query rows a sequence: the measured attention
        rate at those rows where the device has one (``rows`` >= 2), else :meth:`peak`."""
        if not matvec and rows >= 2 and self.attention_peaks:
            from fuel.cost.spec import rate_at_rows

            rate = rate_at_rows(self.attention_peaks, rows)
            if rate is not None:
                return rate
        return self.peak(compute, matvec=matvec)

    def peak(self, compute: ComputeClass, *, matvec: bool = False, rows: int = 0) -> float:
        """FLOP/s of ``compute``: the one-row rate for ``matvec``, the rate measured at ``rows``
        rows (``rows`` >= 2, where measured), else the dense peak (with its fallbacks)."""
        if matvec:
            rate = self.matvec_peaks.get(compute.value)
            if rate is not None and math.isfinite(rate) and rate > 0:
                return rate
        if rows >= 2 and self.rows_peaks.get(compute.value):
            from fuel.cost.spec import rate_at_rows

            one = self.matvec_peaks.get(compute.value)
            points = (*(((1, one),) if one else ()), *self.rows_peaks[compute.value])
            rate = rate_at_rows(points, rows)
            if rate is not None:
                return rate
        rate = self.peaks.get(compute.value)
        # fp4 on a chip without fp4 units runs at its fp8 (or bf16) tensor rate after unpacking;
        # fp16 at the bf16 rate (datasheets quote them equal); an f32 product with no stated
        # matrix peak at the vector rate.
        fallbacks = {"fp4": ("fp8", "bf16"), "fp8": ("bf16",), "fp16": ("bf16",),
                     "fp32-matrix": ("fp32",)}.get(compute.value, ())
        for name in fallbacks:
            if rate is not None and rate > 0:
                break
            rate = self.peaks.get(name)
        if rate is None or not math.isfinite(rate) or rate <= 0:
            raise MissingRate(self.name, compute.value)
        return rate


@dataclass(frozen=True, slots=True)
class SequenceRows:
    """One sequence in a step: ``rows`` added this step, ``context`` its KV length after it."""

    rows: int
    context: int

    def __post_init__(self) -> None:
        if self.rows < 1 or self.context < self.rows:
            raise ValueError(f"a sequence adds at least one row and its context ({self.context}) "
                             f"holds its rows ({self.rows})")

    @property
    def attended_positions(self) -> int:
        """Sum over this step's rows of the positions each attends (causal)."""
        k, c = self.rows, self.context
        return k * (c - k) + k * (k + 1) // 2


@dataclass(frozen=True, slots=True)
class Workload:
    """One step: the sequences it serves and the KV cache element format."""

    sequences: tuple[SequenceRows, ...]
    kv_format: Format
    logit_rows: int | None = None
    """Rows whose logits the step computes (the final norm, the LM head and the argmax run over
    them alone); None, every row (a verify step, a perplexity run). A generation's prefill
    needs one a sequence: ``fuel run`` computes just those (``StepShape.logit_rows``)."""

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.sequences)

    @staticmethod
    def decode(concurrency: int, context: int, kv_format: Format) -> Workload:
        return Workload((SequenceRows(1, context),) * concurrency, kv_format)

    @staticmethod
    def prefill(tokens: int, kv_format: Format) -> Workload:
        return Workload((SequenceRows(tokens, tokens),), kv_format)

    @staticmethod
    def runs(runs: Sequence[tuple[int, int]], context: int, kv_format: Format) -> Workload:
        """``runs`` of (k rows, n sequences), as a verify_batch row table has them."""
        seqs = tuple(SequenceRows(k, max(context, k)) for k, n in runs for _ in range(n))
        return Workload(seqs, kv_format)


def call_at_rows(fit: Sequence[tuple[int, float, float]], rows: int) -> tuple[float, float] | None:
    """``(fixed ns, FLOP/s)`` of a call of ``rows`` rows (``rows`` >= 2) from ``(rows, fixed
    ns, FLOP/s)`` measured at some row counts, each interpolated in ``log2(rows)``
    (:func:`fuel.cost.spec.rate_at_rows`); None without a usable point. Below the smallest
    measured rows the fixed part shrinks in proportion toward a one-row call's none (a 4-row
    product runs the native streaming kernel, not the chunk's GEMM). Pure."""
    if rows < 2 or not fit:
        return None
    from fuel.cost.spec import rate_at_rows

    rate = rate_at_rows([(r, v) for r, _, v in fit], rows)
    if rate is None:
        return None
    fixed_points = [(r, f) for r, f, _ in fit if f > 0]
    fixed = rate_at_rows(fixed_points, rows) or 0.0
    smallest = min((r for r, _ in fixed_points), default=rows)
    if rows < smallest:
        fixed *= (rows - 1) / (smallest - 1)
    return fixed, rate


@dataclass(frozen=True, slots=True)
class NodeWork:
    """FLOPs and bytes of one node for one step; bytes split by what they are."""

    flops: float
    weight_bytes: float
    activation_bytes: float
    kv_bytes: float
    compute: ComputeClass
    matvec: bool = False
    """A one-row matrix product per pass (decode): priced at the measured matrix-vector rate
    where the device has one."""
    matrix_rows: int = 0
    """Rows of each pass's matrix product (0: not a product the device's linear kernel runs);
    priced at the rate the device measured at those rows where it has such rates."""
    attention: bool = False
    """Attention: ``matrix_rows`` are its query rows a sequence, priced at the device's
    measured attention rate at those rows where it has one."""
    calls: int = 0
    """Matrix-product (or prompt-chunk attention) calls the node makes, one a pass (0: neither):
    each pays the device's fixed cost of a call at ``matrix_rows`` rows where it measured one."""

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.activation_bytes + self.kv_bytes

    def time_ns(self, rates: DeviceRates) -> float:
        """The roofline time: the slower of moving the bytes and doing the FLOPs."""
        memory = self.bytes / rates.bandwidth_for(self.weight_bytes, self.compute) * 1e9
        call = None
        if self.calls and not self.matvec and self.flops:
            call = (rates.attention_call(self.matrix_rows) if self.attention
                    else rates.matrix_call(self.compute, self.matrix_rows))
        if call is not None:
            fixed, rate_at = call
            return max(memory, self.calls * fixed + self.flops / rate_at * 1e9)
        rate = rates.attention_peak if self.attention else rates.peak
        compute = (self.flops / rate(self.compute, matvec=self.matvec, rows=self.matrix_rows)
                   * 1e9 if self.flops else 0.0)
        return max(memory, compute)


def expected_distinct_experts(experts: int, top_k: int, tokens: int) -> float:
    """Experts touched in expectation when ``tokens`` each pick ``top_k`` of ``experts``
    uniformly: ``E * (1 - (1 - k/E)^T)``."""
    if tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def kv_bytes_per_token(circuit: Circuit, kv_format: Format) -> int:
    """K and V of one token over every attention layer of the main section:
    ``2 x attention layers x kv_heads x head_dim x bytes per element``."""
    layers = sum(1 for i, n in enumerate(circuit.nodes)
                 if n.op.kind is OpKind.PAGED_ATTENTION and circuit.section_of_node(i).value == "main")
    if layers == 0:
        return 0
    width = _dim(circuit, None, "kv_heads") * _dim(circuit, None, "head_dim")
    return layers * kv_token_bytes(kv_format, width)


def kv_token_bytes(kv_format: Format, width: int) -> int:
    """K and V of one token of one layer (``width`` = kv_heads x head_dim). Scales that grow
    with tokens count; a per-tensor scale is a constant of the cache, not of a token."""
    return kv_format.bytes(2, width) - kv_format.bytes(0, width)


def _dim(circuit: Circuit, node: Node | None, name: str) -> int:
    value = circuit.dims.get(name)
    if value is None:
        raise MissingDim(circuit.arch, node.id if node else "(circuit)", name)
    return value


def _weight_format(circuit: Circuit, node: Node) -> Format:
    fmt = node.weight_format or (circuit.shape.weight_format if circuit.shape else None)
    if fmt is None:
        raise MissingWeightFormat(circuit.arch, node.id)
    return fmt


def _compute_of(fmt: Format) -> ComputeClass:
    if fmt.kind is FormatKind.FP8:
        return ComputeClass.TENSOR_FP8
    if fmt.kind in (FormatKind.NVFP4, FormatKind.MXFP4):
        return ComputeClass.TENSOR_FP4
    if fmt.kind is FormatKind.F32:
        return ComputeClass.TENSOR_FP32
    if fmt.kind is FormatKind.F16:
        return ComputeClass.TENSOR_FP16
    return ComputeClass.TENSOR_BF16


@dataclass(frozen=True, slots=True)
class PlanView:
    """What the cost of a node depends on in a plan: each edge's stored format and whether it
    stays inside the node's group (no memory traffic). ``None`` = unfused, circuit formats."""

    edge_formats: Sequence[Format] | None = None
    internal_edges: frozenset[int] = frozenset()


_LOGIT_OPS = frozenset({OpKind.FINAL_NORM, OpKind.LM_HEAD, OpKind.ARGMAX})
"""The ops that run over the rows whose logits a step computes (``Workload.logit_rows``)."""


def node_work(circuit: Circuit, index: int, workload: Workload, *, view: PlanView = PlanView(),
              passes: int = 1) -> NodeWork:
    """FLOPs and bytes of node ``index`` for one step of ``workload``.

    ``passes`` > 1 costs a per-row loop (see the module docstring): weights are re-read per pass
    and each sequence's cache once per pass that touches it."""
    node = circuit.nodes[index]
    rows = workload.rows
    if workload.logit_rows is not None and node.op.kind in _LOGIT_OPS:
        rows = min(rows, workload.logit_rows)
    dims = {**circuit.dims}
    formats = view.edge_formats

    def edge_bytes(e: int) -> float:
        if e in view.internal_edges:
            return 0.0
        edge = circuit.edges[e]
        fmt = formats[e] if formats is not None else edge.format
        return float(fmt.bytes(edge.rows_at(rows, dims), edge.dim_value))

    def io_bytes() -> float:
        return sum(edge_bytes(e) for e in node.inputs) + sum(edge_bytes(e) for e in node.outputs)

    def in_dim() -> int:
        return circuit.edges[node.inputs[0]].dim_value

    def out_dim() -> int:
        return circuit.edges[node.outputs[0]].dim_value

    def input_compute() -> ComputeClass:
        if not node.inputs:
            return ComputeClass.TENSOR_BF16
        e = node.inputs[0]
        return _compute_of(formats[e] if formats is not None else circuit.edges[e].format)

    def elements(edges: Sequence[int]) -> int:
        return sum(circuit.edges[e].rows_at(rows, dims) * circuit.edges[e].dim_value for e in edges)

    def elementwise(per_element: int, edges: Sequence[int]) -> NodeWork:
        # FLOPs per element of the named edges (the outputs, or the inputs of a reduction).
        return NodeWork(float(per_element * elements(edges)), 0.0, io_bytes(), 0.0,
                        ComputeClass.VECTOR)

    def rows_per_pass() -> int:
        return math.ceil(rows / max(passes, 1))

    def one_row_per_pass() -> bool:
        return rows_per_pass() == 1

    def sequence_passes(seq: SequenceRows) -> int:
        # A per-row loop of `passes` launches over `rows` rows visits a sequence once per piece of
        # its rows; a single pass visits it once.
        if passes <= 1:
            return 1
        piece = max(1, math.ceil(rows / passes))
        return math.ceil(seq.rows / piece)

    kind = node.op.kind
    match kind:
        case OpKind.LINEAR | OpKind.LM_HEAD | OpKind.ROUTER:
            fmt = _weight_format(circuit, node)
            k, n = in_dim(), out_dim()
            weight = fmt.weight_bytes(n, k) + _bias_bytes(node, n)
            return NodeWork(2.0 * rows * k * n, float(weight * passes), io_bytes(), 0.0,
                            input_compute(), matvec=one_row_per_pass(),
                            matrix_rows=rows_per_pass(), calls=max(passes, 1))
        case OpKind.EXPERT_GATE_UP | OpKind.EXPERT_DOWN:
            fmt = _weight_format(circuit, node)
            experts, top_k = _dim(circuit, node, "experts"), _dim(circuit, node, "top_k")
            k, n = _expert_shape(circuit, node, top_k)
            per_pass_tokens = max(1, math.ceil(rows / max(passes, 1)))
            touched = expected_distinct_experts(experts, top_k, per_pass_tokens) * passes
            return NodeWork(2.0 * rows * top_k * k * n, touched * fmt.weight_bytes(n, k), io_bytes(), 0.0,
                            input_compute(), matvec=one_row_per_pass())
        case OpKind.EMBED:
            fmt = _weight_format(circuit, node)
            return NodeWork(0.0, float(fmt.weight_bytes(rows, out_dim())), io_bytes(), 0.0,
                            ComputeClass.VECTOR)
        case OpKind.PAGED_ATTENTION:
            heads, head_dim = _dim(circuit, node, "q_heads"), _dim(circuit, node, "head_dim")
            per_token = kv_token_bytes(workload.kv_format, _dim(circuit, node, "kv_heads") * head_dim)
            window = _window(node)
            positions = sum(_windowed_positions(s, window) for s in workload.sequences)
            kv = sum(sequence_passes(s) * min(s.context, window or s.context) * per_token
                     for s in workload.sequences)
            flops = 4.0 * heads * head_dim * positions
            query_rows = min(max(s.rows for s in workload.sequences), rows_per_pass())
            return NodeWork(flops, 0.0, io_bytes(), float(kv), input_compute(),
                            matvec=max(s.rows for s in workload.sequences) == 1,
                            matrix_rows=query_rows, attention=True,
                            calls=max(passes, 1) * len(workload.sequences))
        case OpKind.KV_WRITE:
            width = _dim(circuit, node, "kv_heads") * _dim(circuit, node, "head_dim")
            written = rows * kv_token_bytes(workload.kv_format, width)
            return NodeWork(0.0, 0.0, io_bytes(), float(written), ComputeClass.VECTOR)
        case OpKind.RMS_NORM | OpKind.FINAL_NORM | OpKind.QK_NORM:
            fmt = _weight_format(circuit, node)
            gain_width = _dim(circuit, node, "head_dim") if kind is OpKind.QK_NORM else out_dim()
            gain = len(node.bindings) * fmt.weight_bytes(1, gain_width)
            return NodeWork(float(_NORM_FLOPS * elements(node.outputs)), float(gain * passes),
                            io_bytes(), 0.0, ComputeClass.VECTOR)
        case OpKind.SILU_MUL | OpKind.GELU_TANH_MUL:
            return elementwise(_GATED_ACT_FLOPS, node.outputs)
        case OpKind.ROPE:
            return elementwise(_ROPE_FLOPS, node.outputs)
        case OpKind.ACT_QUANT | OpKind.LOGIT_SOFTCAP:
            return elementwise(_QUANT_FLOPS if kind is OpKind.ACT_QUANT else _SOFTCAP_FLOPS,
                               node.outputs)
        case OpKind.RESIDUAL_ADD:
            return elementwise(1, node.outputs)
        case OpKind.ARGMAX | OpKind.TOP_K:
            # A reduction: one compare per input element.
            return elementwise(1, node.inputs[:1])
        case OpKind.BLEND:
            # Weighted sum of the experts' rows: a multiply and an add per input element.
            return elementwise(2, node.inputs[:1])
        case OpKind.COPY | OpKind.CONCAT | OpKind.SPLIT:
            return NodeWork(0.0, 0.0, io_bytes(), 0.0, ComputeClass.VECTOR)
        case (OpKind.ALL_REDUCE | OpKind.ALL_GATHER | OpKind.REDUCE_SCATTER | OpKind.EP_REDUCE
              | OpKind.SEND | OpKind.RECV):
            # The chip's side of a collective: reading and writing its buffers. The time on the
            # link is priced by fuel.cost.interconnect (fuel.report.parallel adds it per step).
            return NodeWork(0.0, 0.0, io_bytes(), 0.0, ComputeClass.VECTOR)
    raise AssertionError(f"no cost model for op {kind}")  # the op set is closed


def _bias_bytes(node: Node, out: int) -> int:
    # A bias binding is a bf16/f32 vector of `out`; count it at 2 bytes per element.
    return sum(2 * out for b in node.bindings if b.endswith("bias"))


def _expert_shape(circuit: Circuit, node: Node, top_k: int) -> tuple[int, int]:
    """(in, out) of one expert's matrix: the node's output edge carries ``top_k`` experts' rows
    side by side when its width is a multiple of ``top_k`` times the per-expert width."""
    hidden = _dim(circuit, node, "hidden")
    inter = _moe_intermediate(circuit, node)
    if node.op.kind is OpKind.EXPERT_GATE_UP:
        return hidden, 2 * inter
    return inter, hidden


def _moe_intermediate(circuit: Circuit, node: Node) -> int:
    for name in ("moe_intermediate", "expert_intermediate"):
        if name in circuit.dims:
            return circuit.dims[name]
    raise MissingDim(circuit.arch, node.id, "moe_intermediate")


def _window(node: Node) -> int | None:
    text = node.param("sliding_window") or node.param("window")
    return int(text) if text else None


def _windowed_positions(seq: SequenceRows, window: int | None) -> int:
    if window is None:
        return seq.attended_positions
    k, c = seq.rows, seq.context
    return sum(min(c - k + j + 1, window) for j in range(k))


# --- plan-level estimates ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupCost:
    """One group of a plan at one workload."""

    index: int
    rule: str
    block: str
    locals: tuple[str, ...]
    ops: tuple[str, ...]
    launches: int
    passes: int
    flops: float
    bytes: float
    weight_bytes: float
    kv_bytes: float
    ceiling_ns: float
    node_ns: tuple[float, ...] = field(default=())


@dataclass(frozen=True, slots=True)
class StepEstimate:
    """The roofline of one step: the ceiling (no launch overhead) and with launches added."""

    ceiling_ns: float
    launches: int
    launch_overhead_ns: float
    tokens: int
    weight_bytes: float
    kv_bytes: float
    groups: tuple[GroupCost, ...]

    @property
    def with_launch_ns(self) -> float:
        return self.ceiling_ns + self.launches * self.launch_overhead_ns

    @property
    def tokens_per_s_ceiling(self) -> float:
        return self.tokens / self.ceiling_ns * 1e9 if self.ceiling_ns else math.inf

    @property
    def tokens_per_s_with_launch(self) -> float:
        return self.tokens / self.with_launch_ns * 1e9 if self.with_launch_ns else math.inf

    def time_by_op(self) -> dict[str, float]:
        """Ceiling ns per op name, ops in first-seen plan order (deterministic)."""
        out: dict[str, float] = {}
        for g in self.groups:
            for op, ns in zip(g.ops, g.node_ns, strict=True):
                out[op] = out.get(op, 0.0) + ns
        return out


@dataclass(frozen=True, slots=True)
class PlannedGroup:
    """The parts of a fuser group the roofline reads: member node indices, the rule, the
    number of launches per step, and the pass count of its per-row loop (1 for ``once`` and
    ``per_run``)."""

    nodes: tuple[int, ...]
    rule: str
    launches: int
    passes: int


def estimate_step(circuit: Circuit, groups: Sequence[PlannedGroup], workload: Workload,
                  rates: DeviceRates, *, edge_formats: Sequence[Format] | None = None,
                  fused_edges: Callable[[int], frozenset[int]] = lambda g: frozenset()
                  ) -> StepEstimate:
    """Cost every group of a plan at ``workload`` on ``rates``.

    ``fused_edges(g)`` names the edges group ``g`` keeps inside itself (no traffic)."""
    costs = []
    for gi, group in enumerate(groups):
        view = PlanView(edge_formats, fused_edges(gi))
        works = [node_work(circuit, n, workload, view=view, passes=group.passes)
                 for n in group.nodes]
        times = tuple(w.time_ns(rates) for w in works)
        first = circuit.nodes[group.nodes[0]]
        costs.append(GroupCost(
            index=gi, rule=group.rule, block=circuit.blocks[first.block].name,
            locals=tuple(circuit.nodes[n].local for n in group.nodes),
            ops=tuple(circuit.nodes[n].op.name() for n in group.nodes),
            launches=group.launches, passes=group.passes,
            flops=sum(w.flops for w in works), bytes=sum(w.bytes for w in works),
            weight_bytes=sum(w.weight_bytes for w in works),
            kv_bytes=sum(w.kv_bytes for w in works),
            ceiling_ns=sum(times), node_ns=times))
    return StepEstimate(
        ceiling_ns=sum(c.ceiling_ns for c in costs), launches=sum(c.launches for c in costs),
        launch_overhead_ns=rates.launch_overhead_ns, tokens=workload.rows,
        weight_bytes=sum(c.weight_bytes for c in costs), kv_bytes=sum(c.kv_bytes for c in costs),
        groups=tuple(costs))


def section_nodes(circuit: Circuit, section: str) -> tuple[int, ...]:
    return tuple(i for i in range(len(circuit.nodes)) if circuit.section_of_node(i).value == section)


def decode_weight_bytes(circuit: Circuit) -> float:
    """Weight bytes one decode step of one row reads (main section, unfused): every matrix and
    gain once, one embedding row, ``top_k`` experts per MoE layer."""
    workload = Workload.decode(1, 1, Format(FormatKind.BF16))
    return sum(node_work(circuit, i, workload).weight_bytes for i in section_nodes(circuit, "main"))


def weight_floor_ns(circuit: Circuit, rates: DeviceRates) -> float:
    """Bytes of weights read per decode step over the bandwidth: no decode step is faster."""
    return decode_weight_bytes(circuit) / rates.bandwidth * 1e9
