"""Native step lists: a CPU program's steps run in one call of the native library.

Decides how a compiled program is dispatched when every one of its steps is a kernel the native
library has: as one call of ``fuel_run_steps`` (``kernels/native/steps.c``) instead of one
Python call per node. A decode step of SmolLM2 is ~790 nodes; each Python call (argument
checks, an output allocation, the ctypes transition) cost more than the kernel it ran, so the
step's dispatch, not its arithmetic, was most of its time.

How: the program is laid out once, when it is compiled. Every value gets a fixed address: the
fed tensors (their addresses are written into a pointer table at each run), the weights and
constants, and one arena holding every value a step computes (a program with host steps, a
prompt chunk, lets values whose lives do not overlap share its bytes). A view (reshape, unsqueeze, a
select or slice along a leading dimension, a permute or transpose that only moves size-1
dimensions) is an offset into its operand: it costs nothing and runs nothing. Every other step
is a record naming a native kernel and its operands' addresses.

Invariants:
- The kernels are the ones the one-call-per-node path runs for the same node (the native
  matmuls, 8-bit-activation matmuls, paged attention, ``residual_add_rms_norm``, rope, argmax,
  the KV write and the dequantizer), with the same arguments, so their results are the same;
  ``rms_norm``, ``silu_mul``, ``add`` and the row gather (``index_select``) are short loops in
  ``steps.c`` with the ops' own definitions (tests compare every one with the torch kernel).
- A program is laid out only when every step is a native step or a **host step**: a node
  without a native step that is a product (a prompt chunk's GEMM: oneDNN's f32 linear, the
  native 16-bit GEMM, a JIT-adopted quantized kernel) or prompt-chunk attention
  (:func:`_hostable`) runs its own kernel from Python between native segments, on views of
  the arena, and its result's address is written into the pointer table for the records
  after it. Each of those kernels runs for far longer than its one Python call, and the
  nodes around it (norms, rope, KV writes, views) no longer cost one call each: a SmolLM2
  prefill chunk goes from ~820 Python calls to ~300 (measured at 41 rows, bf16 and Q4_1:
  0.82x the per-node step's time; f32, whose per-node kernels are cheaper, ~0.97-1.0x). One
  node of any other kind without a native step (another op, a dtype, a layout that is not
  contiguous) and the program keeps its per-node path, the reason kept in :attr:`Declined`
  for the run report.
- A view that is not an offset (a column slice, a permute moving dimensions of more than one
  element) is a strided copy into the arena (``STEP_COPY``): the per-node path's torch view
  made contiguous, the same values.
- A run returns fresh tensors (the roots are copied out of the arena), so a caller holding the
  logits of one step never sees the next step's. A run that finds a fed tensor not contiguous,
  the program already running on another thread, or a step refusing its operands (a KV slot or
  block outside the cache) returns None: the caller runs the per-node path, which raises the
  precise error or computes the same values.
- ``FUEL_NATIVE_STEPS=0`` turns step lists off (every program runs node by node).

**Fused steps** (:func:`fuse`, ``FUEL_FUSED_STEPS=0`` off). Once laid out, the records are
grouped: a product takes along the later products of the same activations in the same format (a
layer's q, k and v; gate and up), which run as one kernel (the activations rounded to 8 bits or
summed once, every weight row shared out in one parallel region of torch's pool instead of one
region each), followed by the serial row-wise records that read what it wrote, as its epilogue
(a GEMM with an epilogue, as CUTLASS composes one): rope, the KV writes and decode attention;
silu_mul; residual_add_rms_norm; argmax over the logits. A SmolLM2 decode step goes from ~460
kernels to ~126, four a layer: ``qkv + rope + kv writes + attention``, ``o + residual norm``,
``gate/up + silu_mul``, ``down + residual norm``. A record moves up only past records that
neither write what it reads nor touch what it writes, and every output row is computed by the
same row kernel over the same tiles as unfused, so the results are the unfused records' bit for
bit (tests hold both to that).
"""

from __future__ import annotations

import ctypes
import itertools
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from fuel.graph.ir import Fused, Graph, NodeId, Prim
from fuel.graph.ops import OpKind
from fuel.graph.registry import FusedOps
from fuel.kernels.threads import step_threads
from fuel.kernels.torch_kernels import NATIVE_WEIGHT_FORMATS, torch_dtype

ENV = "FUEL_NATIVE_STEPS"

_MATMUL, _MATMUL_Q8, _DEQUANTIZE, _ROPE, _ARGMAX, _KV_WRITE, _PAGED, _RESIDUAL_NORM = 1, 2, 3, 4, 5, 6, 7, 8
_RMS_NORM, _SILU_MUL, _ADD, _GATHER, _FUSED, _CAST, _COPY = 9, 10, 11, 12, 13, 14, 15
_HOST = -1
"""A marker in the planner's records, not a native kind: a host step (:class:`_Host`)."""
_KV_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
"""Cache element dtypes the KV write and attention records take (gemv.c's F32, F16, BF16)."""
_ALIGN = 64


_INDEX_BYTES = {torch.int64: 8, torch.int32: 4, torch.uint32: 4}
"""Index operands (a gather's, paged attention's table and lengths) by element size."""


class _Step(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("slot", ctypes.c_int64 * 9),
                ("offset", ctypes.c_int64 * 9), ("n", ctypes.c_int64 * 14),
                ("f", ctypes.c_float * 2)]


@dataclass(frozen=True, slots=True)
class Declined:
    """Why a program runs node by node (no step list): the node and what it lacks."""

    reason: str


@dataclass(frozen=True, slots=True)
class _Ref:
    """Where a value lives: ``table[slot] + offset`` bytes, contiguous, of ``shape``/``dtype``."""

    slot: int
    offset: int
    shape: tuple[int, ...]
    dtype: Any

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _Unsupported(Exception):
    """A node the step list cannot lay out (internal: becomes :class:`Declined`)."""


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


FUSE_ENV = "FUEL_FUSED_STEPS"
"""``FUEL_FUSED_STEPS=0`` keeps every product its own step (no fused steps: :func:`fuse`)."""


