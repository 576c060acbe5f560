"""Assemble the plan report: one JSON document (schema ``plan_report.schema.json``) that the
text, JSON and HTML outputs all render.

Decides which cases, plans and tiers a report holds and in what order:

- roofline cases: decode at C = 1 (mode ``decode``) and C = 16, 128 (mode ``multi_seq``, rows
  C), at the stated context per sequence; prefill of 4k and 32k tokens, run as chunks of
  ``prefill_chunk`` rows (mode ``prefill``), each chunk attending the prompt so far;
- plan summaries for one representative tier per mode;
- gaps over every covering plan the report made, each with its share of the first case whose
  plan holds it;
- the coverage matrix over every tier, and the requested ``--serve`` modes' unplanned tiers.

Inputs are values (circuit, device spec, rule set choice, policy); the only file this module
reads is a built-in rule set, in :func:`rule_set_for` (the loading edge). Same inputs, same
document.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

from fuel.circuit.format import BF16, Format, FormatKind
from fuel.circuit.fuser import AvailableKernels, FuseError, FusionPlan, Policy
from fuel.circuit.ir import Circuit
from fuel.circuit.rules import Mode, RepeatKind, RuleSet, load_rules
from fuel.circuit.runs import RowTable
from fuel.report.coverage import (DEFAULT_TABLES, CoverageCell, coverage_matrix,
                                  covering_fuse, gaps_of, is_novel, tiers, unserved)
from fuel.report.jit import gap_request
from fuel.report.memory import USABLE_FRACTION, memory_fit, stored_weight_bytes
from fuel.report.roofline import (DeviceRates, PlannedGroup, SequenceRows, StepEstimate, Workload,
                                  decode_weight_bytes, estimate_step, kv_bytes_per_token)

SCHEMA_ID = "fuel-plan-report/1"
DECODE_CONCURRENCIES = (1, 16, 128)
PREFILL_TOKENS = (4096, 32768)

NOTES = (
    "Ceiling: every node costs max(bytes / bandwidth, FLOPs / peak), summed over the plan's "
    "groups; it includes NO launch overhead. '+launch' adds launches x the device's launch "
    "overhead.",
    "Edges a plan keeps inside one group cost no memory traffic; weights are read in their stored "
    "formats, scales included.",
    "Decode at C sequences reads each sequence's whole KV cache at the stated context; prefill "
    "runs in chunks, each chunk attending the prompt so far (causal).",
    "Per-row loops (per_row, chunk<n>) re-read weights per pass; MoE layers read "
    "E*(1-(1-k/E)^T) distinct experts for T tokens (uniform routing).",
    "Matmul-like ops run at the matrix peak of their input dtype (fp4 inputs on a chip with no "
    "fp4 peak at its fp8, else bf16, peak); a one-row product (decode) at the device's measured "
    "matrix-vector rate where it has one; a product of more rows at the rate the device measured "
    "at its rows where it has such rates (a probed CPU), and attention of several rows a "
    "sequence at the device's measured prompt-chunk attention rate at its rows (measured with "
    "as many positions as rows); element-wise ops at the fp32 vector peak. Available "
    "kernels are the offline view (every kernel the rule set names).",
    "Memory fit: usable = device memory x 0.9; need = stored weights + KV bytes per token x "
    "context x C.",
)


@dataclass(frozen=True, slots=True)
class RuleChoice:
    """The rule set a device's backend picks, or ``rules=None`` and why none applies."""

    name: str | None
    backend: str | None
    rules: RuleSet | None
    reason: str


def rule_set_for(title: str, kind: str) -> RuleChoice:
    """A device's rule set: ``cpu`` for the CPU fuel runs on, ``cuda`` for NVIDIA GPUs (by the
    spec's title, which names the vendor); none for other vendors: fuel ships no ROCm or Metal
    rules, and pretending a CUDA stack runs there would report kernels that do not exist."""
    if kind == "cpu":
        name, backend = "cpu", "cpu"
        reason = "the CPU backend's rule set (fuel's own kernels)"
    elif title.startswith("NVIDIA"):
        name, backend = "cuda", "cuda"
        reason = "an NVIDIA GPU: the CUDA serving stack's rule set"
    else:
        return RuleChoice(None, None, None,
                          f"no rule set applies to {title}: fuel ships `cpu` and `cuda` (NVIDIA) "
                          "only; every op is a gap and the roofline prices unfused single ops")
    path = resources.files("fuel") / "data" / "rules" / f"{name}.toml"
    return RuleChoice(name, backend, load_rules(str(path)), reason)


