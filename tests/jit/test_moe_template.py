"""The numba moe template: recognized only for the registry's moe recipe, equal to the recipe's
decomposition (which adoption verifies before the cost gate), reading only the experts the
tokens chose, and declining what it does not serve (bf16, prefill-sized steps) with a reason."""

from __future__ import annotations

import math

import pytest
import torch

from fuel.graph import BackendId, DType, FusedOpParams, FusedOps
from fuel.graph.registry import SPECS, Moe, RuntimeFusedRegistry, recipe_for
from fuel.jit import Declined, Synthesized
from fuel.jit.adopt import Outcome, adopt
from fuel.jit.moe_template import MAX_TOKENS, MoeRegion, match_moe
from fuel.kernels import RECIPE_TOLERANCE, cpu_table
from tests.jit.helpers import float_feeds, fused_node, paged, reference, request_for

TOKENS, HIDDEN, INTER, EXPERTS = 3, 16, 8, 6


def moe_node(tokens=TOKENS, top_k=2, normalize=False, shared=True, dtype=DType.F32):
    """Qwen2-MoE's variant by default (one compiled kernel serves every test that runs one)."""
    shapes = [[tokens, HIDDEN], [tokens, EXPERTS], [EXPERTS, 2 * INTER, HIDDEN],
              [EXPERTS, HIDDEN, INTER]]
    if shared:
        shapes += [[tokens, HIDDEN], [tokens, 1]]
    return fused_node(FusedOps.MOE, FusedOpParams.Moe(top_k, normalize, shared), shapes,
                      [dtype] * len(shapes))


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_the_moe_recipe_is_recognized_with_its_parameters(normalize, shared):
    g, node = moe_node(top_k=3, normalize=normalize, shared=shared)
    assert match_moe(recipe_for(g, node)) == MoeRegion(3, normalize, shared)


def test_other_regions_are_not_the_moe_region():
    g, node, _ = paged()
    assert match_moe(recipe_for(g, node)) is None
    assert match_moe(SPECS[FusedOps.RMS_NORM].template(FusedOpParams.RmsNorm(1e-5))) is None


def test_the_parallel_variant_matches_too(numba_synth):
    from fuel.jit import moe_template

    g, node = moe_node(tokens=2)
    answer = numba_synth.synthesize(request_for(g, node))
    runner = numba_synth.take_kernel(answer.entry_point).run
    feeds = float_feeds(g, node, seed=7)
    arrays = [feeds[f"in{i}"].numpy() for i in range(len(feeds))]
    out = torch.empty(TOKENS - 1, HIDDEN)
    module = runner._parallel  # the prange variant, whatever the call's size
    module(out.numpy(), *arrays)
    atol, rtol = RECIPE_TOLERANCE[DType.F32]
    assert torch.allclose(out, reference(g, node, feeds), atol=atol, rtol=rtol)
    assert moe_template.PARALLEL_MIN_WORK > 2 * 2 * 3 * HIDDEN * INTER  # tests call it directly


def test_template_matches_the_recipe_decomposition(numba_synth):
    g, node = moe_node()
    answer = numba_synth.synthesize(request_for(g, node))
    assert isinstance(answer, Synthesized), answer
    kernel = numba_synth.take_kernel(answer.entry_point)
    feeds = float_feeds(g, node, seed=3)
    got = kernel.run(*(feeds[f"in{i}"] for i in range(len(feeds))))
    expected = reference(g, node, feeds)
    atol, rtol = RECIPE_TOLERANCE[DType.F32]
    assert torch.allclose(got, expected, atol=atol, rtol=rtol)


def test_only_the_chosen_experts_are_read(numba_synth):
    """Experts no token chose hold NaN: the template and the recipe's grouped matmuls both stay
    finite, so neither reads them (no dense [tokens, experts] product)."""
    g, node = moe_node(tokens=1, top_k=2)
    feeds = float_feeds(g, node, seed=5)
    logits = feeds["in1"]
    chosen = set(torch.topk(logits.softmax(-1), 2, dim=-1).indices.reshape(-1).tolist())
    for expert in set(range(EXPERTS)) - chosen:
        feeds["in2"][expert] = math.nan
        feeds["in3"][expert] = math.nan
    answer = numba_synth.synthesize(request_for(g, node))
    kernel = numba_synth.take_kernel(answer.entry_point)
    got = kernel.run(*(feeds[f"in{i}"] for i in range(len(feeds))))
    expected = reference(g, node, feeds)
    assert torch.isfinite(got).all() and torch.isfinite(expected).all()
    assert torch.allclose(got, expected, atol=2e-5, rtol=2e-5)


