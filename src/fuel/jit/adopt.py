"""Adoption: a synthesized kernel becomes a runtime fused op, verified and cost-gated.

Decides whether a kernel a synthesizer handed over may run in place of its region:

1. ask (or take the given answer); a ``Declined`` is recorded with its reason;
2. take the artifact once (``take_kernel``); nothing handed over is recorded;
3. verify: run the kernel and the recipe's decomposition (emitted over inputs of the request's
   shapes and executed with the CPU binding table) on generated inputs — normal floats, and for
   paged attention valid block tables (distinct blocks) and context lengths between the query
   length and the table's capacity. Every output element must satisfy
   ``|kernel - reference| <= atol + rtol * |reference|`` with the dtype's
   :data:`~fuel.kernels.RECIPE_TOLERANCE`, plus, for a kernel that states one
   (``SynthesizedKernel.error_bound``: it rounds on purpose), that bound's allowance for the
   element, computed from the same inputs; a wrong kernel is rejected with a report sent to
   ``on_rejected`` (max error, where, tolerance, the bound's allowance there); a bound that is
   not finite and non-negative rejects its kernel (nothing verifiable against it);
4. the cost gate: profile the kernel and the decomposed region on the same inputs, their samples
   interleaved (``fuel.cost.profile.profile_pair``); adopt only
   when the kernel is strictly faster (both figures are recorded either way; a slower kernel is
   rejected through ``on_rejected`` too). A loss on the thread pool is measured again on one
   thread, and where the pool stalled the kernel (another process holding a core) the one-
   thread pair decides (:func:`_confirm_on_one_thread`);
5. register the region (``RuntimeFusedRegistry``, deduplicated by structural hash), bind the
   kernel under ``(runtime id, input dtypes then output dtype, backend)`` with the synthesizer's
   ``kernel_source``, its precision (recipe tolerance) and a cost function answering the
   measured latency for the verified shapes, and record the latency in the Judge's store under
   the key the Judge-aware cost provider reads (``fuel.optimize.providers.judge_key``: the
   region's stable ``jit:<hash>`` name and operand size class, output dtype, backend, kernel
   source), so the measurement is found in later processes whatever id the region gets there.

Every outcome is an :class:`AdoptionRecord` with its reason and numbers; nothing here raises for
an ordinary "no". This module measures and runs kernels: it is an edge, never called from the
planning core (``optimize_graph`` only records requests; ``fuel jit`` runs adoption).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from fuel.graph.dtype import BackendId
from fuel.graph.ir import Fused, Graph, Node
from fuel.graph.recipe import EmitRefused, emit, structural_hash
from fuel.graph.registry import RegionRefused, RuntimeFusedParams, RuntimeFusedRegistry, fused_name
from fuel.jit.paged import match_paged
from fuel.jit.quant_gemv import match_quant_linear
from fuel.jit.protocol import Declined, JitRequest, SynthesisResult, Synthesized, Synthesizer
from fuel.kernels.table import RECIPE_TOLERANCE, KernelBindingTable, KernelEntry, Precision


GATE_BUDGET_NS = 300_000_000
"""Time the cost gate spends sampling one side (``fuel.cost.profile``: a slow recipe is sampled
at least three times, not nine)."""


class Outcome(Enum):
    ADOPTED = "adopted"
    ALREADY_ADOPTED = "already adopted"
    DECLINED = "declined by the synthesizer"
    NOT_HANDED_OVER = "artifact not handed over"
    NOT_VERIFIABLE = "not verifiable"
    WRONG = "rejected: wrong numbers"
    SLOWER = "rejected: slower than the decomposed region"
    NOT_REGISTERED = "region refused by the registry"


@dataclass(frozen=True, slots=True)
class AdoptionRecord:
    """What adoption did with one request, and why; numbers are ``None`` when not reached."""

    synthesizer: str
    outcome: Outcome
    reason: str
    entry_point: str | None = None
    runtime_id: int | None = None
    max_abs_error: float | None = None
    tolerance: tuple[float, float] | None = None
    error_bound_max: float | None = None
    """The largest allowance the kernel's own error bound gave (added to ``tolerance``), or None
    when the kernel states no bound (verified against the recipe tolerance alone)."""
    kernel_ns: int | None = None
    decomposed_ns: int | None = None
    compile_ms: float | None = None
    from_cache: bool = False
    kernel_source: str | None = None

    @property
    def adopted(self) -> bool:
        return self.outcome in (Outcome.ADOPTED, Outcome.ALREADY_ADOPTED)

    @property
    def speedup(self) -> float | None:
        if self.kernel_ns is None or self.decomposed_ns is None:
            return None
        return self.decomposed_ns / self.kernel_ns


@dataclass(frozen=True, slots=True)
class Verification:
    ok: bool
    max_abs_error: float
    report: str
    bound_max: float | None = None
    """The largest per-element allowance of the kernel's stated bound (None: no bound given)."""