def fusing_enabled() -> bool:
    return os.environ.get(FUSE_ENV, "1") != "0"


# Fused steps ------------------------------------------------------------------------------
_FUSED_MAX = 4
"""Products one fused step holds (``FUSED_MAX`` in steps.c)."""
_HOIST_WINDOW = 8
"""How many records ahead a product sharing the activations is looked for."""
_EPILOGUE_MAX = 8
_EPILOGUE_KINDS = frozenset({_ROPE, _KV_WRITE, _PAGED, _RESIDUAL_NORM, _RMS_NORM, _SILU_MUL, _ADD,
                             _ARGMAX, _CAST})
"""Serial row-wise kernels a fused step may run after its products (its epilogue)."""
_ACCESS = {  # kind -> (operands read, operands written)
    _MATMUL: ((0, 1), (2,)), _MATMUL_Q8: ((0, 1), (2,)), _DEQUANTIZE: ((0,), (1,)),
    _ROPE: ((0, 1, 2), (3,)), _ARGMAX: ((0,), (1,)), _KV_WRITE: ((0, 1, 2), (0,)),
    _PAGED: ((0, 1, 2, 3, 4), (5,)), _RESIDUAL_NORM: ((0, 1, 2), (3,)),
    _RMS_NORM: ((0, 1), (2,)), _SILU_MUL: ((0, 1), (2,)), _ADD: ((0, 1), (2,)),
    _GATHER: ((0, 1), (2,)), _CAST: ((0,), (1,)), _COPY: ((0,), (1,)),
}


_NAMES = {_MATMUL: "matmul", _MATMUL_Q8: "matmul_q8", _DEQUANTIZE: "dequantize", _ROPE: "rope",
          _ARGMAX: "argmax", _KV_WRITE: "kv_write", _PAGED: "paged_attn",
          _RESIDUAL_NORM: "residual_add_rms_norm", _RMS_NORM: "rms_norm", _SILU_MUL: "silu_mul",
          _ADD: "add", _GATHER: "gather", _CAST: "cast", _COPY: "copy"}


def _describe(head, epilogue) -> str:
    if head[0] != _FUSED:
        return _NAMES[head[0]]
    products = f"{_NAMES[_MATMUL_Q8 if head[2][1] else _MATMUL]} x{head[2][4]}"
    return " + ".join([products, *(_NAMES[r[0]] for r in epilogue)])


def _extent(ref: _Ref) -> tuple[int, int, int]:
    return ref.slot, ref.offset, ref.offset + max(ref.numel * ref.dtype.itemsize, 1)


def _touches(record, which: int) -> list[tuple[int, int, int]]:
    kind, operands = record[0], record[1]
    return [_extent(operands[k]) for k in _ACCESS[kind][which] if operands[k] is not None]


def _overlap(a, b) -> bool:
    return any(s == t and lo < hi2 and lo2 < hi for s, lo, hi in a for t, lo2, hi2 in b)


def _independent(earlier, later) -> bool:
    """Whether ``later`` may run before ``earlier`` (neither writes what the other touches)."""
    reads_e, writes_e = _touches(earlier, 0), _touches(earlier, 1)
    reads_l, writes_l = _touches(later, 0), _touches(later, 1)
    return not (_overlap(writes_e, reads_l) or _overlap(writes_e, writes_l)
                or _overlap(reads_e, writes_l))


def fuse(records: list) -> list[tuple[Any, tuple]]:
    """The records as (head, epilogue) pairs, one step each: a product (``_MATMUL`` /
    ``_MATMUL_Q8``) takes along the later products of the same activations in the same format
    (q, k and v; gate and up), moved up past the records between where nothing reads or writes
    what they touch, and then the run of serial row-wise records that follows and reads what
    the step wrote (rope, the KV writes and attention; silu_mul; residual_add_rms_norm; argmax
    over the logits) as its epilogue. Every other record is its own step. Program order is kept
    wherever a value flows, so the results are the unfused records' (steps.c: bit for bit)."""
    done = [False] * len(records)
    out: list[tuple[Any, tuple]] = []
    for i, record in enumerate(records):
        if done[i]:
            continue
        done[i] = True
        kind = record[0]
        if kind not in (_MATMUL, _MATMUL_Q8):
            out.append((record, ()))
            continue
        x, fmt, rows, cols = record[1][0], record[2][0], record[2][1], record[2][3]
        group, passed = [record], []
        for j in range(i + 1, min(len(records), i + 1 + _HOIST_WINDOW)):
            if done[j]:
                continue
            other = records[j]
            if (len(group) < _FUSED_MAX and other[0] == kind and other[1][0] == x
                    and other[2][0] == fmt and other[2][1] == rows and other[2][3] == cols
                    and all(_independent(p, other) for p in passed)):
                group.append(other)
                done[j] = True
            else:
                passed.append(other)
        written = [e for r in group for e in _touches(r, 1)]
        epilogue = []
        for j in range(i + 1, len(records)):
            if done[j]:
                continue
            other = records[j]
            if (other[0] not in _EPILOGUE_KINDS or len(epilogue) == _EPILOGUE_MAX
                    or not _overlap(_touches(other, 0), written)):
                break
            epilogue.append(other)
            written += _touches(other, 1)
            done[j] = True
        if len(group) == 1 and not epilogue:
            out.append((record, ()))
            continue
        operands = [x] + [r[1][1] for r in group] + [None] * (_FUSED_MAX - len(group))
        operands += [r[1][2] for r in group] + [None] * (_FUSED_MAX - len(group))
        pad = [0] * (_FUSED_MAX - len(group))
        ints = (fmt, int(kind == _MATMUL_Q8), rows, cols, len(group),
                *[r[2][2] for r in group], *pad, *[r[2][4] for r in group], *pad, len(epilogue))
        out.append(((_FUSED, tuple(operands), ints, ()), tuple(epilogue)))
    return out