@dataclass(frozen=True, slots=True)
class ReportOptions:
    context: int = 4096
    kv_format: Format = BF16
    prefill_chunk: int = 2048
    tables: tuple[RowTable, ...] = field(
        default_factory=lambda: tuple(RowTable.parse(t) for t in DEFAULT_TABLES))
    serve: tuple[Mode, ...] = ()
    measured_experts: Any = None
    """An :class:`ExpertMeasurement` from a ``fuel run`` (``fuel plan --experts-from``), or None."""


@dataclass(frozen=True, slots=True)
class ExpertMeasurement:
    """Distinct experts per MoE layer a real run read, by mode: ``(mode, rows per step,
    measured per layer, uniform expectation per layer)``, and which run it was."""

    source: str
    model: str
    modes: tuple[tuple[str, float, float, float], ...]


def expert_notes(circuit: Circuit, measured: ExpertMeasurement | None) -> list[str]:
    """For an MoE circuit: the plan keeps the uniform-routing estimate and says so, and states
    the distinct-expert counts a run measured when one was supplied."""
    dims = circuit.dims
    if "experts" not in dims or "top_k" not in dims:
        return []
    experts, top_k = dims["experts"], dims["top_k"]
    notes = [f"MoE expert reads are the uniform-routing estimate (E={experts}, k={top_k}: "
             f"decode at T=1 reads k={top_k} experts per layer); routing is data, so the plan "
             "cannot know it."]
    if measured is None:
        notes.append("No run supplied a measured distinct-expert count (fuel plan "
                     "--experts-from RUN.json reads one from `fuel run --json`).")
    else:
        counts = "; ".join(f"{mode} at {rows:g} rows/step: {per_layer:g} per layer (uniform "
                           f"{uniform:g})" for mode, rows, per_layer, uniform in measured.modes)
        notes.append(f"Measured by a run of {measured.model} ({measured.source}): {counts}. "
                     "The estimate above is not replaced: another prompt routes differently.")
    return notes


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """The device as the document shows it: rates plus its title and number sources."""

    rates: DeviceRates
    title: str
    sources: dict[str, str]


def device_info(spec: Any) -> DeviceInfo:
    """The report's view of a cost-stage :class:`fuel.cost.spec.DeviceSpec`: bandwidth, the
    fp32 vector rate (``fp32``), the dense matrix peaks the roofline prices at (``bf16``,
    falling back to the chip's fp16 peak, which datasheets quote as equal; ``fp16``;
    ``fp32-matrix``; ``fp8``; ``fp4``), the measured matrix-vector rates, the matrix rates by
    rows and the attention rates by rows where the spec has them."""
    from fuel.cost.spec import PeakClass

    peaks = {"fp32": float(spec.vector_flops)}
    tensor = {"bf16": spec.peak_flops.get(PeakClass.BF16) or spec.peak_flops.get(PeakClass.FP16),
              "fp16": spec.peak_flops.get(PeakClass.FP16),
              "fp32-matrix": spec.peak_flops.get(PeakClass.FP32),
              "fp8": spec.peak_flops.get(PeakClass.FP8), "fp4": spec.peak_flops.get(PeakClass.FP4)}
    peaks.update({k: float(v) for k, v in tensor.items() if v})
    names = {PeakClass.FP32: "fp32-matrix", PeakClass.FP16: "fp16", PeakClass.BF16: "bf16"}
    matvec = {names[c]: float(v) for c, v in spec.gemv_flops.items() if c in names and v}
    by_rows = {names[c]: tuple((int(r), float(v)) for r, v in curve)
               for c, curve in sorted(spec.gemm_rows_flops.items(), key=lambda kv: kv[0].value)
               if c in names and curve}
    fits = {names[c]: tuple((int(r), float(f), float(v)) for r, f, v in fit)
            for c, fit in sorted(spec.gemm_rows_fit.items(), key=lambda kv: kv[0].value)
            if c in names and fit}
    attention = tuple((int(r), float(v)) for r, v in spec.attention_rows_flops)
    rates = DeviceRates(spec.name, float(spec.bandwidth_bytes_per_s), peaks,
                        float(spec.launch_overhead_ns), int(spec.memory_bytes), matvec, by_rows,
                        attention, tuple((int(b), float(v)) for b, v in spec.bandwidth_by_bytes),
                        tuple((int(b), float(v)) for b, v in spec.half_bandwidth_by_bytes), fits,
                        tuple((int(r), float(f), float(v)) for r, f, v in spec.attention_rows_fit))
    return DeviceInfo(rates, spec.title, dict(spec.sources))


