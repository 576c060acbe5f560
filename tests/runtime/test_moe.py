"""Mixture-of-experts models run on the CPU and compute what transformers computes.

Tiny random Mixtral, Qwen2-MoE (shared expert) and Qwen3-MoE checkpoints written by transformers
itself (``tests/moe_models.py``): prefill plus 8 greedy decode steps agree with transformers'
f32 logits within 1e-4 and pick the same tokens, and so do multi_seq and verify steps. Both
routes are checked: the fused ``moe`` op (the CPU rule set's choice, run as its recipe) and the
single-op rules (router, top_k, expert_gate_up, expert_down, blend). The expert-load counts the
engine reports are the experts transformers routed to."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fuel.circuit import Mode, load_builtin_rules
from fuel.graph.ir import Fused, Prim
from fuel.graph.ops import OpKind
from fuel.graph.registry import FusedOps
from fuel.runtime.engine import Engine
from fuel.runtime.weights import load_weights
from tests.moe_models import checkpoint, reference_experts, reference_logits

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
PROMPT = [5, 17, 30, 2, 44, 9]
TOLERANCE = 1e-4
CPU_RULES = load_builtin_rules("cpu")
SINGLE_OP_RULES = replace(CPU_RULES, rules=tuple(r for r in CPU_RULES if r.id != "cpu.moe"))


def engine_for(family: str, rules=None) -> Engine:
    weights = load_weights(checkpoint(family).folder)
    return Engine(weights, rules=rules, max_context=64, max_sequences=3, block_size=16)


def max_error(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matmuls: torch's thread pool only adds wake-ups (and on a shared machine, waits).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.mark.parametrize("route", ["fused", "single_op"])
def test_prefill_and_8_decode_steps_match_transformers(family, route):
    tiny = checkpoint(family)
    engine = engine_for(family, SINGLE_OP_RULES if route == "single_op" else None)
    engine.add_sequence("s")
    first = engine.step(Mode.PREFILL, [("s", PROMPT)])
    rows, ids = [first.logits], list(PROMPT)
    for _ in range(8):
        ids.append(rows[-1][-1].argmax().item())
        step = engine.step(Mode.DECODE, [("s", ids[-1:])])
        assert step.tokens == [int(step.logits[0].argmax())]
        rows.append(step.logits)
    # The model is causal: one forward over the whole sequence gives every step's reference row.
    reference = reference_logits(tiny.model, ids + [0])
    assert max_error(rows[0], reference[:len(PROMPT)]) < TOLERANCE
    for index, row in enumerate(rows[1:]):
        expected = reference[len(PROMPT) + index]
        assert max_error(row[0], expected) < TOLERANCE
    # Greedy tokens: each token fuel chose is transformers' argmax at that position.
    assert ids[len(PROMPT):] == reference[len(PROMPT) - 1:-2].argmax(-1).tolist()
    graph = step.program.step.graph
    fused = [n for n in graph.nodes() if isinstance(n.op, Fused) and n.op.id == FusedOps.MOE]
    grouped = [n for n in graph.nodes() if isinstance(n.op, Prim) and n.op.kind is OpKind.EXPERT_MATMUL]
    if route == "fused":
        assert len(fused) == 2  # one per layer; the CPU has no kernel, so it ran as its recipe
        assert any("moe x2" in step.program.bake_summary().describe() for _ in [0])
    else:
        assert not fused and len(grouped) == 4  # gate_up and down per layer


def test_multi_seq_rows_match_each_sequence_alone(family):
    tiny = checkpoint(family)
    engine = engine_for(family)
    prompts = {"a": PROMPT, "b": [11, 3, 60, 8]}
    pending = {}
    for name, prompt in prompts.items():
        engine.add_sequence(name)
        pending[name] = engine.step(Mode.PREFILL, [(name, prompt)]).tokens[-1]
    history = {name: list(prompt) for name, prompt in prompts.items()}
    rows = {name: [] for name in prompts}
    for _ in range(3):
        step = engine.step(Mode.MULTI_SEQ, [(name, [pending[name]]) for name in prompts])
        for row, name in enumerate(prompts):
            history[name].append(pending[name])
            rows[name].append(step.logits[row])
            pending[name] = step.tokens[row]
    for name, prompt in prompts.items():
        reference = reference_logits(tiny.model, history[name])[len(prompt):]
        assert max_error(torch.stack(rows[name]), reference) < TOLERANCE
        assert history[name][len(prompt) + 1:] + [pending[name]] == reference.argmax(-1).tolist()


def test_verify_rows_match_the_full_forward(family):
    tiny = checkpoint(family)
    engine = engine_for(family)
    engine.add_sequence("s")
    engine.step(Mode.PREFILL, [("s", PROMPT[:-1])])
    drafted = [PROMPT[-1], 7, 21, 40]  # the pending token and three drafted ones
    step = engine.step(Mode.VERIFY, [("s", drafted)])
    reference = reference_logits(tiny.model, PROMPT[:-1] + drafted)[-len(drafted):]
    assert max_error(step.logits, reference) < TOLERANCE
    assert step.tokens == reference.argmax(-1).tolist()


def test_expert_load_counts_the_experts_transformers_routed_to(family):
    tiny = checkpoint(family)
    engine = engine_for(family)
    engine.add_sequence("s")
    step = engine.step(Mode.PREFILL, [("s", PROMPT)])
    routed = reference_experts(tiny.model, PROMPT, tiny.top_k)
    stats = engine.stats
    assert stats.expert_layer_steps["prefill"] == len(routed) == 2
    assert stats.experts["prefill"] == sum(len(experts) for experts in routed)
    per_expert = step.program.step.routing[0].expert_bytes
    assert per_expert == 4 * 3 * 32 * (24 if family == "mixtral" else 16)  # f32 gate, up, down
    assert stats.expert_bytes["prefill"] == stats.experts["prefill"] * per_expert
    engine.step(Mode.DECODE, [("s", [step.tokens[-1]])])
    # One token picks k distinct experts in each layer: exactly k are read, not all of them.
    assert stats.experts["decode"] == 2 * tiny.top_k


def test_bf16_run_routes_the_same_tokens(family):
    """bf16 weights are not the 1e-4 oracle, but a greedy decode of a few steps stays on the f32
    path (the matrices are held in bf16 and multiplied in f32; MoE experts stay f32)."""
    weights = load_weights(checkpoint(family).folder, dtype="bf16")
    engine = Engine(weights, max_context=64, max_sequences=1, block_size=4)
    engine.add_sequence("s")
    step = engine.step(Mode.PREFILL, [("s", PROMPT)])
    assert step.logits.dtype == torch.float32
    assert weights.format_of("model.layers.0.self_attn.q_proj.weight") == "bf16"
    reference = reference_logits(checkpoint(family).model, PROMPT)
    assert max_error(step.logits, reference) < 0.25