def _hostable(node, kernel) -> bool:
    """Whether a node without a native step runs from Python between native segments (a host
    step) rather than costing the program its step list: a product (a prompt chunk's GEMM:
    oneDNN's, the native GEMM, a JIT-adopted quantized one) or prompt-chunk attention, each far
    longer than the one Python call it takes. Anything else still declines the step list."""
    op = node.op
    if not isinstance(op, Fused):
        return False
    from fuel.jit import native_synth

    return op.id == FusedOps.FUSED_LINEAR or isinstance(
        kernel, native_synth._PagedRunner | native_synth._QuantRunner)


def _drop_unread_copies(records: list, read: list[_Ref]) -> list:
    """The records without the copies nothing reads: a consumer reading a copy's source rows
    apart (``_Planner._rows_apart``) leaves it unread. ``read``: what else reads values (the
    roots, host steps' operands). A copy writes only its own fresh arena range, so only a
    record after it, a host step or a root can read it."""
    import bisect

    # A ref lies inside one value, so a read touches a copy's result exactly when it starts
    # inside it: the read starts, sorted per slot, answer each copy by bisection.
    starts: dict[int, list[int]] = {}
    for ref in read:
        starts.setdefault(ref.slot, []).append(ref.offset)
    for record in records:
        if record[0] != _HOST:
            for k in _ACCESS[record[0]][0]:
                ref = record[1][k]
                if ref is not None:
                    starts.setdefault(ref.slot, []).append(ref.offset)
    for offsets in starts.values():
        offsets.sort()
    kept = []
    for record in records:
        if record[0] == _COPY:
            slot, lo, hi = _extent(record[1][1])
            offsets = starts.get(slot, [])
            at = bisect.bisect_left(offsets, lo)
            if at == len(offsets) or offsets[at] >= hi:
                continue  # nothing reads it
        kept.append(record)
    return kept


def _segments(records: list) -> list:
    """The records split at host steps: lists of native records, each host marker alone."""
    out: list = []
    run: list = []
    for record in records:
        if record[0] == _HOST:
            if run:
                out.append(run)
                run = []
            out.append(record)
        else:
            run.append(record)
    if run:
        out.append(run)
    return out


class _Host:
    """A step the program runs from Python between native segments (:func:`_hostable`): the
    node's own kernel on its operands' values; its result's address goes into ``slot``."""

    __slots__ = ("kernel", "ins", "slot", "shape", "dtype", "name")

    def __init__(self, kernel, ins, slot, shape, dtype, name):
        self.kernel, self.ins, self.slot, self.shape, self.dtype, self.name = (
            kernel, ins, slot, shape, dtype, name)


_PROGRAM_KEYS = itertools.count()
"""A step list's key in the thread chooser's figures."""


class NativeSteps:
    """A program laid out for ``fuel_run_steps``: :meth:`run` with the fed tensors."""

    def __init__(self, lib, segments, table, feed_slots, roots, keep, layout, views, released):
        self._call = lib.run_steps
        self._segments = segments
        """In order: a native segment (a ``_Step`` array, run in one call) or a :class:`_Host`."""
        self._released = released
        """Per segment, the host results no later segment reads: dropped once it ran, so torch's
        allocator hands their memory to the next result (warm, already mapped) as the per-node
        path's dead values are."""
        self.layout: tuple[str, ...] = layout
        """What each step runs, in order: a kernel's name (``rope``), a fused step's products
        and epilogue (``matmul_q8 x3 + rope + rope + kv_write + kv_write + paged_attn``), or a
        step run from Python (``host fused_linear``)."""
        self._table = table
        self._feed_slots = feed_slots
        self._roots = roots  # (arena view, None, None), (None, feed index, None) or (None, None, host ref)
        self._keep = keep  # the arena, weights and constants the table points into
        self._views = views  # (slot, offset, shape, dtype) -> a tensor on the arena or a constant
        self._lock = threading.Lock()
        self._threads = torch.get_num_threads
        self._adaptive = not any(isinstance(segment, _Host) for segment in segments)
        """Whether the thread count is the process's chooser's (``fuel.kernels.threads.
        step_threads``): a step list with no host steps (torch's kernels may sum in another
        order on another count)."""
        self._key = next(_PROGRAM_KEYS)
        self.last_threads: int | None = None
        """The thread count the last run took."""
        self._last: list[Any] = [None] * len(feed_slots)
        """The fed tensors whose addresses the table holds: one passed again as the same object
        (the engine's KV caches and reused feed buffers, never resized) is not checked again."""

    @property
    def kernels(self) -> int:
        """Kernels one run makes (views cost nothing and are not counted; a fused step, its
        products and its epilogue, is one; a host step is one)."""
        return len(self.layout)

    @property
    def host_calls(self) -> int:
        """Calls from Python one run makes: one a native segment, one a host step."""
        return len(self._segments)

    def _value(self, ref: _Ref, fed: list[Any], held: dict[int, Any]) -> Any:
        """The tensor ``ref`` names, for a host step's operand or a root."""
        view = self._views.get((ref.slot, ref.offset, ref.shape, ref.dtype))
        if view is not None:
            return view
        base = held[ref.slot] if ref.slot in held else fed[self._feed_slots.index(ref.slot)]
        if ref.offset == 0 and tuple(base.shape) == ref.shape:
            return base
        return _tensor_at(base, ref)

    def run(self, fed: list[Any]) -> tuple[Any, ...] | None:
        """The roots' values, or None where the per-node path must run instead (module docs)."""
        if not self._lock.acquire(blocking=False):
            return None
        self.last_threads = None
        try:
            table, last = self._table, self._last
            for index, (slot, tensor) in enumerate(zip(self._feed_slots, fed)):
                if tensor is last[index]:
                    continue
                if not tensor.is_contiguous():
                    last[index] = None
                    return None
                table[slot] = tensor.data_ptr()
                last[index] = tensor
            held: dict[int, Any] = {}  # host steps' results, alive until the roots are out
            threads, chooser = self._threads(), None
            if self._adaptive:
                chooser = step_threads(threads)
                threads = chooser.threads()
            for segment, released in zip(self._segments, self._released):
                if not isinstance(segment, _Host):
                    started = time.perf_counter()
                    if self._call(segment, len(segment), table, threads) != 0:
                        return None
                    if chooser is not None:
                        chooser.record(self._key, threads, time.perf_counter() - started)
                else:
                    out = segment.kernel(*(self._value(r, fed, held) for r in segment.ins))
                    if out.dtype != segment.dtype or tuple(out.shape) != segment.shape:
                        return None  # not what the graph says: the per-node path decides
                    if not out.is_contiguous():
                        out = out.contiguous()
                    held[segment.slot] = out
                    table[segment.slot] = out.data_ptr()
                for slot in released:
                    del held[slot]
            self.last_threads = threads
            return tuple(view.clone() if view is not None
                         else fed[index] if index is not None
                         else self._root(ref, fed, held)
                         for view, index, ref in self._roots)
        finally:
            self._lock.release()

    def _root(self, ref: _Ref, fed: list[Any], held: dict[int, Any]) -> Any:
        value = self._value(ref, fed, held)
        return value if value is held.get(ref.slot) else value.clone()


