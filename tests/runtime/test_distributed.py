"""The tensor-parallel runtime on torch.distributed (gloo, localhost): SmolLM2-135M split over
three processes computes what one process computes."""

from __future__ import annotations

import pytest

from fuel.circuit import zoo
from fuel.circuit.parallel import Parallel, SplitRefused, rank_circuit

PROMPT = [1]  # one id: the whole run is decode steps (one program per rank)
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def single_process(smollm2_weights):
    from fuel.runtime.distributed import greedy_logits
    from fuel.runtime.engine import Engine

    engine = Engine(smollm2_weights, max_context=64, max_sequences=1)
    return greedy_logits(engine, PROMPT, NEW_TOKENS)


def test_smollm2_tp3_over_gloo_equals_the_single_process_run(smollm2_weights, single_process):
    from fuel.runtime.distributed import run_tensor_parallel

    tokens, logits = single_process
    result = run_tensor_parallel(smollm2_weights, PROMPT, NEW_TOKENS, 3, max_context=64)
    assert result.backend == "gloo"
    assert list(result.tokens) == tokens
    assert result.logits.shape == logits.shape == (NEW_TOKENS, 49152)
    # f32 over three ranks: the row-parallel projections sum in another order, so the logits
    # agree to rounding (measured 7.2e-5 on logits of magnitude ~20), not bit for bit.
    assert (result.logits - logits).abs().max().item() < 1e-3
    decode = [{what: digest for digest, what in d.items()}["decode rows=1"] for d in result.digests]
    assert len(set(decode)) == 3  # every rank ran its own plan


def test_tp2_is_refused_before_any_process_starts(smollm2_weights):
    from fuel.runtime.distributed import run_tensor_parallel

    with pytest.raises(SplitRefused, match="9 heads do not divide into 2 ranks"):
        run_tensor_parallel(smollm2_weights, PROMPT, 1, 2)


def test_a_rank_binds_only_its_slice_of_each_sharded_tensor(smollm2_weights):
    from fuel.runtime.distributed import shard_weights
    from fuel.runtime.lower import expected_weight_shapes
    from fuel.runtime.weights import check_weights

    circuit = rank_circuit(zoo.load("smollm2-135m"), Parallel(tp=3), 2)
    sharded = shard_weights(smollm2_weights, circuit)
    check_weights(sharded, expected_weight_shapes(circuit))
    q = "model.layers.3.self_attn.q_proj.weight"
    assert sharded[q].shape == (192, 576)
    assert sharded[q].equal(smollm2_weights[q][384:576])
    norm = "model.layers.3.input_layernorm.weight"
    assert sharded[norm] is smollm2_weights.tensors[norm]