def adopt_from_response(synth: Synthesizer, request: JitRequest, backend: BackendId,
                        **kwargs: Any) -> int | None:
    """The runtime fused id the kernel was adopted as, or ``None`` (see :func:`adopt`)."""
    return adopt(synth, request, backend, **kwargs).runtime_id


def adopt(synth: Synthesizer, request: JitRequest, backend: BackendId, *,
          table: KernelBindingTable, registry: RuntimeFusedRegistry,
          response: SynthesisResult | None = None, store: Any = None, seed: int = 0,
          profile_repeats: int = 9) -> AdoptionRecord:
    """Adopt the kernel ``synth`` answers ``request`` with, or record why not.

    ``store`` (a :class:`~fuel.cost.JudgeStore`) receives the kernel's measured latency when it
    is adopted. ``seed`` fixes the generated inputs.
    """
    record = lambda outcome, reason, **more: AdoptionRecord(  # noqa: E731
        synth.name, outcome, reason, **more)
    response = synth.synthesize(request) if response is None else response
    if isinstance(response, Declined):
        return record(Outcome.DECLINED, response.reason)
    assert isinstance(response, Synthesized)
    entry = response.entry_point
    kernel = synth.take_kernel(entry)
    if kernel is None:
        return record(Outcome.NOT_HANDED_OVER, f"`{entry}` was not handed over (already taken?)",
                      entry_point=entry)
    known = dict(entry_point=entry, compile_ms=kernel.compile_ms, from_cache=kernel.from_cache,
                 kernel_source=kernel.kernel_source)
    if kernel.backend is not backend:
        return record(Outcome.NOT_VERIFIABLE, f"kernel targets {kernel.backend.value}, adoption "
                      f"is for {backend.value}", **known)

    bench = _Bench.build(request, seed)
    if isinstance(bench, str):
        return record(Outcome.NOT_VERIFIABLE, bench, **known)
    output_dtype = request.output.dtype.dtype
    tolerance = RECIPE_TOLERANCE.get(output_dtype)
    if tolerance is None:
        return record(Outcome.NOT_VERIFIABLE, f"no verification tolerance for "
                      f"{output_dtype.value}", **known)
    try:
        got = kernel.run(*bench.inputs)
    except Exception as error:  # noqa: BLE001 — a crashing kernel is a rejected kernel
        report = f"kernel raised {type(error).__name__}: {error}"
        synth.on_rejected(entry, report)
        return record(Outcome.WRONG, report, tolerance=tolerance, **known)
    bound = None
    if kernel.error_bound is not None:
        try:
            bound = kernel.error_bound(bench.inputs, bench.reference)
        except Exception as error:  # noqa: BLE001 — a bound that cannot be computed verifies nothing
            report = f"the kernel's error bound raised {type(error).__name__}: {error}"
            synth.on_rejected(entry, report)
            return record(Outcome.NOT_VERIFIABLE, report, tolerance=tolerance, **known)
    check = verify(got, bench.reference, tolerance, bound)
    known.update(max_abs_error=check.max_abs_error, tolerance=tolerance,
                 error_bound_max=check.bound_max)
    if not check.ok:
        synth.on_rejected(entry, check.report)
        return record(Outcome.WRONG, check.report, **known)

    from fuel.cost.profile import profile_pair, race_pair

    # Interleaved, so interference from other work lands on both sides alike; a side whose
    # calibration call already loses by the race margin is not sampled further (a 40 ms
    # dequantize-then-matmul LM head beside its 1 ms kernel).
    def measure():
        return profile_pair(lambda: kernel.run(*bench.inputs), lambda: bench.program.run(bench.feeds),
                            repeats=profile_repeats, budget_ns=GATE_BUDGET_NS, retire=race_pair)

    measured, decomposed = measure()
    stalled = ""
    if measured.median_ns >= decomposed.median_ns:
        measured, decomposed, stalled = _confirm_on_one_thread(measure, measured, decomposed)
    kernel_ns, decomposed_ns = measured.median_ns, decomposed.median_ns
    known.update(kernel_ns=kernel_ns, decomposed_ns=decomposed_ns)
    if kernel_ns >= decomposed_ns:
        report = (f"slower: kernel {kernel_ns} ns >= decomposed region {decomposed_ns} ns "
                  f"at {', '.join(map(str, request.inputs))}{stalled}")
        synth.on_rejected(entry, report)
        return record(Outcome.SLOWER, report, **known)

    name = f"jit:{structural_hash(request.region)[:16]}"
    try:
        runtime_id = registry.register_runtime_fused(name, request.region)
    except RegionRefused as refused:
        return record(Outcome.NOT_REGISTERED, refused.reason, **known)
    dtypes = tuple(o.dtype.dtype for o in request.operands)
    bound = [e for e in table.lookup_alternatives(runtime_id, dtypes, backend)
             if e.kernel_source == kernel.kernel_source]
    if bound:
        return record(Outcome.ALREADY_ADOPTED, f"{fused_name(runtime_id)} already has a "
                      f"{kernel.kernel_source} kernel bound", runtime_id=runtime_id, **known)
    _bind(table, runtime_id, request, backend, kernel, kernel_ns,
          tuple(tuple(t.shape) for t in bench.inputs))
    if store is not None:
        _record_latency(store, bench, runtime_id, registry, backend, kernel.kernel_source,
                        measured)
    speedup = decomposed_ns / kernel_ns
    within = "" if check.bound_max is None else \
        f" within its stated bound (largest allowance {check.bound_max:.2e})"
    return record(Outcome.ADOPTED, f"verified (max error {check.max_abs_error:.2e}{within}) and "
                  f"{speedup:.2f}x faster than the decomposed region{stalled}",
                  runtime_id=runtime_id, **known)