_PLAIN_FLOATS = frozenset({FormatKind.BF16, FormatKind.F16, FormatKind.F32})


def in_dtype(circuit: Circuit, *, weights: Format | None = None,
             activations: Format | None = None) -> Circuit:
    """The circuit as a run in another dtype executes it: every weight stored in ``weights``
    (``fuel plan --weights``, ``--dtype``) and every plain-float edge in ``activations``
    (``--dtype``: the run computes every activation in its dtype). Quantized edges keep their
    format. ``None`` keeps what the model states."""
    if weights is not None:
        nodes = tuple(replace(n, weight_format=weights) if n.weight_format is not None else n
                      for n in circuit.nodes)
        shape = replace(circuit.shape, weight_format=weights) if circuit.shape else None
        circuit = replace(circuit, nodes=nodes, shape=shape)
    if activations is not None:
        edges = tuple(replace(e, format=activations) if e.format.kind in _PLAIN_FLOATS else e
                      for e in circuit.edges)
        circuit = replace(circuit, edges=edges)
    return circuit


def kv_format_for(policy: Policy, activation: Format = BF16) -> Format:
    """The KV cache element format the policy's ``kv_cache_dtype`` states: ``auto`` keeps the
    activation format, ``fp8`` stores E4M3 (its per-tensor scale counted)."""
    from fuel.circuit.format import parse

    setting = policy.settings.get("kv_cache_dtype", "auto")
    return activation if setting == "auto" else parse(f"{setting}/tensor")


class _Planner:
    """Covering plans, built once per (mode, rows, table) and reused."""

    def __init__(self, circuit: Circuit, choice: RuleChoice, policy: Policy):
        self.circuit, self.policy = circuit, policy
        self.rules = tuple(choice.rules) if choice.rules is not None else ()
        self.available = AvailableKernels.all_named_by(self.rules)
        self.cache: dict[tuple[Mode, int, str], FusionPlan | FuseError] = {}

    def plan(self, mode: Mode, rows: int, table: RowTable | None = None) -> FusionPlan | FuseError:
        key = (mode, rows, table.text() if table else "")
        if key not in self.cache:
            try:
                self.cache[key] = covering_fuse(self.circuit, self.rules, self.available,
                                                self.policy, mode, rows, table)
            except FuseError as error:
                self.cache[key] = error
        return self.cache[key]


def planned_groups(plan: FusionPlan) -> list[PlannedGroup]:
    out = []
    for g in plan.groups:
        looped = g.repeat.kind in (RepeatKind.PER_ROW, RepeatKind.CHUNK, RepeatKind.PER_ROW_BUT_LAST)
        passes = max(1, g.repeat.count(plan.rows) or 1) if looped else 1
        out.append(PlannedGroup(g.nodes, g.rule, g.launch_count(plan.rows), passes))
    return out


def _fused_edges(plan: FusionPlan):
    by_group: dict[int, set[int]] = {}
    for e, state in enumerate(plan.edge_states):
        if state is not None and state.group is not None:
            by_group.setdefault(state.group, set()).add(e)
    frozen = {g: frozenset(edges) for g, edges in by_group.items()}
    return lambda g: frozen.get(g, frozenset())