def test_adoption_verifies_and_gates_the_template(numba_synth):
    g, node = moe_node(tokens=1)
    record = adopt(numba_synth, request_for(g, node), BackendId.CPU, table=cpu_table(),
                   registry=RuntimeFusedRegistry())
    # One call against the recipe's ~20 primitive calls: measured 15x faster at these dims.
    assert record.outcome is Outcome.ADOPTED, record.reason
    assert record.max_abs_error <= 1e-4
    assert record.kernel_ns < record.decomposed_ns


def test_bf16_is_declined_with_the_reason(numba_synth):
    g, node = moe_node(dtype=DType.BF16)
    answer = numba_synth.synthesize(request_for(g, node))
    assert isinstance(answer, Declined) and "f32 only" in answer.reason


def test_a_prefill_sized_step_is_declined_with_the_reason(numba_synth):
    g, node = moe_node(tokens=MAX_TOKENS + 1)
    answer = numba_synth.synthesize(request_for(g, node))
    assert isinstance(answer, Declined) and "prefill-sized" in answer.reason


def test_top_k_is_part_of_the_kernel_identity():
    one, two = (request_for(*moe_node(top_k=k)) for k in (1, 2))
    assert one.structure_key() != two.structure_key()
    assert isinstance(SPECS[FusedOps.MOE].params_type(2, True), Moe)


class _MoeOnly:
    """The numba synthesizer, asked about moe regions only (the other regions of a step —
    paged attention, norms — have their own tests; compiling them here would only cost time)."""

    name = "numba"

    def __init__(self, synth):
        self._synth = synth

    def synthesize(self, request):
        if match_moe(request.region) is None:
            return Declined("this test adopts moe kernels only")
        return self._synth.synthesize(request)

    def take_kernel(self, entry_point):
        return self._synth.take_kernel(entry_point)

    def on_rejected(self, entry_point, report):
        self._synth.on_rejected(entry_point, report)


def test_a_jit_run_adopts_the_template_for_decode_and_still_matches_transformers(numba_synth,
                                                                                   tmp_path):
    from fuel.circuit import Mode
    from fuel.runtime.engine import Engine
    from fuel.runtime.model import jit_options
    from fuel.runtime.weights import load_weights
    from tests.moe_models import checkpoint, reference_logits

    tiny = checkpoint("qwen2_moe")
    table = cpu_table()
    options = jit_options(table, store_path=tmp_path / "judge.db", synthesizer=_MoeOnly(numba_synth))
    session = options.jit
    session.profile_options = {"warmup": 1, "repeats": 5, "min_sample_ns": 50_000}
    engine = Engine(load_weights(tiny.folder), table=table, optimize_options=options,
                    max_context=32, max_sequences=1)
    engine.add_sequence("s")
    prompt = [5, 17, 30, 2]
    tokens = [engine.step(Mode.PREFILL, [("s", prompt)]).tokens[-1]]
    rows = []
    for _ in range(3):
        step = engine.step(Mode.DECODE, [("s", tokens[-1:])])
        rows.append(step.logits[0])
        tokens.append(step.tokens[0])
    moe = [e for e in session.events if e.region == "moe"]
    assert len(moe) == 2  # the prefill shape (4 tokens) and the decode shape (1 token)
    assert all(e.record.adopted for e in moe), [e.record.reason for e in moe]
    decode = [p for p in engine.programs() if p.step.plan.mode is Mode.DECODE][0]
    moe_branches = [b for b in decode.branch_decisions() if b["region"] == "moe"]
    # Both arms measured on this machine; the bake took the faster (the template, ~15x here).
    # Only the last layer's branch is baked: layer 0's moe output is read by the next layer's
    # residual_add_rms_norm, itself lowered after the branch was made, which orphans that
    # branch's merge (optimize._lower_unrunnable; see the issue-16 report). Layer 0 runs the recipe.
    assert sum(b["count"] for b in moe_branches) >= 1
    assert all(len(b["arms"]) == 2 for b in moe_branches)
    assert all(a["source"] == "judge" for b in moe_branches for a in b["arms"])
    # Whichever arm the bake picked, the numbers are transformers'.
    reference = reference_logits(tiny.model, prompt + tokens[:-1])[len(prompt):]
    assert float((torch.stack(rows) - reference).abs().max()) < 1e-4
    assert tokens[1:] == reference.argmax(-1).tolist()
    assert engine.stats.experts["decode"] == 3 * 2 * tiny.top_k  # 3 steps, 2 layers, k each