STALL_FACTOR = 4
"""How many times its one-thread time a kernel must take on the pool for its pooled measurement
to count as stalled (:func:`_confirm_on_one_thread`)."""


def _confirm_on_one_thread(measure, measured, decomposed):
    """A kernel that lost the gate on the thread pool, measured again with both sides on one
    thread: ``(kernel, decomposed, note)``, the one-thread pair and a note for the record where
    the pool stalled the kernel, else the pooled pair unchanged and no note.

    A parallel region waits for every thread of the pool. When another process holds a core
    (a compiler, a second engine), a thread of the pool waits for a time slice at each region,
    so a kernel that shares its rows over the pool takes milliseconds where it takes
    microseconds alone, while a decomposition of small torch ops, each run on the calling
    thread, hardly notices (measured here with two busy processes on the two cores: bf16
    quant_linear 1x576 by 576x576, 7.7 ms against the decomposition's 0.17 ms; ~0.05 ms on a
    quiet machine). Rejected, the kernel stays rejected in every program built then and stored.
    So a loss is confirmed on one thread: where the kernel takes more than :data:`STALL_FACTOR`
    times as long on the pool as on one thread (on a quiet machine a pool is never slower than
    one of its threads by that much), the pooled figure measured the stall, and the gate decides
    on the one-thread pair instead. A kernel that loses on merit (a serial kernel beside a
    decomposition the pool speeds up) is as fast on one thread as on the pool: its loss stands."""
    import torch

    from fuel.kernels.threads import one_thread

    if torch.get_num_threads() <= 1:
        return measured, decomposed, ""
    with one_thread() as pool:
        alone, decomposed_alone = measure()
    if measured.median_ns <= STALL_FACTOR * alone.median_ns:
        return measured, decomposed, ""
    note = (f" on one thread (on the pool of {pool} it took {measured.median_ns} ns, "
            f"{measured.median_ns / alone.median_ns:.0f}x its one-thread time: the pool was "
            f"stalled, another process holding a core)")
    return alone, decomposed_alone, note


def _bind(table: KernelBindingTable, runtime_id: int, request: JitRequest, backend: BackendId,
          kernel: Any, kernel_ns: int | None, shapes: tuple[tuple[int, ...], ...]) -> None:
    dtypes = tuple(o.dtype.dtype for o in request.operands)
    run = kernel.run

    def cost(node: Node, inputs) -> float | None:
        # The measurement is for the verified shapes only; elsewhere the cost is unknown.
        same = tuple(tuple(n.shape.dims) for n in inputs) == shapes
        return float(kernel_ns) if same and kernel_ns is not None else None

    table.bind(runtime_id, dtypes, backend, KernelEntry(
        lambda node: run, frozenset({"gqa", "softcap"}) if match_paged(request.region) else
        frozenset(), Precision.RECIPE_TOLERANCE if kernel.error_bound is None
        else Precision.STATED_BOUND, cost, kernel.kernel_source))