def predict_step(circuit: Circuit, device: DeviceInfo, choice: RuleChoice, policy: Policy,
                 mode: Mode, sequences: Sequence[SequenceRows], kv_format: Format = BF16,
                 logit_rows: int | None = None) -> StepEstimate | FuseError:
    """The roofline of one step exactly as ``fuel plan`` prices it: the covering plan of
    ``mode`` at the step's rows, costed for ``sequences`` (rows added, context after).
    ``logit_rows``: the rows whose logits the step computes (None, every row, as the report
    prices a prefill chunk; a generation's prefill in ``fuel run`` computes one a sequence).
    A mode with no plan at those rows is the :class:`FuseError` that says why."""
    load = Workload(tuple(sequences), kv_format, logit_rows)
    plan = _Planner(circuit, choice, policy).plan(mode, load.rows)
    return plan if isinstance(plan, FuseError) else _estimate(circuit, plan, load, device.rates)


def _estimate(circuit: Circuit, plan: FusionPlan, load: Workload, rates: DeviceRates) -> StepEstimate:
    return estimate_step(circuit, planned_groups(plan), load, rates,
                         edge_formats=plan.edge_formats, fused_edges=_fused_edges(plan))


@dataclass
class _Case:
    name: str
    mode: Mode
    rows: int
    concurrency: int
    context: int
    steps: list[tuple[FusionPlan, StepEstimate]]
    error: str | None = None


def build_report(model: str, circuit: Circuit, device: DeviceInfo, choice: RuleChoice,
                 policy: Policy, options: ReportOptions = ReportOptions()) -> dict[str, Any]:
    """The report document for ``model`` (its ``circuit``) on ``device``."""
    rates = device.rates
    notes = [*NOTES, f"Prefill runs in chunks of {options.prefill_chunk} rows.",
             *expert_notes(circuit, options.measured_experts)]
    if circuit.shape is not None and circuit.shape.weight_format is None:
        # A config without `torch_dtype` does not say how its checkpoint stores weights; price
        # them as bf16 and say so, rather than refuse a report or guess silently.
        circuit = replace(circuit, shape=replace(circuit.shape, weight_format=BF16))
        notes.append("The config states no torch_dtype: weights are assumed stored as bf16.")
    planner = _Planner(circuit, choice, policy)
    cases = _cases(circuit, planner, rates, options)
    floor_bytes = decode_weight_bytes(circuit)
    floor_ns = floor_bytes / rates.bandwidth * 1e9
    kv_token = kv_bytes_per_token(circuit, options.kv_format)
    fit = memory_fit(stored_weight_bytes(circuit), kv_token, options.kv_format,
                     rates.memory_bytes)
    tier_list = tiers(options.tables)
    cells = coverage_matrix(circuit, tuple(choice.rules) if choice.rules is not None else None,
                            planner.available, policy, tier_list, choice.reason)
    plans = _plan_summaries(circuit, planner, options)
    gaps = _gaps(circuit, cases, plans, choice)
    shape = circuit.shape
    return {
        "schema": SCHEMA_ID,
        "model": {"name": model, "arch": circuit.arch,
                  "layers": shape.layers if shape else _count_layers(circuit),
                  "dims": dict(sorted(circuit.dims.items())),
                  "weight_format": shape.weight_format.name() if shape and shape.weight_format
                  else None},
        "device": {"name": rates.name, "title": device.title,
                   "bandwidth_bytes_per_s": rates.bandwidth,
                   "peak_flops_per_s": dict(sorted(rates.peaks.items())),
                   "memory_bytes": rates.memory_bytes,
                   "launch_overhead_ns": rates.launch_overhead_ns,
                   "sources": dict(sorted(device.sources.items()))},
        "rule_set": {"name": choice.name, "digest": choice.rules.digest if choice.rules else None,
                     "reason": choice.reason},
        "assumptions": {"context": options.context, "kv_format": options.kv_format.name(),
                        "usable_memory_fraction": USABLE_FRACTION,
                        "notes": notes},
        "weight_floor": {"weight_bytes": floor_bytes, "ns": floor_ns,
                         "tokens_per_s": 1e9 / floor_ns if floor_ns > 0 else None},
        "roofline": [_case_doc(c) for c in cases if c.steps],
        "memory_fit": {"device_bytes": fit.device_bytes, "usable_bytes": fit.usable_bytes,
                       "weight_bytes": fit.weight_bytes, "kv_bytes_per_token": kv_token,
                       "kv_format": options.kv_format.name(),
                       "cells": [{"context": c.context, "concurrency": c.concurrency,
                                  "need_bytes": c.need_bytes, "fits": c.fits,
                                  "shortfall_bytes": c.shortfall_bytes} for c in fit.cells]},
        "plans": [_plan_doc(circuit, p) for p in plans],
        "gaps": gaps,
        "coverage": [_cell_doc(c) for c in cells],
        "serve": unserved(cells, options.serve),
    }


