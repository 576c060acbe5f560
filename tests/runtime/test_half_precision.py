"""bf16 runs of the real SmolLM2 against transformers in the same dtype.

The tolerance is calibrated, not guessed: both engines hold the same 16-bit weights (the same
stored values) and round intermediate results to the same format, at different points (fuel's
fused kernels accumulate in f32 and round once; transformers' eager ops round after each op).
So each engine's distance from the exact (f32) logits is that format's rounding noise, and two
such noises of one scale differ by at most about twice it: fuel's logits must lie within twice
transformers' own half-precision error against transformers in f32 (and the greedy token of
the last row must agree).

f16 is not offered: fuel's decomposed recipes compute in the storage dtype, and an rms_norm's
sum of squares over 576 channels leaves f16's range (65504), where transformers computes its
norms in f32 (a first try measured logits 59 apart)."""

from __future__ import annotations

import pytest
import torch

from fuel.runtime.engine import Engine
from fuel.runtime.generate import prefill
from fuel.runtime.oracle import Oracle
from fuel.runtime.weights import load_weights

PROMPT = "Write one sentence about the sea."


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16"])
def test_half_precision_logits_stay_within_transformers_own_rounding(dtype, fuel_cache,
                                                                      smollm2_oracle,
                                                                      smollm2_tokenizer):
    torch.set_num_threads(2)
    weights = load_weights(cache=fuel_cache, dtype=dtype, progress=False)
    ids = smollm2_tokenizer.encode(smollm2_tokenizer.format_prompt(PROMPT))
    engine = Engine(weights, max_context=64, max_sequences=1)
    engine.add_sequence("half")
    ours = prefill(engine, "half", ids).logits.float()
    assert ours.shape[0] == len(ids), "one chunk: every row's logits"
    half = Oracle(weights)
    half.model.to(weights.dtype.torch)
    theirs = half.logits(ids).float()
    exact = smollm2_oracle.logits(ids).float()
    own_error = float((theirs - exact).abs().max())
    ours_error = float((ours - theirs).abs().max())
    print(f"{dtype}: fuel vs transformers-{dtype} {ours_error:.3g}; transformers-{dtype} vs f32 "
          f"{own_error:.3g}; fuel vs f32 {float((ours - exact).abs().max()):.3g}")
    assert own_error > 0, "the half-precision reference must actually round"
    assert ours_error <= 2 * own_error
    assert int(ours[-1].argmax()) == int(theirs[-1].argmax())
