"""fuel's per-rank memory calculator against vLLM's logged memory figures.

Sources (found with the project's search tool, vLLM's own GitHub threads):

- vLLM PR #10511 "[core] overhaul memory profiling and fix backward compatibility"
  (https://github.com/vllm-project/vllm/pull/10511, comment by youkaichao, 2024-12-14), two
  sanity runs of ``vllm serve meta-llama/Meta-Llama-3-8B`` on one H100 (``total_gpu_memory
  79.22GiB``, ``gpu_memory_utilization 0.90``): at tp=1 ``model weights take 14.96GiB`` and
  ``available_kv_cache_memory 53.29GiB``; with ``-tp 2`` ``model weights take 7.48GiB`` per
  rank. Meta-Llama-3-8B has the tensor shapes of the zoo's Llama-3.1-8B (32 layers, hidden
  4096, intermediate 14336, 32 heads, 8 KV heads, vocabulary 128256; 3.1 changed RoPE scaling
  and context, not shapes).
- vLLM issue #17469 "Qwen3 OOM v0.8.5" (https://github.com/vllm-project/vllm/issues/17469):
  ``Qwen/Qwen3-30B-A3B`` on 4 x A10, tensor-parallel-size 4, vLLM 0.8.5: every worker logs
  ``Model loading took 14.2474 GiB``.

Same assumptions: bf16 weights, the stated tp, the stated device memory and utilization, and
fuel's own activation (buffer planner, a 2048-row prefill chunk) and workspace terms.
"""

from __future__ import annotations

import pytest

from fuel.circuit import AvailableKernels, build_policy, load_builtin_rules, zoo
from fuel.circuit.parallel import Parallel, rank_circuit
from fuel.circuit.rules import Mode
from fuel.report.coverage import covering_fuse
from fuel.report.parallel import kv_cache_tokens, rank_memory

GIB = 2**30
RULES = tuple(load_builtin_rules("cuda"))
CHUNK = 2048


def rank0_memory(model: str, tp: int):
    circuit = rank_circuit(zoo.load(model, draft=False), Parallel(tp=tp), 0)
    plan = covering_fuse(circuit, RULES, AvailableKernels.all_named_by(RULES), build_policy(),
                         Mode.PREFILL, CHUNK, None)
    return rank_memory(circuit, plan, CHUNK)


@pytest.mark.parametrize(("model", "tp", "logged_gib"), [
    ("llama-3.1-8b", 1, 14.96),      # vLLM PR #10511, tp=1
    ("llama-3.1-8b", 2, 7.48),       # vLLM PR #10511, -tp 2 (per rank)
    ("qwen3-30b-a3b", 4, 14.2474),   # vLLM issue #17469, tp=4 (per rank, experts tensor-split)
])
def test_per_rank_weights_land_within_5_percent_of_vllms_log(model, tp, logged_gib):
    weights = rank0_memory(model, tp).weights / GIB
    assert weights == pytest.approx(logged_gib, rel=0.05)


def test_kv_cache_memory_lands_within_5_percent_of_vllms_log():
    # vLLM PR #10511: 79.22 GiB x 0.90 = 71.29 GiB usable, 53.29 GiB left for the KV cache.
    memory = rank0_memory("llama-3.1-8b", 1)
    usable = int(79.22 * GIB * 0.90)
    assert memory.free_for_kv(usable) / GIB == pytest.approx(53.29, rel=0.05)
    # ... which is the same share of tokens: 128 KiB of K and V per token over 32 layers
    assert memory.kv_per_token == 2 * 32 * 8 * 128 * 2
    assert kv_cache_tokens(memory, usable) == pytest.approx(53.29 * GIB / memory.kv_per_token, rel=0.05)