def _count_layers(circuit: Circuit) -> int:
    return len({b.layer for b in circuit.blocks if b.layer is not None})


def _cases(circuit: Circuit, planner: _Planner, rates: DeviceRates,
           options: ReportOptions) -> list[_Case]:
    cases = []
    for c in DECODE_CONCURRENCIES:
        mode = Mode.DECODE if c == 1 else Mode.MULTI_SEQ
        case = _Case(f"decode C={c}", mode, c, c, options.context, [])
        plan = planner.plan(mode, c)
        if isinstance(plan, FuseError):
            case.error = str(plan)
        else:
            load = Workload.decode(c, options.context, options.kv_format)
            case.steps.append((plan, _estimate(circuit, plan, load, rates)))
        cases.append(case)
    for tokens in PREFILL_TOKENS:
        case = _Case(f"prefill {tokens // 1024}k", Mode.PREFILL, tokens, 1, tokens, [])
        done = 0
        while done < tokens:
            rows = min(options.prefill_chunk, tokens - done)
            done += rows
            plan = planner.plan(Mode.PREFILL, rows)
            if isinstance(plan, FuseError):
                case.error, case.steps = str(plan), []
                break
            load = Workload((SequenceRows(rows, done),), options.kv_format)
            case.steps.append((plan, _estimate(circuit, plan, load, rates)))
        cases.append(case)
    return cases


def _case_doc(case: _Case) -> dict[str, Any]:
    ests = [e for _, e in case.steps]
    ceiling = sum(e.ceiling_ns for e in ests)
    with_launch = sum(e.with_launch_ns for e in ests)
    by_op: dict[str, float] = {}
    sites: dict[tuple[str, tuple[str, ...], str], dict[str, Any]] = {}
    for e in ests:
        for op, ns in e.time_by_op().items():
            by_op[op] = by_op.get(op, 0.0) + ns
        for g in e.groups:
            key = (g.block, g.locals, g.rule)
            site = sites.setdefault(key, {"block": g.block, "locals": list(g.locals),
                                          "rule": g.rule, "count": 0, "flops": 0.0,
                                          "bytes": 0.0, "ns": 0.0})
            site["count"] += 1
            site["flops"] += g.flops
            site["bytes"] += g.bytes
            site["ns"] += g.ceiling_ns
    tokens = case.rows
    return {
        "name": case.name, "mode": case.mode.value, "rows": case.rows,
        "concurrency": case.concurrency, "context": case.context,
        "planned": not any(is_novel(g.rule) for p, _ in case.steps for g in p.groups),
        "ceiling_ns": ceiling, "with_launch_ns": with_launch,
        "launches": sum(e.launches for e in ests),
        "tokens_per_s_ceiling": tokens / ceiling * 1e9 if ceiling else 0.0,
        "tokens_per_s_with_launch": tokens / with_launch * 1e9 if with_launch else 0.0,
        "weight_bytes": sum(e.weight_bytes for e in ests),
        "kv_bytes": sum(e.kv_bytes for e in ests),
        "flops": sum(g.flops for e in ests for g in e.groups),
        "bytes": sum(g.bytes for e in ests for g in e.groups),
        "time_by_op": by_op,
        "sites": list(sites.values()),
    }