def rebind(synth: Synthesizer, request: JitRequest, name: str, backend: BackendId, *,
           table: KernelBindingTable, registry: RuntimeFusedRegistry) -> int | str:
    """Bind, without verifying or gating again, a kernel an earlier process adopted for
    ``request`` under the stable ``name`` (the program cache restores a program built with
    it): the synthesizer builds it again (its disk cache loads the compiled kernel), the region
    is registered and the kernel bound as :func:`adopt` binds it. Returns the runtime id here,
    or why the kernel could not be restored (then the caller builds the program afresh)."""
    answer = synth.synthesize(request)
    if isinstance(answer, Declined):
        return f"the synthesizer declined on restore: {answer.reason}"
    kernel = synth.take_kernel(answer.entry_point)
    if kernel is None or kernel.backend is not backend:
        return f"`{answer.entry_point}` was not handed over for {backend.value}"
    try:
        runtime_id = registry.register_runtime_fused(name, request.region)
    except RegionRefused as refused:
        return refused.reason
    dtypes = tuple(o.dtype.dtype for o in request.operands)
    if not any(e.kernel_source == kernel.kernel_source
               for e in table.lookup_alternatives(runtime_id, dtypes, backend)):
        _bind(table, runtime_id, request, backend, kernel, None, ())
    return runtime_id


def verify(got: Any, reference: Any, tolerance: tuple[float, float],
           bound: Any = None) -> Verification:
    """Elementwise ``|got - ref| <= atol + rtol * |ref|`` (NaN only where the reference is NaN),
    plus ``bound`` (the kernel's stated allowance per element, broadcast to the reference's
    shape; it must be finite and non-negative) when given."""
    import torch

    atol, rtol = tolerance
    if tuple(got.shape) != tuple(reference.shape) or got.dtype != reference.dtype:
        return Verification(False, math.inf, f"kernel returned {got.dtype}{list(got.shape)}, "
                            f"expected {reference.dtype}{list(reference.shape)}")
    a, b = got.double(), reference.double()
    allowed = atol + rtol * b.abs().nan_to_num(0.0)
    bound_max = None
    if bound is not None:
        try:
            extra = torch.as_tensor(bound).double().broadcast_to(b.shape)
        except RuntimeError as error:
            return Verification(False, math.inf, f"the kernel's error bound does not fit the "
                                f"output {list(b.shape)}: {error}")
        if extra.numel() and not bool((torch.isfinite(extra) & (extra >= 0)).all()):
            return Verification(False, math.inf, "the kernel's error bound is not finite and "
                                "non-negative everywhere: nothing to verify against")
        bound_max = float(extra.max()) if extra.numel() else 0.0
        allowed = allowed + extra
    nan_mismatch = torch.isnan(a) != torch.isnan(b)
    error = (a - b).abs().nan_to_num(0.0)
    excess = error - allowed
    worst = float(error.max()) if error.numel() else 0.0
    with_bound = "" if bound is None else " + the kernel's bound"
    if bool(nan_mismatch.any()):
        where = tuple(int(i) for i in nan_mismatch.nonzero()[0])
        return Verification(False, math.inf, f"NaN mismatch at {where}", bound_max)
    if error.numel() and bool((excess > 0).any()):
        where = tuple(int(i) for i in torch.nonzero(excess > 0)[0])
        return Verification(False, worst, f"max error {worst:.3e} exceeds atol {atol} + rtol "
                            f"{rtol}{with_bound} (first at {where}: kernel {float(a[where]):.6g}, "
                            f"decomposed {float(b[where]):.6g}, allowed "
                            f"{float(allowed[where]):.3e})", bound_max)
    return Verification(True, worst, f"max error {worst:.3e} within atol {atol}, rtol "
                        f"{rtol}{with_bound}", bound_max)