def plan(graph: Graph, steps, kernels, entries, leaves: dict[NodeId, tuple[str, int]],
         feeds, constants, roots) -> NativeSteps | Declined:
    """Lay out a compiled program (``executor.compile_program``'s steps, kernels, table entries,
    leaves and constants) as a step list, or say why not."""
    if not enabled():
        return Declined(f"{ENV}=0")
    from fuel.kernels import native

    lib = native.load()
    if isinstance(lib, native.Unavailable):
        return Declined(f"no native library: {lib.reason}")
    try:
        return _Planner(graph, lib, feeds, constants).plan(steps, kernels, entries, leaves, roots)
    except _Unsupported as why:
        return Declined(str(why))


def steppable(table, backend) -> Any:
    """The predicate ``(graph, node_id) -> bool`` the bake charges forfeited step lists with
    (``OptimizeOptions.steppable``): whether the node, as the table binds it, would be laid out
    as a step (or a view) of a step list. None when step lists are off or the native library is
    missing (no program has one: nothing is charged).

    The node is laid out by the same :meth:`_Planner._step` :func:`plan` runs, on operands
    standing in for the real ones (the graph's shapes and dtypes, contiguous at offset 0): what
    that depends on (op, dtype, shape, the kernel bound) the graph decides alone. A constant that
    turns out not to be contiguous, a fed tensor that is not, are found only when the program is
    laid out (as they are today)."""
    if not enabled():
        return None
    from fuel.kernels import native
    from fuel.kernels.table import KernelMissing, key_dtypes, op_key, required_caps

    lib = native.load()
    if isinstance(lib, native.Unavailable):
        return None

    def check(graph: Graph, node_id: NodeId) -> bool:
        node = graph.node(node_id)
        if not isinstance(node.op, Prim | Fused):
            return True
        if isinstance(node.op, Prim) and node.op.kind is OpKind.CONCAT:
            # The executor drops a concatenation its readers all take back apart (a packed
            # projection's gate and up): it never becomes a step.
            readers = graph.consumers()[node_id]
            return bool(readers) and all(_takes_back_a_part(graph, r) for r in readers)
        if _takes_back_a_part(graph, node_id):
            return True  # the executor reads the concatenated part itself
        operands = [graph.node(i) for i in node.inputs]
        if not node.shape.is_concrete or not all(o.shape.is_concrete for o in operands):
            return False
        try:
            ins = [_Ref(1, 0, tuple(o.shape.dims), torch_dtype(o.dtype)) for o in operands]
            entry = table.lookup(op_key(node.op), key_dtypes(graph, node_id), backend,
                                 required_caps(node))
            kernel = entry.kernel(node)
        except (KernelMissing, KeyError):
            return False
        try:
            _Planner(graph, lib, (), ())._step(node_id, node, ins, kernel, entry)
        except _Unsupported:
            return _hostable(node, kernel)  # a host step keeps the step list
        return True

    return check


def _takes_back_a_part(graph: Graph, node_id: NodeId) -> bool:
    """Whether ``node_id`` is a slice returning one operand of the concatenation it reads whole
    (what the executor replaces by that operand: ``executor.concat_part``)."""
    from fuel.runtime.executor import concat_part

    node = graph.node(node_id)
    if not (isinstance(node.op, Prim) and node.op.kind is OpKind.SLICE):
        return False
    concat = graph.node(node.inputs[0])
    if not (isinstance(concat.op, Prim) and concat.op.kind is OpKind.CONCAT):
        return False
    return concat_part(graph, node.op, concat, concat.inputs) is not None