def _plan_summaries(circuit: Circuit, planner: _Planner,
                    options: ReportOptions) -> list[FusionPlan]:
    """One representative covering plan per mode (modes whose section is empty are skipped;
    the coverage matrix says why)."""
    picks: list[tuple[Mode, int, RowTable | None]] = [
        (Mode.DECODE, 1, None), (Mode.MULTI_SEQ, 16, None), (Mode.VERIFY, 4, None)]
    if options.tables:
        picks.append((Mode.VERIFY_BATCH, options.tables[0].rows(), options.tables[0]))
    picks += [(Mode.DRAFT, 1, None), (Mode.PREFILL, options.prefill_chunk, None)]
    out = []
    for mode, rows, table in picks:
        plan = planner.plan(mode, rows, table)
        if not isinstance(plan, FuseError):
            out.append(plan)
    return out


def _plan_doc(circuit: Circuit, plan: FusionPlan) -> dict[str, Any]:
    sites: dict[tuple[str, tuple[str, ...], str], dict[str, Any]] = {}
    for g in plan.groups:
        first = circuit.nodes[g.nodes[0]]
        locals_ = tuple(circuit.nodes[n].local for n in g.nodes)
        key = (circuit.blocks[first.block].name, locals_, g.rule)
        # A per_run group launches what its runs' selectors name, per run of the table.
        kernels = [str(k) for k in g.kernels] or [
            f"{r.run.text()}: {launch.text()}" for r in g.runs for launch in r.launches]
        site = sites.setdefault(key, {"block": key[0], "locals": list(locals_),
                                      "kernels": kernels, "rule": g.rule, "count": 0})
        site["count"] += 1
    states = [s for s in plan.edge_states if s is not None]
    return {"mode": plan.mode.value, "rows": plan.rows,
            "table": plan.table.text() if plan.table else None, "digest": plan.digest,
            "groups": len(plan.groups), "launches": plan.launches(), "copies": plan.copies(),
            "fused_edges": sum(1 for s in states if s.is_fused),
            "materialized_edges": sum(1 for s in states if not s.is_fused),
            "novel_groups": sum(1 for g in plan.groups if is_novel(g.rule)),
            "sites": list(sites.values())}


def _gaps(circuit: Circuit, cases: Sequence[_Case], plans: Sequence[FusionPlan],
          choice: RuleChoice) -> list[dict[str, Any]]:
    found: dict[tuple[str, str, str], dict[str, Any]] = {}
    for case in cases:
        for plan, est in case.steps:
            node_ns = {n: ns for g, group in zip(est.groups, plan.groups, strict=True)
                       for n, ns in zip(group.nodes, g.node_ns, strict=True)}
            step_ns = est.ceiling_ns
            for site in gaps_of(circuit, plan):
                key = (site.op, site.block, site.local)
                entry = found.setdefault(key, {"site": site, "modes": set(), "share": None,
                                               "rows": plan.rows})
                entry["modes"].add(plan.mode.value)
                if entry["share"] is None and step_ns > 0:
                    entry["share"] = sum(node_ns[n] for n in site.nodes) / step_ns
    for plan in plans:
        for site in gaps_of(circuit, plan):
            key = (site.op, site.block, site.local)
            entry = found.setdefault(key, {"site": site, "modes": set(), "share": None,
                                           "rows": plan.rows})
            entry["modes"].add(plan.mode.value)
    out = []
    for entry in sorted(found.values(), key=lambda e: e["site"].nodes[0]):
        site = entry["site"]
        out.append({"op": site.op, "block": site.block, "local": site.local,
                    "modes": sorted(entry["modes"]), "count": len(site.nodes),
                    "share_of_step": min(1.0, entry["share"] or 0.0),
                    "request": gap_request(circuit, site.nodes[0], entry["rows"], choice.backend)})
    return out


def _cell_doc(cell: CoverageCell) -> dict[str, Any]:
    return {"mode": cell.tier.mode.value, "tier": cell.tier.label, "rows": cell.tier.rows,
            "planned": cell.planned, "launches": cell.launches, "reason": cell.reason}

