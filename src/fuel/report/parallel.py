"""The parallel part of ``fuel plan --tp N [--pp M] [--ep] [--nodes K]`` (SPEC §I).

Decides what a report says about a model split over ranks:

- **per rank** (one per pipeline stage: the tensor-parallel ranks of a stage run the same plan
  on different slices, so their costs are equal; every rank's digest is listed): weights and
  KV bytes per token the rank holds, its fused decode plan, and for decode at C = 1, 16, 128 and
  a prefill chunk the roofline step time, the collective time (every collective node of the
  plan priced on the interconnect by :mod:`fuel.cost.interconnect`) and its share;
- **the memory fit of a rank**: ``usable = memory x utilization`` must hold weights, the KV
  cache, the activations (the buffer planner's arena for the largest step the engine runs: a
  prefill chunk) and the workspace (the step's f32 logits for sampling, the gathered logits);
- **the fit solved in reverse**: the largest context at each concurrency, and the largest
  concurrency at each context, from the same terms;
- **the smallest layout that fits** the stated context at concurrency 1 (fewest GPUs; tensor
  parallel within a server before pipeline stages, as vLLM recommends), and the ``vllm serve``
  command line of the requested layout.

A step of a pipeline is the sum of its stages (one batch passes every stage in turn; no
micro-batch overlap is assumed). Pure: the device, interconnects, circuit and rules are values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fuel.circuit.buffers import plan_buffers
from fuel.circuit.fuser import FuseError, FusionPlan
from fuel.circuit.ir import COLLECTIVE_OPS, Circuit
from fuel.circuit.parallel import Parallel, SplitRefused, collective_bytes, rank_circuit
from fuel.circuit.rules import Mode
from fuel.cost.interconnect import CollectiveCost, Interconnect, NoInterconnect, collective_cost
from fuel.report.memory import stored_weight_bytes
from fuel.report.roofline import SequenceRows, Workload, kv_bytes_per_token

DEFAULT_UTILIZATION = 0.9
"""vLLM's default ``--gpu-memory-utilization``."""
FIT_CONCURRENCIES = (1, 8, 32, 128)
FIT_CONTEXTS = (4096, 32768, 131072)
SUGGEST_TP = (1, 2, 4, 8)
SUGGEST_PP = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class Links:
    """The interconnects a layout's collectives run over (or why there is none)."""

    intra: Interconnect | NoInterconnect
    inter: Interconnect | None
    nodes: int


@dataclass(frozen=True, slots=True)
class RankMemory:
    """What one rank must hold, in bytes (KV per token of the layers it serves)."""

    weights: int
    kv_per_token: int
    activations: int
    workspace: int

    def need(self, context: int, concurrency: int) -> int:
        return (self.weights + self.activations + self.workspace
                + self.kv_per_token * context * concurrency)

    def free_for_kv(self, usable: int) -> int:
        return usable - self.weights - self.activations - self.workspace


def rank_memory(circuit: Circuit, plan: FusionPlan | None, rows: int) -> RankMemory:
    """A rank's weights, KV per token, activation arena at ``rows`` rows (``plan``: the
    largest step's; none → 0) and sampling workspace (f32 logits of ``rows`` rows)."""
    activations = plan_buffers(circuit, plan, rows).arena_bytes if plan is not None else 0
    is_last = circuit.rank is None or circuit.rank.pp_rank == circuit.rank.pp - 1
    vocab = circuit.dims.get("vocab", 0) * (circuit.rank.tp if circuit.rank else 1)
    workspace = 4 * rows * vocab if is_last else 0
    return RankMemory(stored_weight_bytes(circuit), kv_bytes_per_token_of(circuit), activations,
                      workspace)


def kv_bytes_per_token_of(circuit: Circuit, kv_format=None) -> int:
    from fuel.circuit.format import BF16

    return kv_bytes_per_token(circuit, kv_format or BF16)