class _Planner:
    def __init__(self, graph: Graph, lib, feeds, constants):
        self.graph, self.lib, self.feeds, self.constants = graph, lib, feeds, constants
        self.refs: dict[NodeId, _Ref] = {}
        self.slots: list[Any] = [None]  # slot 0: the arena (its address set once it exists)
        self.const_slot: dict[int, int] = {}
        self.feed_slots: list[int] = []
        self.arena_bytes = 0
        self.allocs: list[tuple[int, int]] = []  # every _alloc: (offset, bytes), by offset
        self.hosts: list[_Host] = []
        self.copies: dict[tuple[int, int], tuple] = {}
        """A copy's result (slot, offset) -> (its source from the first element, outer sizes,
        byte strides, bytes a run, elements): what a consumer reading rows apart reads instead
        (:meth:`_rows_apart`), leaving the copy to :func:`_drop_unread_copies`."""
        self.records: list[tuple[int, tuple[_Ref | None, ...], tuple[int, ...], tuple[float, ...]]] = []

    # Layout -------------------------------------------------------------------------------
    def plan(self, steps, kernels, entries, leaves, roots) -> NativeSteps:
        for feed in self.feeds:
            if not all(isinstance(d, int) for d in feed.dims):
                raise _Unsupported(f"input `{feed.name}` has a symbolic shape")
            self.feed_slots.append(len(self.slots))
            self.slots.append(None)
        for node_id, (kind, index) in leaves.items():
            node = self.graph.node(node_id)
            if kind == "fed":
                feed = self.feeds[index]
                self.refs[node_id] = _Ref(self.feed_slots[index], 0, tuple(feed.dims), feed.dtype)
            else:
                tensor = self.constants[index]
                if tensor.device.type != "cpu" or not tensor.is_contiguous():
                    raise _Unsupported(f"constant of node {node_id} is not contiguous on the CPU")
                slot = self.const_slot.get(index)
                if slot is None:
                    slot = self.const_slot[index] = len(self.slots)
                    self.slots.append(tensor)
                self.refs[node_id] = _Ref(slot, 0, tuple(node.shape.dims), tensor.dtype)
        for (node_id, reads), kernel, entry in zip(steps, kernels, entries):
            node = self.graph.node(node_id)
            if not node.shape.is_concrete:
                raise _Unsupported(f"node {node_id} ({node.op}) has a symbolic shape")
            ins = [self.refs[r] for r in reads]
            try:
                self.refs[node_id] = self._step(node_id, node, ins, kernel, entry)
            except _Unsupported:
                if not _hostable(node, kernel):
                    raise
                self.refs[node_id] = self._host(node, ins, kernel)
        self.records = _drop_unread_copies(self.records, [self.refs[r] for r in roots]
                                           + [ref for h in self.hosts for ref in h.ins])
        if self.hosts:
            self._reuse_arena([self.refs[r] for r in roots])
        if not any(r[0] != _HOST for r in self.records):
            raise _Unsupported("no step runs natively")
        arena = torch.empty(max(self.arena_bytes, _ALIGN), dtype=torch.uint8)
        pointers = (ctypes.c_void_p * len(self.slots))()
        pointers[0] = arena.data_ptr()
        for slot, tensor in enumerate(self.slots):
            if tensor is not None:
                pointers[slot] = tensor.data_ptr()
        segments: list[Any] = []
        layout: list[str] = []
        parts = _segments(self.records)
        host_slots = {h.slot for h in self.hosts}
        last_read: dict[int, int] = {}  # a host result's slot -> the last segment reading it
        for index, part in enumerate(parts):
            for record in ([part] if part[0] == _HOST else part):
                for ref in record[1]:
                    if ref is not None and ref.slot in host_slots:
                        last_read[ref.slot] = index
        for root in roots:
            last_read.pop(self.refs[root].slot, None)  # returned: held to the end
        released: list[tuple[int, ...]] = [()] * len(parts)
        for slot, index in last_read.items():
            released[index] += (slot,)
        for part in parts:
            if part[0] == _HOST:
                host = self.hosts[part[2][0]]
                segments.append(host)
                layout.append(f"host {host.name}")
                continue
            fused = fuse(part) if fusing_enabled() else [(r, ()) for r in part]
            flat = [r for head, epilogue in fused for r in (head, *epilogue)]
            records = (_Step * len(flat))()
            for record, (kind, operands, ints, floats) in zip(records, flat):
                record.kind = kind
                for k, ref in enumerate(operands):
                    record.slot[k], record.offset[k] = (-1, 0) if ref is None else (ref.slot, ref.offset)
                for k, value in enumerate(ints):
                    record.n[k] = value
                for k, value in enumerate(floats):
                    record.f[k] = value
            segments.append(records)
            layout.extend(_describe(head, epilogue) for head, epilogue in fused)
        views: dict[tuple, Any] = {}
        for host in self.hosts:  # the operands a host step reads from the arena or a constant
            for ref in host.ins:
                base = arena if ref.slot == 0 else self.slots[ref.slot]
                if base is None:
                    continue  # fed, or another host step's result: found at each run
                same = base is not arena and ref.offset == 0 and tuple(base.shape) == ref.shape
                views[(ref.slot, ref.offset, ref.shape, ref.dtype)] = (
                    base if same else _tensor_at(base, ref))
        out = []
        for root in roots:
            ref = self.refs[root]
            if ref.slot == 0:
                out.append((_tensor_at(arena, ref), None, None))
            elif (ref.slot in self.feed_slots and ref.offset == 0
                  and ref.shape == tuple(self.feeds[self.feed_slots.index(ref.slot)].dims)):
                out.append((None, self.feed_slots.index(ref.slot), None))  # a cache written in place
            elif ref.slot in host_slots:
                out.append((None, None, ref))  # a host step's result (or a view of it)
            else:
                raise _Unsupported(f"root {root} is a view of a weight or an input")
        return NativeSteps(self.lib, segments, pointers, self.feed_slots, out,
                           (arena, [t for t in self.slots if t is not None]), tuple(layout), views,
                           tuple(released))

    def _host(self, node, ins: list[_Ref], kernel) -> _Ref:
        """A host step (:func:`_hostable`): its result gets a slot of its own, filled at each
        run with the address of what the kernel returned."""
        slot = len(self.slots)
        self.slots.append(None)
        shape, dtype = tuple(node.shape.dims), torch_dtype(node.dtype)
        name = str(node.op).removeprefix("fused:")
        self.hosts.append(_Host(kernel, tuple(ins), slot, shape, dtype, name))
        self.records.append((_HOST, tuple(ins), (len(self.hosts) - 1,), ()))
        return _Ref(slot, 0, shape, dtype)

    def _copied_rows(self, ref: _Ref) -> tuple[_Ref, int, int, int] | None:
        """Where ``ref`` is all of a copy's result that gathered rows from one source (a column
        range of a prompt chunk's product): (the source from the first row, rows, bytes a row,
        the rows' stride in bytes), which a consumer may read instead (the copy is then
        dropped, :func:`_drop_unread_copies`), else None."""
        copy = self.copies.get((ref.slot, ref.offset))
        if copy is None:
            return None
        source, sizes, strides, run, numel = copy
        if numel != ref.numel or sizes[:3] != (1, 1, 1) or source.dtype != ref.dtype:
            return None
        if source.slot in self.feed_slots:  # a fed tensor (a KV cache) may be written between
            return None
        return source, sizes[3], run, strides[3]

    def _rows_apart(self, ref: _Ref, rows: int, row_bytes: int) -> tuple[_Ref, int] | None:
        """:meth:`_copied_rows` where they are ``rows`` rows of ``row_bytes``: (source, stride)."""
        copied = self._copied_rows(ref)
        if copied is None or copied[1] != rows or copied[2] != row_bytes:
            return None
        return copied[0], copied[3]

    def _alloc(self, shape, dtype) -> _Ref:
        offset = self.arena_bytes
        self.arena_bytes += -(-max(math.prod(shape) * dtype.itemsize, 1) // _ALIGN) * _ALIGN
        self.allocs.append((offset, self.arena_bytes - offset))
        return _Ref(0, offset, tuple(shape), dtype)

    def _reuse_arena(self, roots: list[_Ref]) -> None:
        """Lay the arena out again so that values whose lives do not overlap share bytes (a
        linear scan in program order, first fit): each value lives from the record writing it
        to the last record or host step reading it (a root to the end). A record's results
        never share bytes with its operands (those expire after it). Every ref into the arena
        is moved with its value.

        For programs with host steps (prompt chunks): every value of a 256-row SmolLM2 chunk
        laid end to end was a ~240 MB arena whose pages the first run faulted in (0.3-0.4 s a
        chunk, first run only) and kept resident; the live values at any point are one
        layer's. Decode programs keep one range a value: their arena is small, and the fused
        steps' reordering (which treats shared bytes as a dependency) keeps every product it
        can hoist."""
        import bisect

        starts = [offset for offset, _ in self.allocs]

        def owner(ref: _Ref) -> int:
            return bisect.bisect_right(starts, ref.offset) - 1

        first: dict[int, int] = {}
        last: dict[int, int] = {}
        end = len(self.records)
        for index, record in enumerate(self.records):
            written = () if record[0] == _HOST else _ACCESS[record[0]][1]
            for k, ref in enumerate(record[1]):
                if ref is None or ref.slot != 0:
                    continue
                a = owner(ref)
                if k in written:
                    first.setdefault(a, index)
                last[a] = index
        for ref in roots:
            if ref.slot == 0:
                last[owner(ref)] = end
        placed: dict[int, int] = {}
        live: list[tuple[int, int, int]] = []  # (offset, size, alloc), by offset
        expiring: dict[int, list[int]] = {}
        for a, index in last.items():
            expiring.setdefault(index, []).append(a)
        born: dict[int, list[int]] = {}
        for a, index in first.items():
            born.setdefault(index, []).append(a)
        top = 0
        for index in range(end + 1):
            for a in born.get(index, ()):
                size = self.allocs[a][1]
                at = 0
                for offset, taken, _ in live:  # first gap that fits
                    if offset - at >= size:
                        break
                    at = max(at, offset + taken)
                placed[a] = at
                bisect.insort(live, (at, size, a))
                top = max(top, at + size)
            for a in expiring.get(index, ()):
                if a in placed:
                    live.remove((placed[a], self.allocs[a][1], a))
        for a in last:  # read but written by no record: a range of its own, past the rest
            if a not in placed:
                placed[a] = top
                top += self.allocs[a][1]
        self.arena_bytes = top  # a dropped copy's range, which nothing names, takes no bytes

        def moved(ref: _Ref | None) -> _Ref | None:
            if ref is None or ref.slot != 0:
                return ref
            a = owner(ref)
            if a not in placed:  # a dropped copy's node: no record, host step or root reads it
                return ref
            return _Ref(0, placed[a] + ref.offset - self.allocs[a][0], ref.shape, ref.dtype)

        self.records = [(kind, tuple(moved(r) for r in operands), ints, floats)
                        for kind, operands, ints, floats in self.records]
        for host in self.hosts:
            host.ins = tuple(moved(r) for r in host.ins)
        self.refs = {node: moved(ref) for node, ref in self.refs.items()}

    def _emit(self, kind: int, operands, ints=(), floats=()) -> None:
        self.records.append((kind, tuple(operands), tuple(ints), tuple(floats)))

    # Nodes --------------------------------------------------------------------------------
    def _step(self, node_id, node, ins: list[_Ref], kernel, entry) -> _Ref:
        op, shape = node.op, tuple(node.shape.dims)
        dtype = torch_dtype(node.dtype)
        if isinstance(op, Prim):
            view = self._view(op, ins, shape, dtype)
            if view is not None:
                return view
        stock = entry.kernel_source.startswith("torch.")
        f32 = torch.float32
        if isinstance(op, Prim) and stock:
            attrs = op.attr_dict()
            copy = _strided_copy(op, ins, shape, dtype)
            if copy is not None:  # a view that is not an offset: made contiguous
                (sizes, strides, run), origin = copy
                whole = ins[0]  # read from the view's first element to the operand's end
                source = _Ref(whole.slot, whole.offset + origin,
                              (whole.numel - origin // dtype.itemsize,), dtype)
                out = self._alloc(shape, dtype)
                self._emit(_COPY, (source, out), (len(sizes), *sizes, *strides, run))
                self.copies[(out.slot, out.offset)] = (source, sizes, strides, run, out.numel)
                return out
            if op.kind is OpKind.INDEX_SELECT and attrs["dim"] % len(ins[0].shape) == 0:
                source, index = ins
                width = _INDEX_BYTES.get(index.dtype)
                if width is not None and source.dtype == dtype:
                    out = self._alloc(shape, dtype)
                    row = math.prod(source.shape[1:]) * dtype.itemsize
                    self._emit(_GATHER, (source, index, out), (index.numel, row, source.shape[0], width))
                    return out
            if op.kind is OpKind.DEQUANTIZE and ins[0].dtype == torch.uint8 and dtype == f32:
                from fuel.kernels.native import FORMAT_CODES

                code = FORMAT_CODES.get(attrs["layout"])
                if code is not None:
                    row_bytes = ins[0].shape[-1]
                    out = self._alloc(shape, dtype)
                    self._emit(_DEQUANTIZE, (ins[0], out),
                               (code, ins[0].numel // row_bytes, attrs["cols"], row_bytes))
                    return out
            if (op.kind is OpKind.ADD and ins[0].shape == ins[1].shape == shape
                    and ins[0].dtype == ins[1].dtype == dtype == f32):
                out = self._alloc(shape, dtype)
                self._emit(_ADD, (ins[0], ins[1], out), (out.numel,))
                return out
            if (op.kind is OpKind.ARGMAX and ins[0].dtype == f32 and dtype == torch.int64
                    and attrs["dim"] % len(ins[0].shape) == len(ins[0].shape) - 1):
                width = ins[0].shape[-1]
                out = self._alloc(shape, dtype)
                self._emit(_ARGMAX, (ins[0], out), (ins[0].numel // width, width))
                return out
            if op.kind is OpKind.KV_CACHE_WRITE:
                cache, rows, slots = ins
                if (cache.dtype == rows.dtype and cache.dtype in _KV_CODES
                        and slots.dtype == torch.int64
                        and len(cache.shape) >= 2 and rows.shape[1:] == cache.shape[2:]
                        and len(slots.shape) == 1 and rows.shape[0] == slots.shape[0]):
                    row_bytes = math.prod(rows.shape[1:]) * rows.dtype.itemsize
                    apart = self._rows_apart(rows, rows.shape[0], row_bytes)
                    source, stride = apart if apart else (rows, 0)
                    self._emit(_KV_WRITE, (cache, source, slots),
                               (cache.shape[0] * cache.shape[1], row_bytes, slots.shape[0], stride))
                    return cache
            if (op.kind is OpKind.CAST and ins[0].dtype == f32 and _KV_CODES.get(dtype)
                    and ins[0].shape == shape):  # rows rounded for a half-precision KV cache
                out = self._alloc(shape, dtype)
                copied = self._copied_rows(ins[0])
                if copied and copied[1]:  # element-wise: the copy's rows, read in place
                    source, rows, run, stride = copied
                    self._emit(_CAST, (source, out), (out.numel, _KV_CODES[dtype], rows, run // 4,
                                                      stride // 4))
                else:
                    self._emit(_CAST, (ins[0], out), (out.numel, _KV_CODES[dtype]))
                return out
        if isinstance(op, Fused) and stock:
            fused = op.id
            if fused == FusedOps.RMS_NORM and ins[0].dtype == dtype == f32 and all(
                    r.dtype == f32 for r in ins):
                width = shape[-1]
                gain = ins[1] if op.params.has_gain else None
                if gain is None or gain.shape == (width,):
                    out = self._alloc(shape, dtype)
                    self._emit(_RMS_NORM, (ins[0], gain, out), (ins[0].numel // width, width),
                               (op.params.eps,))
                    return out
            if fused == FusedOps.SILU_MUL and ins[0].shape == ins[1].shape == shape and (
                    ins[0].dtype == ins[1].dtype == dtype == f32):
                out = self._alloc(shape, dtype)
                gate, up = self._copied_rows(ins[0]), self._copied_rows(ins[1])
                if gate and up and gate[1:3] == up[1:3] and gate[1]:
                    # a product's gate and up columns, read in place (element-wise: the rows
                    # the copies would have gathered, in their order)
                    self._emit(_SILU_MUL, (gate[0], up[0], out),
                               (out.numel, gate[1], gate[2] // 4, gate[3] // 4, up[3] // 4))
                else:
                    self._emit(_SILU_MUL, (ins[0], ins[1], out), (out.numel,))
                return out
            if fused == FusedOps.ROPE:
                x, cos, sin = ins
                if (len(x.shape) == 3 and x.dtype == cos.dtype == sin.dtype == dtype == f32
                        and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2])
                        and x.shape[2] % 2 == 0):
                    out = self._alloc(shape, dtype)
                    apart = self._rows_apart(x, x.shape[0], x.shape[1] * x.shape[2] * 4)
                    if apart:  # the rows are a column range of a product: read in place
                        self._emit(_ROPE, (apart[0], cos, sin, out), (*x.shape, apart[1] // 4))
                    else:
                        self._emit(_ROPE, (x, cos, sin, out), x.shape)
                    return out
            if fused == FusedOps.FUSED_LINEAR and not op.params.has_bias:
                from fuel.kernels.native import FORMAT_CODES, STREAM_ROWS

                x, w = ins
                fmt = NATIVE_WEIGHT_FORMATS.get(w.dtype)
                cols = x.shape[-1]
                if (fmt and x.dtype == dtype == f32 and len(w.shape) == 2 and w.shape[1] == cols
                        and x.numel <= STREAM_ROWS * cols):
                    out = self._alloc(shape, dtype)
                    self._emit(_MATMUL, (x, w, out), (FORMAT_CODES[fmt], x.numel // cols,
                                                      w.shape[0], cols, cols * w.dtype.itemsize))
                    return out
        if isinstance(op, Fused):
            laid = self._adopted(kernel, ins, shape, dtype)
            if laid is not None:
                return laid
        raise _Unsupported(f"node {node_id} ({op}, {node.dtype.value}{list(shape)}) has no native step")

    def _adopted(self, kernel, ins, shape, dtype) -> _Ref | None:
        """A JIT-adopted native kernel's step (``fuel.jit.native_synth`` runners)."""
        from fuel.jit import native_synth
        from fuel.kernels.native import FORMAT_CODES, STREAM_ROWS

        f32 = torch.float32
        if isinstance(kernel, native_synth._QuantRunner):
            x, w = ins
            cols = kernel.cols
            if (x.dtype == dtype == f32 and x.shape[-1] == cols and len(w.shape) == 2
                    and x.numel <= STREAM_ROWS * cols):
                q8 = kernel.activations == "q8"
                out = self._alloc(shape, dtype)
                self._emit(_MATMUL_Q8 if q8 else _MATMUL, (x, w, out),
                           (FORMAT_CODES[kernel.layout], x.numel // cols, w.shape[0], cols,
                            w.shape[1] * w.dtype.itemsize))
                return out
        if isinstance(kernel, native_synth._PagedRunner):
            q, k_cache, v_cache, table, lens = ins
            width = _INDEX_BYTES.get(table.dtype)
            if (kernel.native_rows(q.shape[2]) and width and lens.dtype == table.dtype
                    and len(q.shape) == 4 and len(k_cache.shape) == 4
                    and q.dtype == dtype == f32 and k_cache.dtype == v_cache.dtype
                    and k_cache.dtype in _KV_CODES
                    and k_cache.shape == v_cache.shape and q.shape[3] == k_cache.shape[3]
                    and q.shape[1] % k_cache.shape[2] == 0 and shape == q.shape):
                out = self._alloc(shape, dtype)
                self._emit(_PAGED, (q, k_cache, v_cache, table, lens, out),
                           (*q.shape, *k_cache.shape[:3], table.shape[1], width,
                            _KV_CODES[k_cache.dtype]),
                           (kernel.scale, kernel.softcap or 0.0))
                return out
        if isinstance(kernel, native_synth._ResidualNormRunner):
            x, residual, gain = ins
            if (x.dtype == residual.dtype == gain.dtype == dtype == f32 and x.shape == residual.shape
                    and gain.shape == (x.shape[-1],) and shape == (2, *x.shape)):
                out = self._alloc(shape, dtype)
                self._emit(_RESIDUAL_NORM, (x, residual, gain, out),
                           (x.numel // x.shape[-1], x.shape[-1]), (kernel.eps,))
                return out
        return None

    def _view(self, op: Prim, ins: list[_Ref], shape, dtype) -> _Ref | None:
        """An offset into the operand for a view that keeps it contiguous, else None."""
        kind = op.kind
        if kind not in _VIEWS or not ins or ins[0].dtype != dtype:
            return None
        source, attrs = ins[0], op.attr_dict()
        if kind in (OpKind.RESHAPE, OpKind.UNSQUEEZE) or (
                kind in (OpKind.EXPAND, OpKind.CAST) and source.shape == shape):
            return _Ref(source.slot, source.offset, shape, dtype)
        rank = len(source.shape)
        if kind in (OpKind.SELECT, OpKind.SLICE):
            dim = attrs["dim"] % rank
            if math.prod(source.shape[:dim]) != 1:
                return None
            start = (attrs["index"] if kind is OpKind.SELECT else attrs["start"]) % source.shape[dim]
            inner = math.prod(source.shape[dim + 1:]) * dtype.itemsize
            return _Ref(source.slot, source.offset + start * inner, shape, dtype)
        if kind in (OpKind.PERMUTE, OpKind.TRANSPOSE):
            order = _permutation(op, rank)
            moved = [d for d in order if source.shape[d] != 1]
            if moved == sorted(moved):
                return _Ref(source.slot, source.offset, shape, dtype)
        return None


def _permutation(op: Prim, rank: int) -> list[int]:
    """The operand dimension each result dimension of a permute or transpose takes (>= 0)."""
    attrs = op.attr_dict()
    if op.kind is OpKind.PERMUTE:
        return [d % rank for d in attrs["dims"]]
    order = list(range(rank))
    i, j = attrs["dim0"] % rank, attrs["dim1"] % rank
    order[i], order[j] = order[j], order[i]
    return order


def _tensor_at(base: Any, ref: _Ref) -> Any:
    """``ref``'s value as a tensor viewing ``base`` (the contiguous tensor its slot names)."""
    size = ref.numel * ref.dtype.itemsize
    return base.reshape(-1).view(torch.uint8)[ref.offset:ref.offset + size].view(
        ref.dtype).view(ref.shape)


def _strided_copy(op: Prim, ins: list[_Ref], shape, dtype):
    """A select, slice, permute or transpose of a contiguous operand as the strided copy that
    makes it contiguous (``STEP_COPY``): ((4 outer sizes), (their 4 byte strides into the
    operand, from its offset), bytes a run), or None for another op or a view needing more
    than four outer dimensions. The operand's ``offset`` is moved to the view's first element
    by the caller's ref: here a select/slice's start is folded into the strides' origin."""
    kind = op.kind
    if kind not in (OpKind.SELECT, OpKind.SLICE, OpKind.PERMUTE, OpKind.TRANSPOSE) or not ins:
        return None
    source, attrs = ins[0], op.attr_dict()
    if source.dtype != dtype:
        return None
    rank = len(source.shape)
    contiguous = [math.prod(source.shape[d + 1:]) for d in range(rank)]
    start = 0
    if kind in (OpKind.SELECT, OpKind.SLICE):
        dim = attrs["dim"] % rank
        size = source.shape[dim]
        if kind is OpKind.SELECT:
            begin = attrs["index"] % size
            sizes, strides = list(source.shape), list(contiguous)
            del sizes[dim], strides[dim]
        else:  # the graph checked 0 <= start <= end <= extent
            begin = attrs["start"]
            sizes, strides = list(source.shape), list(contiguous)
            sizes[dim] = attrs["end"] - begin
        start = begin * contiguous[dim]
    else:
        order = _permutation(op, rank)
        sizes = [source.shape[d] for d in order]
        strides = [contiguous[d] for d in order]
    if tuple(sizes) != tuple(shape):
        return None
    dims = [(n, t) for n, t in zip(sizes, strides) if n != 1]
    merged: list[list[int]] = []
    for n, t in dims:  # adjacent dimensions that step as one
        if merged and merged[-1][1] == n * t:
            merged[-1] = [merged[-1][0] * n, t]
        else:
            merged.append([n, t])
    item = dtype.itemsize
    run = item
    if merged and merged[-1][1] == 1:
        run = merged.pop()[0] * item
    if len(merged) > 4:
        return None
    merged = [[1, 0]] * (4 - len(merged)) + merged
    origin = start * item
    return ((tuple(n for n, _ in merged), tuple(t * item for _, t in merged), run), origin)


_VIEWS = frozenset({OpKind.RESHAPE, OpKind.UNSQUEEZE, OpKind.SELECT, OpKind.SLICE,
                    OpKind.PERMUTE, OpKind.TRANSPOSE, OpKind.EXPAND, OpKind.CAST})


__all__ = ["ENV", "Declined", "NativeSteps", "enabled", "plan"]
