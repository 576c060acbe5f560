"""The engine: runtime state (paged KV cache, plans, programs) and one step of any mode.

Decides how a step of a mode is fed and run. A step is a list of ``(sequence, tokens)``: each
sequence appends its tokens to its KV cache (the block tables hand out the slots), the step's
rows are the tokens in batch order, and the mode's plan — fused once per (mode, rows) or row
table — is lowered and compiled once per (plan digest, step geometry) and then reused.

Modes and their rows:

- ``prefill``: one sequence, a prompt chunk (rows = chunk length; ``fuel.runtime.generate``
  chunks a prompt so it runs at most two programs);
- ``decode``: one sequence, one row;
- ``multi_seq``: several sequences, one row each;
- ``verify``: one sequence, k rows (the pending token and k-1 drafted ones);
- ``verify_batch``: several sequences with k_i rows each, described by a row table;
- ``draft``: the circuit's draft section (a layer-0 early-exit head over the model's own
  weights) with its *own* caches and block tables, any rows (it catches up in one step).

Invariants:
- The main and draft sections keep separate block tables and cache tensors; a sequence exists
  in the draft tables only once a draft step has run for it.
- A step that fails before running (out of blocks, a sequence too long) leaves every table as
  it was; :meth:`Engine.rollback` truncates a sequence (speculative decoding's rejected rows).
- The block-table width of a step is the smallest power of two of blocks covering its longest
  sequence (capped at the engine's ``max_context``), so attention reads what the context needs
  and there are at most ``log2`` programs per (mode, rows).
- Caches are laid out ``[num_blocks, block_size, kv_heads, head_dim]`` — the layout
  ``FusedOps.PAGED_ATTN`` and ``kv_cache_write`` define (``fuel.graph.registry``).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fuel.circuit.fuser import AvailableKernels, FusionPlan, Policy, fuse, fuse_table
from fuel.circuit.ir import Circuit, Section
from fuel.circuit.rules import Mode, RuleSet, load_builtin_rules
from fuel.circuit.runs import RowTable
from fuel.errors import FuelError
from fuel.runtime.kv_cache import BlockTables
from fuel.runtime.lower import (
    LOGIT_ROWS, POSITIONS, SLOTS, TOKENS, StepShape, block_table_input, context_lens_input,
    expected_weight_shapes, lower,
)
from fuel.runtime.program import StepProgram, WeightStore, build_program

if TYPE_CHECKING:
    import torch

    from fuel.runtime.weights import Weights

DEFAULT_BLOCK_SIZE = 16


class EngineError(FuelError):
    """A step the engine cannot run as asked."""


class BadStep(EngineError):
    def __init__(self, mode: Mode, detail: str):
        self.mode, self.detail = mode, detail
        super().__init__(f"{mode.value} step: {detail}")


class ContextTooLong(EngineError):
    """A sequence would exceed the engine's context (the prompt plus what is generated)."""

    def __init__(self, sequence: Hashable, length: int, max_context: int):
        self.sequence, self.length, self.max_context = sequence, length, max_context
        super().__init__(
            f"sequence {sequence!r} needs {length} positions, but the KV cache holds at most "
            f"{max_context} per sequence; shorten the prompt, lower --max-new-tokens or raise "
            f"--max-context")


@dataclass(frozen=True, slots=True)
class StepResult:
    """One step's output: logits ``[rows, vocab]`` and the greedy token of each row."""

    logits: torch.Tensor
    tokens: list[int]
    program: StepProgram
    node_seconds: tuple[float, ...] | None = None
    """Wall seconds of each executed node (``program.program.executed`` order) when the step
    was run ``timed``; ``None`` otherwise."""