@dataclass
class _Bench:
    """Generated inputs, the decomposed region compiled for them, and its result."""

    inputs: tuple[Any, ...]
    feeds: dict[str, Any]
    program: Any
    reference: Any
    graph: Graph
    node_inputs: tuple[int, ...]

    @classmethod
    def build(cls, request: JitRequest, seed: int) -> _Bench | str:
        import torch

        from fuel.kernels import cpu_table
        from fuel.graph.branch import lower
        from fuel.kernels.torch_kernels import torch_dtype
        from fuel.runtime.executor import compile_program

        for operand in request.operands:
            if not all(isinstance(d, int) for d in operand.shape):
                return f"operand {operand} has a symbolic extent: no concrete inputs to verify on"
        generator = torch.Generator().manual_seed(seed)
        inputs = _generate(request, generator)
        if isinstance(inputs, str):
            return inputs
        graph = Graph()
        binds = tuple(graph.input(f"in{i}", o.shape, o.dtype.dtype)
                      for i, o in enumerate(request.inputs))
        out = request.output
        root = emit(graph, request.region, binds, expect=(_shape(out.shape), out.dtype.dtype))
        if isinstance(root, EmitRefused):
            return f"the region does not emit over the request's operands: {root.reason}"
        feeds = {f"in{i}": t for i, t in enumerate(inputs)}
        try:
            program = compile_program(graph, lower(graph, [root]), cpu_table())
        except Exception as error:  # noqa: BLE001 — no reference means no verification
            return f"the decomposed region cannot run on the CPU table: {error}"
        reference = program.run(feeds)[root]
        assert reference.dtype == torch_dtype(out.dtype.dtype)
        return cls(tuple(inputs), feeds, program, reference, graph, binds)


def _shape(dims):
    from fuel.graph.dtype import Shape

    return Shape.from_dims(dims)


def _generate(request: JitRequest, generator) -> list[Any] | str:
    import torch

    from fuel.kernels.torch_kernels import torch_dtype

    paged = match_paged(request.region)
    quant = match_quant_linear(request.region)
    inputs: list[Any] = []
    for index, operand in enumerate(request.inputs):
        dtype = operand.dtype.dtype
        if quant is not None and index == 1:
            from fuel.kernels.quant_blocks import random_blocks

            # Valid packed blocks (finite f16 scales of a real weight's size), not raw bytes.
            inputs.append(random_blocks(quant.layout, operand.shape[0], quant.cols, generator))
        elif dtype.is_float:
            inputs.append(torch.randn(operand.shape, generator=generator).to(torch_dtype(dtype)))
        elif paged is None:
            return f"operand {index} ({operand}) is an index operand outside paged attention: " \
                   "no generator for valid values"
        else:
            inputs.append(None)
    if paged is not None:
        q_shape, cache_shape = request.inputs[0].shape, request.inputs[1].shape
        batch, q_len = q_shape[0], q_shape[2]
        blocks, per_seq = cache_shape[0], request.inputs[3].shape[1]
        capacity = per_seq * paged.block_size
        index_dtype = torch_dtype(request.inputs[3].dtype.dtype)
        if blocks < per_seq:
            return f"the cache has {blocks} blocks, fewer than a block table row ({per_seq})"
        # Each sequence gets distinct blocks (a permutation), the way a KV cache allocates.
        table = torch.stack([torch.randperm(blocks, generator=generator)[:per_seq]
                             for _ in range(batch)])
        low = min(q_len, capacity)
        lens = torch.randint(low, capacity + 1, (batch,), generator=generator)
        lens[0] = capacity  # one sequence always fills its table: the boundary is exercised
        inputs[3], inputs[4] = table.to(index_dtype), lens.to(index_dtype)
    return inputs


def _record_latency(store: Any, bench: _Bench, runtime_id: int, registry: RuntimeFusedRegistry,
                    backend: BackendId, kernel_source: str, measured: Any) -> None:
    from fuel.cost.fingerprint import device_fingerprint, library_versions
    from fuel.cost.store import StoredMeasurement
    from fuel.kernels.torch_kernels import TORCH_DTYPES
    from fuel.optimize.providers import judge_key

    graph = bench.graph
    reference = bench.reference
    dtype = next(d for d, t in TORCH_DTYPES.items() if t == reference.dtype)
    node = graph.push(Node(Fused(runtime_id, RuntimeFusedParams()), bench.node_inputs,
                           _shape(tuple(reference.shape)), dtype))
    cell = judge_key(graph, node, runtime=registry)
    if cell is None:
        return
    store.record(StoredMeasurement(
        op=cell[0], dtype=dtype.value, size_class=cell[1],
        backend=backend.value, kernel_source=kernel_source,
        device_fingerprint=device_fingerprint(backend.value), library_versions=library_versions(),
        median_ns=measured.median_ns, spread_ns=measured.spread_ns, samples=measured.samples))


__all__ = ["AdoptionRecord", "Outcome", "Verification", "adopt", "adopt_from_response", "verify"]