def max_context(memory: RankMemory, usable: int, concurrency: int) -> int:
    free = memory.free_for_kv(usable)
    return max(0, free // (memory.kv_per_token * concurrency)) if memory.kv_per_token else 0


def max_concurrency(memory: RankMemory, usable: int, context: int) -> int:
    free = memory.free_for_kv(usable)
    return max(0, free // (memory.kv_per_token * context)) if memory.kv_per_token else 0


def kv_cache_tokens(memory: RankMemory, usable: int, block_size: int = 16) -> int:
    """Tokens of KV cache a rank holds, in whole blocks (vLLM's ``GPU KV cache size``)."""
    if not memory.kv_per_token:
        return 0
    blocks = max(0, memory.free_for_kv(usable)) // (memory.kv_per_token * block_size)
    return blocks * block_size


def collective_time(circuit: Circuit, plan: FusionPlan, rows: int, links: Links,
                    parallel: Parallel) -> tuple[float, list[dict[str, Any]]] | NoInterconnect:
    """Nanoseconds per step on the links, and one record per collective kind."""
    if isinstance(links.intra, NoInterconnect):
        return links.intra
    by_op: dict[str, dict[str, Any]] = {}
    total = 0.0
    for group in plan.groups:
        for n in group.nodes:
            node = circuit.nodes[n]
            if node.op.kind not in COLLECTIVE_OPS:
                continue
            op = node.op.kind.value
            if op in ("send", "recv"):
                # Stages on different servers hand the stream over the network.
                ranks, nodes = 2, (2 if links.nodes > 1 else 1)
            else:
                # A tensor-parallel group fills a server before it spans the next.
                per_node = max(1, parallel.world // links.nodes)
                ranks, nodes = parallel.tp, max(1, -(-parallel.tp // per_node))
            size = collective_bytes(circuit, n, rows)
            cost = collective_cost(op, size, ranks, links.intra, links.inter, nodes)
            if isinstance(cost, NoInterconnect):
                return cost
            assert isinstance(cost, CollectiveCost)
            entry = by_op.setdefault(op, {"op": op, "count": 0, "bytes": 0, "ns": 0.0,
                                          "algorithm": cost.algorithm})
            entry["count"] += 1
            entry["bytes"] += size
            entry["ns"] += cost.ns
            total += cost.ns
    return total, list(by_op.values())


def vllm_command(model_id: str, parallel: Parallel, utilization: float, context: int) -> str:
    parts = [f"vllm serve {model_id}", f"--tensor-parallel-size {parallel.tp}",
             f"--pipeline-parallel-size {parallel.pp}"]
    if parallel.ep > 1:
        parts.append("--enable-expert-parallel")
    parts += [f"--max-model-len {context}", f"--gpu-memory-utilization {utilization:g}"]
    return " ".join(parts)


def parallel_section(full: Circuit, parallel: Parallel, planner_for: Any, estimate: Any,
                     rates: Any, links: Links, options: Any, *, model_id: str,
                     utilization: float = DEFAULT_UTILIZATION) -> dict[str, Any]:
    """The ``parallel`` object of the report. ``planner_for(circuit)`` returns a covering
    planner (``.plan(mode, rows)``); ``estimate(circuit, plan, workload)`` a roofline
    :class:`~fuel.report.roofline.StepEstimate`."""
    usable = int(rates.memory_bytes * utilization)
    stages = []
    step_ns: dict[str, float] = {}
    coll_ns: dict[str, float | None] = {}
    digests = []
    worst: RankMemory | None = None
    context = options.context
    for rank in range(parallel.world):
        circuit = rank_circuit(full, parallel, rank)
        planner = planner_for(circuit)
        decode = planner.plan(Mode.DECODE, 1)
        digests.append({"rank": rank, "tp_rank": rank % parallel.tp,
                        "stage": rank // parallel.tp,
                        "decode_digest": None if isinstance(decode, FuseError) else decode.digest})
        if rank % parallel.tp:
            continue  # the stage's other tensor-parallel ranks cost the same
        chunk = planner.plan(Mode.PREFILL, options.prefill_chunk)
        memory = rank_memory(circuit, None if isinstance(chunk, FuseError) else chunk,
                             options.prefill_chunk)
        if worst is None or memory.need(context, 1) > worst.need(context, 1):
            worst = memory
        cases = []
        for name, mode, rows, load in _cases(context, options):
            plan = planner.plan(mode, rows)
            if isinstance(plan, FuseError):
                cases.append({"name": name, "error": str(plan)})
                continue
            ceiling = estimate(circuit, plan, load).ceiling_ns
            links_ns = collective_time(circuit, plan, rows, links, parallel)
            if isinstance(links_ns, NoInterconnect):
                cases.append({"name": name, "compute_ns": ceiling, "collective_ns": None,
                              "collective_reason": links_ns.reason})
                step_ns[name] = step_ns.get(name, 0.0) + ceiling
                coll_ns[name] = None  # unknown for the whole step, said once per case
                continue
            ns, by_op = links_ns
            step_ns[name] = step_ns.get(name, 0.0) + ceiling + ns
            if name not in coll_ns or coll_ns[name] is not None:
                coll_ns[name] = (coll_ns.get(name) or 0.0) + ns
            cases.append({"name": name, "rows": rows, "compute_ns": ceiling, "collective_ns": ns,
                          "collective_share": ns / (ceiling + ns) if ceiling + ns else 0.0,
                          "collectives": by_op})
        stages.append({"stage": rank // parallel.tp, "layers": list(circuit.rank.layers),
                       "weight_bytes": memory.weights, "kv_bytes_per_token": memory.kv_per_token,
                       "activation_bytes": memory.activations,
                       "workspace_bytes": memory.workspace, "cases": cases})
    assert worst is not None
    steps = [{"name": name, "ns": ns, "collective_ns": coll_ns[name],
              "collective_share": (None if coll_ns[name] is None
                                   else coll_ns[name] / ns if ns else 0.0),
              "tokens_per_s": _rows(name, options) / ns * 1e9 if ns else None}
             for name, ns in step_ns.items()]
    return {
        "layout": {"tp": parallel.tp, "pp": parallel.pp, "ep": parallel.ep,
                   "world": parallel.world, "nodes": links.nodes},
        "interconnect": _links_doc(links),
        "utilization": utilization,
        "usable_bytes_per_rank": usable,
        "ranks": digests,
        "stages": stages,
        "steps": steps,
        "fit": {"need_bytes": worst.need(context, 1), "fits": worst.need(context, 1) <= usable,
                "kv_cache_tokens": kv_cache_tokens(worst, usable),
                "max_context": [{"concurrency": c, "max_context": max_context(worst, usable, c)}
                                for c in FIT_CONCURRENCIES],
                "max_concurrency": [{"context": t, "max_concurrency": max_concurrency(worst, usable, t)}
                                    for t in FIT_CONTEXTS]},
        "suggestion": suggest_layout(full, usable, planner_for, options, parallel.ep > 1),
        "vllm_command": vllm_command(model_id, parallel, utilization, context),
        "notes": [
            "Per rank: usable = memory x utilization holds weights + KV + activations (buffer "
            f"planner arena of a {options.prefill_chunk}-row prefill chunk) + workspace (f32 "
            "logits of those rows).",
            "Collectives are priced with NCCL's cost model (ring/tree, LL protocol latencies) on "
            "the interconnect; a step adds them to the roofline (no compute/communication overlap).",
            "A pipeline step is the sum of its stages (one batch, no micro-batch overlap).",
        ] + (["Expert parallel: each rank's expert FLOPs and touched experts are priced as if "
              "every token's top_k choices were local (an upper bound)."] if parallel.ep > 1 else []),
    }


def _cases(context: int, options: Any):
    from fuel.report.build import DECODE_CONCURRENCIES

    for c in DECODE_CONCURRENCIES:
        mode = Mode.DECODE if c == 1 else Mode.MULTI_SEQ
        yield f"decode C={c}", mode, c, Workload.decode(c, context, options.kv_format)
    chunk = options.prefill_chunk
    yield (f"prefill chunk {chunk}", Mode.PREFILL, chunk,
           Workload((SequenceRows(chunk, chunk),), options.kv_format))


def _rows(name: str, options: Any) -> int:
    if name.startswith("decode C="):
        return int(name.split("=")[1])
    return options.prefill_chunk


def _links_doc(links: Links) -> dict[str, Any]:
    def one(link):
        if link is None:
            return None
        if isinstance(link, NoInterconnect):
            return {"name": None, "reason": link.reason}
        return {"name": link.name, "title": link.title,
                "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
                "hop_latency_ns": link.hop_latency_ns, "sources": dict(link.sources)}
    return {"intra_node": one(links.intra), "inter_node": one(links.inter)}


def suggest_layout(full: Circuit, usable: int, planner_for: Any, options: Any,
                   expert_parallel: bool) -> dict[str, Any]:
    """The fewest GPUs (then the fewest pipeline stages) whose every rank fits the stated
    context at concurrency 1; each layout tried that does not is listed with why."""
    tried = []
    candidates = sorted(((tp, pp) for tp in SUGGEST_TP for pp in SUGGEST_PP),
                        key=lambda c: (c[0] * c[1], c[1]))
    for tp, pp in candidates:
        layout = Parallel(tp=tp, pp=pp, ep=tp if expert_parallel else 1)
        try:
            worst = 0
            for stage in range(pp):
                circuit = rank_circuit(full, layout, stage * tp)
                chunk = planner_for(circuit).plan(Mode.PREFILL, options.prefill_chunk)
                memory = rank_memory(circuit, None if isinstance(chunk, FuseError) else chunk,
                                     options.prefill_chunk)
                worst = max(worst, memory.need(options.context, 1))
        except SplitRefused as refused:
            tried.append({"tp": tp, "pp": pp, "fits": False, "reason": refused.detail})
            continue
        if worst <= usable:
            return {"tp": tp, "pp": pp, "world": tp * pp, "need_bytes": worst, "tried": tried}
        tried.append({"tp": tp, "pp": pp, "fits": False,
                      "reason": f"needs {worst / 2**30:.1f} GiB per rank, {usable / 2**30:.1f} usable"})
    return {"tp": None, "pp": None, "world": None, "need_bytes": None, "tried": tried}


__all__ = [
    "DEFAULT_UTILIZATION", "Links", "RankMemory", "collective_time", "kv_cache_tokens",
    "max_concurrency", "max_context", "parallel_section", "rank_memory", "suggest_layout",
    "vllm_command",
]


def parallel_report(circuit: Circuit, device: Any, choice: Any, policy: Any, options: Any,
                    parallel: Parallel, links: Links, *, model_id: str,
                    utilization: float = DEFAULT_UTILIZATION) -> dict[str, Any]:
    """The ``parallel`` object for ``fuel plan``: :func:`parallel_section` with the report's
    covering planner and roofline (``fuel.report.build``)."""
    from fuel.report.build import _estimate, _Planner

    planners: dict[int, Any] = {}

    def planner_for(rank_c: Circuit):
        key = id(rank_c)
        if key not in planners:
            planners[key] = _Planner(rank_c, choice, policy)
        return planners[key]

    def estimate(rank_c: Circuit, plan: FusionPlan, load: Workload):
        return _estimate(rank_c, plan, load, device.rates)

    return parallel_section(circuit, parallel, planner_for, estimate, device.rates, links,
                            options, model_id=model_id, utilization=utilization)