@dataclass(slots=True)
class EngineStats:
    """What the engine ran: steps and rows by mode, launches (from the plans) and kernel calls
    (from the programs), and every plan digest used."""

    steps: Counter = field(default_factory=Counter)
    rows: Counter = field(default_factory=Counter)
    launches: Counter = field(default_factory=Counter)
    dispatched: Counter = field(default_factory=Counter)
    host_calls: Counter = field(default_factory=Counter)
    """Per mode: calls made from Python (a program laid out as a native step list is one)."""
    digests: dict[str, str] = field(default_factory=dict)
    # Programs built (lower + optimize, JIT adoption and Judge measurement included) and the
    # seconds they took, by the mode of the step that needed them: a rate that counts them
    # measures compilation, not decoding.
    builds: Counter = field(default_factory=Counter)
    build_s: Counter = field(default_factory=Counter)
    routes: Counter = field(default_factory=Counter)
    """Per (mode, branch, arm taken, device, the picker's reason): steps that took it."""
    # MoE expert load, by mode: distinct experts read (summed over the MoE layers of every
    # step), their bytes, the layer-steps counted, and what uniform routing would have read.
    experts: Counter = field(default_factory=Counter)
    expert_bytes: Counter = field(default_factory=Counter)
    expert_layer_steps: Counter = field(default_factory=Counter)
    experts_uniform: Counter = field(default_factory=Counter)
    expert_shape: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per mode: (experts per layer, choices per token) of the MoE layers counted."""

    def record_routing(self, mode: Mode, program: StepProgram, chosen: Sequence[Any]) -> None:
        """Count the distinct experts each MoE layer of one step read (``chosen``: each layer's
        ``[rows, k]`` expert ids, ``program.step.routing`` order)."""
        from fuel.report.roofline import expected_distinct_experts

        for probe, ids in zip(program.step.routing, chosen):
            distinct = len(set(ids.reshape(-1).tolist()))
            rows, top_k = ids.shape
            self.experts[mode.value] += distinct
            self.expert_bytes[mode.value] += distinct * probe.expert_bytes
            self.expert_layer_steps[mode.value] += 1
            self.experts_uniform[mode.value] += expected_distinct_experts(probe.experts, top_k, rows)
            self.expert_shape[mode.value] = (probe.experts, top_k)
    restored: Counter = field(default_factory=Counter)
    """Of ``builds``, the programs restored from the on-disk program cache."""
    threads: Counter = field(default_factory=Counter)
    """Per (mode, thread count): steps a native step list ran on that many threads (fewer than
    the pool's while the pool stalled: ``fuel.kernels.threads.StepThreads``)."""

    def record(self, mode: Mode, program: StepProgram, threads: int | None = None) -> None:
        """Count one step of ``program`` (``threads``: the count its step list ran on, None
        when it ran node by node)."""
        self.steps[mode.value] += 1
        self.rows[mode.value] += program.step.shape.rows
        self.launches[mode.value] += program.launches
        self.dispatched[mode.value] += program.dispatched
        self.host_calls[mode.value] += program.host_calls
        if threads is not None:
            self.threads[(mode.value, threads)] += 1
        if program.digest not in self.digests:
            self.digests[program.digest] = f"{mode.value} rows={program.step.plan.rows}"
        for choice in program.last_route.choices if program.last_route is not None else ():
            arm = next((a for a in choice.arms if a.arm == choice.arm), None)
            where = str(arm.device) if arm is not None and arm.device is not None else "?"
            self.routes[(mode.value, choice.branch, choice.arm, where, choice.reason)] += 1

    def reset(self) -> None:
        for counter in (self.steps, self.rows, self.launches, self.dispatched, self.host_calls,
                        self.builds,
                        self.build_s, self.routes, self.experts, self.expert_bytes,
                        self.expert_layer_steps, self.experts_uniform, self.restored,
                        self.threads):
            counter.clear()
        self.digests.clear()
        self.expert_shape.clear()


def runs_of(lengths: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Maximal runs ``(k, n)`` of equal lengths, in order."""
    runs: list[list[int]] = []
    for k in lengths:
        if runs and runs[-1][0] == k:
            runs[-1][1] += 1
        else:
            runs.append([k, 1])
    return tuple((k, n) for k, n in runs)


class FeedBuffers:
    """A step's small host feeds (token ids, positions, slots, block tables, context lengths)
    written into tensors kept from the step before, by name and shape, instead of new ones each
    step: making a tensor from a list costs ~10 us, a few of them a tenth of a SmolLM2 Q4_1
    decode step's Python. A step's feeds are read only while the step runs (the engine steps one
    batch at a time), so the next step may overwrite them: what a step returns (logits, tokens,
    routed expert ids) is computed, never one of these buffers."""

    def __init__(self, torch: Any) -> None:
        self._from_numpy = torch.from_numpy
        self._buffers: dict[tuple[str, tuple[int, ...]], tuple[np.ndarray, Any]] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype) -> tuple[np.ndarray, Any]:
        """(array, tensor sharing its memory) for feed ``name`` of ``shape`` and ``dtype``."""
        key = (name, shape)
        entry = self._buffers.get(key)
        if entry is None or entry[0].dtype != dtype:
            array = np.empty(shape, dtype=dtype)
            entry = self._buffers[key] = (array, self._from_numpy(array))
        return entry

    def ints(self, name: str, values: Sequence[int]) -> Any:
        """An int64 tensor holding ``values``."""
        array, tensor = self.get(name, (len(values),), np.int64)
        array[:] = values
        return tensor


class Engine:
    """A model ready to step: weights, circuit, rules, caches, plans and programs."""

    def __init__(self, weights: Weights, *, circuit: Circuit | None = None,
                 rules: RuleSet | None = None, policy: Policy | None = None,
                 max_context: int = 2048, max_sequences: int = 4,
                 block_size: int = DEFAULT_BLOCK_SIZE, table: Any = None,
                 optimize_options: Any = None, program_cache: Any = None,
                 on_build: Callable[[str, str], Any] | None = None):
        import torch

        from fuel.circuit import zoo
        from fuel.circuit.policy import build_policy
        from fuel.runtime.weights import check_weights

        if circuit is None:
            from fuel.runtime.weights import SourceKind

            source = weights.source
            config_file = (source.folder / "config.json" if source.kind is SourceKind.CHECKPOINT_FOLDER
                           else source.path)
            circuit = zoo.circuit_for_config(dict(weights.config), str(config_file))
        check_weights(weights, expected_weight_shapes(circuit))
        self.weights = weights
        self.circuit = circuit
        self.rules = rules or load_builtin_rules("cpu")
        self.policy = policy or build_policy()
        self.available = AvailableKernels.all_named_by(self.rules)
        if table is None:
            from fuel.kernels import cpu_table

            table = cpu_table()
        self.table = table
        self.optimize_options = optimize_options
        self.program_cache = program_cache
        """A :class:`~fuel.runtime.program_cache.ProgramCache`: programs built in an earlier
        process are restored from it, new ones stored in it (None: every program is built)."""
        self.on_build = on_build
        """Called ``(what, "start" | "built" | "restored")`` around each program build (the
        CLI's progress bar)."""
        # The compute dtype: f32 for every storage dtype (bf16/f16/stored matrices are widened
        # in registers by the matmul kernels: fuel.runtime.weights.DType.compute).
        self.dtype = weights.dtype.compute
        self.kv_dtype = weights.dtype.kv
        """The KV caches' element dtype (``weights.DType.kv``: bf16/f16 for a half-precision run)."""
        self.store = WeightStore(weights, self.dtype)
        self.block_size = block_size
        self.max_context = max_context
        self.max_blocks = math.ceil(max_context / block_size)
        self.num_blocks = self.max_blocks * max_sequences
        self.tables = {section: BlockTables(self.num_blocks, block_size) for section in Section}
        self._caches: dict[str, torch.Tensor] = {}
        self._program_caches: dict[int, dict[str, torch.Tensor]] = {}
        self._feed_buffers = FeedBuffers(torch)
        self._plans: dict[tuple[Mode, int, str], FusionPlan] = {}
        self._programs: dict[tuple[str, StepShape], StepProgram] = {}
        self.stats = EngineStats()
        self._torch = torch

    # -- plans and programs ------------------------------------------------------------------

    def plan(self, mode: Mode, rows: int, table: RowTable | None = None) -> FusionPlan:
        """The fused plan for ``mode`` at ``rows`` (a row table for verify_batch), made once."""
        key = (mode, rows, table.text() if table is not None else "")
        if key not in self._plans:
            if mode is Mode.VERIFY_BATCH:
                assert table is not None
                self._plans[key] = fuse_table(self.circuit, self.rules, self.available, self.policy, table)
            else:
                self._plans[key] = fuse(self.circuit, self.rules, self.available, self.policy, mode, rows)
        return self._plans[key]

    def program(self, plan: FusionPlan, shape: StepShape) -> StepProgram:
        """The compiled program of ``plan`` at ``shape``, built once (keyed by the digest)."""
        key = (plan.digest, shape)
        if key not in self._programs:
            what = f"{plan.mode.value} rows={plan.rows} blocks={shape.max_blocks}"
            if self.on_build is not None:
                self.on_build(what, "start")
            program, disk_key = None, None
            if self.program_cache is not None:
                from fuel.runtime.lower import packed_layouts
                from fuel.runtime.program_cache import program_key

                disk_key = program_key(plan.digest, shape, self.dtype, self.optimize_options,
                                       packed_layouts(self.store), self.kv_dtype)
                program = self.program_cache.load(disk_key, self.store, self.table,
                                                  self.optimize_options)
            outcome = "restored"
            if program is None:
                outcome = "built"
                step = lower(plan, self.circuit, self.store, shape, dtype=_graph_dtype(self.dtype),
                             kv_dtype=_graph_dtype(self.kv_dtype))
                program = build_program(step, self.store, self.table, self.optimize_options)
                if disk_key is not None:
                    self.program_cache.save(disk_key, program, self.optimize_options)
            step = program.step
            inputs = _input_nodes(step)
            for cache in step.caches:
                for name in (cache.k_input, cache.v_input):
                    self._cache(name, step.graph.node(inputs[name]).shape.dims)
            self._programs[key] = program
            self.stats.restored[plan.mode.value] += outcome == "restored"
            if self.on_build is not None:
                self.on_build(what, outcome)
        return self._programs[key]

    def programs(self) -> tuple[StepProgram, ...]:
        return tuple(self._programs.values())

    def _cache(self, name: str, dims: tuple[int, ...]) -> torch.Tensor:
        if name not in self._caches:
            self._caches[name] = zeroed_pages(self._torch, dims, self.kv_dtype)
        return self._caches[name]

    def _cache_feeds(self, program: StepProgram) -> dict[str, torch.Tensor]:
        """The KV caches ``program`` reads, by feed name (made once per program: the caches are
        allocated once and never replaced; a program, once built, is kept for the engine's life,
        so its id names it)."""
        feeds = self._program_caches.get(id(program))
        if feeds is None:
            feeds = {}
            for cache in program.step.caches:
                feeds[cache.k_input] = self._caches[cache.k_input]
                feeds[cache.v_input] = self._caches[cache.v_input]
            self._program_caches[id(program)] = feeds
        return feeds

    # -- sequences ---------------------------------------------------------------------------

    def add_sequence(self, sequence: Hashable) -> None:
        self.tables[Section.MAIN].add(sequence)

    def length(self, sequence: Hashable, section: Section = Section.MAIN) -> int:
        tables = self.tables[section]
        return tables.length(sequence) if sequence in tables else 0

    def rollback(self, sequence: Hashable, length: int, section: Section = Section.MAIN) -> None:
        self.tables[section].rollback(sequence, length)

    def free(self, sequence: Hashable) -> None:
        for tables in self.tables.values():
            if sequence in tables:
                tables.free(sequence)

    def reset(self) -> None:
        """Free every sequence (caches keep their storage; stale rows are never read)."""
        for tables in self.tables.values():
            for sequence in tables.sequences():
                tables.free(sequence)

    # -- a step ------------------------------------------------------------------------------

    def step(self, mode: Mode, batch: Sequence[tuple[Hashable, Sequence[int]]], *,
             timed: bool = False, logit_rows: Sequence[int] | None = None) -> StepResult:
        """Append each sequence's tokens and run one step of ``mode`` over all of them
        (``timed``: also clock every node, for the profiler). ``logit_rows``: the rows (indices
        into the step's rows, in batch order) whose logits and greedy tokens the step computes
        and returns, in that order; None, every row's. A prompt chunk whose only use is its
        last token's logits asks for that row: the LM head then multiplies one row."""
        if not batch or any(not tokens for _, tokens in batch):
            raise BadStep(mode, "every sequence of a step feeds at least one token")
        lengths = [len(tokens) for _, tokens in batch]
        if logit_rows is not None and (not logit_rows or any(
                not isinstance(r, int) or not 0 <= r < sum(lengths) for r in logit_rows)):
            raise BadStep(mode, f"logit rows {list(logit_rows)} are not rows of a "
                                f"{sum(lengths)}-row step")
        if mode in (Mode.DECODE, Mode.MULTI_SEQ) and any(k != 1 for k in lengths):
            raise BadStep(mode, f"one row per sequence, got {lengths}")
        if mode in (Mode.DECODE, Mode.PREFILL, Mode.VERIFY) and len(batch) != 1:
            raise BadStep(mode, f"one sequence, got {len(batch)}")
        if mode is not Mode.VERIFY_BATCH and len(set(lengths)) != 1:
            raise BadStep(mode, f"every sequence feeds the same rows, got {lengths}")
        section = Section.DRAFT if mode is Mode.DRAFT else Section.MAIN
        tables = self.tables[section]
        for sequence, tokens in batch:
            if section is Section.DRAFT and sequence not in tables:
                tables.add(sequence)
            length = self.length(sequence, section) + len(tokens)
            if length > self.max_context:
                raise ContextTooLong(sequence, length, self.max_context)
        starts = [tables.length(sequence) for sequence, _ in batch]
        slots: list[int] = []
        try:
            for sequence, tokens in batch:
                slots += tables.append(sequence, len(tokens))
        except Exception:
            for (sequence, _), start in zip(batch, starts):
                if tables.length(sequence) > start:
                    tables.rollback(sequence, start)
            raise
        try:
            return self._run(mode, section, batch, lengths, starts, slots, timed, logit_rows)
        except Exception:
            for (sequence, _), start in zip(batch, starts):
                tables.rollback(sequence, start)
            raise

    def _run(self, mode: Mode, section: Section, batch, lengths, starts, slots,
             timed: bool = False, logit_rows: Sequence[int] | None = None) -> StepResult:
        tables = self.tables[section]
        runs = runs_of(lengths)
        row_table = RowTable.from_seqs(lengths) if mode is Mode.VERIFY_BATCH else None
        if row_table is not None:
            runs = tuple((r.k, r.n) for r in row_table.runs)
        rows = sum(lengths)
        longest = max(start + k for start, k in zip(starts, lengths))
        width = min(self.max_blocks, 1 << max(0, math.ceil(math.log2(math.ceil(longest / self.block_size)))))
        shape = StepShape(runs, self.block_size, self.num_blocks, width, self.max_context,
                          None if logit_rows is None else len(logit_rows))
        plan = self.plan(mode, rows, row_table)
        if (plan.digest, shape) not in self._programs:
            started = time.perf_counter()
            self.program(plan, shape)
            self.stats.builds[mode.value] += 1
            self.stats.build_s[mode.value] += time.perf_counter() - started
        program = self.program(plan, shape)

        buffers = self._feed_buffers
        feeds: dict[str, Any] = {
            TOKENS: buffers.ints(TOKENS, [t for _, tokens in batch for t in tokens]),
            POSITIONS: buffers.ints(POSITIONS, [p for start, k in zip(starts, lengths)
                                                for p in range(start, start + k)]),
            SLOTS: buffers.ints(SLOTS, slots),
        }
        if logit_rows is not None:
            feeds[LOGIT_ROWS] = buffers.ints(LOGIT_ROWS, logit_rows)
        sequences = [sequence for sequence, _ in batch]
        first = 0
        for run, (_, n) in enumerate(runs):
            members = sequences[first:first + n]
            name = block_table_input(run)
            array, feeds[name] = buffers.get(name, (n, width), np.uint32)
            tables.block_table_into(members, array)
            name = context_lens_input(run)
            array, feeds[name] = buffers.get(name, (n,), np.uint32)
            tables.context_lengths_into(members, array)
            first += n
        feeds.update(self._cache_feeds(program))
        seconds = None
        chosen: tuple[Any, ...] = ()
        if timed:
            out, seconds = program.program.run_timed(feeds)
            logits, tokens = out[program.logits_root], out[program.tokens_root]
            chosen = tuple(out[r] for r in program.routing_roots)
        elif program.routing_roots:
            logits, tokens, chosen = program.run_routed(feeds)
        else:
            logits, tokens = program.run(feeds)
        self.stats.record(mode, program, None if timed else program.program.last_threads)
        if chosen:
            self.stats.record_routing(mode, program, chosen)
        return StepResult(logits, tokens.reshape(-1).tolist(), program, seconds)


def _graph_dtype(dtype: Any):
    from fuel.graph.dtype import DType

    return {"torch.bfloat16": DType.BF16, "torch.float16": DType.F16}.get(str(dtype), DType.F32)


def _input_nodes(step) -> dict[str, int]:
    """The step graph's inputs by name (one pass: a layer's caches are looked up 60 times)."""
    from fuel.graph.ir import Input

    found: dict[str, int] = {}
    for node_id in step.graph:
        op = step.graph.node(node_id).op
        if isinstance(op, Input):
            found.setdefault(op.name, node_id)
    return found


_LAZY_ZERO_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
"""KV dtypes :func:`zeroed_pages` makes from the system's zeroed pages (bf16 as its bits)."""


def zeroed_pages(torch: Any, dims: tuple[int, ...], dtype: Any) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages the kernel zeroes on first touch (numpy's zeros:
    calloc, so a large one is fresh mapped pages), where ``torch.zeros`` writes every byte now.
    A KV cache is sized for the longest context and mostly never touched: SmolLM2's 60 caches
    at 2,048 positions (189 MB) took 54 ms to zero before the first token, 0.5 ms this way, and
    only the blocks a run writes become resident. Other dtypes: ``torch.zeros``."""
    bits = _LAZY_ZERO_DTYPES.get(str(dtype).removeprefix("torch."))
    if bits is None:
        return torch.zeros(dims, dtype=dtype)
    return torch.from_numpy(np.zeros(dims, dtype=bits)).view(dtype)


__all__ = [
    "BadStep", "ContextTooLong", "DEFAULT_BLOCK_SIZE", "Engine", "EngineError", "EngineStats",
    "StepResult", "runs_of",
]
